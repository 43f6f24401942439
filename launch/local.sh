#!/usr/bin/env bash
# One machine, several processes: the multi-controller runtime of a TPU pod or a GPU cluster
# (jax.distributed over a 127.0.0.1 coordinator, CPU devices, gloo collectives), for testing a
# multi-host run before renting one.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: launch/local.sh --processes N --devices-per-process M --config FILE[:ARG] --workdir DIR
           [--port P] [--logs DIR] [--python PY] [--check] [--dry-run] [--config.KEY=VALUE ...] [-- FLAGS ...]

Starts N processes of `PY -m jaxrag.train --config FILE --workdir DIR ...` on this machine, each
with M CPU devices, joined as one job of N x M devices (process 0 is the coordinator, at
127.0.0.1:P). They share DIR, as the hosts of a pod share a mounted bucket.
  --processes N            processes (default 2)
  --devices-per-process M  CPU devices per process (default 1)
  --port P                 the coordinator's port (default 8476; the watchdogs use P + 1)
  --logs DIR               process I appends to DIR/process-I.log (default: logs/ in the workdir)
  --python PY              Python with jaxrag installed (default: python)
  --check                  run `PY -m jaxrag.runtime.multihost --workdir DIR` (join, the start
                           checks, a barrier and an allgather) instead of jaxrag.train
  --dry-run                print one command per process instead of running them
The exit status is the worst of the processes'. --config.* flags and everything after `--` are
passed to jaxrag.train verbatim.
EOF
}

PROCESSES=2 DEVICES=1 PORT=8476 LOGS="" PYTHON=python
while [[ $# -gt 0 ]]; do
  if [[ $1 == --*=* && $1 != --config.* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --processes) PROCESSES=$(value "$@"); shift 2 ;;
    --devices-per-process) DEVICES=$(value "$@"); shift 2 ;;
    --port) PORT=$(value "$@"); shift 2 ;;
    --logs) LOGS=$(value "$@"); shift 2 ;;
    --python) PYTHON=$(value "$@"); shift 2 ;;
    *) common_option "$@"; shift "$SHIFT" ;;
  esac
done
require_program
[[ $PROCESSES =~ ^[1-9][0-9]*$ && $DEVICES =~ ^[1-9][0-9]*$ ]] \
  || die "--processes and --devices-per-process must be positive integers"
check_port "$PORT"
LOGS=${LOGS:-$WORKDIR/logs}

program_args
train=("$PYTHON" "${PROGRAM[@]}")
# (jaxrag.train raises XLA's CPU collective timeouts itself: jaxrag.pipeline.cli.patient_cpu_collectives)
xla_flags="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES"

commands=()
for ((i = 0; i < PROCESSES; i++)); do
  vars=()
  while IFS= read -r var; do vars+=("$var"); done < <(process_env "127.0.0.1:$PORT" "$PROCESSES" "$i")
  commands+=("$(quote env "${vars[@]}" JAX_PLATFORMS=cpu "XLA_FLAGS=$xla_flags" "${train[@]}")")
done
if ((DRY_RUN)); then
  printf '%s\n' "${commands[@]}"
  exit 0
fi

mkdir -p "$LOGS"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM  # Ctrl-C stops every process
for ((i = 0; i < PROCESSES; i++)); do
  echo "+ ${commands[i]} >> $LOGS/process-$i.log" >&2
  (eval "${commands[i]}") >>"$LOGS/process-$i.log" 2>&1 &  # (): errexit would turn its status into 1
  pids+=($!)
done
worst=0
for ((i = 0; i < PROCESSES; i++)); do
  status=0
  wait "${pids[i]}" || status=$?
  if ((status)); then echo "process $i exited with status $status: $LOGS/process-$i.log" >&2; fi
  if ((status > worst)); then worst=$status; fi
done
exit "$worst"

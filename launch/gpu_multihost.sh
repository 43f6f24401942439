#!/usr/bin/env bash
# Several GPU hosts: one jaxrag.train process per host, each using all of its host's GPUs.
# jaxrag.sharding.initialize_distributed() joins the processes (jax.distributed.initialize).
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: launch/gpu_multihost.sh slurm|mpirun|env --hosts N --config FILE[:ARG] --workdir DIR
           [--gpus-per-host G] [--port P] [--coordinator HOST:PORT] [--process-id I]
           [--hostfile FILE] [--python PY] [--dry-run] [--config.KEY=VALUE ...] [-- FLAGS ...]

Starts `PY -m jaxrag.train --config FILE --workdir DIR ...` on N hosts. DIR must be storage
every host sees at the same path (NFS, or a bucket mounted with Cloud Storage FUSE).
  slurm   inside an allocation (salloc/sbatch --nodes>=N): one srun task per node; the
          coordinator is the step's first node at port P (default 8476)
  mpirun  Open MPI, one rank per node; JAX reads rank, size and coordinator from Open MPI
          (run it on the first host, or give --coordinator); --hostfile FILE is passed on
  env     prints one command per host (--dry-run), or runs host I's (--process-id I);
          needs --coordinator HOST:PORT, the address of the host with process id 0
  --gpus-per-host G  GPUs per host (default 8; slurm and mpirun, see README)
  --python PY        Python with jaxrag installed, same path on every host (default: python)
  --dry-run          print the commands instead of running them
--config.* flags and everything after `--` are passed to jaxrag.train verbatim.
EOF
}

MODE="" HOSTS="" GPUS_PER_HOST=8 PORT=8476 COORDINATOR="" PROCESS_ID="" HOSTFILE="" PYTHON=python
case ${1-} in
  -h|--help) usage; exit 0 ;;
  slurm|mpirun|env) MODE=$1; shift ;;
  *) die "first argument must be slurm, mpirun or env (try --help)" ;;
esac
while [[ $# -gt 0 ]]; do
  if [[ $1 == --*=* && $1 != --config.* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --hosts) HOSTS=$(value "$@"); shift 2 ;;
    --gpus-per-host) GPUS_PER_HOST=$(value "$@"); shift 2 ;;
    --port) PORT=$(value "$@"); shift 2 ;;
    --coordinator) COORDINATOR=$(value "$@"); shift 2 ;;
    --process-id) PROCESS_ID=$(value "$@"); shift 2 ;;
    --hostfile) HOSTFILE=$(value "$@"); shift 2 ;;
    --python) PYTHON=$(value "$@"); shift 2 ;;
    *) common_option "$@"; shift "$SHIFT" ;;
  esac
done
require --hosts "$HOSTS" --config "$CONFIG" --workdir "$WORKDIR"
[[ $HOSTS =~ ^[1-9][0-9]*$ && $GPUS_PER_HOST =~ ^[1-9][0-9]*$ ]] \
  || die "--hosts and --gpus-per-host must be positive integers"

train=("$PYTHON" -m jaxrag.train --config "$CONFIG" --workdir "$WORKDIR" ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"})
# JAX's SLURM / Open MPI detection would give each process only GPU <local rank>; with one
# process per host it has to be told to use them all.
local_ids=0
for ((i = 1; i < GPUS_PER_HOST; i++)); do local_ids+=",$i"; done

case $MODE in
  slurm)
    # Each task works out the same coordinator (the step's first node, where task 0 runs) and
    # takes its id from SLURM_PROCID; the single-quoted $... are expanded by the task, not here.
    # shellcheck disable=SC2016
    printf -v setup '%s && export %s %s %s %s && exec "$@"' \
      'host=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1)' \
      "JAX_COORDINATOR_ADDRESS=\$host:$PORT" "JAX_NUM_PROCESSES=$HOSTS" \
      'JAX_PROCESS_ID=$SLURM_PROCID' "JAX_LOCAL_DEVICE_IDS=$local_ids"
    run srun --nodes="$HOSTS" --ntasks-per-node=1 bash -c "$setup" bash "${train[@]}" ;;
  mpirun)
    cmd=(mpirun -np "$HOSTS" --map-by ppr:1:node)
    if [[ -n $HOSTFILE ]]; then cmd+=(--hostfile "$HOSTFILE"); fi
    cmd+=(-x "JAX_LOCAL_DEVICE_IDS=$local_ids")
    if [[ -n $COORDINATOR ]]; then cmd+=(-x "JAX_COORDINATOR_ADDRESS=$COORDINATOR"); fi
    run "${cmd[@]}" "${train[@]}" ;;
  env)
    require --coordinator "$COORDINATOR"
    if [[ -n $PROCESS_ID ]]; then
      [[ $PROCESS_ID =~ ^[0-9]+$ && $PROCESS_ID -lt $HOSTS ]] || die "--process-id must be 0..$((HOSTS - 1))"
    elif ((!DRY_RUN)); then
      die "env: run this on every host with its --process-id I (0..$((HOSTS - 1))), or --dry-run to print all"
    fi
    # No cluster for JAX to detect: all three values are explicit, every visible GPU is used.
    for ((i = 0; i < HOSTS; i++)); do
      if [[ -z $PROCESS_ID || $PROCESS_ID == "$i" ]]; then
        mapfile -t vars < <(process_env "$COORDINATOR" "$HOSTS" "$i")
        run env "${vars[@]}" "${train[@]}"
      fi
    done ;;
esac

#!/usr/bin/env bash
# Several GPU hosts: one jaxrag.train process per host, each using all of its host's GPUs.
# jaxrag.runtime.join.initialize_distributed() joins the processes (jax.distributed.initialize).
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: launch/gpu_multihost.sh slurm|mpirun|env --hosts N --config FILE[:ARG] --workdir DIR
           [--gpus-per-host G] [--port P] [--coordinator HOST:PORT] [--process-id I]
           [--hostfile FILE] [--python PY] [--check] [--dry-run] [--config.KEY=VALUE ...] [-- FLAGS ...]

Starts `PY -m jaxrag.train --config FILE --workdir DIR ...` on N hosts. DIR must be storage
every host sees at the same path that can rename directories (NFS such as Filestore; not a flat
Cloud Storage bucket).
  slurm   inside an allocation (salloc/sbatch --nodes>=N): one srun task per node; the
          coordinator is the step's first node, at port P (default: 20000 + SLURM_JOB_ID % 40000,
          one port per job), each task using SLURM_GPUS_ON_NODE GPUs unless --gpus-per-host
  mpirun  Open MPI (4 or 5), one rank per node; each rank takes its process id and count from
          OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE; the coordinator is --coordinator, else the
          hostfile's first host (where rank 0 runs), else this host, at port P (default 8476)
  env     prints one command per host (--dry-run), or runs host I's (--process-id I);
          needs --coordinator HOST:PORT, the address of the host with process id 0
  --gpus-per-host G  GPUs per host (mpirun default 8; slurm default SLURM_GPUS_ON_NODE)
  --python PY        Python with jaxrag installed, same path on every host (default: python)
  --check            run `PY -m jaxrag.runtime.multihost --workdir DIR` (join, the start checks,
                     a barrier and an allgather; seconds) instead of jaxrag.train
  --dry-run          print the commands instead of running them
--config.* flags and everything after `--` are passed to jaxrag.train verbatim.
EOF
}

MODE="" HOSTS="" GPUS_PER_HOST="" PORT="" COORDINATOR="" PROCESS_ID="" HOSTFILE="" PYTHON=python
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
require --hosts "$HOSTS"
require_program
[[ $HOSTS =~ ^[1-9][0-9]*$ && $GPUS_PER_HOST =~ ^([1-9][0-9]*)?$ ]] \
  || die "--hosts and --gpus-per-host must be positive integers"
if [[ -n $PORT ]]; then check_port "$PORT"; fi

program_args
train=("$PYTHON" "${PROGRAM[@]}")
# JAX's SLURM / Open MPI detection would give each process only GPU <local rank>; with one
# process per host it has to be told to use them all.
ids() { local out=0 i; for ((i = 1; i < $1; i++)); do out+=",$i"; done; echo "$out"; }

case $MODE in
  slurm)
    # Each task works out the same coordinator (the step's first node, where task 0 runs), port
    # and GPUs from what Slurm set for it, and takes its id from SLURM_PROCID; the single-quoted
    # $... are expanded by the task, not here.
    # shellcheck disable=SC2016
    setup='host=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1)'
    # shellcheck disable=SC2016
    if [[ -n $PORT ]]; then setup+=" && port=$PORT"; else setup+=' && port=$((20000 + SLURM_JOB_ID % 40000))'; fi
    if [[ -n $GPUS_PER_HOST ]]; then setup+=" && ids=$(ids "$GPUS_PER_HOST")"
    else
      # shellcheck disable=SC2016
      setup+=' && { [[ ${SLURM_GPUS_ON_NODE-} =~ ^[1-9][0-9]*$ ]] || { echo "error: SLURM_GPUS_ON_NODE is not set on $(hostname) (an allocation without --gpus-per-node): pass --gpus-per-host G" >&2; exit 2; }; } && ids=$(seq -s, 0 $((SLURM_GPUS_ON_NODE - 1)))'
    fi
    # shellcheck disable=SC2016
    setup+=" && export JAX_COORDINATOR_ADDRESS=\$host:\$port JAX_NUM_PROCESSES=$HOSTS"' JAX_PROCESS_ID=$SLURM_PROCID JAX_LOCAL_DEVICE_IDS=$ids && exec "$@"'
    run srun --nodes="$HOSTS" --ntasks-per-node=1 bash -c "$setup" bash "${train[@]}" ;;
  mpirun)
    # Open MPI 4 and 5 both give each rank OMPI_COMM_WORLD_RANK / _SIZE (JAX's own detection
    # reads Open MPI 4's coordinator variable only): every value is passed explicitly.
    if [[ -z $COORDINATOR ]]; then
      if [[ -n $HOSTFILE ]]; then
        [[ -r $HOSTFILE ]] || die "--hostfile $HOSTFILE: no such readable file"
        first=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")
        [[ -n $first ]] || die "--hostfile $HOSTFILE names no host"
      else
        first=$(hostname)
      fi
      COORDINATOR=$first:${PORT:-8476}
    fi
    cmd=(mpirun -np "$HOSTS" --map-by ppr:1:node)
    if [[ -n $HOSTFILE ]]; then cmd+=(--hostfile "$HOSTFILE"); fi
    cmd+=(-x "JAX_LOCAL_DEVICE_IDS=$(ids "${GPUS_PER_HOST:-8}")" -x "JAX_COORDINATOR_ADDRESS=$COORDINATOR")
    # shellcheck disable=SC2016
    rank='export JAX_PROCESS_ID=$OMPI_COMM_WORLD_RANK JAX_NUM_PROCESSES=$OMPI_COMM_WORLD_SIZE && exec "$@"'
    run "${cmd[@]}" bash -c "$rank" bash "${train[@]}" ;;
  env)
    require --coordinator "$COORDINATOR"
    check_port "${COORDINATOR##*:}"
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

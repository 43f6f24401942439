#!/usr/bin/env bash
# One host, all its GPUs: one process; the mesh spans every visible GPU.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: launch/gpu_single.sh --config FILE[:ARG] --workdir DIR [--gpus IDS] [--python PY]
                            [--check] [--dry-run] [--config.KEY=VALUE ...] [-- JAXRAG_TRAIN_FLAGS ...]

Runs `PY -m jaxrag.train --config FILE --workdir DIR ...` on this host with all local GPUs, as one
process (JAXRAG_DISTRIBUTED=0: inside an sbatch of several tasks too).
  --gpus IDS     restrict to these GPUs (sets CUDA_VISIBLE_DEVICES, e.g. 0,1); default: all
  --python PY    Python with jaxrag installed (default: python)
  --check        run `PY -m jaxrag.runtime.multihost --workdir DIR` (the start checks) instead
  --dry-run      print the command instead of running it
--config.* flags and everything after `--` are passed to jaxrag.train verbatim.
EOF
}

GPUS="" PYTHON=python
while [[ $# -gt 0 ]]; do
  if [[ $1 == --*=* && $1 != --config.* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --gpus) GPUS=$(value "$@"); shift 2 ;;
    --python) PYTHON=$(value "$@"); shift 2 ;;
    *) common_option "$@"; shift "$SHIFT" ;;
  esac
done
require_program
program_args

# `env VAR=...` rather than an assignment prefix so the printed command is the executed one.
# JAXRAG_DISTRIBUTED=0: one process, even where the environment (an sbatch's SLURM_NTASKS > 1)
# would have it join a multi-host run and wait for peers that never come.
cmd=(env JAXRAG_DISTRIBUTED=0)
if [[ -n $GPUS ]]; then cmd+=("CUDA_VISIBLE_DEVICES=$GPUS"); fi
run "${cmd[@]}" "$PYTHON" "${PROGRAM[@]}"

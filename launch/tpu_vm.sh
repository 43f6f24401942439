#!/usr/bin/env bash
# Cloud TPU VM slice: create it (or reuse it), install jaxrag on every worker, start the same
# jaxrag.train command on all workers at once, in the background (a dropped connection does not
# stop it), each worker logging to its own file; JAX reads the slice topology from the TPU metadata.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
usage: launch/tpu_vm.sh --name NAME --zone ZONE --accelerator-type TYPE --config FILE[:ARG]
           --workdir DIR [--version V] [--source wheel|git] [--git-url URL] [--git-ref REF]
           [--no-create] [--no-install] [--check] [--dry-run] [--config.KEY=VALUE ...] [-- FLAGS ...]

Runs from the repository root. The slice's size (v4-16, v5litepod-16, v6e-32, ...) sets the
number of workers; every command reaches all of them with --worker=all.
  --version V        TPU software version (default by TYPE: v6e -> v2-alpha-tpuv6e, v5p ->
                     v2-alpha-tpuv5, v5litepod -> v2-alpha-tpuv5-lite, else tpu-ubuntu2204-base)
  --source wheel     (default) build a wheel here, scp it and configs/ to every worker
  --source git       clone --git-url at --git-ref (branch or tag, default main) on every worker
  --no-create        the TPU VM exists already (skip create; without it, an existing VM is
                     reused, so rerunning the same command resumes the run)
  --no-install       jaxrag is installed already (skip copy and install)
  --check            run `python -m jaxrag.runtime.multihost --workdir DIR` (join, the start
                     checks, a barrier and an allgather) instead of jaxrag.train
  --dry-run          print the commands (for a VM that does not exist yet) instead of running them
Each worker first stops what a previous launch left running (the process group in
~/jaxrag-run.pid, then any process holding the TPU, and /tmp/libtpu_lockfile), then runs the
command under nohup: its output goes to ~/jaxrag-run.log, its exit status to ~/jaxrag-run.status.
DIR must be shared by all workers at the same path and rename directories: an NFS (Filestore)
mount, or a Cloud Storage bucket with hierarchical namespace mounted by gcsfuse (a flat bucket
is refused at start). --config is a path relative to the repository root.
--config.* flags and everything after `--` are passed to jaxrag.train verbatim.
EOF
}

NAME="" ZONE="" ACCEL="" VERSION="" SOURCE=wheel GIT_URL="" GIT_REF=main CREATE=1 INSTALL=1
while [[ $# -gt 0 ]]; do
  if [[ $1 == --*=* && $1 != --config.* ]]; then set -- "${1%%=*}" "${1#*=}" "${@:2}"; fi
  case $1 in
    -h|--help) usage; exit 0 ;;
    --name) NAME=$(value "$@"); shift 2 ;;
    --zone) ZONE=$(value "$@"); shift 2 ;;
    --accelerator-type) ACCEL=$(value "$@"); shift 2 ;;
    --version) VERSION=$(value "$@"); shift 2 ;;
    --source) SOURCE=$(value "$@"); shift 2 ;;
    --git-url) GIT_URL=$(value "$@"); shift 2 ;;
    --git-ref) GIT_REF=$(value "$@"); shift 2 ;;
    --no-create) CREATE=0; shift ;;
    --no-install) INSTALL=0; shift ;;
    *) common_option "$@"; shift "$SHIFT" ;;
  esac
done
require --name "$NAME" --zone "$ZONE"
require_program
if ((CREATE)); then require --accelerator-type "$ACCEL"; fi
case $SOURCE in
  wheel) [[ -f pyproject.toml && -d configs ]] || die "--source wheel runs from the jaxrag repository root" ;;
  git) require --git-url "$GIT_URL" ;;
  *) die "--source must be wheel or git" ;;
esac
if [[ -z $VERSION ]]; then
  case $ACCEL in
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v5litepod-*) VERSION=v2-alpha-tpuv5-lite ;;
    *) VERSION="tpu-ubuntu2204-base" ;;
  esac
fi

tpu=(gcloud compute tpus tpu-vm)
on_all=(--zone="$ZONE" --worker=all)
# Remote commands start in the home dir. The TPU images ship Python 3.10 and jaxrag needs
# >= 3.11, so uv fetches one into ~/jaxrag-venv.
install="python3 -m pip install -q --user uv && python3 -m uv venv -q --allow-existing --python 3.11 jaxrag-venv"
install+=" && python3 -m uv pip install -q --python jaxrag-venv/bin/python \"jax[tpu]\""
if [[ $SOURCE == wheel ]]; then
  wheel=build/launch/jaxrag-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)-py3-none-any.whl
  install+=" ./${wheel##*/}"
  cd_run=""  # configs/ is copied to the home dir, where --config then resolves
else
  install="rm -rf jaxrag && git clone -q --depth 1 --branch $(quote "$GIT_REF") $(quote "$GIT_URL") jaxrag && $install ./jaxrag"
  cd_run="cd jaxrag && "  # the clone brings configs/
fi

if ((CREATE)); then
  # A VM that exists (a rerun after a failure or a preemption) is reused: the run resumes from its workdir.
  if ((!DRY_RUN)) && "${tpu[@]}" describe "$NAME" --zone="$ZONE" >/dev/null 2>&1; then
    echo "TPU VM $NAME exists in $ZONE: reusing it" >&2
  else
    run "${tpu[@]}" create "$NAME" --zone="$ZONE" --accelerator-type="$ACCEL" --version="$VERSION"
  fi
fi
if ((INSTALL)); then
  if [[ $SOURCE == wheel ]]; then
    run python3 -m pip wheel -q --no-deps --wheel-dir build/launch .
    run "${tpu[@]}" scp --recurse "$wheel" configs "$NAME": "${on_all[@]}"
  fi
  run "${tpu[@]}" ssh "$NAME" "${on_all[@]}" --command "$install"
fi
program_args
# On each worker: stop what a previous launch left (its process group, if it is still jaxrag's;
# processes holding the TPU; libtpu's lock file, as MaxText's launcher does), then start the
# command detached from this connection. JAXRAG_DISTRIBUTED=1: TPU VMs set no launcher
# variables, so opt in to jax.distributed.initialize().
# shellcheck disable=SC2016
free='pid=$(cat ~/jaxrag-run.pid 2>/dev/null) && grep -qa jaxrag "/proc/$pid/cmdline" 2>/dev/null && kill -9 -- "-$pid"; '
# shellcheck disable=SC2016
free+='if ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then sudo lsof -t /dev/accel* /dev/vfio/[0-9]* 2>/dev/null | xargs -r sudo kill -9; fi; '
free+='if [ -e /tmp/libtpu_lockfile ]; then sudo rm -f /tmp/libtpu_lockfile; fi; rm -f ~/jaxrag-run.status; '
job="${cd_run}JAXRAG_DISTRIBUTED=1 ~/jaxrag-venv/bin/python $(quote "${PROGRAM[@]}")"
# shellcheck disable=SC2016
start="setsid nohup bash -c $(quote "$job; echo \$? > ~/jaxrag-run.status") >> ~/jaxrag-run.log 2>&1 < /dev/null & echo \$! > ~/jaxrag-run.pid"
run "${tpu[@]}" ssh "$NAME" "${on_all[@]}" --command "$free$start"
if ((!DRY_RUN)); then
  echo "started on every worker of $NAME; follow it with: ${tpu[*]} ssh $NAME --zone=$ZONE --worker=0 --command 'tail -f ~/jaxrag-run.log' (exit status: ~/jaxrag-run.status)" >&2
fi

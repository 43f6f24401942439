# shellcheck shell=bash disable=SC2034  # SHIFT is read by the launchers
# Sourced by the launchers: the options they share, quoting and --dry-run.
# Kept to bash 3.2 (macOS) since tpu_vm.sh usually runs on a laptop.

CONFIG="" WORKDIR="" DRY_RUN=0 CHECK=0
PASSTHROUGH=()  # --config.* overrides and everything after `--`, given to jaxrag.train verbatim

die() { echo "error: $*" >&2; exit 2; }

# Value of option $1, or one clear error; used as X=$(value "$@").
value() { [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value (try --help)"; echo "$2"; }

# Parses one option every launcher takes; sets SHIFT to the number of words used.
common_option() {
  SHIFT=2
  case $1 in
    --config) CONFIG=$(value "$@") ;;
    --workdir) WORKDIR=$(value "$@") ;;
    --dry-run) DRY_RUN=1 SHIFT=1 ;;
    --check) CHECK=1 SHIFT=1 ;;
    --config.*)  # `--config.a.b=v`, or `--config.a.b v` when the next word is not a flag
      if [[ $1 == *=* || $# -lt 2 || $2 == --* ]]; then PASSTHROUGH+=("$1") SHIFT=1
      else PASSTHROUGH+=("$1" "$2"); fi ;;
    --) shift; PASSTHROUGH+=("$@") SHIFT=$(($# + 1)) ;;
    *) die "unknown option $1 (try --help)" ;;
  esac
}

require() {  # require NAME VALUE...: one error line per run, for the first missing option
  while [[ $# -ge 2 ]]; do [[ -n $2 ]] || die "$1 is required (try --help)"; shift 2; done
}

# --workdir always; --config unless --check (which runs no config).
require_program() {
  if ((CHECK)); then require --workdir "$WORKDIR"; else require --config "$CONFIG" --workdir "$WORKDIR"; fi
}

# What every process runs after the interpreter: `-m jaxrag.train ...`, or with --check
# `-m jaxrag.runtime.multihost --workdir DIR` (joins every process, runs the start checks, a barrier
# and an allgather, then exits: the launch and the shared workdir tested in seconds).
program_args() {
  if ((CHECK)); then PROGRAM=(-m jaxrag.runtime.multihost --workdir "$WORKDIR")
  else PROGRAM=(-m jaxrag.train --config "$CONFIG" --workdir "$WORKDIR" ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"}); fi
}

# The coordinator's port P: the run's watchdogs listen at P + 1, so P is at most 65534.
check_port() {
  [[ $1 =~ ^[1-9][0-9]*$ && $1 -le 65534 ]] || die "--port must be 1..65534 (the watchdogs use the port above it)"
}

# Prints its arguments as one shell command that pastes back to the same words:
# plain words stay bare (readable), anything else is single-quoted.
quote() {
  local word out="" sq="'\\''"
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $word"
    else out+=" '${word//\'/$sq}'"; fi
  done
  printf '%s\n' "${out# }"
}

# The environment that makes `jaxrag.runtime.join.initialize_distributed` join process I of N, whose
# process 0 listens at COORDINATOR (host:port): what every multi-process launcher hands each process.
process_env() {  # process_env COORDINATOR N I
  printf '%s\n' "JAX_COORDINATOR_ADDRESS=$1" "JAX_NUM_PROCESSES=$2" "JAX_PROCESS_ID=$3"
}

PROGRAM=()
# Runs a command, or with --dry-run only prints it; so a dry run shows exactly what would run.
run() {
  if ((DRY_RUN)); then quote "$@"; return; fi
  echo "+ $(quote "$@")" >&2
  "$@"
}

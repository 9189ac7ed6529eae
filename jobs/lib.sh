# The steps every job script in jobs/ shares (docs/slurm.md). Sourced from the repository root:
#     cd "${SLURM_SUBMIT_DIR:-.}" && source jobs/lib.sh
# (sbatch runs a copy of the script from Slurm's spool directory, so the script's own path does not lead here).
#
# Variables a job reads (defaults in brackets); jobs/run_local.sh sets them to run a script on one machine:
#   VENV             the virtual environment [.venv]
#   HPCINFER_LAUNCH  the command that starts the ranks [srun --mpi=pmi2 --kill-on-bad-exit=1]
#                    (--kill-on-bad-exit: one failed rank ends the step instead of leaving its peers waiting)
#   HPCINFER_OUT     where results, metrics and generated inputs go [out]
#   HPCINFER_SET     extra `--set section.key=value` overrides for `hpcinfer run`, separated by spaces
#   HPCINFER_MODEL   the checkpoint a checkpoint job runs [the one its script names]

VENV=${VENV:-.venv}
HPCINFER_OUT=${HPCINFER_OUT:-out}
read -r -a LAUNCH <<<"${HPCINFER_LAUNCH:-srun --mpi=pmi2 --kill-on-bad-exit=1}"

# One BLAS/OpenMP thread pool per rank, sized to the cores Slurm gave it.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

# Exit codes of `hpcinfer run` (docs/reliability.md).
EXIT_CONFIG=2
EXIT_STOPPED=75          # stopped by SIGTERM / SIGUSR1 after committing its results: re-running resumes

die() {
    echo "$(basename "${BASH_SOURCE[1]:-job}"): $*" >&2
    exit "$EXIT_CONFIG"
}

require_venv() {
    test -x "$VENV/bin/python" || die "no $VENV: run 'make venv' first"
}

require_file() {         # FILE [HOW]: stop unless FILE exists
    test -f "$1" || die "no $1: ${2:-run 'make $1' first}"
}

hpcinfer_local() {       # a one-process step on the batch node (prompt files, summaries)
    "$VENV/bin/python" "$@"
}

token_prompts() {        # FILE COUNT LENGTH VOCAB: random token-id prompts for a preset (made once)
    test -f "$1" && return 0
    mkdir -p "$(dirname "$1")"
    hpcinfer_local -c 'import sys; from hpcinfer.checkpoint.presets import write_token_prompts as w
w(sys.argv[1], count=int(sys.argv[2]), length=int(sys.argv[3]), vocab=int(sys.argv[4]), seed=0)' "$@"
}

run_args() {             # CONFIG [ARGS...] -> RUN_ARGS: `hpcinfer run` arguments with HPCINFER_SET appended
    RUN_ARGS=("$@")
    local item
    for item in ${HPCINFER_SET:-}; do
        RUN_ARGS+=(--set "$item")
    done
}

hpcinfer_run() {         # CONFIG [ARGS...]: the job step, on every rank
    run_args "$@"
    "${LAUNCH[@]}" "$VENV/bin/python" -m hpcinfer run "${RUN_ARGS[@]}"
}

hpcinfer_run_requeueable() {   # CONFIG [ARGS...]: the job step; on a stop (exit 75) requeue this job
    # The step runs in the background so this shell can take Slurm's warning signal (--signal=B:USR1@T goes to
    # the batch shell only) and hand it to the launcher, which passes it to every rank. The traps are set before
    # the step starts; a signal that comes before the step exists is handed over as soon as it does.
    # SIGTERM to this shell means Slurm itself is ending this start (scancel, preemption, `scontrol requeue`, the
    # time limit): the results are committed all the same, but the job is not requeued from here; Slurm requeues
    # a preempted job by itself, and a cancelled one must stay cancelled.
    run_args "$@"
    STEP="" STOP_SIGNAL="" TERMINATED=""
    trap '_forward USR1' USR1
    trap '_forward TERM' TERM
    "${LAUNCH[@]}" "$VENV/bin/python" -m hpcinfer run "${RUN_ARGS[@]}" &
    STEP=$!
    [ -z "$STOP_SIGNAL" ] || _forward "$STOP_SIGNAL"
    local status=0
    while true; do       # `wait` returns early (status > 128) when a trapped signal arrives: wait again
        status=0
        wait "$STEP" || status=$?
        kill -0 "$STEP" 2>/dev/null || break
    done
    trap - USR1 TERM
    if [ "$status" -eq "$EXIT_STOPPED" ] && [ -n "$TERMINATED" ]; then
        echo "job: stopped by SIGTERM with its results committed; Slurm requeues or ends job ${SLURM_JOB_ID:-}" >&2
        return "$status"
    fi
    if [ "$status" -eq "$EXIT_STOPPED" ]; then
        echo "job: stopped with its results committed; requeueing job ${SLURM_JOB_ID:?}" >&2
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$status"
}

_forward() {             # SIGNAL: pass it to the running step (or keep it for the step about to start)
    STOP_SIGNAL=$1
    [ "$1" != TERM ] || TERMINATED=1
    if [ -n "${STEP:-}" ]; then
        echo "job: SIG$1: every rank stops after its current batch" >&2
        kill "-$1" "$STEP" 2>/dev/null || true
    fi
}

#!/usr/bin/env bash
# Runs every test suite, then sums them up:
#   0. the compile caches (Numba's, the kernel emulator's header): tests/helpers/warm_caches.py
#   1. no MPI:       pytest -n W --dist loadfile tests       (tests marked `mpi` skip themselves; W pytest-xdist
#                                                             workers, a test file per worker at a time)
#   2. 2 MPI ranks:  mpiexec -n 2 pytest --with-mpi -m mpi tests
#   3. 4 MPI ranks:  mpiexec -n 4 pytest --with-mpi -m mpi tests
# Under MPI every rank writes its own output file (interleaved reports glue summary lines together), its own
# pytest temp dir (ranks race on cleanup) and its own exit code. A rank that leaves no exit code was aborted
# (tests/conftest.py aborts the job on the first failure) or killed by MPIEXEC_TIMEOUT; Hydra's own exit status
# is not trusted (MPICH 5.0.2's mpiexec exits 0 after a timeout). pytest's exit 5 (no test selected, e.g. no
# test wants this many ranks) counts as success for the MPI runs only.
# Rank 0's report is printed, and any failed rank's too. The last line reads "N passed, M failed" over the
# three runs (errors, and a failed run with no pytest summary, count as failed); the exit status is non-zero
# when any run failed.
#
# Environment (all optional):
#   VENV (.venv), PY ($VENV/bin/python), MPIEXEC ($VENV/bin/mpiexec), TESTS_DIR (tests),
#   MPI_SIZES ("2 4"), MPI_TIMEOUT (900: seconds per MPI run), SINGLE_TIMEOUT (3300: seconds),
#   WORKERS (the cores, at most 4; 0: one process, no pytest-xdist),
#   LOG_DIR (out/test-logs), PYTEST_ARGS (extra arguments for every run, e.g. "-k comm -x"),
#   KEEP_TMP=1 (keep the pytest temp dirs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
MPIEXEC=${MPIEXEC:-$VENV/bin/mpiexec}
TESTS_DIR=${TESTS_DIR:-tests}
MPI_SIZES=${MPI_SIZES:-2 4}
MPI_TIMEOUT=${MPI_TIMEOUT:-900}
SINGLE_TIMEOUT=${SINGLE_TIMEOUT:-3300}
LOG_DIR=${LOG_DIR:-out/test-logs}
read -ra EXTRA <<<"${PYTEST_ARGS:-}"
COMMON=(-q -p no:cacheprovider --color=no)
NPROC=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)   # nproc honours OMP_*
WORKERS=${WORKERS:-$((NPROC < 4 ? NPROC : 4))}
XDIST=()
if [ "$WORKERS" -ge 2 ] && "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$WORKERS" --dist loadfile)
fi
SLOWEST=(--durations=25)                         # the run's slowest tests, for keeping make test within its time

mkdir -p "$LOG_DIR"
TMP_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/hpcinfer-tests.XXXXXX")
for n in $MPI_SIZES; do mkdir -p "$TMP_ROOT/mpi$n"; done  # pytest makes --basetemp, not its parents
SHM_BEFORE=$(ls /dev/shm 2>/dev/null | grep '^mpich_shm_' || true)

# Remove the MPICH shared-memory files that appeared since this script started and that no live process
# maps (an aborted or killed job leaves its files behind; a concurrent job's files stay mapped).
clean_shm() {
    local f
    for f in /dev/shm/mpich_shm_*; do
        [ -e "$f" ] || continue
        grep -qxF "${f#/dev/shm/}" <<<"$SHM_BEFORE" && continue
        grep -qsF "$f" /proc/[0-9]*/maps && continue
        rm -f "$f"
    done
}
finish() {
    clean_shm
    [ "${KEEP_TMP:-0}" = 1 ] || rm -rf "$TMP_ROOT"
}
trap finish EXIT

RUN_NAMES=() RUN_LINES=()
TOTAL_PASSED=0 TOTAL_FAILED=0 ANY_FAILED=0

# The pytest summary line of a report ("3 passed, 1 skipped in 0.12s", or "==== ... ====" without -q).
summary_line() {
    grep -E ' in [0-9]+(\.[0-9]+)?s( \([0-9:.]+\))?( =+)?$' "$1" 2>/dev/null | tail -n 1
}
count() {  # count WORD-REGEX SUMMARY -> the number before the word, or 0
    local n
    n=$(grep -oE "[0-9]+ ($1)\b" <<<"$2" | grep -oE '^[0-9]+' | head -n 1)
    echo "${n:-0}"
}

# record NAME OK(0|1) REPORT-FILE: add a run's counts to the totals.
record() {
    local name=$1 ok=$2 report=$3 summary passed failed errors skipped note=""
    summary=$(summary_line "$report")
    passed=$(count passed "$summary")
    failed=$(count failed "$summary")
    errors=$(count 'errors?' "$summary")
    skipped=$(count skipped "$summary")
    failed=$((failed + errors))
    if [ "$ok" != 0 ]; then
        ANY_FAILED=1
        if [ "$failed" = 0 ]; then
            failed=1
            if [ -z "$summary" ]; then
                note=" (no pytest summary: aborted, killed or timed out; counted as 1 failed)"
            else
                note=" (exit status says failed, summary lists no failure; counted as 1 failed)"
            fi
        fi
    fi
    TOTAL_PASSED=$((TOTAL_PASSED + passed))
    TOTAL_FAILED=$((TOTAL_FAILED + failed))
    RUN_NAMES+=("$name")
    RUN_LINES+=("$([ "$ok" = 0 ] && echo ok || echo FAILED) - passed $passed, failed $failed, skipped $skipped$note")
}

# The compile caches every suite reads (tests/helpers/warm_caches.py), filled once by three processes before the
# suites start, instead of by each test process at once on a fresh clone. A failure here is reported, not fatal:
# the tests that need the kernels then fail, saying why.
warm_caches() {
    local warm=(env "PYTHONPATH=tests/helpers${PYTHONPATH:+:$PYTHONPATH}" "$PY" tests/helpers/warm_caches.py) rc=0
    echo "=== [compile caches] ${warm[*]:1}"
    "${warm[@]}" float </dev/null & local float=$!
    "${warm[@]}" quantized </dev/null & local quantized=$!
    "${warm[@]}" rest </dev/null || rc=$?
    wait "$float" || rc=$?
    wait "$quantized" || rc=$?
    [ "$rc" = 0 ] || echo "!!! warm_caches.py exited $rc: the suites compile for themselves"
}

run_without_mpi() {
    local log="$LOG_DIR/without-mpi.out" rc
    warm_caches
    echo "=== [without MPI] $PY -m pytest ${COMMON[*]}${XDIST[*]:+ ${XDIST[*]}}${EXTRA[*]:+ ${EXTRA[*]}} $TESTS_DIR"
    timeout -k 30 "$SINGLE_TIMEOUT" "$PY" -m pytest "${COMMON[@]}" "${XDIST[@]}" "${SLOWEST[@]}" --basetemp "$TMP_ROOT/without-mpi" \
        "${EXTRA[@]}" "$TESTS_DIR" </dev/null 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "!!! run without MPI killed after ${SINGLE_TIMEOUT}s"
    [ "$rc" = 5 ] && echo "!!! run without MPI selected no test: that is a failure here"
    echo "=== [without MPI] pytest exit $rc"
    record "without MPI" "$([ "$rc" = 0 ] && echo 0 || echo 1)" "$log"
}

# Each rank: pytest with its own --basetemp, then its exit code into DIR/rc.RANK.
RANK_WRAPPER='r=${PMI_RANK:?PMI_RANK is not set}; py=$1 dir=$2 tmp=$3; shift 3
"$py" -m pytest --basetemp "$tmp/rank$r" "$@"; rc=$?; echo "$rc" >"$dir/rc.$r"; exit "$rc"'

run_mpi() {
    local n=$1 dir="$LOG_DIR/mpi$n" threads ok=0 r rc bad=()
    threads=$((NPROC / n)); [ "$threads" -ge 1 ] || threads=1
    rm -rf "$dir" && mkdir -p "$dir"
    echo "=== [mpiexec -n $n] $PY -m pytest ${COMMON[*]} --with-mpi -m mpi${EXTRA[*]:+ ${EXTRA[*]}} $TESTS_DIR" \
        "(MPIEXEC_TIMEOUT=$MPI_TIMEOUT, per-rank output in $dir)"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} MPIEXEC_TIMEOUT=$MPI_TIMEOUT \
        "$MPIEXEC" -n "$n" -outfile-pattern "$dir/out.%r" -errfile-pattern "$dir/err.%r" \
        sh -c "$RANK_WRAPPER" sh "$PY" "$dir" "$TMP_ROOT/mpi$n" \
        "${COMMON[@]}" --with-mpi -m mpi "${EXTRA[@]}" "$TESTS_DIR" </dev/null >"$dir/mpiexec.log" 2>&1
    local mpirc=$?
    clean_shm
    for ((r = 0; r < n; r++)); do
        rc=$(cat "$dir/rc.$r" 2>/dev/null || echo none)
        if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
            bad+=("$r:$rc")
        fi
    done
    [ "${#bad[@]}" = 0 ] && [ "$mpirc" != 0 ] && [ "$mpirc" != 5 ] && bad+=("mpiexec:$mpirc")
    [ "${#bad[@]}" = 0 ] || ok=1

    echo "--- rank 0 output ($dir/out.0)"
    cat "$dir/out.0" 2>/dev/null || echo "(none)"
    [ -z "$(tail -c 1 "$dir/out.0" 2>/dev/null)" ] || echo  # the output may not end with a newline
    if [ -s "$dir/err.0" ]; then
        echo "--- rank 0 stderr ($dir/err.0)"
        cat "$dir/err.0"
    fi
    for ((r = 1; r < n; r++)); do
        rc=$(cat "$dir/rc.$r" 2>/dev/null || echo none)
        if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
            echo "--- rank $r failed (exit: $rc); last 100 lines of $dir/out.$r and $dir/err.$r"
            tail -n 100 "$dir/out.$r" 2>/dev/null; echo
            tail -n 100 "$dir/err.$r" 2>/dev/null
        fi
    done
    if [ -s "$dir/mpiexec.log" ]; then
        echo "--- mpiexec ($dir/mpiexec.log)"
        tail -n 50 "$dir/mpiexec.log"
    fi
    if [ "$ok" = 0 ]; then
        echo "=== [mpiexec -n $n] every rank exited 0 (or 5: no test for this size)"
    else
        echo "=== [mpiexec -n $n] FAILED: rank:exit ${bad[*]} (exit 'none': aborted or timed out)"
    fi
    record "mpiexec -n $n" "$ok" "$dir/out.0"
}

if [ ! -x "$MPIEXEC" ]; then
    echo "!!! $MPIEXEC not found: run 'make venv' first" >&2
    exit 2
fi

run_without_mpi
for n in $MPI_SIZES; do
    run_mpi "$n"
done

echo
echo "=== totals over ${#RUN_NAMES[@]} runs"
for i in "${!RUN_NAMES[@]}"; do
    printf '  %-16s %s\n' "${RUN_NAMES[$i]}" "${RUN_LINES[$i]}"
done
echo "$TOTAL_PASSED passed, $TOTAL_FAILED failed"
exit "$ANY_FAILED"

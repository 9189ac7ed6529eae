#!/bin/bash
# Run a jobs/*.slurm script on this machine, with the same steps: mpiexec instead of srun (docs/slurm.md).
#
#   jobs/run_local.sh [-n RANKS] jobs/demo.slurm
#
# The ranks are the script's #SBATCH count (--ntasks, or --nodes x --ntasks-per-node) scaled down to this machine:
# at most HPCINFER_LOCAL_RANKS (default: the cores here, at most 4), or -n RANKS. A script whose config needs a
# bigger mesh, model or prompt set takes smaller ones through HPCINFER_SET / HPCINFER_MODEL / HPCINFER_OUT
# (jobs/lib.sh); the tests (tests/cli/test_jobs.py) run every script this way with a tiny model.
# Slurm's variables are set as a one-node allocation would set them; `scontrol` is a stub that only reports
# unless one is on PATH already. The script replaces this shell (exec), so a signal sent here reaches it.
set -euo pipefail

usage() { echo "usage: $0 [-n RANKS] SCRIPT.slurm" >&2; exit 2; }
ranks=""
while getopts "n:" opt; do
    case $opt in
        n) ranks=$OPTARG ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 1 ] || usage
script=$1
[ -f "$script" ] || { echo "$0: no script $script" >&2; exit 2; }

sbatch_value() {         # OPTION: the value of `#SBATCH --OPTION=VALUE` in the script, or nothing
    sed -n "s/^#SBATCH[[:space:]]\{1,\}--$1=\([^[:space:]]*\).*/\1/p" "$script" | tail -n 1
}

if [ -z "$ranks" ]; then
    wanted=$(sbatch_value ntasks)
    if [ -z "$wanted" ]; then
        nodes=$(sbatch_value nodes)
        per_node=$(sbatch_value ntasks-per-node)
        wanted=$(( ${nodes:-1} * ${per_node:-1} ))
    fi
    cap=${HPCINFER_LOCAL_RANKS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}   # the cores (nproc alone honours OMP_*)
    [ "$cap" -le 4 ] || cap=4
    ranks=$(( wanted < cap ? wanted : cap ))
    [ "$ranks" -ge 1 ] || ranks=1
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$root/.venv}
export VENV=$venv
export SLURM_JOB_ID=${SLURM_JOB_ID:-$$}
export SLURM_SUBMIT_DIR=$root
export SLURM_NTASKS=$ranks SLURM_NPROCS=$ranks SLURM_JOB_NUM_NODES=1 SLURM_NNODES=1
export SLURM_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
export HPCINFER_LAUNCH="$venv/bin/mpiexec -n $ranks"

if ! command -v scontrol >/dev/null; then
    stubs=${TMPDIR:-/tmp}/hpcinfer-run-local-$(id -u)
    mkdir -p "$stubs"
    printf '#!/bin/sh\necho "scontrol (local stub): $*" >&2\n' >"$stubs/scontrol"
    chmod +x "$stubs/scontrol"
    export PATH=$stubs:$PATH
fi
echo "run_local: $script on $ranks rank(s) with $(command -v scontrol) as scontrol" >&2
exec bash "$script"

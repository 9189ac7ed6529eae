#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/gpu.md ("What a GPU session must run first"), as steps run in order on the
# lent machine (the device tool), in the repository root:
#
#     COMMIT=<sha> bash gpu/session.sh setup stash ops mpi sanitize bench    # call 1 of docs/gpu.md's 3
#
# Steps:
#   setup     install the carried wheels (.carry/whl, made here by `make gpu-carry`) into /tmp/site; record the
#             machine (nvidia-smi, python, cupy, torch) in the log
#   stash     move carried parts (.carry/part*/*: GGUF parts, MiniLM) to $CARRY (/tmp/carry), kept while the machine is warm
#   models    join the GGUF parts (checked against gguf.sha256) and convert: models/smollm2.h5 (float32), and
#             /tmp/minilm.h5 from the carried MiniLM folder
#   ops       every CuPy op against NumPy, CUDA graphs, the NCCL group on one rank (tests/backend/test_cupy_ops.py, ...)
#   mpi       the communicator tests on 2 ranks sharing the GPU (mpiexec from the mpich wheel)
#   suite     the whole test suite with the GPU present (pytest-xdist over the CPU cores)
#   sanitize  compute-sanitizer memcheck and racecheck over the op tests
#   bench     python -m bench.gpu (copy bandwidth, decode, graphs, prefill, MoE gating,
#             transformers eager)
#   attention python -m bench.gpu_attention: decode attention alone (dense and paged, float16 and float32 KV,
#             batch 1 and 16, context 128 / 1024 / 4096) against the copy bandwidth (issue 29; 2 files)
#   quant     python -m bench.quant --backend cupy (needs the GGUF: stash + models first)
#   encoder   python -m bench.encoder --backend cupy (needs MiniLM: stash + models first)
#   offload   python -m bench.offload --backend cupy (needs models/smollm2.h5)
#   profile   hpcinfer profile --backend cupy: the planner's profile of this machine ($OUT/profile-gpu.toml)
#   scenarios issue 32's paper scenarios, one after the other, each under its own budget: python -m gpu.scenarios
#             flexgen|zero|moe ($OUT/<name>.json, rewritten after every case; gpu/check.py chains the same steps)
#
# Each step runs under `timeout $STEP_TIMEOUT` (default 540 s); everything goes to $OUT/session.log, one line per
# step ("step rc seconds") to $OUT/summary.txt, and the benchmarks write their JSON and markdown to $OUT. A step
# that fails is recorded and the next one runs. The device tool brings back 8 files of $OUT at most: plan a call's
# steps so that the benchmarks' files (2 each) and these 2 fit.
set -u
OUT=${OUT:-/tmp/gpu-session-out}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
CARRY=${CARRY:-/tmp/carry}                 # where carried parts stay between calls (machine warm)
GGUF=$CARRY/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT" "$CARRY"
MPICH_DIR=/tmp/hpcinfer-mpich              # the carried mpich wheel unpacked whole, when the image's MPI does not load
export PYTHONPATH=".:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PATH="$MPICH_DIR/bin:/tmp/site/bin:$PATH"
export LD_LIBRARY_PATH="$MPICH_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs"

step_setup() {
    if [ -d .carry/whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .carry/whl/*.whl || return 1
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || return 1
    python3 -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__)" \
        || return 1
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    # pip install --target drops the mpich wheel's lib/ folder: if MPI does not load, unpack the wheel whole
    # (gpu/check.py's mpi step does the same); a failure here fails the step, not the later mpi step
    if ! python3 -c "import mpi4py.MPI" 2>/dev/null; then
        python3 -c "import glob, sys; from gpu.check import unpack_mpich; \
unpack_mpich(glob.glob('.carry/whl/mpich-*.whl')[0], sys.argv[1])" "$MPICH_DIR" || return 1
    fi
    python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])" || return 1
    echo "commit $COMMIT"
}

step_stash() {
    for path in .carry/part*/*; do
        [ -e "$path" ] && { rm -rf "${CARRY:?}/$(basename "$path")"; mv -v "$path" "$CARRY/"; }
    done
    ls -la "$CARRY"
}

step_models() {
    if [ ! -f "$GGUF" ]; then
        ls "$CARRY"/gguf.part-* >/dev/null 2>&1 || { echo "no GGUF parts in $CARRY: stash them first"; return 1; }
        cat "$CARRY"/gguf.part-* > "$GGUF.part"
        (cd "$CARRY" && sed "s/ .*/  $(basename "$GGUF").part/" gguf.sha256 | sha256sum -c -) || {
            echo "the joined GGUF does not match gguf.sha256: a part is missing (the machine went back between"
            echo "calls?); carry the parts again (docs/gpu.md)"; rm -f "$GGUF.part"; return 1; }
        mv "$GGUF.part" "$GGUF" && rm "$CARRY"/gguf.part-*
    fi
    [ -f models/smollm2.h5 ] || python3 -m hpcinfer convert "$GGUF" models/smollm2.h5 --dtype float32 || return 1
    if [ -f "$CARRY/minilm/model.safetensors" ] && [ ! -f /tmp/minilm.h5 ]; then
        python3 -m hpcinfer convert "$CARRY/minilm" /tmp/minilm.h5 --dtype float32 || return 1
    fi
    ls -la models /tmp/minilm.h5 2>/dev/null
    return 0
}

step_ops() { $PYTEST tests/backend/test_cupy_ops.py tests/comm/test_nccl_group.py; }

step_mpi() { mpiexec -n 2 $PYTEST --with-mpi tests/comm/test_nccl_group.py; }

step_suite() {
    $PYTEST -x -n "${JOBS:-8}" tests -k "not slow" --deselect tests/checkpoint/test_gguf.py
}

step_sanitize() {
    compute-sanitizer --tool memcheck $PYTEST tests/backend/test_cupy_ops.py -k test_op_matches_numpy || return 1
    compute-sanitizer --tool racecheck $PYTEST tests/backend/test_cupy_ops.py -k test_op_matches_numpy
}

step_bench() { python3 -m bench.gpu --out "$OUT" --commit "$COMMIT"; }

step_attention() { python3 -m bench.gpu_attention --out "$OUT"; }

step_quant() { python3 -m bench.quant --backend cupy --gguf "$GGUF" --out "$OUT"; }

step_encoder() {
    python3 -m bench.encoder --backend cupy --checkpoint /tmp/minilm.h5 --folder "$CARRY/minilm" \
        --out "$OUT"
}

step_offload() {
    python3 -m bench.offload --backend cupy --checkpoint models/smollm2.h5 --out "$OUT" \
        --work /tmp/offload-work
}

step_profile() {
    python3 -m hpcinfer profile --backend cupy --disk-dir /tmp --out "$OUT/profile-gpu.toml"
}

step_scenarios() {
    local rc=0 name
    for name in flexgen zero moe; do
        python3 -m gpu.scenarios "$name" --out "$OUT/$name.json" || rc=1
    done
    return $rc
}

run_step() {
    local name=$1 start rc
    if ! declare -F "step_$name" >/dev/null; then
        echo "unknown step '$name' (steps: setup stash models ops mpi suite sanitize bench quant encoder offload profile scenarios)"
        echo "$name unknown 0" >> "$OUT/summary.txt"
        return
    fi
    echo "===== $name ($(date -u +%FT%TZ))"
    start=$(date +%s)
    # the step's function in a child shell, under timeout: a hung step cannot hold the call
    timeout "$STEP_TIMEOUT" bash -c "$(declare -f "step_$name"); $(declare -p PYTEST GGUF OUT COMMIT CARRY); step_$name"
    rc=$?
    echo "$name $rc $(( $(date +%s) - start ))" | tee -a "$OUT/summary.txt"
}

[ $# -gt 0 ] || { sed -n '2,29p' "$0"; exit 2; }
for name in "$@"; do
    run_step "$name"
done >> "$OUT/session.log" 2>&1
cat "$OUT/summary.txt"

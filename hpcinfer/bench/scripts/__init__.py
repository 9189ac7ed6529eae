"""The single-question benchmarks, each a script run from the repository root (the Makefile's bench-* targets;
docs/bench-scripts.md): `python -m hpcinfer.bench.scripts.NAME --help`. Each writes
bench/results/<name>-<date>.json and .md.

    cpu.py            hpcinfer against transformers on the CPU, and the machine's read bandwidth (make bench-cpu)
    pipeline.py       pipeline parallelism: equal against hybrid micro-batch counts (make bench-pipeline)
    moe.py            MoE gating and dispatch, all-to-all messages and layer times (make bench-moe); its MPI
                      jobs run moe_layer.py
    offload.py        weights streamed from host memory and disk, zig-zag against row by row (make bench-offload);
                      what it compares: offload_setups.py, its report: offload_report.py, on a GPU: offload_gpu.py
    gpu.py            the GPU figures on the CuPy backend in one run (make bench-gpu)
    quant.py          bytes and decode time per quantization mode (make bench-quant)
    encoder.py        encoders (MiniLM) against transformers (make bench-encoder)
    perplexity.py     SmolLM2 perplexity per weight- and KV-quantization mode (docs/quantization.md)
    planner_check.py  the performance model against measurements here, and the papers' scale claims (make
                      planner-check)

    results.py        the results tail: <out>/<name>-<date>.json + .md
    device.py         the device of a backend: synchronize, pool bytes, its description
"""

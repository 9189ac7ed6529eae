"""Benchmarks: the suite runner behind `hpcinfer bench` and the single-question benchmark scripts, with what both
share. Results go to bench/results/ of the repository (bench/README.md).

    suites/         `hpcinfer bench CONFIG`: the papers' workloads as named suites over the layouts of a bench
                    config, each cell a real `hpcinfer run` job, the baselines in the same run, a results JSON,
                    a markdown report and plots (docs/bench.md)
    scripts/        one question each, run from the repository root as `python -m hpcinfer.bench.scripts.NAME`
                    (make bench-cpu, bench-gpu, ...; docs/bench-scripts.md): cpu, pipeline, moe, offload, gpu,
                    quant, encoder, perplexity, planner_check

    common.py       what both use: the machine's description, quiet-machine checks, prompts of real text, token
                    agreement, the logger
    hf_baseline.py  the Hugging Face transformers baseline, in process (the suites' baseline and scripts/cpu.py)
"""

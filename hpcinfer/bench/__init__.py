"""Benchmarks: the suite runner behind `hpcinfer bench`, and what the suites share with the single-question
benchmark scripts of the repository's bench/ (outside the package: `python -m bench.NAME`, docs/bench-scripts.md).
Results go to bench/results/ of the repository (bench/README.md).

    suites/         `hpcinfer bench CONFIG`: the papers' workloads as named suites over the layouts of a bench
                    config, each cell a real `hpcinfer run` job, the baselines in the same run, a results JSON,
                    a markdown report and plots (docs/bench.md)

    common.py       the machine's description, quiet-machine checks, prompts of real text, token agreement, the
                    logger (the scripts use them too)
    hf_baseline.py  the Hugging Face transformers baseline, in process (the suites' baseline; bench/cpu.py's too)
"""

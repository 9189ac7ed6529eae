"""`hpcinfer bench`: the papers' workloads as named suites, run as real `hpcinfer run` jobs, with the baselines in
the same run, a results JSON (schema.py), a markdown report and plots (report.py). docs/bench.md.

    main.py         the `hpcinfer bench` command
    config.py       the bench config and the suites' defaults
    plan.py         which cells a suite runs (layouts x batches x variants) and its prompts
    cells.py        one cell = one generated config launched under mpiexec/srun; its metrics
    figures.py      figures from a job's metrics, medians, ratios, the machine's read bandwidth
    run.py          the rounds and the results
    schema.py       the results' JSON Schema
    report.py       markdown + PNG plots from a results file

The machine description, quiet-machine checks and prompts (../common.py) and the transformers baseline
(../hf_baseline.py) are shared with the benchmark scripts
(the repository's bench/, outside the package).
"""

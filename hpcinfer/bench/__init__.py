"""`hpcinfer bench`: the papers' workloads as named suites, run as real `hpcinfer run` jobs, with the baselines in
the same run, a results JSON (schema.py), a markdown report and plots (report.py). docs/bench.md.

    main.py         the `hpcinfer bench` command

    common.py       machine info, quiet-machine checks, prompts, the results tail (also used by bench/*.py)
    suites.py       the bench config and the suites' defaults
    plan.py         which cells a suite runs (layouts x batches x variants) and its prompts
    cells.py        one cell = one generated config launched under mpiexec/srun; its metrics
    figures.py      figures from a job's metrics, medians, ratios, the machine's read bandwidth
    hf_baseline.py  the Hugging Face transformers baseline (in process)
    run.py          the rounds and the results
    schema.py       the results' JSON Schema
    report.py       markdown + PNG plots from a results file
"""

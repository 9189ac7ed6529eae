"""Heterogeneous memory: tiers (device, host, disk), FlexGen's cost model and its policy search.

Planning (no model is run):
  policy.py      the `[offload]` policy (FlexGen's Policy): block shape, placement percentages, schedule
  placement.py   the placement rules (percent ranges, device + host <= 100 per pair, schedules): the config's
                 check and Policy's
  profile.py     a machine's capacities, bandwidths and rates (measured, or a preset), as flat TOML
  cost_model.py  FlexGen's per-layer cost model: predicted time, throughput, latency, peak memory per tier
  lp.py          the placement LP (scipy's HiGHS) and the (gpu_batch_size, num_gpu_batches) search
  planning.py    the planned model and what it holds quantized, read from `hpcinfer plan`'s options (both planners)
  report.py      `hpcinfer plan` without --gpus: the options checked, the search, the printed [offload] section
Running (hpcinfer run):
  tiers.py       the weights of each layer on the device, in host memory or on disk, streamed with prefetch
  partition.py   partitioned fetch: each replica of a node keeps and reads 1/N of a layer, an all-gather joins it
  budget.py      the memory plan of a run, checked against the budgets before any weight is read
  sizes.py       the bytes one rank holds (layers, tables; float or quantized), the rows a placement keeps on the
                 device: the plan's, the planner's and the schedules' rule
"""

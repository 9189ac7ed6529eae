"""Heterogeneous memory: tiers (device, host, disk), FlexGen's cost model and its policy search.

Planning (no model is run):
  policy.py      the `[offload]` policy (FlexGen's Policy): block shape, placement percentages, schedule
  profile.py     a machine's capacities, bandwidths and rates (measured, or a preset), as flat TOML
  cost_model.py  FlexGen's per-layer cost model: predicted time, throughput, latency, peak memory per tier
  lp.py          the placement LP (scipy's HiGHS) and the (gpu_batch_size, num_gpu_batches) search
Running (hpcinfer run):
  tiers.py       the weights of each layer on the device, in host memory or on disk, streamed with prefetch
  partition.py   partitioned fetch: each replica of a node keeps and reads 1/N of a layer, an all-gather joins it
  zigzag.py      FlexGen's block schedule
  budget.py      the memory plan of a run, checked against the budgets before any weight is read
  sizes.py       the bytes one rank holds (layers, tables; float or quantized): the plan's and the planner's rule
"""

"""Heterogeneous memory: tiers (device, host, disk), FlexGen's cost model and its policy search.

Planning (no model is run):
  policy.py      the `[offload]` policy (FlexGen's Policy): block shape, placement percentages, schedule
  profile.py     a machine's capacities, bandwidths and rates (measured, or a preset), as flat TOML
  cost_model.py  FlexGen's per-layer cost model: predicted time, throughput, latency, peak memory per tier
  lp.py          the placement LP (scipy's HiGHS) and the (gpu_batch_size, num_gpu_batches) search
The runtime's tiers, budgets and schedules live beside them in this package.
"""

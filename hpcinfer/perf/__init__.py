"""The analytic performance model of one inference step and the layout planner (`hpcinfer plan --gpus N`).

docs/planner.md gives the equations. Modules, bottom up: comm_cost (collectives and all-to-all variants on the two
link classes), layout (a candidate layout and its validity, by the runtime's own checks), step (compute, memory
traffic and the pipeline schedule of a prompt step and a token step), memory (bytes per rank), planner (the search),
report (the table and TOML that `hpcinfer plan --gpus` prints), links (measuring this machine's links under MPI).
"""

"""The lent GPU machine's tooling, run from the repository root (docs/gpu.md): not part of the package, since it
drives the repository's tests and carried files.

    check.py     the first GPU window in one device call: every check and the decode benchmark under a time budget;
                 here, a rehearsal on the CPU stand-in of cupy (make gpu-check; python -m gpu.check)
    carry.py     what a session carries to the machine: wheels its image lacks, the GGUF in parts, MiniLM in float16
                 (make gpu-carry; python -m gpu.carry)
    session.sh   the later calls' checks and benchmarks, as named steps (bash gpu/session.sh STEP...)

The benchmarks they run live in bench/.
"""

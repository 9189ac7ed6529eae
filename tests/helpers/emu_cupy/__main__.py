"""Run a module or a script on the CPU stand-in of cupy (gpu/check.py's rehearsal without a GPU):
`PYTHONPATH=tests/helpers python -m emu_cupy -m bench.gpu ARGS` or `python -m emu_cupy script.py ARGS`."""

import runpy
import sys

from . import installed

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m emu_cupy (-m MODULE | SCRIPT.py) [ARGS...]")
    with installed():
        if sys.argv[1] == "-m":
            module, sys.argv = sys.argv[2], sys.argv[2:]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script, sys.argv = sys.argv[1], sys.argv[1:]
            runpy.run_path(script, run_name="__main__")

"""hpcinfer's modules import one another without cycles, hidden or not (docs: ARCHITECTURE.md, "imports point down").

Every import statement of every module under hpcinfer/ counts, wherever it is written: at module level, inside a
function or method, under `if TYPE_CHECKING:`. Relative imports are resolved; `from package import name` imports
package.name when that is a submodule, else the package itself (its __init__, which counts like any module); and an
import of a.b.c from outside package a.b also runs a.b's and a's __init__, so it counts as importing them too.
Imports of other packages (numpy, cupy, mpi4py, torch, transformers, matplotlib, scipy ...) never close a cycle
here, and may stay inside the functions that need them, to keep a heavy or optional dependency lazy.

An import of an hpcinfer module written inside a function is the usual way a cycle is hidden; the second test
allows none but the ones listed in LAZY_ALLOWED, each with its reason (there are none).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpcinfer"

# (importing module, imported module): an hpcinfer import that stays inside a function, and why.
LAZY_ALLOWED: dict = {}           # none: every hpcinfer import is at the top of its module


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path) -> dict[str, Path]:
    """Module name -> file, for every module and package of the package folder `package`."""
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names (relative levels resolved against `module`)."""
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path, known: dict) -> list[tuple[str, int, bool]]:
    """(imported module of `known`, line, inside a function) for each import in the file; other packages left out."""
    is_package = path.name == "__init__.py"
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                target = _target(module, is_package, child)
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in child.names]
            found.extend((name, child.lineno, inner) for name in names if name in known)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _with_packages(module: str, target: str) -> list[str]:
    """target and the packages above it whose __init__ importing it runs (those not holding `module` itself)."""
    parts = target.split(".")
    above = [".".join(parts[:n]) for n in range(1, len(parts))]
    return [target] + [p for p in above if not (module == p or module.startswith(p + "."))]


def graph(package: Path = PACKAGE) -> tuple[dict, list]:
    """(module -> set of the package's modules it imports, [(module, file:line, imported)] of the imports written
    inside functions)."""
    known = modules(package)
    edges, lazy = {m: set() for m in known}, []
    for module, path in known.items():
        for target, line, in_function in imports(module, path, known):
            if target != module:
                edges[module].update(t for t in _with_packages(module, target) if t != module)
            if in_function:
                lazy.append((module, f"{path.relative_to(package.parent)}:{line}", target))
    return edges, lazy


def cycles(edges: dict) -> list[list[str]]:
    """One cycle (a list of modules, first = last) for each strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_one_cycle(edges, group) for group in groups]


def _one_cycle(edges: dict, group: set) -> list[str]:
    """A shortest cycle through the group's first module (breadth first, inside the group)."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle in {sorted(group)}")


def test_the_graph_is_read():
    edges, _ = graph()
    assert "hpcinfer.arch" in edges["hpcinfer.checkpoint.format"]
    assert edges["hpcinfer.arch"] == set()                                   # the bottom: ModelArch
    assert "hpcinfer.backend.interface" in edges["hpcinfer.backend.numpy_ops"]
    assert "hpcinfer.kernels" in edges["hpcinfer.backend.cupy_quant"]       # kernels/__init__ runs too


def test_cycles_are_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_hidden_and_package_imports_are_counted(tmp_path):
    """A cycle through a package's __init__, an import inside a function, a submodule named by `from . import`."""
    files = {"__init__.py": "", "sub/__init__.py": "from ..b import x\n", "sub/c.py": "import numpy\n",
             "a.py": "def f():\n    from . import b\n", "b.py": "from .sub import c\nx = 1\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    edges, lazy = graph(tmp_path / "pkg")
    assert edges["pkg.b"] == {"pkg.sub", "pkg.sub.c"} and edges["pkg.sub"] == {"pkg.b"}
    assert cycles(edges) == [["pkg.b", "pkg.sub", "pkg.b"]]
    assert lazy == [("pkg.a", "pkg/a.py:2", "pkg.b")]


def test_no_import_cycles():
    found = cycles(graph()[0])
    assert not found, "import cycles (module-level and function-level imports):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found)


def test_no_hidden_hpcinfer_imports():
    """An hpcinfer import inside a function hides the module's place in the layering; each one left is listed."""
    _, lazy = graph()
    listed = set(LAZY_ALLOWED)
    left = sorted({f"{where} imports {target}" for module, where, target in lazy if (module, target) not in listed})
    assert not left, "imports of hpcinfer modules inside functions (move them to the top):\n" + "\n".join(left)
    stale = listed - {(module, target) for module, _, target in lazy}
    assert not stale, f"listed imports no longer inside functions (remove them from the lists): {sorted(stale)}"


OUTSIDE = ("bench", "gpu", "tests")   # the repository's folders beside the package: never shipped in the wheel


def test_the_package_imports_nothing_from_outside_it():
    """bench/ (the single-question benchmarks), gpu/ and tests/ import hpcinfer, never the other way round: an
    installed hpcinfer has none of them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in OUTSIDE]
    assert not found, "\n".join(found)

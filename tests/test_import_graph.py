"""The import graph of the `hstu` package: no cycles, no upward imports between its layers.

Every module under hstu/ is parsed with `ast` (nothing is imported). An edge A -> B means module
A imports module B, at module level or inside a function or method: both count, since both
execute B (and whatever B imports) when they run. Imports under ``if TYPE_CHECKING:`` do not
count (they never run), nor do names that are not `hstu` modules. An edge goes to the most
specific module an import names: ``from hstu.data import loader`` is an edge to hstu.data.loader
when that module exists, ``from hstu.data import Batch`` one to the package hstu.data (its
``__init__``). Importing hstu.b.x also runs the ``__init__`` of every package on the way
(hstu.b) that the importer is not itself inside, so those are edges too.

Layers. The subpackages of `hstu` form a stack; a module may import from its own package and
from packages below it, never from one above:

    config < data < embeddings < ops < modules < models < training < inference

- config: argument dataclasses and gin loading; imports no other layer;
- data: datasets, batches and the batch iterator (knows the config);
- embeddings: embedding tables and their sharding (knows the batches they look up);
- ops: the attention kernels and their PyTorch reference;
- modules: HSTU layers, preprocessor, heads, metrics (built on ops);
- models: ranking / retrieval models (modules + embeddings);
- training: trainer, checkpoints, distributed setup, launchers;
- inference: answers from a trained checkpoint (uses everything).

embeddings and ops are independent (neither needs the other); the order above lets embeddings
use ops some day and keeps ops, the lowest compute layer under the HSTU modules, free of
embeddings. ``hstu/__init__.py`` and the top-level modules ``hstu/*.py``
(shared helpers such as hstu.comm) belong to no layer: they may be imported from any layer, but
a top-level module counts as high as the highest layer it imports (directly or through other
top-level modules), so importing it from a lower layer is an upward import too. Cycles are
checked over all modules, top-level ones included.

A new subpackage must be placed in `LAYERS` (a test fails until it is).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hstu"
LAYERS = ("config", "data", "embeddings", "ops", "modules", "models", "training", "inference")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    path: str  # file of the import, relative to the repository
    line: int
    implicit: bool = False  # the __init__ of a package on the way to the imported module

    def where(self) -> str:
        how = " (its package __init__ runs first)" if self.implicit else ""
        return f"{self.path}:{self.line}{how}"


def module_files(package_dir: Path) -> dict[str, Path]:
    """Module name -> file for every .py file under ``package_dir`` (packages: their __init__)."""
    root = package_dir.parent
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (their else runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            stack.append(node.test)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """(dotted module, imported attribute or None) pairs an import node names, relative imports
    resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        return [(base, a.name) for a in node.names]
    if (  # importlib.import_module("hstu.x") with a literal name
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Attribute, ast.Name))
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [(node.args[0].value, None)]
    return []


def import_edges(package_dir: Path) -> tuple[dict[str, Path], list[Edge]]:
    """All modules of the package and the import edges between them (see the module docstring)."""
    files = module_files(package_dir)
    top = package_dir.name
    root = package_dir.parent

    def existing(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: set[Edge] = set()
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        own = set(_ancestors(module)) | ({module} if is_package else set())
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _runtime_nodes(tree):
            for base, attr in _imported_names(node, module, is_package):
                if base != top and not base.startswith(top + "."):
                    continue
                full = f"{base}.{attr}" if attr and attr != "*" else base
                target = full if full in files else existing(base)
                if target is None or target == module:
                    continue
                line = getattr(node, "lineno", 0)
                edges.add(Edge(module, target, rel, line))
                for pkg in _ancestors(target):
                    if pkg not in own and pkg in files and pkg != module:
                        edges.add(Edge(module, pkg, rel, line, implicit=True))
    return files, sorted(edges, key=lambda e: (e.source, e.target, e.line, e.implicit))


def _ancestors(module: str) -> list[str]:
    """hstu.a.b.c -> [hstu, hstu.a, hstu.a.b]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                out.append(sorted(comp))
    return out


def _shortest_cycle(start: str, members: set[str], succ: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through ``start`` inside one component: [start, ..., start]."""
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(succ.get(node, ())):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start]


def find_cycles(files: dict[str, Path], edges: list[Edge]) -> list[str]:
    """One message per import cycle (strongly connected component of more than one module): its
    modules, then a shortest cycle through the first of them with the file:line of each import."""
    succ: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], Edge] = {}
    for e in edges:
        succ[e.source].add(e.target)
        key = (e.source, e.target)
        if key not in where or (where[key].implicit and not e.implicit):
            where[key] = e
    messages = []
    for comp in strongly_connected(sorted(files), succ):
        if len(comp) < 2:
            continue
        cycle = _shortest_cycle(comp[0], set(comp), succ)
        steps = [f"{a} imports {b} at {where[(a, b)].where()}" for a, b in zip(cycle, cycle[1:])]
        messages.append(f"cycle among {', '.join(comp)}:\n      " + "\n      ".join(steps))
    return messages


def layer_of(module: str) -> str | None:
    """The subpackage of hstu a module belongs to (its layer); None for hstu and hstu/*.py."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def find_upward_imports(files: dict[str, Path], edges: list[Edge]) -> list[str]:
    """One message per import of a higher layer (see the module docstring), top-level modules
    counted at the highest layer they reach."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    succ: dict[str, list[Edge]] = defaultdict(list)
    for e in edges:
        succ[e.source].append(e)

    reach: dict[str, tuple[int, list[str]]] = {}

    def top_level_reach(module: str, visiting: frozenset[str]) -> tuple[int, list[str]]:
        """(highest layer rank, chain to it) reached from top-level ``module``; -1 = none."""
        if module in reach:
            return reach[module]
        best: tuple[int, list[str]] = (-1, [])
        for e in succ.get(module, ()):
            if e.implicit:  # same layer as the explicit edge beside it
                continue
            layer = layer_of(e.target)
            if layer is not None:
                cand = (rank.get(layer, -1), [e.target])
            elif e.target in visiting:
                continue
            else:
                sub, chain = top_level_reach(e.target, visiting | {e.target})
                cand = (sub, [e.target, *chain])
            if cand[0] > best[0]:
                best = cand
        reach[module] = best
        return best

    messages = []
    for e in edges:
        src_layer = layer_of(e.source)
        if src_layer not in rank or e.implicit:  # unplaced subpackages: their own test fails
            continue
        dst_layer = layer_of(e.target)
        if dst_layer is not None:
            if rank.get(dst_layer, -1) > rank[src_layer]:
                messages.append(
                    f"{e.path}:{e.line}: {e.source} ({src_layer}) imports {e.target} "
                    f"({dst_layer}, a higher layer)"
                )
            continue
        if e.target == PACKAGE_DIR.name or e.target not in files:
            continue
        high, chain = top_level_reach(e.target, frozenset({e.target}))
        if high > rank[src_layer]:
            messages.append(
                f"{e.path}:{e.line}: {e.source} ({src_layer}) imports {e.target}, which reaches "
                f"{LAYERS[high]} (a higher layer) through {' -> '.join([e.target, *chain])}"
            )
    return messages


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    return import_edges(PACKAGE_DIR)


def test_every_subpackage_has_a_layer(graph):
    files, _ = graph
    packages = {
        m.split(".")[1] for m in files if m.count(".") >= 1 and files[m].name == "__init__.py"
    }
    assert packages <= set(LAYERS), (
        f"subpackages {sorted(packages - set(LAYERS))} of hstu have no place in LAYERS "
        f"{LAYERS}: add them where their imports put them"
    )
    assert set(LAYERS) <= packages, (
        f"LAYERS names missing subpackages {sorted(set(LAYERS) - packages)}"
    )


def test_no_import_cycles(graph):
    cycles = find_cycles(*graph)
    assert not cycles, f"{len(cycles)} import cycle(s) in hstu:\n  " + "\n  ".join(cycles)


def test_no_upward_imports(graph):
    upward = find_upward_imports(*graph)
    assert not upward, (
        f"{len(upward)} upward import(s) (layers, lowest first: {' < '.join(LAYERS)}):\n  "
        + "\n  ".join(upward)
    )


# ---- the graph builder itself, on a small package written for the test ----------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "hstu"


def test_builder_counts_function_level_relative_and_package_imports(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "hstu/__init__.py": "",
            "hstu/comm.py": "import torch\n",
            "hstu/config/__init__.py": "from hstu.config.args import A\n",
            "hstu/config/args.py": "A = 1\n",
            "hstu/data/__init__.py": "",
            "hstu/data/batch.py": (
                "from typing import TYPE_CHECKING\n"
                "from . import loader\n"
                "from ..config import args\n"
                "if TYPE_CHECKING:\n"
                "    from hstu.training import trainer\n"
                "def f():\n"
                "    import hstu.training.trainer\n"
            ),
            "hstu/data/loader.py": "from hstu.config import A\nfrom .batch import *\n",
            "hstu/training/__init__.py": "",
            "hstu/training/trainer.py": "import importlib\nimportlib.import_module('hstu.comm')\n",
        },
    )
    files, edges = import_edges(pkg)
    pairs = {(e.source, e.target, e.implicit) for e in edges}
    assert ("hstu.data.batch", "hstu.data.loader", False) in pairs  # from . import loader
    assert ("hstu.data.batch", "hstu.config.args", False) in pairs  # from ..config import args
    assert ("hstu.data.batch", "hstu.config", True) in pairs  # hstu/config/__init__ runs first
    assert ("hstu.data.batch", "hstu.training.trainer", False) in pairs  # inside a function
    assert ("hstu.data.batch", "hstu.training", True) in pairs
    assert ("hstu.data.loader", "hstu.config", False) in pairs  # a name of the package
    assert ("hstu.data.loader", "hstu.data.batch", False) in pairs  # from .batch import *
    assert ("hstu.training.trainer", "hstu.comm", False) in pairs  # import_module literal
    # the TYPE_CHECKING import added no line-5 edge; the function-level one is at line 7
    lines = {e.line for e in edges if e.target == "hstu.training.trainer"}
    assert lines == {7}
    assert not any(e.target == "hstu.data" for e in edges if e.source.startswith("hstu.data."))
    cycles = find_cycles(files, edges)
    assert len(cycles) == 1 and "hstu.data.batch, hstu.data.loader" in cycles[0]
    upward = find_upward_imports(files, edges)
    assert len(upward) == 1 and "hstu.data.batch (data) imports hstu.training.trainer" in upward[0]


def test_builder_sees_upward_imports_through_top_level_modules(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "hstu/__init__.py": "",
            "hstu/comm.py": "from hstu.util import x\n",
            "hstu/util.py": "def g():\n    from hstu.training.trainer import T\nx = 1\n",
            "hstu/config/__init__.py": "import hstu.comm\n",
            "hstu/training/__init__.py": "",
            "hstu/training/trainer.py": "T = 1\n",
        },
    )
    files, edges = import_edges(pkg)
    assert find_cycles(files, edges) == []
    upward = find_upward_imports(files, edges)
    assert len(upward) == 1
    assert "hstu.config (config) imports hstu.comm, which reaches training" in upward[0]
    assert "hstu.comm -> hstu.util -> hstu.training.trainer" in upward[0]

"""The package's shape: no import cycle, the reference never imports a kernel, and converting a model
changes nothing outside it - ``fp4train.quantize`` and ``fp4train.hadamard`` give the same bits after
any ``convert()``."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fp4train

PACKAGE = Path(fp4train.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, at the top or inside a function."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each subpackage collapsed to one node (``fp4train.linear.op`` -> ``fp4train.linear``; a top-level
    module such as ``fp4train.cli`` is its own node)."""
    def node(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, edges in graph.items():
        out.setdefault(node(m), set()).update(node(e) for e in edges if node(e) != node(m))
    return out


def test_the_package_graph_collapses_subpackages():
    graph = {"fp4train.a.x": {"fp4train.b.y"}, "fp4train.b.y": {"fp4train.a.z"}, "fp4train.a.z": set(), "fp4train.c": {"fp4train.a.x"}}
    assert cycles(graph) == []  # no loop between modules ...
    assert cycles(package_graph(graph)) == [["fp4train.a", "fp4train.b"]]  # ... but one between their packages


def test_no_subpackage_imports_itself_back():
    """Layers, not a web: no two subpackages (or top-level modules) that import each other, directly or around a
    loop, at the top or inside a function (``linear`` runs AdaHOP's outlier GEMM without importing ``adahop``;
    ``evaluate`` reads checkpoints without importing the trainer)."""
    assert cycles(package_graph(import_graph())) == []


def test_the_reference_imports_no_kernel():
    graph = import_graph()
    pure = [m for m in graph if m.startswith(("fp4train.formats", "fp4train.transforms")) or m == "fp4train.counter_rng"]
    assert pure and all(not any(t.startswith("fp4train.kernels") for t in graph[m]) for m in pure)


def _reference_results():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 128)
    out = []
    for fmt, kw in (("mxfp4", {}), ("mxfp4", dict(axis=0, rounding="stochastic", seed=5)), ("nvfp4", dict(block=(16, 16))),
                    ("mxfp8", dict(block=(32, 32))), ("fp8", {})):
        q = fp4train.quantize(x, fmt, **kw)
        out += [q.codes, q.scales, q.dequantize()]
    out += [fp4train.hadamard(x, 32), fp4train.hadamard(x, 16, seed=9)]
    return out


@pytest.mark.parametrize("backend,numerics", [("emulated", None), ("fp8_blockwise", None), ("triton", None),
                                              ("triton", "triton"), ("emulated", "compiled")])
def test_quantize_gives_the_same_bits_before_and_after_a_convert(backend, numerics, monkeypatch):
    """No convert() switches anything process-wide. The kernels are watched: after a convert asking for Triton
    numerics on a (pretended) GPU machine, the public functions must still run the reference alone."""
    before = _reference_results()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine's convert() sees
    m = fp4train.convert(nn.Sequential(nn.Linear(128, 128)), "mxfp4", backend=backend, numerics=numerics)
    monkeypatch.undo()
    m(torch.randn(32, 128)).sum().backward()  # the layer ran with its own numerics
    from fp4train.kernels import dispatch

    monkeypatch.setattr(dispatch, "quantize", lambda *a, **k: pytest.fail("fp4train.quantize reached a kernel"))
    after = _reference_results()
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after))


def test_no_module_level_switch_is_left():
    """No ``global`` statement anywhere in the package, except the capability caches (what this torch or GPU can
    run, learnt on first use) and the lazily built compiled functions' memos."""
    allowed = {"_FP32_MM", "_BLOCKWISE_OK", "_ROWWISE_OK", "_FP32_OUT", "_ROWWISE_FP32_OUT"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found += [(path.name, n) for n in node.names if n not in allowed]
    assert found == []

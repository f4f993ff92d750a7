"""Imports run one way: no module imports itself back through others, and the packages form layers (parallel below
attention, moe, eplb and dbo, those below engine, engine below disagg and launch; cpu, kvstore and structured import
none of the others) — read from the code's own import statements, the ones inside functions included."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_PACKAGES = {"tests", "bench", "docs", "build"}


def _modules() -> dict[str, Path]:
    out = {}
    for init in REPO.glob("*/__init__.py"):
        top = init.parent.name
        if top in NOT_PACKAGES or top.startswith("."):
            continue
        for f in init.parent.rglob("*.py"):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts if parts[0] == "wideep" else ["wideep", *parts])] = f
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (wideep.<folder>.<...> names)."""
    mods, edges = _modules(), defaultdict(set)
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m:
                    edges[m].add(n)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _level(edges: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph of packages `depth` dots deep (2: wideep.engine; 3: wideep.engine.worker)."""
    out = defaultdict(set)
    for a, bs in edges.items():
        pa = ".".join(a.split(".")[:depth])
        for b in bs:
            pb = ".".join(b.split(".")[:depth])
            if pa != pb:
                out[pa].add(pb)
    return out


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_the_packages_form_layers():
    g = _graph()
    assert _cycles(_level(g, 2)) == [], "top-level packages import each other in a circle"
    engine = {a: {b for b in bs if b.startswith("wideep.engine.")} for a, bs in _level(g, 3).items()
              if a.startswith("wideep.engine.")}
    assert _cycles(engine) == [], "engine's subpackages import each other in a circle"
    top = _level(g, 2)
    for bottom in ("wideep.cpu", "wideep.kvstore", "wideep.structured", "wideep.parallel"):
        assert not top.get(bottom), f"{bottom} imports {sorted(top[bottom])}: it is a bottom layer"
    for low in ("wideep.parallel", "wideep.attention_mla", "wideep.attention_v4", "wideep.moe", "wideep.eplb",
                "wideep.dbo", "wideep.layers"):
        up = top.get(low, set()) & {"wideep.engine", "wideep.disagg", "wideep.launch"}
        assert not up, f"{low} imports {sorted(up)}, a layer above it"
    assert "wideep.launch" not in top.get("wideep.engine", set()) | top.get("wideep.disagg", set())
    assert "wideep.disagg" not in top.get("wideep.engine", set())


def test_the_engine_knows_no_model_family():
    """engine/worker, sched, front, sampling, spec_decode's protocol, disagg, kvstore and eplb import no family's
    model module: they reach a family through engine/model/family.py's interface (families.py picks)."""
    g = _graph()
    family_modules = {m for m in _modules() if m.startswith("wideep.engine.model.") and m.rsplit(".", 1)[1] in
                      ("mla_family", "v4_family", "model", "v4_model", "mtp", "mla_cache", "v4_cache", "fused_decode")}
    for m, deps in g.items():
        parts = m.split(".") + [""]
        if parts[1] in ("disagg", "kvstore", "eplb") or (parts[1] == "engine" and len(parts) > 2
                                                          and parts[2] in ("worker", "sched", "front", "sampling")):
            assert not deps & family_modules, f"{m} imports {sorted(deps & family_modules)}"

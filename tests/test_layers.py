"""colora's rooms: no import cycle between its modules, subpackages that import only the rooms below
them, and no module grown past what a reader takes in at one sitting.

The order of the rooms, lowest first (docs/architecture.md, "Where the code lives"): the foundations
at colora/'s top (config, tables, seeding, environment, output, stopping), then the run's record, the
base models, the engine, the training, the co-runner, one run, runs over a Ray cluster, the
time-slicing arm (its tenants are runs), studies over runs, sweeps of runs, the benchmarks, the service;
the command line (colora/cli.py) sits on top and may load any of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "colora"
ROOMS = ["(top)", "record", "models", "engine", "training", "corun", "run", "cluster", "timeslice", "studies",
         "sweeps", "bench", "service"]
LONGEST = 520  # lines: STYLE.md's "library modules stay under ~600", held to ~500 here
GENERATED = {"service/tinker_public_pb2.py"}  # the Tinker SDK's protobuf module, vendored as it is


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["colora", *parts])] = p
    return out


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """colora's own modules that `mod` imports, at any depth of its code."""
    found = set()
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for n in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(up + ([n.module] if n.module else []))
            # `from pkg import mod` imports mod (and pkg's docstring-only __init__); `from mod import x`, mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in n.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod and name != "colora":
                found.add(name)
    return found


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else "(top)"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_module_imports_itself_through_others(graph):
    """Tarjan's strongly connected components: any of more than one module is a cycle."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_each_room_imports_only_the_rooms_below_it(graph):
    up = []
    for mod, deps in graph.items():
        if mod == "colora.cli":
            continue  # the command line loads whichever room its command needs
        src = _room(mod)
        assert src in ROOMS, f"{mod}: room {src!r} is not in this test's order of rooms"
        for dep in deps:
            dst = _room(dep)
            if dst != src and ROOMS.index(dst) > ROOMS.index(src):
                up.append(f"{mod} -> {dep}")
    assert up == []


def test_no_module_is_longer_than_a_sitting(graph):
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if str(p.relative_to(PKG)) not in GENERATED and (n := len(p.read_text().splitlines())) > LONGEST}
    assert long == {}


def test_the_check_finds_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The walk itself: a made-up package with a cycle and a low room importing a high one."""
    import sys

    fake = tmp_path / "colora"
    for rel, text in {"__init__.py": "", "record/__init__.py": "", "run/__init__.py": "",
                      "record/a.py": "from colora.run import b\n", "run/__init__x.py": "",
                      "run/b.py": "from . import c\n", "run/c.py": "import colora.run.b\n"}.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    mods = _modules()
    g = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert g["colora.record.a"] == {"colora.run.b"} and g["colora.run.b"] == {"colora.run.c"}
    with pytest.raises(AssertionError, match="colora.run.b"):
        test_no_module_imports_itself_through_others(g)
    with pytest.raises(AssertionError, match="colora.record.a -> colora.run.b"):
        test_each_room_imports_only_the_rooms_below_it(g)

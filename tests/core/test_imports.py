"""The project's import graph, read from the source (imports inside functions included):
no circle among its own modules, and the rooms import one way: the core (`jetsplit/`) and
the export tool never import the coordinator (`server/`), and the coordinator's
subpackages import down their order (`SERVER_ROOMS`). Only the command-line root,
`jetsplit/cli.py`, mounts every room's commands and so imports them all."""

from __future__ import annotations

import ast
from pathlib import Path

from jetsplit.config_io import tomllib

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION_ROOT = "jetsplit.cli"  # mounts the coordinator's commands beside the rest
# The coordinator's subpackages, top to bottom (docs/architecture.md): a module may import
# its own room and the rooms below it; report and ops stand side by side.
SERVER_ROOMS = (("run",), ("report", "ops"), ("methods",), ("training",), ("cuts",),
                ("fleet",), ("engines",), ("defences",))
SERVER = "jetsplit.server"


def _package_dirs() -> dict[str, Path]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: ROOT / folder for pkg, folder in setuptools["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every first-party module by its installed dotted name (the package-dir mapping:
    server/ installs as jetsplit.server, and so on)."""
    out: dict[str, Path] = {}
    dirs = _package_dirs()
    for pkg, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([pkg, *parts])
            # a nested mapping (jetsplit.server inside jetsplit/) wins over its parent's
            if name not in out or len(str(folder)) > len(str(out[name].parent)):
                out[name] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the first-party modules it imports anywhere in its file. `from P import x`
    depends on P.x when x is a module (not on P's __init__), else on P."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_checker_sees_every_room_and_a_planted_circle() -> None:
    modules = _modules()
    for name in ("jetsplit.catalog", "jetsplit.server.training.trainer",
                 "jetsplit.server.run.round_loop",
                 "jetsplit.edge_agent.worker", "jetsplit.export.planner",
                 "jetsplit.server.methods.scala"):
        assert name in modules
    graph = import_graph(modules)
    # imports inside functions count: the method factory loads methods lazily by name,
    # but the trainer's lazy completions import is seen
    assert "jetsplit.server.cuts.completions" in graph["jetsplit.server.training.trainer"]
    planted = {k: set(v) for k, v in graph.items()}
    planted["jetsplit.catalog"].add("jetsplit.server.training.trainer")
    assert any("jetsplit.catalog" in c for c in cycles(planted))


def test_no_import_circle_among_the_projects_modules() -> None:
    assert cycles(import_graph(_modules())) == []


def test_core_and_export_never_import_the_coordinator() -> None:
    graph = import_graph(_modules())
    offenders = {m: sorted(d for d in deps if d.startswith("jetsplit.server"))
                 for m, deps in graph.items()
                 if not m.startswith(("jetsplit.server", "jetsplit.edge_agent"))
                 and m != COMPOSITION_ROOT}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_device_side_never_imports_the_coordinator() -> None:
    graph = import_graph(_modules())
    offenders = {m: sorted(d for d in deps if d.startswith("jetsplit.server"))
                 for m, deps in graph.items() if m.startswith("jetsplit.edge_agent")}
    assert {m: d for m, d in offenders.items() if d} == {}


def _rank(module: str) -> int | None:
    """How far down `SERVER_ROOMS` a coordinator module's room stands (None: no room)."""
    room = module.split(".")[2] if module.startswith(SERVER + ".") else None
    return next((rank for rank, rooms in enumerate(SERVER_ROOMS) if room in rooms), None)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Coordinator module → what it imports against the order: a coordinator module of a
    higher room, or any coordinator module from outside every room; `server/__init__.py`
    imports nothing of the project."""
    out: dict[str, list[str]] = {}
    for module, deps in graph.items():
        if module == SERVER:
            wrong = sorted(deps)
        elif module.startswith(SERVER + "."):
            rank = _rank(module)
            wrong = sorted(d for d in deps if d.startswith(SERVER) and (
                rank is None or d == SERVER or (_rank(d) or 0) < rank))
        else:
            continue
        if wrong:
            out[module] = wrong
    return out


def test_the_coordinators_rooms_import_one_way_down_their_order() -> None:
    graph = import_graph(_modules())
    rooms = {m.split(".")[2] for m in graph if m.startswith(SERVER + ".")}
    assert rooms == {room for rank in SERVER_ROOMS for room in rank}
    assert upward_imports(graph) == {}


def test_the_order_check_catches_a_planted_upward_import() -> None:
    graph = import_graph(_modules())
    planted = {k: set(v) for k, v in graph.items()}
    planted["jetsplit.server.defences.memory"].add("jetsplit.server.training.trainer")
    planted["jetsplit.server.cuts.planning"].add("jetsplit.server.methods.base")
    planted[SERVER].add("jetsplit.server.engines.seam")
    assert upward_imports(planted) == {
        "jetsplit.server.defences.memory": ["jetsplit.server.training.trainer"],
        "jetsplit.server.cuts.planning": ["jetsplit.server.methods.base"],
        SERVER: ["jetsplit.server.engines.seam"]}

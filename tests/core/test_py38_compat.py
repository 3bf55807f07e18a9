"""The device side runs on JetPack 5 (Python 3.8, torch 1.13).

vermin (in `.ci/run`) checks syntax and library use; it cannot tell which annotations are
evaluated at run time. Pydantic models, dataclass fields and typer commands evaluate theirs,
so there `X | None` and `list[int]` fail on 3.8 at import: this test finds them by AST.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

# torch-free device side: `.ci/run` also runs this on Python 3.9
pytestmark = pytest.mark.device_pure

ROOT = Path(__file__).resolve().parents[2]
DEVICE_DIRS = ("jetsplit", "edge_agent")
# `jetsplit profile` runs on the device: its CLI module and what it imports on that path.
PROFILE_PATH = ("export/__init__.py", "export/profile_cli.py", "export/profiler.py",
                "export/cost_model.py", "export/flop_count.py", "export/torch_compat.py",
                "export/onnx_export.py")
_GENERIC_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "type"}


def device_files() -> list[Path]:
    return [p for d in DEVICE_DIRS for p in sorted((ROOT / d).rglob("*.py"))] + [
        ROOT / p for p in PROFILE_PATH]


def _new_style(node: ast.AST, any_union: bool) -> str | None:
    """What in `node` itself needs Python >= 3.9 when evaluated: a `list[...]`-style
    subscript, or a `|` union (any `|` where the node is a type, else `... | None`, which is
    never an integer or)."""
    if isinstance(node, ast.Subscript):
        value = node.value
        if isinstance(value, ast.Name) and value.id in _GENERIC_BUILTINS:
            return f"{value.id}[...]"
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) \
                and value.value.id in ("abc", "collections"):
            return f"{value.value.id}.{value.attr}[...]"
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        none = any(isinstance(s, ast.Constant) and s.value is None
                   for s in (node.left, node.right))
        if any_union or none:
            return "X | Y"
    return None


def _is_typer_command(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    text = ast.dump(fn.args)
    return "typer" in text or "Annotated" in text


def runtime_annotation_problems(path: Path) -> list[str]:
    """Lines where a run-time-evaluated annotation or type expression needs Python ≥ 3.9."""
    tree = ast.parse(path.read_text(), str(path))
    lazy: set[int] = set()  # nodes only evaluated by type checkers (future annotations)
    strict: set[int] = set()  # nodes that are types evaluated at run time
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            anns = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                           args.vararg, args.kwarg) if a and a.annotation]
            anns += [node.returns] if node.returns else []
            target = strict if _is_typer_command(node) else lazy
            target.update(id(n) for a in anns for n in ast.walk(a))
            lazy.update(id(n) for sub in ast.walk(node) if isinstance(sub, ast.AnnAssign)
                        for n in ast.walk(sub.annotation))
        elif isinstance(node, ast.ClassDef):  # pydantic fields, dataclass fields
            strict.update(id(n) for sub in node.body if isinstance(sub, ast.AnnAssign)
                          for n in ast.walk(sub.annotation))
    for stmt in tree.body:  # module-level `x: T = ...` is not evaluated
        if isinstance(stmt, ast.AnnAssign):
            lazy.update(id(n) for n in ast.walk(stmt.annotation))
    for node in ast.walk(tree):  # isinstance(x, int | float): a TypeError before 3.10
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            strict.update(id(n) for n in ast.walk(node.args[1]))
    lazy -= strict
    rel = path.relative_to(ROOT)
    found = {f"{rel}:{node.lineno}: {what}" for node in ast.walk(tree)
             if id(node) not in lazy and (what := _new_style(node, id(node) in strict))}
    if _future_annotations(tree) and any(
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _is_typer_command(node) for node in ast.walk(tree)):
        found.add(f"{rel}:1: typer command under `from __future__ import annotations`")
    return sorted(found)


def _future_annotations(tree: ast.Module) -> bool:
    """typer on Python < 3.10 does not evaluate string annotations: under this import every
    `Annotated[..., typer.Option(...)]` of a command is silently ignored."""
    return any(isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"
               and any(alias.name == "annotations" for alias in stmt.names)
               for stmt in tree.body)


def test_device_side_runtime_annotations_use_typing_forms() -> None:
    problems = [p for f in device_files() for p in runtime_annotation_problems(f)]
    assert problems == [], "use Optional/Union/List/Dict/Tuple from typing:\n" + "\n".join(
        problems)


def test_checker_finds_new_style_runtime_annotations(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from __future__ import annotations\n"
        "class M(BaseModel):\n"
        "    a: int | None = None\n"
        "    b: list[int]\n"
        "    c: Optional[int] = None\n"
        "Alias = dict[str, int]\n"
        "def f(x: int | None, y: list[int]) -> dict[str, int]:\n"
        "    z: list[int] = []\n"
        "    return 1 | 2\n"
        "def cmd(x: Annotated[str | None, typer.Option()] = None) -> None: ...\n"
        "ok = isinstance(1, (int, float)) and 3 | 4\n"
        "bad = isinstance(1, int | np.integer)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = runtime_annotation_problems(sample)
    finally:
        ROOT = saved
    assert found == ["sample.py:10: X | Y", "sample.py:12: X | Y",
                     "sample.py:1: typer command under `from __future__ import annotations`",
                     "sample.py:3: X | Y",
                     "sample.py:4: list[...]", "sample.py:6: dict[...]"]


def test_agent_commands_import_no_coordinator_code(tmp_path: Path) -> None:
    """`jetsplit agent ...` mounts only device commands: no server module and no export
    module but `jetsplit profile`'s CLI (the rest need Python 3.10) is imported."""
    allowed = sorted("jetsplit." + p[:-len(".py")].replace("/__init__", "").replace("/", ".")
                     for p in PROFILE_PATH)
    code = (
        "import sys\n"
        "from jetsplit.cli import main\n"
        "assert main(['agent', 'run', '--help']) == 0\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('jetsplit.server', "
        f"'jetsplit.export')) and m not in {allowed!r})\n"
        "print(bad)\n"
    )
    # From a neutral folder: in the checkout its jetsplit/ would shadow an installed package.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"

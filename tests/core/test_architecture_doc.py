"""docs/architecture.md stays complete: every module of the four source rooms (`server/`,
`edge_agent/`, `export/`, `jetsplit/`, subpackages included; `__init__.py` aside) is named on
it by its path from the repository root, e.g. `server/training/trainer.py`, and so is every
subpackage folder, e.g. `jetsplit/wire/`. A module added without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
ROOMS = ("server", "edge_agent", "export", "jetsplit")


def modules() -> list[str]:
    """Every module file of the rooms (not `__init__.py`), as a path from the root."""
    return sorted(p.relative_to(ROOT).as_posix() for room in ROOMS
                  for p in (ROOT / room).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def packages() -> list[str]:
    """Every subpackage folder below a room's top (`jetsplit/wire/`, `server/methods/`)."""
    return sorted(p.parent.relative_to(ROOT).as_posix() + "/" for room in ROOMS
                  for p in (ROOT / room).rglob("__init__.py")
                  if p.parent != ROOT / room and "__pycache__" not in p.parts)


def _named(path: str, text: str) -> bool:
    """Whether `path` appears as a whole path (not as the tail of a longer one)."""
    return re.search(rf"(?<![\w./-]){re.escape(path)}(?![\w-])", text) is not None


def unnamed(text: str) -> list[str]:
    """The modules and package folders `text` does not name. A package folder counts when
    it is named in backticks on its own (`jetsplit/wire/` or `jetsplit/wire`), not merely
    as the prefix of one of its modules' paths."""
    spans = set(re.findall(r"`([^`\n]+)`", text))
    missing = [m for m in modules() if not _named(m, text)]
    missing += [p for p in packages() if p not in spans and p.rstrip("/") not in spans]
    return missing


def test_the_page_names_every_module_and_package() -> None:
    assert unnamed(PAGE.read_text(encoding="utf-8")) == []


def test_the_check_sees_every_room_and_catches_a_missing_line() -> None:
    found = modules()
    assert len(found) >= 100
    for path in ("server/training/trainer.py", "server/run/round_loop.py",
                 "server/methods/scala.py",
                 "edge_agent/worker.py", "export/planner.py", "jetsplit/catalog.py",
                 "jetsplit/wire/envelope.py", "jetsplit/runtimes/tensorrt_runtime.py"):
        assert path in found
    assert "server/methods/" in packages() and "jetsplit/wire/" in packages()
    assert not any(p.endswith("__init__.py") for p in found)

    text = PAGE.read_text(encoding="utf-8")
    without = "\n".join(line for line in text.splitlines()
                        if "`server/training/trainer.py`" not in line
                        and "`jetsplit/wire/`" not in line)
    assert {"server/training/trainer.py", "jetsplit/wire/"} <= set(unnamed(without))
    # a path inside a longer one does not count
    assert not _named("server/training/trainer.py", "`tests/server/trainer.py`")
    assert not _named("server/report/document.py", "`server/report/document.pyc`")
    assert _named("server/engines/seam.py", "see `server/engines/seam.py`.")

"""One namespace: server/, export/ and edge_agent/ install as jetsplit.*, never bare."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jetsplit.config_io import tomllib

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"jetsplit": "jetsplit", "jetsplit.server": "server", "jetsplit.export": "export",
          "jetsplit.edge_agent": "edge_agent", "jetsplit.bundled_profiles": "profiles"}


def _setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_its_jetsplit_name() -> None:
    table = _setuptools_table()
    assert table["package-dir"] == MAPPED
    found = set()
    for dotted, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((dotted, *rel)))
    assert set(table["packages"]) == found
    assert all(name == "jetsplit" or name.startswith("jetsplit.") for name in table["packages"])


def test_decoy_modules_in_the_working_directory_shadow_nothing(tmp_path: Path) -> None:
    for name in ("server", "export", "edge_agent"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('decoy imported')\n")
    code = ("import jetsplit.server.run.trial, jetsplit.export.planner\n"
            "import jetsplit.edge_agent.daemon\n"
            "import sys\n"
            "bare = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('server', 'export', 'edge_agent'))\n"
            "print('bare:', bare)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bare: []" in done.stdout

"""The accuracy benchmark runs end to end (slow: excluded from `make test`; run with
`pytest -m slow`). The full table comes from `python benchmarks/accuracy.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_accuracy_benchmark_quick_run_prints_its_table(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy.py"),
                           "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| method | final accuracy |" in done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"psl", "scala"}
    assert all(0 <= r["final_accuracy"] <= 1 for runs in results.values() for r in runs)

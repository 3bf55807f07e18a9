"""The report's Re-planning section and cuts plot (server/report/replan.py), from rows as the
round loop writes them, and from hostile ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jetsplit.server.report.replan import plot_cuts, replan_section


def rows() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in range(6):
        cuts = {"a0": 2 if r < 3 else 5, "a1": 7}
        out.append({"round": r, "cuts": cuts, "seconds": 10.0 if r < 3 else 6.0,
                    "bundle_bytes": 18_007_552 if r == 3 else 0})
    out[2]["replan"] = {"before": {"a0": 2, "a1": 7}, "after": {"a0": 5, "a1": 7},
                        "moved": {"a0": [2, 5]}, "predicted_before_s": 10.46,
                        "predicted_after_s": 8.7, "switch_s": 7.2,
                        "switch_bytes": {"a0": 18_007_552}, "reason": "a0 2→5: predicted"}
    return out


def test_the_section_lists_each_switch_with_prediction_and_measurement() -> None:
    lines = replan_section(rows())
    assert lines[0] == "## Re-planning"
    table = [line for line in lines if line.startswith("| 2 |")]
    assert table == ["| 2 | a0 2→5 | 10.46 → 8.70 | 6.00 | 18,007,552 | 18,007,552 | "
                     "a0 2→5: predicted |"]
    assert replan_section([{"round": 0, "cuts": {"a0": 1}}]) == []  # never switched


def test_hostile_rows_are_skipped_or_cut(tmp_path: Path) -> None:
    bad = rows()
    bad[2]["replan"]["moved"] = {"a0": "x", "a1" * 100: [1, 2]}
    bad[2]["replan"]["predicted_before_s"] = float("nan")
    bad[2]["replan"]["reason"] = "|" * 1000
    bad[4]["replan"] = "not a dict"
    lines = replan_section(bad)
    row = next(line for line in lines if line.startswith("| 2 |"))
    assert "a0 " not in row and " - → 8.70 " in row and len(row) < 700


def test_the_plot_draws_cuts_and_round_time(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    path = tmp_path / "cuts.png"
    assert plot_cuts(rows(), path, Figure) is None and path.stat().st_size > 1000
    assert plot_cuts([{"round": 0}], tmp_path / "x.png", Figure) == "the run never re-planned"

"""The report's Defences section names the devices the coordinator limited, per round and
why, and the capped size claims; hostile row contents are cut or skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetsplit.server.report.defences import (
    MAX_NOTE,
    defences_section,
    limited_rounds,
    plot_influence,
)
from jetsplit.server.report.document import write_report

pytestmark = pytest.mark.fast


def test_the_section_names_who_was_limited_and_why() -> None:
    rows = [{"round": 0, "bounded": {"a3": "activations bounded: median norm 9e+05"},
             "aggregation": {"a3": "left out by multi-krum (score 12)"}, "benched": []},
            {"round": 1, "bounded": {}, "aggregation": {}, "benched": ["a1"],
             "down_weighted": {"a4": "3 steps down-weighted, last: loss 6.1"},
             "excluded": {"a4": "2 steps left out of the server update"}},
            {"round": 2, "aggregation": {"a3": "x" * 1000, "a0": 7}, "benched": "junk"}]
    summary = {"capped_claims": {"a2": {"claimed": 10**9, "weight": 1250},
                                 "a7": {"claimed": 10**9, "weight": 265,
                                        "by": "provisioned size"},
                                 "a8": {"claimed": 9, "weight": 2, "by": "<b>"}},
               "histogram_claims": {"a5": {"distance": 0.9125, "bound": 0.2936, "labels": 600},
                                    "a6": {"distance": "x", "bound": 1, "labels": 1}}}
    lines = defences_section(rows, summary)
    text = "\n".join(lines)
    # a device named twice in one round counts once; a1 benched; a0's note is no string
    assert limited_rounds(rows) == {"a3": 2, "a1": 1, "a4": 1}
    assert lines[0] == "## Defences"
    assert ("Devices the coordinator limited: a3 (2 of 3 rounds), a1 (1 of 3 rounds), "
            "a4 (1 of 3 rounds).") in text
    assert ("| 1 | a4 | 3 steps down-weighted, last: loss 6.1; 2 steps left out of the "
            "server update |") in text
    assert ("| 0 | a3 | activations bounded: median norm 9e+05; left out by multi-krum "
            "(score 12) |") in text
    assert "| 1 | a1 | sat out (missed deadlines) |" in text
    assert f"| 2 | a3 | {'x' * MAX_NOTE} |" in text and "a0" not in text
    assert "- a2: claimed 1000000000 samples, weighed as 1250 (size cap)." in text
    assert "- a7: claimed 1000000000 samples, weighed as 265 (provisioned size)." in text
    assert "- a8: claimed 9 samples, weighed as 2 (size cap)." in text  # no other text
    assert ("- a5: its label histogram was 0.912 (total variation) from the 600 labels it "
            "sent, over 0.294: its prior came from those labels.") in text
    assert "a6" not in text  # a malformed entry is skipped
    only = "\n".join(defences_section([], {"histogram_claims": summary["histogram_claims"]}))
    assert "- a5: its label histogram was 0.912" in only


def test_a_clean_run_says_so(tmp_path: Path) -> None:
    assert defences_section([{"round": 0, "bounded": {}, "aggregation": {}, "benched": []}],
                            {})[2].startswith("No device's size claim was capped")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"round": 0, "accuracy": 0.5, "bounded": {"a9": "activations bounded: |x|"}}) + "\n")
    (run / "summary.json").write_text(json.dumps({"final_accuracy": 0.5}))
    report = write_report(run).read_text()
    assert "## Defences" in report and "| 0 | a9 | activations bounded: \\|x\\| |" in report


def test_the_influence_plot_draws_shares_and_scales_and_skips_junk(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    rows = [{"round": 0, "influence": {"a0": 0.5, "a1": 0.5, "a9": "x", "a8": 1e400},
             "activation_scale": {"a1": 1e-6, "a7": -3}},
            {"round": 1, "influence": {"a0": 1.0, "a1": 0.0}, "activation_scale": "junk"}]
    drawn: list[list[str]] = []

    class Recording(Figure):  # type: ignore[misc]
        def savefig(self, *args: object, **kwargs: object) -> None:
            drawn.append([line.get_label() for ax in self.axes for line in ax.get_lines()])
            super().savefig(*args, **kwargs)

    path = tmp_path / "influence.png"
    assert plot_influence(rows, path, Recording) is None
    assert path.stat().st_size > 1000
    assert drawn == [["a0", "a1", "a1"]]  # shares of a0 and a1; a1's scale; no junk
    assert plot_influence([{"round": 0, "influence": {}}], path, Recording) == (
        "no round records a device's share of an average or a bounded activation")

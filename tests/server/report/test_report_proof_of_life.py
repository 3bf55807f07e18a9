"""The report shows what the step deadlines and the proof-of-life probes did: the rounds
table a step deadline column (`deadlines_s`: the forwards', else the longest kind), the
agents table each agent's rounds benched and probes answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jetsplit.server.report.document import agents_table, rounds_table
from jetsplit.server.report.run_data import RunData, agent_totals

pytestmark = pytest.mark.fast


def _row(round_: int, **extra: Any) -> dict[str, Any]:
    return {"round": round_, "selected": ["a0", "a1"], "missed": {}, "train_loss": 1.0,
            "accuracy": 0.5, "balanced_accuracy": 0.5, "bytes_up": 1, "bytes_down": 1,
            "seconds": 2.0, **extra}


ROWS = [
    _row(0, missed={"a2": "deadline"}, benched=["a2"],
         deadlines_s={"forward": 60.0, "backward": 60.0}),
    _row(1, benched=["a2"], deadlines_s={"forward": 12.5, "get_weights": 60.0}),
    _row(2, missed={"a2": "deadline"}, benched=["a2"], probes={"a2": "no answer: deadline"},
         deadlines_s={"get_weights": 30.0, "set_weights": 40.0}),
    _row(3, benched=[], probes={"a2": "answered in 0.04 s", "a1": "answered in 0.10 s"}),
]


def _column(table: list[str], header: str) -> dict[str, str]:
    """agent (first cell) → the cell under `header`."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table if line]
    index = cells[0].index(header)
    return {row[0]: row[index] for row in cells[2:]}


def test_rounds_table_shows_each_rounds_step_deadline() -> None:
    column = _column(rounds_table(ROWS), "step deadline s")
    assert column == {"1": "60.0", "2": "12.5", "3": "40.0", "4": "—"}  # rounds from 1
    assert "step deadline s" not in rounds_table([_row(0)])[0]  # older runs: no column


def test_agents_table_shows_benched_rounds_and_probe_answers(tmp_path: Path) -> None:
    totals = agent_totals(ROWS)
    assert (totals["a2"].benched, totals["a2"].probes, totals["a2"].probes_answered) == (3, 2, 1)
    assert (totals["a1"].benched, totals["a1"].probes, totals["a1"].probes_answered) == (0, 1, 1)
    table = agents_table(RunData(tmp_path, ROWS, {}, None, []))
    assert _column(table, "rounds benched") == {"a0": "—", "a1": "0", "a2": "3"}
    assert _column(table, "probes answered") == {"a0": "—", "a1": "1/1", "a2": "1/2"}
    plain = agents_table(RunData(tmp_path, [_row(0)], {}, None, []))
    assert "rounds benched" not in plain[0] and "probes answered" not in plain[0]

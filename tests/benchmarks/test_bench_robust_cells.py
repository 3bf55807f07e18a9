"""bench_robust's cells: run `--jobs` at a time in spawned processes, each kept under the cell
it ran, and read back by `--reuse` only under the same run shape, so an interrupted table (a
lent GPU's call that ran out of time) goes on where it stopped without mixing settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the module, imported from benchmarks/)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("JETSPLIT_ALLOW_ATTACKS", "1")
    import bench_robust

    return bench_robust


def _args(**over: object) -> argparse.Namespace:
    """The smoke run's shape: digits, five agents, one round of two steps."""
    shape = {"agents": 5, "rounds": 1, "local_steps": 2, "batch": 40, "lr": None,
             "model": "mobilenetv3-small", "split": 2, "dataset": "digits",
             "partition": "iid", "last": 5, "jobs": 1, "reuse": False}
    return argparse.Namespace(**(shape | over))


def test_two_at_a_time_each_score_stays_with_its_cell(bench, tmp_path: Path) -> None:
    """Two workers, three different cells: every returned score is the one its worker wrote
    beside that cell (the wall times differ, so a mix-up shows)."""
    cells = [bench.Cell("splitfed-v1", "none", None, 0, 0),
             bench.Cell("splitfed-v1", "none", "scale:1000", 1, 0),
             bench.Cell("splitfed-v1", "default", "scale:1000", 1, 0)]
    scores = bench.run_cells(_args(jobs=2), tmp_path, cells)
    assert list(scores) == cells
    rows = [json.loads(line) for line in (tmp_path / bench.CELLS_FILE).read_text().splitlines()]
    written = {bench.Cell(*(row[f] for f in bench.Cell._fields)): bench.Score(
        row["final"], row["last"], row["seconds"]) for row in rows}
    assert written == scores
    assert len({s.seconds for s in scores.values()}) == 3
    # the default's direction check leaves the ×1000 upload of a4 out; `none` limits nobody
    assert {(row["defence"], row["attack"]): row["limited"] for row in rows} == {
        ("none", None): {}, ("none", "scale:1000"): {}, ("default", "scale:1000"): {"a4": 1}}


def test_reuse_reads_only_the_same_shape_and_runs_the_rest(bench, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(reuse=True)
    shape = bench.run_shape(args)
    done = bench.Cell("scala", "default", "labelflip", 1, 2)
    other_rounds = bench.Cell("scala", "default", None, 0, 2)
    todo = bench.Cell("scala", "default", "signflip", 1, 2)
    rows = [{**done._asdict(), "final": 0.9, "last": 0.8, "seconds": 12.0, "shape": shape},
            {**other_rounds._asdict(), "final": 0.5, "last": 0.5, "seconds": 1.0,
             "shape": shape | {"rounds": 30}},
            {**todo._asdict(), "final": "0.7"}]  # no shape: an older line, not reused
    (tmp_path / bench.CELLS_FILE).write_text(
        "\n".join(map(json.dumps, rows)) + '\n{"method": "scala", "defe')  # a killed write
    assert bench.finished_cells(args, tmp_path) == {done: bench.Score(0.9, 0.8, 12.0)}

    ran: list[object] = []
    monkeypatch.setattr(bench, "run_cell", lambda a, out, cell: ran.append(cell) or bench.Score(
        0.1, 0.1, 1.0))
    scores = bench.run_cells(args, tmp_path, [done, other_rounds, todo])
    # the warm-up (one round of the first cell to run), then the two not reused
    assert ran == [other_rounds._replace(rounds=1), other_rounds, todo]
    assert scores[done] == bench.Score(0.9, 0.8, 12.0)
    assert scores[todo] == bench.Score(0.1, 0.1, 1.0)

    ran.clear()
    bench.run_cells(_args(reuse=True), tmp_path, [done])
    assert ran == []  # nothing left to run: no warm-up either
    bench.run_cells(_args(reuse=False), tmp_path, [done])
    assert ran == [done._replace(rounds=1), done]  # without --reuse every cell runs

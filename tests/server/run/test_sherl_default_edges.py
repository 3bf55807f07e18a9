"""`jetsplit simulate --algorithm sherl` runs at its defaults: without `--edges` it runs √K
edges rounded (server/run/simulate.py `default_edges`), clients dealt round-robin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.errors import ConfigError
from jetsplit.server.run.simulate import default_edges, sherl_topology


@pytest.mark.fast
def test_default_edge_count_is_the_rounded_square_root() -> None:
    assert [default_edges(k) for k in (1, 2, 3, 4, 5, 9, 10, 12, 13, 100)] == \
        [1, 1, 2, 2, 2, 3, 3, 3, 4, 10]
    assert sherl_topology("sherl", None, 5) == {"e0": ["a0", "a2", "a4"], "e1": ["a1", "a3"]}
    assert sherl_topology("scala", None, 5) == {}  # only the three-tier method has edges
    with pytest.raises(ConfigError, match="needs 1..5 --edges"):
        sherl_topology("sherl", 0, 5)  # given: still checked


def test_simulate_sherl_runs_at_its_defaults(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sherl"
    code = main(["simulate", "--algorithm", "sherl", "--dataset", "digits", "--model",
                 "mobilenetv3-small", "--rounds", "1", "--local-steps", "2", "--batch", "16",
                 "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"] == str(out)
    summary = json.loads((out / "summary.json").read_text())
    # the default 4 agents: 2 edges of 2
    assert summary["settings"]["edges"] == {"e0": ["a0", "a2"], "e1": ["a1", "a3"]}
    assert summary["final_accuracy"] is not None


@pytest.mark.parametrize(("algorithm", "edges", "agents", "want"), [
    ("sherl", None, 4, 2), ("sherl", None, 10, 3), ("sherl", 1, 10, 1), ("scala", None, 4, 0),
])
def test_a_trial_derives_its_edge_count_like_simulate(algorithm: str, edges: int | None,
                                                      agents: int, want: int) -> None:
    from jetsplit.server.run.trial import trial_edges

    assert trial_edges({"algorithm": algorithm}, edges, agents) == want

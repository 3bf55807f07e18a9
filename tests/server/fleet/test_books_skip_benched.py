"""The fleet books' status poll after a round skips the agents sitting out (a silent one
would cost the poll's whole deadline every round; the round-start probe asks it instead):
they keep their registry facts, without a reply's books."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.fleet.books import FleetBooks

pytestmark = pytest.mark.fast


class _Counting(InProcessEngine):
    def __init__(self, workers: dict[str, AgentWorker]) -> None:
        super().__init__(workers)
        self.asked: list[list[str]] = []

    def broadcast(self, command: Any, agents: list[str], **kwargs: Any) -> Any:
        self.asked.append(sorted(agents))
        return super().broadcast(command, agents, **kwargs)


def test_the_poll_skips_whoever_sits_out() -> None:
    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    engine = _Counting({f"a{i}": AgentWorker(f"a{i}", data) for i in range(3)})
    books = FleetBooks(engine)
    row = books.collect({"round": 0, "benched": ["a1"], "device_gflops": {}})
    assert engine.asked == [["a0", "a2"]]
    assert row["agents"]["a1"] == {"state": "online"}  # listed, not polled
    assert "compute_s" in row["agents"]["a0"] and "compute_s" in row["agents"]["a2"]
    books.collect({"round": 1, "benched": [], "device_gflops": {}})
    books.collect({"round": 2, "benched": "a0", "device_gflops": {}})  # malformed: all
    assert engine.asked[1:] == [["a0", "a1", "a2"], ["a0", "a1", "a2"]]


def test_the_poll_skips_whoever_awaits_a_probe_answer() -> None:
    """Out of the round for silence, not benched (server/training/rejoin.py): not polled."""
    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    engine = _Counting({f"a{i}": AgentWorker(f"a{i}", data) for i in range(3)})
    books = FleetBooks(engine)
    books.collect({"round": 0, "benched": ["a0"], "awaiting_probe": ["a2"],
                   "device_gflops": {}})
    assert engine.asked == [["a1"]]

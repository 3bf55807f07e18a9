"""Replay floors that survive an agent restart (jetsplit/transport/replay_state.py and
`ReplayGuard(floors=...)`), without a broker or torch: these also run under Python 3.8 and
3.9 in `.ci/run` (marker `device_pure`). The live restart is tests/agent/test_replay_restart.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jetsplit.transport.replay_state import MAX_SENDERS, ReplayState
from jetsplit.wire.errors import ReplayedMessage
from jetsplit.wire.replay import ReplayGuard

pytestmark = pytest.mark.device_pure


def test_a_floor_refuses_what_was_accepted_before_a_restart() -> None:
    guard = ReplayGuard(floors={"coordinator": 100})
    now = time.time()
    for seq in (99, 100):
        with pytest.raises(ReplayedMessage, match="before this process restarted"):
            guard.check("coordinator", seq, now)
    guard.check("coordinator", 101, now)
    guard.check("other", 5, now)  # floors are per sender


def test_replay_state_round_trips_and_shrugs_off_a_bad_file(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    path = tmp_path / "state" / "replay.json"
    state = ReplayState(path)
    assert state.load() == {}
    state.save("coordinator", 10)
    state.save("coordinator", 7)  # never lowered
    state.save("e0", 3)
    assert json.loads(path.read_text()) == {"coordinator": 10, "e0": 3}
    assert ReplayState(path).load() == {"coordinator": 10, "e0": 3}
    for bad in ("[1, 2]", "{", "\xff", json.dumps({"a": "7", "b": True, "c": -1, "d": 2**70,
                                                   "ok": 4})):
        path.write_text(bad, encoding="latin-1")
        floors = ReplayState(path).load()
        assert floors in ({}, {"ok": 4})
    assert "unusable" in caplog.text
    many = ReplayState(tmp_path / "many.json")
    for i in range(MAX_SENDERS):  # full: a new sender evicts the oldest
        many.floors[f"s{i}"] = i
    many.save("new", 1)
    assert len(many.floors) == MAX_SENDERS and "s0" not in many.floors
    assert many.floors["new"] == 1

"""`ReplayState`, the replay floors an agent keeps on disk across restarts: `save` only ever
raises a sender's floor and rewrites the file atomically, `load` gives back what was saved,
and the file is untrusted input: over 1 MiB, not a JSON object, not UTF-8 or unreadable
costs its floors (one warning), never the agent; entries are kept only where the sender
id has at most 64 characters and the seq is an int (not a bool) in [0, 2**63); at most
4096 senders are read or kept (the oldest leaves first)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jetsplit.transport.replay_state import (
    _MAX_SEQ,
    MAX_FILE_BYTES,
    MAX_SENDERS,
    ReplayState,
)

pytestmark = pytest.mark.fast


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "jetsplit.transport" and r.levelno == logging.WARNING]


def test_constants() -> None:
    assert MAX_SENDERS == 4096
    assert MAX_FILE_BYTES == 1024 * 1024
    assert _MAX_SEQ == 2 ** 63


def test_no_file_is_no_floors_and_no_warning(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    state = ReplayState(tmp_path / "replay.json")
    assert state.load() == {}
    assert state.floors == {}
    assert warnings(caplog) == []


def test_saved_floors_load_in_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "state" / "deep" / "replay.json"  # folders made as needed
    state = ReplayState(path)
    state.save("coordinator", 10)
    state.save("e0", 0)
    assert json.loads(path.read_text(encoding="utf-8")) == {"coordinator": 10, "e0": 0}
    assert not path.with_name("replay.json.tmp").exists()
    again = ReplayState(str(path))  # a str path is taken too
    assert again.load() == {"coordinator": 10, "e0": 0}
    assert again.floors == {"coordinator": 10, "e0": 0}


def test_load_returns_a_copy(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    path.write_text('{"c": 3}', encoding="utf-8")
    state = ReplayState(path)
    floors = state.load()
    floors["c"] = 99
    assert state.floors == {"c": 3}


def test_save_only_raises_a_floor(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    state = ReplayState(path)
    state.save("c", 5)
    state.save("c", 4)  # lower: ignored
    assert state.floors == {"c": 5}
    path.write_text('{"c": 1}', encoding="utf-8")  # a rewrite would show here
    state.save("c", 5)  # equal: ignored, file untouched
    assert json.loads(path.read_text(encoding="utf-8")) == {"c": 1}
    state.save("c", 6)
    assert state.floors == {"c": 6}
    assert json.loads(path.read_text(encoding="utf-8")) == {"c": 6}


def test_seq_zero_is_a_floor_and_a_negative_seq_is_not(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    state = ReplayState(path)
    state.save("c", -1)
    assert state.floors == {}
    assert not path.exists()
    state.save("c", 0)
    assert state.floors == {"c": 0}
    assert json.loads(path.read_text(encoding="utf-8")) == {"c": 0}


def test_a_full_table_drops_its_oldest_sender_for_a_new_one(tmp_path: Path) -> None:
    state = ReplayState(tmp_path / "replay.json")
    state.floors = {f"s{i}": 1 for i in range(MAX_SENDERS - 1)}
    state.save("new1", 1)  # 4096th sender: room left, nobody dropped
    assert len(state.floors) == 4096
    assert "s0" in state.floors
    state.save("s5", 2)  # a known sender on a full table: nobody dropped
    assert len(state.floors) == 4096
    assert "s0" in state.floors
    state.save("new2", 1)  # a 4097th: the oldest (s0) leaves
    assert len(state.floors) == 4096
    assert "s0" not in state.floors
    assert "s1" in state.floors
    assert state.floors["new2"] == 1
    assert list(state.floors)[-1] == "new2"
    assert len(json.loads((tmp_path / "replay.json").read_text(encoding="utf-8"))) == 4096


def test_a_save_that_cannot_write_warns_and_keeps_the_floor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    state = ReplayState(blocker / "replay.json")  # its folder is a file
    state.save("c", 3)
    assert state.floors == {"c": 3}
    assert len(warnings(caplog)) == 1
    assert warnings(caplog)[0].startswith(f"could not save replay state {blocker}/replay.json")


def test_entries_are_filtered_at_their_bounds(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    data = {
        "a" * 64: 1, "b" * 65: 1,  # id length: 64 kept, 65 dropped
        "zero": 0, "minus": -1,  # seq lower bound
        "top": 2 ** 63 - 1, "over": 2 ** 63, "far": 2 ** 64,  # seq upper bound
        "flag": True, "off": False, "float": 3.0, "text": "5", "none": None, "list": [1],
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    assert ReplayState(path).load() == {"a" * 64: 1, "zero": 0, "top": 2 ** 63 - 1}


def test_at_most_4096_senders_are_read(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({f"s{i}": i for i in range(4097)}), encoding="utf-8")
    floors = ReplayState(path).load()
    assert len(floors) == 4096
    assert floors["s0"] == 0
    assert floors["s4095"] == 4095
    assert "s4096" not in floors


def test_the_file_size_bound_is_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path = tmp_path / "replay.json"
    body = '{"c": 7}'
    path.write_text(body + " " * (MAX_FILE_BYTES - len(body)), encoding="utf-8")
    assert path.stat().st_size == 1 << 20
    assert ReplayState(path).load() == {"c": 7}
    assert warnings(caplog) == []
    path.write_text(body + " " * (MAX_FILE_BYTES - len(body) + 1), encoding="utf-8")
    state = ReplayState(path)
    assert state.load() == {}
    assert state.floors == {}
    assert warnings(caplog) == [
        f"replay state {path} unusable (over 1048576 bytes): starting without floors"]


@pytest.mark.parametrize(("content", "reason"), [
    (b"[1, 2]", "not a JSON object"),
    (b'"c"', "not a JSON object"),
    (b"{not json", "Expecting property name enclosed in double quotes"),
    (b"", "Expecting value"),
    (b'{"c": 1}\xff', "can't decode byte 0xff"),
])
def test_a_damaged_file_costs_its_floors_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str) -> None:
    caplog.set_level(logging.WARNING)
    path = tmp_path / "replay.json"
    path.write_bytes(content)
    state = ReplayState(path)
    assert state.load() == {}
    assert state.floors == {}
    [line] = warnings(caplog)
    assert line.startswith(f"replay state {path} unusable (")
    assert reason in line
    assert line.endswith("): starting without floors")


def test_an_unreadable_path_costs_its_floors_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path = tmp_path / "replay.json"
    path.mkdir()  # a folder where the file should be
    assert ReplayState(path).load() == {}
    [line] = warnings(caplog)
    assert "Is a directory" in line

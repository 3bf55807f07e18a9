"""`ByteCounters`, the books of bytes on the wire: every total (by direction, agent, kind and
their combinations) is the exact sum of what was added, messages are counted one per `add`,
and `snapshot`/`load`/`by_kind` round-trip, because the coordinator's per-round cost rows
and a resumed run's books are read from them. Queries use strings built at run time, so an
`==` that became `is` cannot pass on interned literals."""

from __future__ import annotations

import threading
import typing

import pytest

from jetsplit.transport import counters as counters_module
from jetsplit.transport.counters import ByteCounters

pytestmark = pytest.mark.fast


def fresh(text: str) -> str:
    """An equal string that is not the interned literal (`is` would tell them apart)."""
    return "".join(list(text))


def filled() -> ByteCounters:
    """a0 up weights 100 + 1; a0 down cmd 20; a1 up weights 1000; a1 up act 4000;
    a1 down weights 300 (kinds and directions chosen so every sum is distinct)."""
    books = ByteCounters()
    books.add("a0", "weights", "up", 100)
    books.add("a0", "weights", "up", 1)
    books.add("a0", "cmd", "down", 20)
    books.add("a1", "weights", "up", 1000)
    books.add("a1", "act", "up", 4000)
    books.add("a1", "weights", "down", 300)
    return books


def test_an_empty_book_totals_zero_everywhere() -> None:
    books = ByteCounters()
    assert books.total() == 0
    assert books.total("up", agent="a0", kind="weights") == 0
    assert books.snapshot() == {}
    assert books.by_kind() == {"up": {}, "down": {}}


def test_total_over_everything_and_by_direction() -> None:
    books = filled()
    assert books.total() == 100 + 1 + 20 + 1000 + 4000 + 300
    assert books.total(fresh("up")) == 100 + 1 + 1000 + 4000
    assert books.total(fresh("down")) == 20 + 300


def test_total_by_kind_alone_and_with_a_direction() -> None:
    books = filled()
    assert books.total(kind=fresh("weights")) == 100 + 1 + 1000 + 300
    assert books.total(fresh("up"), kind=fresh("weights")) == 1101
    assert books.total(fresh("down"), kind=fresh("weights")) == 300
    assert books.total(fresh("down"), kind=fresh("act")) == 0
    assert books.total(kind=fresh("cmd")) == 20
    assert books.total(kind=fresh("none")) == 0


def test_total_by_agent_alone_and_combined() -> None:
    """An agent's total is its own bytes only (not the fleet's)."""
    books = filled()
    assert books.total(agent=fresh("a0")) == 121
    assert books.total(agent=fresh("a1")) == 5300
    assert books.total(fresh("up"), agent=fresh("a0")) == 101
    assert books.total(fresh("down"), agent=fresh("a0")) == 20
    assert books.total(fresh("up"), agent=fresh("a1")) == 5000
    assert books.total(agent=fresh("a1"), kind=fresh("weights")) == 1300
    assert books.total(fresh("down"), agent=fresh("a1"), kind=fresh("weights")) == 300
    assert books.total(fresh("up"), agent=fresh("a1"), kind=fresh("act")) == 4000
    assert books.total(fresh("down"), agent=fresh("a1"), kind=fresh("act")) == 0
    assert books.total(agent=fresh("a9")) == 0


def test_direction_by_keyword_and_filters_by_keyword_only() -> None:
    """`total(direction=...)` is allowed; `agent` and `kind` are keyword-only (a positional
    agent would read as a kind by mistake)."""
    books = filled()
    assert books.total(direction=fresh("down")) == 320
    with pytest.raises(TypeError):
        books.total("up", "a0")  # type: ignore[misc]


def test_messages_are_counted_one_per_add() -> None:
    books = filled()
    assert dict(books._messages) == {
        ("a0", "weights", "up"): 2, ("a0", "cmd", "down"): 1, ("a1", "weights", "up"): 1,
        ("a1", "act", "up"): 1, ("a1", "weights", "down"): 1}


def test_snapshot_is_per_agent_direction_and_kind_with_both_directions_present() -> None:
    books = filled()
    books.add("a2", "act", "down", 7)
    assert books.snapshot() == {
        "a0": {"up": {"weights": 101}, "down": {"cmd": 20}},
        "a1": {"up": {"weights": 1000, "act": 4000}, "down": {"weights": 300}},
        "a2": {"up": {}, "down": {"act": 7}},
    }
    assert list(books.snapshot()) == ["a0", "a1", "a2"]
    assert list(books.snapshot()["a1"]["up"]) == ["act", "weights"]  # sorted


def test_by_kind_sums_over_agents() -> None:
    assert filled().by_kind() == {"up": {"weights": 1101, "act": 4000},
                                  "down": {"cmd": 20, "weights": 300}}


def test_load_adds_a_snapshot_to_the_books() -> None:
    """A resumed run: its saved books are added to what this process already counted, for
    every total, snapshot and by_kind alike."""
    saved = filled().snapshot()
    books = ByteCounters()
    books.add("a0", "weights", "up", 9)
    books.load(saved)
    assert books.snapshot() == {
        "a0": {"up": {"weights": 110}, "down": {"cmd": 20}},
        "a1": {"up": {"weights": 1000, "act": 4000}, "down": {"weights": 300}},
    }
    assert books.by_kind() == {"up": {"weights": 1110, "act": 4000},
                               "down": {"cmd": 20, "weights": 300}}
    assert books.total(fresh("up")) == 5110
    assert books.total(fresh("down"), kind=fresh("cmd")) == 20
    assert books.total(fresh("up"), agent=fresh("a0")) == 110


def test_load_of_a_partial_snapshot_and_json_types() -> None:
    """A snapshot read back from JSON may lack a direction; counts arrive as ints."""
    books = ByteCounters()
    books.load({"a0": {"down": {"cmd": 5}}, "a1": {"up": {"act": 6}}})
    books.load({"a0": {"down": {"cmd": 5}}})
    assert books.snapshot() == {"a0": {"up": {}, "down": {"cmd": 10}},
                                "a1": {"up": {"act": 6}, "down": {}}}
    assert books.total(fresh("down")) == 10
    assert books.total(fresh("up")) == 6


def test_snapshot_round_trips_through_load() -> None:
    books = filled()
    again = ByteCounters()
    again.load(books.snapshot())
    assert again.snapshot() == books.snapshot()
    assert again.by_kind() == books.by_kind()


def test_concurrent_adds_lose_nothing() -> None:
    books = ByteCounters()

    def work(agent: str) -> None:
        for _ in range(2000):
            books.add(agent, "weights", "up", 3)

    threads = [threading.Thread(target=work, args=(f"a{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert books.total() == 4 * 2000 * 3
    assert books.total(agent="a2") == 2000 * 3
    assert books._messages[("a3", "weights", "up")] == 2000


def test_annotations_resolve() -> None:
    """Every annotation is a real type on the Python the tests run (a broken one, say
    `str + None`, fails any tool that reads them)."""
    for function in (ByteCounters.add, ByteCounters.total, ByteCounters.snapshot,
                     ByteCounters.load, ByteCounters.by_kind):
        hints = typing.get_type_hints(function, vars(counters_module))
        assert "return" in hints
    hints = typing.get_type_hints(ByteCounters.total, vars(counters_module))
    assert hints["agent"] == (str | None)
    assert hints["kind"] == (str | None)
    assert hints["direction"] == (counters_module.Direction | None)

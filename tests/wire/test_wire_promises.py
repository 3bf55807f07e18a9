"""What the wire's docstrings promise, one test per promise, each written to fail when the
promise is broken in a plausible way (a check dropped, a bound off by one, a repeat counted
again, another sender's message evicted): a replay is refused, a chunk's index and length
are checked against its message, and one sender cannot starve another in the reassembler.
Torch-free (`device_pure`)."""

from __future__ import annotations

import numpy as np
import pytest

from jetsplit.wire import (
    DEFAULT_CHUNK_BYTES,
    Limits,
    Message,
    MessageType,
    Reassembler,
    ReplayGuard,
    chunk_count,
    chunk_message,
    decode_message,
)
from jetsplit.wire import errors as wire_errors

pytestmark = pytest.mark.device_pure

NOW = 1_000_000.0


# ---------------------------------------------------------------- a replay is refused


def test_a_replay_is_refused_per_sender_and_only_a_replay() -> None:
    """(a0, 7) twice: refused; (a1, 7): another sender's, accepted; an unseen seq below
    the highest but inside the window (reordering on the broker): accepted once."""
    guard = ReplayGuard(window=4, max_skew_s=10)
    guard.check("a0", 7, NOW, now=NOW)
    with pytest.raises(wire_errors.ReplayedMessage, match="already seen"):
        guard.check("a0", 7, NOW, now=NOW)
    guard.check("a1", 7, NOW, now=NOW)
    guard.check("a0", 10, NOW, now=NOW)
    guard.check("a0", 8, NOW, now=NOW)  # 8 > 10 - 4: inside the window, never seen
    with pytest.raises(wire_errors.ReplayedMessage):
        guard.check("a0", 8, NOW, now=NOW)


def test_the_window_edge_is_exact() -> None:
    """Highest 20, window 4: 16 is at the edge (20 - 4) and refused unseen, 17 accepted."""
    guard = ReplayGuard(window=4, max_skew_s=10)
    guard.check("a0", 20, NOW, now=NOW)
    with pytest.raises(wire_errors.ReplayedMessage, match="window"):
        guard.check("a0", 16, NOW, now=NOW)
    guard.check("a0", 17, NOW, now=NOW)


def test_a_replay_is_refused_after_the_window_forgets_it() -> None:
    """Once a seq has slid out of the remembered set, the window's floor still refuses it:
    seqs 1..12 with window 4, then every one of 1..8 again."""
    guard = ReplayGuard(window=4, max_skew_s=10)
    for seq in range(1, 13):
        guard.check("a0", seq, NOW, now=NOW)
    for seq in range(1, 13):
        with pytest.raises(wire_errors.ReplayedMessage):
            guard.check("a0", seq, NOW, now=NOW)


@pytest.mark.parametrize(("offset", "accepted"), [(10.0, True), (-10.0, True),
                                                   (10.5, False), (-10.5, False)])
def test_the_timestamp_skew_is_bounded_both_ways(offset: float, accepted: bool) -> None:
    guard = ReplayGuard(window=4, max_skew_s=10)
    if accepted:
        guard.check("a0", 1, NOW + offset, now=NOW)
        with pytest.raises(wire_errors.ReplayedMessage):  # and remembered
            guard.check("a0", 1, NOW + offset, now=NOW)
    else:
        with pytest.raises(wire_errors.ReplayedMessage, match="off now"):
            guard.check("a0", 1, NOW + offset, now=NOW)
        guard.check("a0", 1, NOW, now=NOW)  # a refusal books nothing


def test_a_floor_refuses_at_and_below_it_for_its_sender_only() -> None:
    guard = ReplayGuard(floors={"coordinator": 100, "e0": 5})
    for sender, seq in (("coordinator", 100), ("coordinator", 3), ("e0", 5)):
        with pytest.raises(wire_errors.ReplayedMessage, match="restarted"):
            guard.check(sender, seq, NOW, now=NOW)
    guard.check("coordinator", 101, NOW, now=NOW)
    guard.check("e0", 6, NOW, now=NOW)
    guard.check("a0", 1, NOW, now=NOW)


def test_the_first_message_of_a_sender_is_accepted_whatever_its_seq_and_window() -> None:
    """seq 0 is a valid first seq (no floor, no history), even with a window of 0 or 1."""
    for window in (0, 1):
        guard = ReplayGuard(window=window)
        guard.check("a0", 0, NOW, now=NOW)
        with pytest.raises(wire_errors.ReplayedMessage):
            guard.check("a0", 0, NOW, now=NOW)


def test_the_default_window_and_skew() -> None:
    """Defaults: 4096 seqs back and 300 s either way, each edge exact."""
    guard = ReplayGuard()
    guard.check("a0", 10_000, NOW, now=NOW)
    with pytest.raises(wire_errors.ReplayedMessage, match="window"):
        guard.check("a0", 10_000 - 4096, NOW, now=NOW)
    guard.check("a0", 10_000 - 4095, NOW, now=NOW)
    guard.check("b0", 1, NOW - 300, now=NOW)
    guard.check("b1", 1, NOW + 300, now=NOW)
    for ts in (NOW - 300.5, NOW + 300.5):
        with pytest.raises(wire_errors.ReplayedMessage, match="off now"):
            guard.check("a2", 1, ts, now=NOW)


def test_a_refusal_names_how_far_off_the_timestamp_is() -> None:
    with pytest.raises(wire_errors.ReplayedMessage,
                       match=r"a0 seq 3: timestamp \+600000s off now"):
        ReplayGuard(max_skew_s=10).check("a0", 3, NOW - 600_000, now=NOW)


def test_the_guard_remembers_the_most_recent_senders_within_its_bound() -> None:
    """4096 senders by default: the 4097th pushes out the oldest (bounded memory), never a
    more recent one, and a known sender's message pushes out nobody."""
    guard = ReplayGuard()
    for i in range(4096):
        guard.check(f"s{i}", 5, NOW, now=NOW)
    guard.check("s1", 6, NOW, now=NOW)  # known: nobody is pushed out
    with pytest.raises(wire_errors.ReplayedMessage):
        guard.check("s0", 5, NOW, now=NOW)
    guard.check("new", 5, NOW, now=NOW)  # the 4097th: s0, the oldest, goes
    guard.check("s0", 5, NOW, now=NOW)
    for sender in ("s2", "s4095", "new"):
        with pytest.raises(wire_errors.ReplayedMessage):
            guard.check(sender, 5, NOW, now=NOW)


def test_sequence_numbers_are_integers_from_the_clock_in_microseconds() -> None:
    import time

    from jetsplit.wire import SequenceCounter

    before = time.time_ns() // 1000
    first = SequenceCounter().next()
    after = time.time_ns() // 1000
    assert type(first) is int and before <= first <= after


def test_reserve_hands_out_consecutive_numbers_for_a_messages_chunks() -> None:
    from jetsplit.wire import SequenceCounter

    counter = SequenceCounter(100)
    assert counter.reserve(5) == 100
    assert counter.next() == 105
    assert counter.reserve(1) == 106 and counter.next() == 107
    assert counter.reserve(4) == 108 and counter.next() == 112  # an even count too


def test_presence_defaults_a_day_for_presence_a_month_for_the_last_will() -> None:
    """Defaults: presence up to 24 h old and 300 s ahead, the last will up to 30 days old;
    each edge exact. Only `offline` is a last will: any other state is aged as presence."""
    from jetsplit.wire import PresenceGuard

    day, month = 24 * 3600.0, 30 * 24 * 3600.0
    guard = PresenceGuard()
    guard.check("a0", 1, NOW - day, now=NOW)
    guard.check("a1", 1, NOW + 300, now=NOW)
    guard.check("a2", 1, NOW - month, "".join(["off", "line"]), now=NOW)  # not interned
    for sender, ts, state in (("b0", NOW - day - 0.5, "online"), ("b1", NOW + 300.5, "online"),
                              ("b3", NOW - month - 0.5, "offline"),
                              ("b4", NOW - 2 * day, "busy")):
        with pytest.raises(wire_errors.StalePresence, match="off now"):
            guard.check(sender, 1, ts, state, now=NOW)


def test_a_stale_presence_refusal_names_how_far_off_it_is() -> None:
    from jetsplit.wire import PresenceGuard

    with pytest.raises(wire_errors.StalePresence, match=r"a0 presence \(online\): timestamp "
                       r"\+600000s off now"):
        PresenceGuard().check("a0", 1, NOW - 600_000, now=NOW)


def test_presence_remembers_the_most_recent_senders_within_its_bound() -> None:
    """4096 (sender, state) pairs by default: a new one pushes out the oldest, never the
    newest, and a known one pushes out nobody."""
    from jetsplit.wire import PresenceGuard

    guard = PresenceGuard()
    for i in range(4096):
        guard.check(f"s{i}", 5, NOW - 10, now=NOW)
    guard.check("s1", 6, NOW - 5, now=NOW)  # known
    with pytest.raises(wire_errors.StalePresence, match="older"):
        guard.check("s0", 4, NOW - 20, now=NOW)
    guard.check("new", 5, NOW - 10, now=NOW)  # pushes out s0
    guard.check("s0", 4, NOW - 20, now=NOW)  # forgotten, so taken again
    for sender in ("s2", "s4095", "new"):
        with pytest.raises(wire_errors.StalePresence, match="older"):
            guard.check(sender, 4, NOW - 20, now=NOW)


# ---------------------------------------------------------------- a chunk index is checked


def _chunk(sender: str, msg_id: str, index: int, count: int, total: int, size: int,
           nbytes: int | None = None, fill: int = 0) -> Message:
    """A decoded CHUNK as a peer may forge it: every header field chosen by the sender."""
    if nbytes is None:
        nbytes = size if index < count - 1 else total - size * (count - 1)
    return Message(MessageType.CHUNK, run="r", sender=sender, seq=index + 1, kind="chunk",
                   meta={"id": msg_id, "index": index, "count": count, "total": total,
                         "size": size},
                   tensors={"data": np.full(max(nbytes, 0), fill, np.uint8)})


@pytest.mark.parametrize("index", [-1, 3, 4, 1 << 40])
def test_a_chunk_index_outside_its_message_is_refused(index: int) -> None:
    """A message of 3 chunks (total 250, size 100): index -1, 3 (= count), 4 and a huge
    one are out of range, and nothing is held for them."""
    reassembler = Reassembler()
    with pytest.raises(wire_errors.ReassemblyError, match="out of range"):
        reassembler.feed(_chunk("a0", "m", index, 3, 250, 100, nbytes=100))
    assert reassembler.buffered_bytes == 0


@pytest.mark.parametrize(("count", "total", "size"), [(2, 250, 100), (4, 250, 100),
                                                      (3, 250, 0), (3, 250, -100)])
def test_a_count_that_does_not_follow_from_total_and_size_is_refused(
        count: int, total: int, size: int) -> None:
    with pytest.raises(wire_errors.ReassemblyError, match="out of range"):
        Reassembler().feed(_chunk("a0", "m", 0, count, total, size, nbytes=100))


@pytest.mark.parametrize(("index", "nbytes"), [(0, 99), (0, 101), (2, 49), (2, 51), (2, 100)])
def test_a_chunk_of_the_wrong_length_for_its_index_is_refused(index: int, nbytes: int) -> None:
    """Chunks 0 and 1 carry `size` bytes, the last one the rest (250 - 200 = 50)."""
    with pytest.raises(wire_errors.ReassemblyError, match="expected"):
        Reassembler().feed(_chunk("a0", "m", index, 3, 250, 100, nbytes=nbytes))


def test_a_chunk_disagreeing_with_its_message_is_refused_and_the_message_still_completes(
        ) -> None:
    """a0's first chunk fixes its message at 250 bytes in 3 chunks of 100; a later chunk
    of the same id claiming 350 in 4 is refused, and the honest chunks still complete it
    in index order (bytes placed by index, not by arrival)."""
    reassembler = Reassembler()
    assert reassembler.feed(_chunk("a0", "m", 2, 3, 250, 100, fill=3)) is None
    with pytest.raises(wire_errors.ReassemblyError, match="disagrees"):
        reassembler.feed(_chunk("a0", "m", 1, 4, 350, 100, fill=9))
    assert reassembler.feed(_chunk("a0", "m", 0, 3, 250, 100, fill=1)) is None
    done = reassembler.feed(_chunk("a0", "m", 1, 3, 250, 100, fill=2))
    assert done == bytes([1] * 100 + [2] * 100 + [3] * 50)
    assert reassembler.buffered_bytes == 0


# ---------------------------------------------------------------- no sender starves another


def test_a_repeated_chunk_is_held_once_and_does_not_complete_a_message() -> None:
    """Chunk 0 of 2 sent 50 times: held once (100 bytes), the message not complete; the
    buffer holds exactly a0's chunk plus a1's whole message, and a1's message completes."""
    reassembler = Reassembler(max_buffered_bytes=100 + 150)
    for _ in range(50):
        assert reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100)) is None
    assert reassembler.buffered_bytes == 100
    assert reassembler.feed(_chunk("a1", "x", 0, 2, 150, 100, fill=5)) is None
    assert reassembler.feed(_chunk("a1", "x", 1, 2, 150, 100, fill=6)) == bytes(
        [5] * 100 + [6] * 50)
    assert reassembler.feed(_chunk("a0", "m", 1, 2, 150, 100)) == bytes(150)


def test_a_sender_over_its_in_flight_budget_loses_its_own_oldest_message_only() -> None:
    """a1 opens one message, then a0 opens 5 with a budget of 2 in flight: a0 loses m0..m2
    (oldest first), keeps m3 and m4, and a1's message and a0's m4 both complete."""
    reassembler = Reassembler(per_sender_in_flight=2)
    reassembler.feed(_chunk("a1", "x", 0, 2, 150, 100, fill=1))
    for i in range(5):
        reassembler.feed(_chunk("a0", f"m{i}", 0, 2, 150, 100, fill=i))
    assert reassembler.evicted == 3
    assert reassembler.feed(_chunk("a1", "x", 1, 2, 150, 100, fill=2)) == bytes(
        [1] * 100 + [2] * 50)
    assert reassembler.feed(_chunk("a0", "m4", 1, 2, 150, 100, fill=9)) == bytes(
        [4] * 100 + [9] * 50)
    # m3 is still there (evicting it would have been one more than needed), m0 is gone
    assert reassembler.feed(_chunk("a0", "m3", 1, 2, 150, 100)) is not None
    assert reassembler.feed(_chunk("a0", "m0", 1, 2, 150, 100)) is None


def test_a_sender_over_its_byte_budget_evicts_its_own_and_a_full_table_refuses_newcomers(
        ) -> None:
    """Byte budget 450 per sender: a0's three messages of 150 declared bytes fill it, a
    fourth evicts a0's oldest, never a1's; with the table at max_in_flight a new message is
    refused (no other sender's message is evicted to make room)."""
    reassembler = Reassembler(per_sender_bytes=450, max_in_flight=5, per_sender_in_flight=8)
    reassembler.feed(_chunk("a1", "x", 0, 2, 150, 100, fill=1))
    for i in range(4):
        reassembler.feed(_chunk("a0", f"m{i}", 0, 2, 150, 100))
    assert reassembler.evicted == 1 and reassembler.buffered_bytes == 400
    reassembler.feed(_chunk("a2", "y", 0, 2, 150, 100))  # table: x, m1..m3, y: 5
    with pytest.raises(wire_errors.OversizedMessage, match="in flight"):
        reassembler.feed(_chunk("a3", "z", 0, 2, 150, 100))
    assert reassembler.feed(_chunk("a1", "x", 1, 2, 150, 100, fill=2)) == bytes(
        [1] * 100 + [2] * 50)
    assert reassembler.feed(_chunk("a2", "y", 1, 2, 150, 100)) is not None
    assert reassembler.feed(_chunk("a0", "m1", 1, 2, 150, 100)) is not None
    assert reassembler.feed(_chunk("a0", "m0", 1, 2, 150, 100)) is None  # m0 was evicted


def test_an_accounted_message_counts_against_no_budget() -> None:
    """A 1000-byte message over the 500-byte limit, accounted for a0's `weights`: taken,
    and a0's byte budget (300) still holds its ordinary messages beside it."""
    reassembler = Reassembler(Limits(max_message_bytes=500), per_sender_bytes=300,
                              allowance=lambda s, k: 1000 if (s, k) == ("a0", "weights")
                              else None)
    big = _chunk("a0", "w", 0, 10, 1000, 100)
    big.meta["of"] = "weights"
    reassembler.feed(big)
    reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100))
    assert reassembler.evicted == 0 and reassembler.buffered_bytes == 200
    other = _chunk("a1", "w", 0, 10, 1000, 100)
    other.meta["of"] = "weights"
    with pytest.raises(wire_errors.OversizedMessage):
        reassembler.feed(other)


# ---------------------------------------------------------------- a message's chunks add up


MIB = 1024 * 1024


def _split(encoded: bytes, chunk_bytes: int) -> list[Message]:
    return [decode_message(c) for c in chunk_message(
        encoded, run="r", sender="s", seq_start=1, msg_id="m", chunk_bytes=chunk_bytes)]


@pytest.mark.parametrize(("total", "chunk_bytes", "count"), [
    (MIB, MIB, 1),  # fits exactly: travels whole
    (MIB + 1, MIB, 2),  # one byte over: slices of 1 MiB - 1024, two of them
    (3 * MIB, MIB, 4),  # 3 MiB / (1 MiB - 1024) = 3.003 slices
    (100, 4096, 1),
    (4000, 4096, 1),  # under chunk_bytes though over one slice (3072): still whole
    (2 * 3072, 4096, 2),  # exactly two slices of 4096 - 1024
    (2 * 3072 + 1, 4096, 3),
])
def test_chunk_count_is_the_number_of_slices_of_chunk_bytes_less_the_overhead(
        total: int, chunk_bytes: int, count: int) -> None:
    assert chunk_count(total, chunk_bytes) == count


def test_the_default_chunk_is_one_mib() -> None:
    """A message of exactly 1 MiB travels whole, one byte more in two chunks (the default
    `chunk_bytes` for both chunk_count and chunk_message)."""
    assert DEFAULT_CHUNK_BYTES == MIB
    assert chunk_count(MIB) == 1 and chunk_count(MIB + 1) == 2 and chunk_count(3 * MIB) == 4
    whole = bytes(MIB)
    assert chunk_message(whole, run="r", sender="s", seq_start=1, msg_id="m") == [whole]
    chunks = chunk_message(whole + b"x", run="r", sender="s", seq_start=1, msg_id="m")
    assert len(chunks) == 2 and all(len(c) <= MIB for c in chunks)


def test_a_chunk_size_under_four_overheads_is_refused_and_four_is_taken() -> None:
    """The least chunk size is 4 × the 1024-byte overhead, and the refusal says so."""
    with pytest.raises(ValueError, match="at least 4096 bytes"):
        chunk_message(bytes(10_000), run="r", sender="s", seq_start=1, msg_id="m",
                      chunk_bytes=4095)
    assert len(_split(bytes(10_000), 4096)) == chunk_count(10_000, 4096) == 4


@pytest.mark.parametrize("length", [2 * 3072, 2 * 3072 + 1, 3 * 3072 - 1])
def test_a_message_of_a_whole_number_of_slices_reassembles(length: int) -> None:
    """Chunk size 4096 gives slices of 3072: a message of exactly two slices goes in two
    chunks (no empty third), and every length comes back byte for byte."""
    encoded = bytes(i % 251 for i in range(length))
    chunks = _split(encoded, 4096)
    assert len(chunks) == chunk_count(length, 4096) == -(-length // 3072)
    assert [c.meta["count"] for c in chunks] == [len(chunks)] * len(chunks)
    reassembler = Reassembler()
    assert [reassembler.feed(c) for c in chunks][-1] == encoded


def test_a_message_of_many_chunks_completes() -> None:
    """599 bytes in 300 chunks of 2, the last one of 1 (counts and indices past any
    small-integer cache): each checked against the count and its own length, the last to
    arrive completes the message in index order."""
    reassembler = Reassembler()
    got = [reassembler.feed(_chunk("a0", "m", i, 300, 599, 2, fill=i % 256))
           for i in reversed(range(300))]
    assert got[:-1] == [None] * 299
    assert got[-1] == bytes(i % 256 for i in range(300) for _ in range(2 if i < 299 else 1))


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.float32, np.bool_])
def test_chunk_data_of_any_other_dtype_is_refused(dtype: type) -> None:
    chunk = _chunk("a0", "m", 0, 2, 150, 100)
    chunk.tensors["data"] = np.zeros(100, dtype)
    with pytest.raises(wire_errors.ReassemblyError, match="1-D byte tensor"):
        Reassembler().feed(chunk)


@pytest.mark.parametrize("total", [-5, 0])
def test_a_chunk_declaring_no_bytes_is_refused_as_oversized_even_with_an_allowance(
        total: int) -> None:
    """A total under 1 is never a message its receiver accounted for, whatever the
    allowance for its kind."""
    reassembler = Reassembler(allowance=lambda s, k: 10 * MIB)
    chunk = _chunk("a0", "m", 0, 1, total, 1, nbytes=1)
    chunk.meta["of"] = "weights"
    with pytest.raises(wire_errors.OversizedMessage, match="exceeds the limit"):
        reassembler.feed(chunk)


def test_the_reassemblers_defaults() -> None:
    """1024 messages in flight, 1 GiB buffered, 60 s to arrive, 4 unfinished messages and
    2 × the message limit declared per sender; nothing expired or evicted yet, and one
    expiry counts one."""
    reassembler = Reassembler(Limits(max_message_bytes=1000))
    assert (reassembler.max_in_flight, reassembler.max_buffered_bytes, reassembler.timeout_s,
            reassembler.per_sender_in_flight, reassembler.per_sender_bytes) == (
        1024, 1 << 30, 60.0, 4, 2000)
    assert reassembler.expired == 0 and reassembler.evicted == 0
    reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100))
    started = reassembler._partials[("a0", "m")].started
    assert reassembler.expire(now=started + 60.0) == 0
    assert reassembler.expire(now=started + 60.5) == 1 and reassembler.expired == 1
    assert reassembler.buffered_bytes == 0  # dropped, not only counted


@pytest.mark.parametrize(("field", "value"), [
    ("id", KeyError), ("data", KeyError), ("index", None), ("index", "first"),
    ("count", float("inf")), ("total", float("nan"))])
def test_a_chunk_header_missing_or_unreadable_is_refused_as_such(field: str,
                                                                   value: object) -> None:
    """Each way a forged header can fail to read (a field missing (`KeyError` here), None,
    a word, an infinite or NaN number) is the same refusal, not a crash with another error."""
    chunk = _chunk("a0", "m", 0, 2, 150, 100)
    if value is KeyError:
        del (chunk.tensors if field == "data" else chunk.meta)[field]
    else:
        chunk.meta[field] = value
    with pytest.raises(wire_errors.ReassemblyError, match="lacks"):
        Reassembler().feed(chunk)


def test_a_messages_chunks_take_consecutive_sequence_numbers() -> None:
    """From `seq_start` on, one each (the replay guard refuses a repeated one)."""
    chunks = [decode_message(c) for c in chunk_message(
        bytes(4 * 3072), run="r", sender="s", seq_start=6, msg_id="m", chunk_bytes=4096)]
    assert [c.seq for c in chunks] == [6, 7, 8, 9]
    assert [c.meta["index"] for c in chunks] == [0, 1, 2, 3]


def test_a_chunk_claiming_a_smaller_message_than_its_first_is_refused() -> None:
    """a0's first chunk fixes 250 bytes in 3 chunks of 100; a chunk of the same id claiming
    150 in 2 (smaller, not larger) is refused too, and the message still completes."""
    reassembler = Reassembler()
    assert reassembler.feed(_chunk("a0", "m", 0, 3, 250, 100, fill=1)) is None
    with pytest.raises(wire_errors.ReassemblyError, match="disagrees"):
        reassembler.feed(_chunk("a0", "m", 1, 2, 150, 100))
    assert reassembler.feed(_chunk("a0", "m", 1, 3, 250, 100, fill=2)) is None
    assert reassembler.feed(_chunk("a0", "m", 2, 3, 250, 100, fill=3)) == bytes(
        [1] * 100 + [2] * 100 + [3] * 50)


@pytest.mark.parametrize("shape", [(), (100, 1), (1, 100)])
def test_chunk_data_of_any_other_shape_is_refused(shape: tuple[int, ...]) -> None:
    """A scalar, or the right 100 bytes as a column or a row."""
    chunk = _chunk("a0", "m", 0, 2, 150, 100)
    chunk.tensors["data"] = np.zeros(shape, np.uint8)
    with pytest.raises(wire_errors.ReassemblyError, match="1-D byte tensor"):
        Reassembler().feed(chunk)


def test_an_accounted_message_under_its_allowance_is_taken() -> None:
    """Limit 500, allowance 1000: 800 bytes are over the limit and under the allowance."""
    reassembler = Reassembler(Limits(max_message_bytes=500), allowance=lambda s, k: 1000)
    chunk = _chunk("a0", "w", 0, 8, 800, 100)
    chunk.meta["of"] = "weights"
    assert reassembler.feed(chunk) is None and reassembler.buffered_bytes == 100


def test_a_message_of_exactly_the_senders_byte_budget_is_taken_alone() -> None:
    """Budget 150: a message declaring 150 bytes fits; a second one of 150 evicts the
    first; one of 151 is refused outright."""
    reassembler = Reassembler(per_sender_bytes=150)
    assert reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100)) is None
    assert reassembler.evicted == 0
    assert reassembler.feed(_chunk("a0", "n", 0, 2, 150, 100)) is None
    assert reassembler.evicted == 1
    with pytest.raises(wire_errors.OversizedMessage, match="budget of 150"):
        reassembler.feed(_chunk("a0", "o", 0, 2, 151, 100))


def test_two_messages_over_the_byte_budget_together_evict_the_older() -> None:
    """Budget 300: 200 + 200 declared bytes is over it (the sum, not any cheaper bound)."""
    reassembler = Reassembler(per_sender_bytes=300)
    reassembler.feed(_chunk("a0", "m", 0, 2, 200, 100))
    reassembler.feed(_chunk("a0", "n", 0, 2, 200, 100))
    assert reassembler.evicted == 1
    assert reassembler.feed(_chunk("a0", "m", 1, 2, 200, 100)) is None  # m is gone


def test_an_accounted_message_costs_nothing_of_a_full_byte_budget() -> None:
    """a0's ordinary message fills its 150-byte budget; an accounted 1000-byte message
    beside it evicts nothing (it counts 0 bytes, not 1)."""
    reassembler = Reassembler(Limits(max_message_bytes=500), per_sender_bytes=150,
                              allowance=lambda s, k: 1000)
    reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100))
    big = _chunk("a0", "w", 0, 10, 1000, 100)
    big.meta["of"] = "weights"
    reassembler.feed(big)
    assert reassembler.evicted == 0 and reassembler.buffered_bytes == 200


def test_a_large_in_flight_budget_is_kept_exactly() -> None:
    """300 unfinished messages allowed (past any small-integer cache): the 301st evicts
    the oldest, once."""
    reassembler = Reassembler(per_sender_in_flight=300, per_sender_bytes=1 << 20)
    for i in range(301):
        reassembler.feed(_chunk("a0", f"m{i}", 0, 2, 150, 100))
    assert reassembler.evicted == 1
    assert reassembler.feed(_chunk("a0", "m1", 1, 2, 150, 100)) is not None
    assert reassembler.feed(_chunk("a0", "m0", 1, 2, 150, 100)) is None  # m0 is gone


def test_a_message_under_the_chunk_size_travels_whole() -> None:
    """4000 bytes with chunk_bytes 4096: under the chunk size (though over one slice of
    3072), so it is sent as it is."""
    encoded = bytes(range(250)) * 16
    assert chunk_message(encoded, run="r", sender="s", seq_start=1, msg_id="m",
                         chunk_bytes=4096) == [encoded]


def test_with_no_unaccounted_room_an_accounted_byte_is_still_taken() -> None:
    """`max_message_bytes = 0`: nothing unaccounted fits, and a 1-byte message within its
    allowance is taken (1 is a size, not a refusal)."""
    reassembler = Reassembler(Limits(max_message_bytes=0), allowance=lambda s, k: 10)
    chunk = _chunk("a0", "w", 0, 1, 1, 1, fill=9)
    chunk.meta["of"] = "weights"
    assert reassembler.feed(chunk) == b"\x09"
    plain = _chunk("a0", "p", 0, 1, 1, 1)
    with pytest.raises(wire_errors.OversizedMessage, match="exceeds the limit"):
        reassembler.feed(plain)


def test_a_one_byte_message_is_within_the_limits() -> None:
    assert Reassembler().feed(_chunk("a0", "m", 0, 1, 1, 1, fill=4)) == b"\x04"


def test_the_default_table_refuses_the_1025th_message_in_flight() -> None:
    """1024 senders with one unfinished message each fill the default table; a 1025th
    sender's message is refused, and no one's is evicted for it."""
    reassembler = Reassembler()
    for i in range(1024):
        reassembler.feed(_chunk(f"s{i}", "m", 0, 2, 150, 100))
    with pytest.raises(wire_errors.OversizedMessage, match="more than 1024"):
        reassembler.feed(_chunk("late", "m", 0, 2, 150, 100))
    assert reassembler.evicted == 0 and reassembler.buffered_bytes == 1024 * 100


def test_a_message_of_exactly_the_limit_needs_no_allowance() -> None:
    """Limit 150: a 150-byte message is within it (no allowance asked), 151 is over."""
    reassembler = Reassembler(Limits(max_message_bytes=150))
    assert reassembler.feed(_chunk("a0", "m", 0, 2, 150, 100)) is None
    with pytest.raises(wire_errors.OversizedMessage, match="exceeds the limit"):
        reassembler.feed(_chunk("a0", "n", 0, 2, 151, 100))

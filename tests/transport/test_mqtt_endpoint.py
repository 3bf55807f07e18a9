"""`MqttEndpoint`'s message path without a broker: what `prepare`/`send` put on the wire
(real envelopes, real chunks, consecutive chunk seqs reserved from the sender's counter),
and what `_receive` makes of it on the other side: a topic's owner checked before the
replay window sees the message, presence checked by its own guard (and never by the
replay window), replay floors kept on disk, chunks reassembled with the bytes of all of
them booked, every refusal counted by its class and the last one per verified sender kept
in `refused`, expired and evicted partial messages counted, and `route` taking a message
instead of the inbox. Two endpoints talk through their methods only, with a fleet key
(HMAC) or device keys (Ed25519)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import ConfigError
from jetsplit.identity import KeyRing, Signer
from jetsplit.transport import mqtt as mqtt_module
from jetsplit.transport.mqtt import EndpointOptions, Inbound, MqttEndpoint, presence_payload
from jetsplit.transport.topics import Topics
from jetsplit.wire import (
    Message,
    MessageType,
    WireError,
    chunk_count,
    chunk_message,
    decode_message,
    encode_message,
)
from jetsplit.wire import errors as wire_errors

pytestmark = pytest.mark.fast

KEY = b"fleet-key-0123456789abcdef"
ADDRESS = BrokerAddress("broker.lan", 1883)
TOPICS = Topics("f1")
UP_A0 = TOPICS.up("a0")
SMALL_CHUNKS = 4096  # the least chunk size: a 5000-byte tensor travels in two chunks


class FakeClient:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, int, bool]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        self.published.append((topic, payload, qos, retain))


def coordinator(**options: Any) -> MqttEndpoint:
    """The coordinator's side: up/X and presence/X must come from X."""
    return MqttEndpoint(ADDRESS, "coordinator", EndpointOptions(fleet_key=KEY, **options),
                        sender="coordinator", topic_owner=TOPICS.agent_of)


def agent(name: str = "a0", **options: Any) -> MqttEndpoint:
    options.setdefault("chunk_bytes", SMALL_CHUNKS)
    return MqttEndpoint(ADDRESS, name, EndpointOptions(fleet_key=KEY, **options))


def reply(sender: str, seq: int, nbytes: int = 0, mtype: MessageType = MessageType.REPLY,
          **fields: Any) -> Message:
    tensors = {"x": np.arange(nbytes, dtype=np.uint8)} if nbytes else {}
    return Message(mtype, run="r1", sender=sender, seq=seq, kind="reply", meta={"ok": 1},
                   tensors=tensors, **fields)


def received(made: MqttEndpoint) -> list[Inbound]:
    out = []
    while not made.inbox.empty():
        out.append(made.inbox.get_nowait())
    return out


def handle(made: MqttEndpoint, topic: str, payload: bytes) -> None:
    """As paho's thread delivers a message."""
    made._handle_message(None, None, SimpleNamespace(topic=topic, payload=payload))


# ---------------------------------------------------------------- prepare, send, publish


def test_a_small_message_is_one_envelope_and_takes_no_chunk_seqs() -> None:
    sender = agent()
    msg = reply("a0", 7, nbytes=100, ts=1000.0)
    before = sender.next_seq()
    parts = sender.prepare(msg)
    assert parts == [encode_message(msg, fleet_key=KEY)]
    assert sender.next_seq() == before + 1


def test_codec_and_compression_reach_the_encoder() -> None:
    sender = agent(chunk_bytes=1 << 20)
    msg = Message(MessageType.REPLY, run="r1", sender="a0", seq=1, ts=1000.0,
                  tensors={"x": np.linspace(0, 1, 50, dtype=np.float32)})
    assert sender.prepare(msg, codec="fp16", compression="zstd") == [
        encode_message(msg, codec="fp16", compression="zstd", fleet_key=KEY)]


def test_a_large_message_travels_in_chunks_with_consecutive_reserved_seqs() -> None:
    sender = agent()
    msg = reply("a0", 7, nbytes=5000)
    encoded_len = len(encode_message(msg, fleet_key=KEY))
    before = sender.next_seq()
    parts = sender.prepare(msg)
    assert len(parts) == chunk_count(encoded_len, SMALL_CHUNKS) == 2
    chunks = [decode_message(p, fleet_key=KEY) for p in parts]
    assert [c.type for c in chunks] == [MessageType.CHUNK] * 2
    assert [c.seq for c in chunks] == [before + 1, before + 2]
    assert sender.next_seq() == before + 3
    assert [c.meta["id"] for c in chunks] == ["a0.7", "a0.7"]
    assert [c.meta["of"] for c in chunks] == ["reply", "reply"]
    assert all(len(p) <= SMALL_CHUNKS for p in parts)
    assert all(c.sender == "a0" and c.run == "r1" for c in chunks)


def test_a_chunk_size_override_applies_to_one_message() -> None:
    sender = agent(chunk_bytes=1 << 20)
    msg = reply("a0", 7, nbytes=5000)
    assert len(sender.prepare(msg)) == 1
    assert len(sender.prepare(msg, chunk_bytes=SMALL_CHUNKS)) == 2


def test_a_three_chunk_message_reserves_three_seqs() -> None:
    sender = agent()
    before = sender.next_seq()
    parts = sender.prepare(reply("a0", 9, nbytes=8000))
    assert [decode_message(p, fleet_key=KEY).seq for p in parts] == [
        before + 1, before + 2, before + 3]


def test_next_seq_counts_up_by_one() -> None:
    sender = agent()
    first = sender.next_seq()
    assert [sender.next_seq() for _ in range(3)] == [first + 1, first + 2, first + 3]
    assert abs(first - time.time_ns() // 1000) < 600 * 10**6  # starts at the clock, in µs


def test_send_publishes_every_chunk_with_qos1_and_returns_the_bytes() -> None:
    sender = agent()
    client = FakeClient()
    sender._client = client  # type: ignore[assignment]
    nbytes = sender.send(UP_A0, reply("a0", 7, nbytes=5000), retain=True)
    assert len(client.published) == 2
    assert nbytes == sum(len(p[1]) for p in client.published)
    assert [(t, q, r) for t, _, q, r in client.published] == [(UP_A0, 1, True)] * 2
    chunks = [decode_message(p[1], fleet_key=KEY) for p in client.published]
    assert [c.meta["index"] for c in chunks] == [0, 1]


def test_send_passes_codec_and_compression() -> None:
    sender = agent(chunk_bytes=1 << 20)
    client = FakeClient()
    sender._client = client  # type: ignore[assignment]
    msg = Message(MessageType.REPLY, run="r1", sender="a0", seq=1, ts=1000.0,
                  tensors={"x": np.linspace(0, 1, 50, dtype=np.float32)})
    nbytes = sender.send(UP_A0, msg, codec="fp16", compression="zstd")
    expected = encode_message(msg, codec="fp16", compression="zstd", fleet_key=KEY)
    assert client.published == [(UP_A0, expected, 1, False)]
    assert nbytes == len(expected)


def test_publish_parts_keeps_order_and_counts_bytes() -> None:
    sender = agent()
    client = FakeClient()
    sender._client = client  # type: ignore[assignment]
    assert sender.publish_parts("t", [b"abc", b"de"]) == 5
    assert client.published == [("t", b"abc", 1, False), ("t", b"de", 1, False)]
    assert sender.publish_parts("t", []) == 0


def test_publishing_unconnected_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        agent().send(UP_A0, reply("a0", 1))
    assert str(err.value) == "not connected to broker mqtt://broker.lan:1883"


def test_publish_raw() -> None:
    sender = agent()
    sender.publish_raw("t", b"x")  # unconnected: nothing, no error
    client = FakeClient()
    sender._client = client  # type: ignore[assignment]
    sender.publish_raw("t", b"x")
    sender.publish_raw("u", b"y", retain=True)
    assert client.published == [("t", b"x", 1, False), ("u", b"y", 1, True)]


# ---------------------------------------------------------------- receiving


def test_a_message_lands_in_the_inbox_with_its_wire_bytes() -> None:
    sender, receiver = agent(), coordinator()
    [part] = sender.prepare(reply("a0", 7, nbytes=100))
    receiver._receive(UP_A0, part)
    [inbound] = received(receiver)
    assert inbound.topic == UP_A0
    assert inbound.wire_bytes == len(part)
    assert inbound.message.sender == "a0"
    assert inbound.message.seq == 7
    assert inbound.message.meta == {"ok": 1}
    assert inbound.message.signed is True
    np.testing.assert_array_equal(inbound.message.tensors["x"],
                                  np.arange(100, dtype=np.uint8))
    assert receiver.rejected == {}


def test_a_chunked_message_is_whole_after_its_last_chunk_with_all_bytes_booked() -> None:
    sender, receiver = agent(), coordinator()
    seq = sender.next_seq()  # a sender's messages and chunks share one counter
    parts = sender.prepare(reply("a0", seq, nbytes=8000))
    assert len(parts) == 3
    for part in reversed(parts[1:]):
        receiver._receive(UP_A0, part)
        assert received(receiver) == []
    receiver._receive(UP_A0, parts[0])
    [inbound] = received(receiver)
    assert inbound.wire_bytes == sum(len(p) for p in parts)
    assert inbound.message.type == MessageType.REPLY
    assert inbound.message.seq == seq
    np.testing.assert_array_equal(inbound.message.tensors["x"],
                                  np.arange(8000) % 256)
    assert receiver.rejected == {}


def test_a_chunked_peer_message_is_delivered_too() -> None:
    """A type above CHUNK's number (PEER) chunked and whole again."""
    sender, receiver = agent(), MqttEndpoint(ADDRESS, "e0", EndpointOptions(fleet_key=KEY))
    parts = sender.prepare(reply("a0", sender.next_seq(), nbytes=5000, mtype=MessageType.PEER))
    single = sender.prepare(reply("a0", sender.next_seq(), nbytes=10, mtype=MessageType.ACK))
    for part in parts + single:
        receiver._receive("t", part)
    assert [i.message.type for i in received(receiver)] == [MessageType.PEER, MessageType.ACK]


def test_a_presence_message_is_delivered() -> None:
    receiver = coordinator()
    payload = presence_payload("r1", "a0", "online", fleet_key=KEY)
    receiver._receive(TOPICS.presence("a0"), payload)
    [inbound] = received(receiver)
    assert inbound.message.type == MessageType.PRESENCE
    assert inbound.wire_bytes == len(payload)


def test_a_sender_that_does_not_own_the_topic_is_refused_before_the_replay_window() -> None:
    """a1 on up/a0 and on up/a2 (ids sorting either side of the forger's): refused as
    SenderMismatch, and the forged seq does not burn a1's own window."""
    receiver = coordinator()
    forged = agent("a1").prepare(reply("a1", 40))[0]
    for topic in (UP_A0, TOPICS.up("a2")):
        with pytest.raises(wire_errors.SenderMismatch) as err:
            receiver._receive(topic, forged)
        assert str(err.value) == f"sender 'a1' does not own {topic}"
    assert received(receiver) == []
    receiver._receive(TOPICS.up("a1"), forged)
    assert [i.message.seq for i in received(receiver)] == [40]


def test_a_topic_without_an_owner_takes_any_sender() -> None:
    receiver = coordinator()
    receiver._receive(TOPICS.down_all, agent("a1").prepare(reply("a1", 40))[0])
    receiver._receive("other/topic", agent("a2").prepare(reply("a2", 41))[0])
    assert [i.message.sender for i in received(receiver)] == ["a1", "a2"]


def test_an_endpoint_without_a_topic_owner_takes_any_sender() -> None:
    receiver = MqttEndpoint(ADDRESS, "coordinator", EndpointOptions(fleet_key=KEY))
    receiver._receive(UP_A0, agent("a1").prepare(reply("a1", 40))[0])
    assert [i.message.sender for i in received(receiver)] == ["a1"]


def test_a_replayed_message_is_refused() -> None:
    receiver = coordinator()
    [part] = agent().prepare(reply("a0", 7))
    receiver._receive(UP_A0, part)
    with pytest.raises(wire_errors.ReplayedMessage):
        receiver._receive(UP_A0, part)
    assert len(received(receiver)) == 1


def test_without_a_key_nothing_is_replay_checked() -> None:
    receiver = MqttEndpoint(ADDRESS, "coordinator", topic_owner=TOPICS.agent_of)
    [part] = MqttEndpoint(ADDRESS, "a0").prepare(reply("a0", 7))
    receiver._receive(UP_A0, part)
    receiver._receive(UP_A0, part)
    old = presence_payload("r1", "a0", "online", fleet_key=None)
    stale = encode_message(Message(MessageType.PRESENCE, run="r1", sender="a0", seq=1,
                                   ts=time.time() - 3 * 86400, meta={"state": "online"}))
    receiver._receive(TOPICS.presence("a0"), old)
    receiver._receive(TOPICS.presence("a0"), stale)
    assert len(received(receiver)) == 4


def test_an_unsigned_message_is_refused_where_a_key_is_required() -> None:
    receiver = coordinator()
    [part] = MqttEndpoint(ADDRESS, "a0").prepare(reply("a0", 7))
    with pytest.raises(wire_errors.BadSignature):
        receiver._receive(UP_A0, part)


def presence(seq: int, ts: float, meta: dict[str, Any]) -> bytes:
    return encode_message(Message(MessageType.PRESENCE, run="r1", sender="a0", seq=seq,
                                  ts=ts, kind="presence", meta=meta), fleet_key=KEY)


def test_presence_is_checked_by_its_own_guard_and_not_by_the_replay_window() -> None:
    """Retained presence comes back on every subscription: the same one twice is taken;
    its seq is not booked in the replay window (a reply with that seq is taken after it)."""
    receiver = coordinator()
    now = time.time()
    topic = TOPICS.presence("a0")
    receiver._receive(topic, presence(50, now, {"state": "online"}))
    receiver._receive(topic, presence(50, now, {"state": "online"}))
    receiver._receive(UP_A0, agent().prepare(reply("a0", 50))[0])
    assert [i.message.type for i in received(receiver)] == [
        MessageType.PRESENCE, MessageType.PRESENCE, MessageType.REPLY]
    with pytest.raises(wire_errors.StalePresence):  # older than the last one accepted
        receiver._receive(topic, presence(49, now - 10, {"state": "online"}))


def test_presence_age_depends_on_its_state() -> None:
    """Two days old: an offline last will is still taken, an online message (or one that
    names no state) is stale."""
    receiver = coordinator()
    topic = TOPICS.presence("a0")
    old = time.time() - 2 * 86400
    receiver._receive(topic, presence(1, old, {"state": "offline"}))
    with pytest.raises(wire_errors.StalePresence, match=r"a0 presence \(online\)"):
        receiver._receive(topic, presence(2, old, {"state": "online"}))
    with pytest.raises(wire_errors.StalePresence, match=r"a0 presence \(\)"):
        receiver._receive(topic, presence(3, old, {}))
    assert len(received(receiver)) == 1


# ---------------------------------------------------------------- replay floors on disk


def command(seq: int) -> bytes:
    return encode_message(Message(MessageType.COMMAND, run="r1", sender="coordinator", seq=seq,
                                  kind="train"), fleet_key=KEY)


def test_replay_floors_persist_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    first = agent(replay_state=str(path))
    first._receive(TOPICS.down("a0"), command(77))
    assert json.loads(path.read_text(encoding="utf-8")) == {"coordinator": 77}
    first._receive(TOPICS.presence("a1"), presence(500, time.time(), {"state": "online"}))
    assert json.loads(path.read_text(encoding="utf-8")) == {"coordinator": 77}  # no presence
    restarted = agent(replay_state=str(path))
    with pytest.raises(wire_errors.ReplayedMessage, match="before this process restarted"):
        restarted._receive(TOPICS.down("a0"), command(77))
    restarted._receive(TOPICS.down("a0"), command(78))
    assert json.loads(path.read_text(encoding="utf-8")) == {"coordinator": 78}
    assert [i.message.seq for i in received(first)] == [77, 500]
    assert [i.message.seq for i in received(restarted)] == [78]


def test_no_replay_file_without_a_key(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    path.write_text('{"coordinator": 90}', encoding="utf-8")
    receiver = MqttEndpoint(ADDRESS, "a0", EndpointOptions(replay_state=str(path)))
    unsigned = encode_message(Message(MessageType.COMMAND, run="r1", sender="coordinator",
                                      seq=80, kind="train"))
    receiver._receive(TOPICS.down("a0"), unsigned)
    assert len(received(receiver)) == 1
    assert receiver._replay_state is None
    assert json.loads(path.read_text(encoding="utf-8")) == {"coordinator": 90}


def test_replay_window_in_memory_without_a_replay_file(tmp_path: Path) -> None:
    receiver = agent()
    receiver._receive(TOPICS.down("a0"), command(5))
    with pytest.raises(wire_errors.ReplayedMessage):
        receiver._receive(TOPICS.down("a0"), command(5))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- device keys


def test_device_signed_messages_verify_under_the_senders_key() -> None:
    a0, coord = Signer.generate("a0"), Signer.generate("coordinator")
    keyring = KeyRing({"a0": a0.public_key(), "coordinator": coord.public_key()})
    sender = MqttEndpoint(ADDRESS, "a0", EndpointOptions(signer=a0, keyring=keyring,
                                                         chunk_bytes=SMALL_CHUNKS),
                          sender="a0")
    receiver = MqttEndpoint(ADDRESS, "coordinator",
                            EndpointOptions(signer=coord, keyring=keyring),
                            topic_owner=TOPICS.agent_of)
    parts = sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))
    assert len(parts) == 2
    for part in parts:
        receiver._receive(UP_A0, part)
    receiver._receive(TOPICS.presence("a0"),
                      presence_payload("r1", "a0", "online", fleet_key=None, signer=a0))
    assert [i.message.type for i in received(receiver)] == [MessageType.REPLY,
                                                            MessageType.PRESENCE]
    with pytest.raises(wire_errors.ReplayedMessage):
        receiver._receive(UP_A0, parts[0])
    forged = encode_message(reply("a0", 8), signer=coord)  # the coordinator's key as a0
    with pytest.raises(wire_errors.BadSignature):
        receiver._receive(UP_A0, forged)


# ---------------------------------------------------------------- refusals


def test_refusals_are_counted_by_class_on_pahos_thread(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    receiver = coordinator()
    handle(receiver, UP_A0, b"junk")
    handle(receiver, UP_A0, b"junk")
    handle(receiver, UP_A0, b"X" * 100)
    assert receiver.rejected == {"TruncatedMessage": 2, "BadMagic": 1}
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3
    assert caplog.messages[0] == (f"rejected message on {UP_A0}: TruncatedMessage: message of "
                                  "4 bytes is shorter than its prefix")
    assert received(receiver) == []


def test_an_unexpected_error_is_counted_and_does_not_escape(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")

    def route(inbound: Inbound) -> bool:
        raise RuntimeError("bug")

    receiver = MqttEndpoint(ADDRESS, "e0", EndpointOptions(fleet_key=KEY), route=route)
    handle(receiver, "t", agent().prepare(reply("a0", 1))[0])
    assert receiver.rejected == {"RuntimeError": 1}
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert caplog.messages == ["failed to handle message on t"]


def test_route_takes_a_message_instead_of_the_inbox() -> None:
    taken: list[Inbound] = []

    def route(inbound: Inbound) -> bool:
        taken.append(inbound)
        return inbound.message.seq == 1

    receiver = MqttEndpoint(ADDRESS, "e0", EndpointOptions(fleet_key=KEY), route=route)
    sender = agent()
    receiver._receive("t", sender.prepare(reply("a0", 1))[0])
    receiver._receive("t", sender.prepare(reply("a0", 2))[0])
    assert [i.message.seq for i in taken] == [1, 2]
    assert [i.message.seq for i in received(receiver)] == [2]


def test_a_wire_error_from_route_is_counted_as_a_rejection() -> None:
    def route(inbound: Inbound) -> bool:
        raise wire_errors.UnexpectedPeer("not my peer")

    receiver = MqttEndpoint(ADDRESS, "e0", EndpointOptions(fleet_key=KEY), route=route)
    handle(receiver, "t", agent().prepare(reply("a0", 1))[0])
    assert receiver.rejected == {"UnexpectedPeer": 1}
    assert received(receiver) == []


def bad_chunk(sender: str, seq: int) -> bytes:
    """A signed chunk whose index is past its count."""
    return encode_message(Message(
        MessageType.CHUNK, run="r1", sender=sender, seq=seq, kind="chunk",
        meta={"id": "m", "index": 5, "count": 2, "total": 10, "size": 8, "of": "reply"},
        tensors={"data": np.zeros(2, dtype=np.uint8)}), fleet_key=KEY)


def test_a_bad_chunk_is_refused_and_remembered_for_its_sender() -> None:
    receiver = coordinator()
    before = time.monotonic()
    with pytest.raises(wire_errors.ReassemblyError):
        receiver._receive(UP_A0, bad_chunk("a0", 3))
    after = time.monotonic()
    when, why = receiver.refused["a0"]
    assert before <= when <= after
    assert why == "ReassemblyError: chunk 5 of 2 (size 8) is out of range"
    handle(receiver, UP_A0, bad_chunk("a0", 4))
    assert receiver.rejected == {"ReassemblyError": 1}


def test_a_whole_message_that_fails_verification_is_refused_for_its_sender() -> None:
    """Chunks signed with the fleet key carrying a message signed with another key."""
    inner = encode_message(reply("a0", 7, nbytes=5000), fleet_key=b"another-key-0123456789")
    parts = chunk_message(inner, run="r1", sender="a0", seq_start=100, msg_id="a0.7",
                          chunk_bytes=SMALL_CHUNKS, fleet_key=KEY, kind="reply")
    receiver = coordinator()
    receiver._receive(UP_A0, parts[0])
    assert receiver.refused == {}
    with pytest.raises(wire_errors.BadSignature):
        receiver._receive(UP_A0, parts[1])
    assert receiver.refused["a0"][1] == (
        "BadSignature: HMAC mismatch: wrong fleet key or tampered message")
    assert received(receiver) == []


def test_a_chunk_may_not_carry_another_chunk() -> None:
    inner_chunk = encode_message(Message(
        MessageType.CHUNK, run="r1", sender="a0", seq=50, kind="chunk",
        meta={"id": "x", "index": 0, "count": 1, "total": 5000, "size": 5000, "of": ""},
        tensors={"data": np.zeros(5000, dtype=np.uint8)}), fleet_key=KEY)
    parts = chunk_message(inner_chunk, run="r1", sender="a0", seq_start=100, msg_id="a0.50",
                          chunk_bytes=SMALL_CHUNKS, fleet_key=KEY, kind="chunk")
    receiver = coordinator()
    receiver._receive(UP_A0, parts[0])
    with pytest.raises(WireError) as err:
        receiver._receive(UP_A0, parts[1])
    assert type(err.value) is WireError
    assert str(err.value) == "a chunk may not carry another chunk"
    assert received(receiver) == []


def test_refusals_are_kept_for_at_most_four_times_the_messages_in_flight() -> None:
    receiver = coordinator()
    receiver._reassembler.max_in_flight = 2  # room for 8 senders' refusals
    for i in range(8):
        receiver._refuse(f"s{i}", WireError(f"e{i}"))
    assert list(receiver.refused) == [f"s{i}" for i in range(8)]
    receiver._refuse("s3", WireError("again"))  # a known sender: nobody dropped
    assert len(receiver.refused) == 8
    assert receiver.refused["s3"][1] == "WireError: again"
    receiver._refuse("s8", WireError("e8"))
    assert list(receiver.refused) == [f"s{i}" for i in range(1, 9)]


# ---------------------------------------------------------------- partial messages


def first_chunks(senders: list[str], seq: int = 10) -> list[bytes]:
    """The first of two chunks of one message from each sender (messages never finished)."""
    return [agent(s).prepare(reply(s, seq, nbytes=5000))[0] for s in senders]


def test_a_sender_over_its_budget_loses_its_oldest_unfinished_message(
        caplog: pytest.LogCaptureFixture) -> None:
    """Four unfinished messages per sender: the fifth, sixth and seventh each evict one,
    counted once each."""
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    receiver = coordinator()
    sender = agent()
    firsts = [sender.prepare(reply("a0", seq, nbytes=5000))[0] for seq in range(1, 8)]
    for part in firsts[:4]:
        receiver._receive(UP_A0, part)
    assert "ReassemblyEvicted" not in receiver.rejected
    counts = []
    for part in firsts[4:]:
        receiver._receive(UP_A0, part)
        counts.append(receiver.rejected["ReassemblyEvicted"])
    assert counts == [1, 2, 3]
    assert receiver.rejected == {"ReassemblyEvicted": 3}
    assert caplog.messages == ["dropped an unfinished chunked message from a0: over its "
                               "budget"] * 3


def test_chunk_bytes_are_tracked_for_at_most_four_times_the_messages_in_flight() -> None:
    """max_in_flight 2: the bytes of 8 unfinished messages are kept; a 9th forgets the
    oldest's, whose whole message is then booked with its last chunk's bytes only."""
    for others, forgotten in ((7, False), (8, True)):
        receiver = coordinator()
        receiver._reassembler.max_in_flight = 2
        sender = agent("a0")
        parts = sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))
        receiver._receive(UP_A0, parts[0])
        for index, part in enumerate(first_chunks([f"b{i}" for i in range(others)])):
            if index == 0:  # the second message in flight: taken
                receiver._receive(TOPICS.up("b0"), part)
                continue
            with pytest.raises(wire_errors.OversizedMessage):  # more than 2 in flight
                receiver._receive(TOPICS.up(f"b{index}"), part)
        receiver._receive(UP_A0, parts[1])
        [inbound] = received(receiver)
        expected = len(parts[1]) if forgotten else len(parts[0]) + len(parts[1])
        assert inbound.wire_bytes == expected


def age_partials(made: MqttEndpoint, seconds: float) -> None:
    for partial in made._reassembler._partials.values():
        partial.started -= seconds


def test_expired_partials_are_counted_on_any_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    receiver = coordinator(reassembly_timeout_s=5.0)
    sender = agent()
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))[0])
    age_partials(receiver, 4.0)  # within the timeout
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq()))[0])
    assert "ReassemblyExpired" not in receiver.rejected
    assert caplog.messages == []
    age_partials(receiver, 2.0)  # now 6 s old
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq()))[0])
    assert receiver.rejected == {"ReassemblyExpired": 1}
    assert caplog.messages == ["dropped 1 unfinished chunked message(s): no chunk for 5 s"]
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq()))[0])
    assert receiver.rejected == {"ReassemblyExpired": 1}  # counted once
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))[0])
    age_partials(receiver, 6.0)  # a second one, later
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq()))[0])
    assert receiver.rejected == {"ReassemblyExpired": 2}
    assert len(received(receiver)) == 4


def test_partials_expired_by_a_new_chunk_or_a_refused_message_are_counted() -> None:
    receiver = coordinator(reassembly_timeout_s=5.0)
    sender = agent()
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))[0])
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))[0])
    age_partials(receiver, 6.0)
    # the next chunk's own check expires both
    receiver._receive(UP_A0, sender.prepare(reply("a0", sender.next_seq(), nbytes=5000))[0])
    assert receiver.rejected == {"ReassemblyExpired": 2}
    age_partials(receiver, 6.0)
    handle(receiver, UP_A0, b"junk")
    assert receiver.rejected == {"ReassemblyExpired": 3, "TruncatedMessage": 1}


# ---------------------------------------------------------------- presence payloads


def test_presence_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mqtt_module, "time",
                        SimpleNamespace(time_ns=lambda: 1_700_000_000_123_456_789))
    payload = presence_payload("r1", "a0", "online", fleet_key=KEY, extra={"cut": 3})
    msg = decode_message(payload, fleet_key=KEY)
    assert msg.type == MessageType.PRESENCE
    assert (msg.run, msg.sender, msg.kind) == ("r1", "a0", "presence")
    assert msg.seq == 1_700_000_000_123_456  # the clock in µs
    assert msg.meta == {"state": "online", "cut": 3}
    assert msg.signed is True
    plain = presence_payload("r1", "a0", "offline", fleet_key=None)
    msg = decode_message(plain)
    assert msg.meta == {"state": "offline"}
    assert msg.signed is False
    with pytest.raises(wire_errors.BadSignature):
        decode_message(plain, fleet_key=KEY)


def test_presence_payload_signed_by_a_device_key() -> None:
    signer = Signer.generate("a0")
    payload = presence_payload("r1", "a0", "online", fleet_key=None, signer=signer)
    msg = decode_message(payload, keyring=KeyRing({"a0": signer.public_key()}))
    assert msg.meta == {"state": "online"}
    assert msg.signed is True


# ---------------------------------------------------------------- signatures


def test_leading_parameters_may_be_named_and_options_only_named() -> None:
    """What callers rely on: the leading parameters can be passed by name, everything after
    `*` only by name (a positional retain or codec would be a silent mistake)."""
    made = MqttEndpoint(address=ADDRESS, client_id="dev1",
                        options=EndpointOptions(fleet_key=KEY, chunk_bytes=SMALL_CHUNKS))
    with pytest.raises(TypeError):
        MqttEndpoint(ADDRESS, "dev1", EndpointOptions(), ("t",))  # type: ignore[misc]
    msg = reply("dev1", 1, ts=1000.0)
    assert made.prepare(message=msg) == [encode_message(msg, fleet_key=KEY)]
    with pytest.raises(TypeError):
        made.prepare(msg, "fp16")  # type: ignore[misc]
    with pytest.raises(ConfigError):  # unconnected, but the call itself is valid
        made.send(topic="t", message=msg)
    with pytest.raises(TypeError):
        made.send("t", msg, "fp16")  # type: ignore[misc]
    with pytest.raises(ConfigError):
        made.publish_parts(topic="t", parts=[b"x"])
    with pytest.raises(TypeError):
        made.publish_parts("t", [b"x"], True)  # type: ignore[misc]
    made.publish_raw(topic="t", payload=b"x")
    with pytest.raises(TypeError):
        made.publish_raw("t", b"x", True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        made.close(False)  # type: ignore[misc]
    made.close(graceful=False)
    payload = presence_payload(run="r1", sender="a0", state="online", fleet_key=None)
    assert decode_message(payload).meta == {"state": "online"}
    with pytest.raises(TypeError):
        presence_payload("r1", "a0", "online", None)  # type: ignore[misc]

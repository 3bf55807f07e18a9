"""The device faults (edge_agent/faults.py) by hand: which commands each takes, the chunks a
hanging device publishes, the wall clock a jumping one reads, and what the wire then does
with them (a half message dropped once it is stale, a stamp an hour off refused). The
matrix over a real broker is tests/integration/test_fault_matrix.py. Torch-free."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from jetsplit.broker_url import BrokerAddress
from jetsplit.edge_agent.attacks import NEEDS_BROKER, Attack, AttackSpec, parse_attack
from jetsplit.edge_agent.faults import FAULT_ROUND, HANG_CHUNK_BYTES, Fault, step_wall_clock
from jetsplit.errors import ConfigError
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
from jetsplit.transport.settings import MqttSection
from jetsplit.wire import Message, MessageType, ReplayGuard, decode_message, encode_message
from jetsplit.wire.errors import ReplayedMessage

pytestmark = pytest.mark.device_pure

WORK = ("forward", "backward", "get_weights", "set_weights", "release", "status", "train")


@pytest.fixture()
def clock() -> Iterator[list[Fault]]:
    """Faults a test stepped the clock with; their steps undone afterwards."""
    faults: list[Fault] = []
    yield faults
    for fault in reversed(faults):
        if fault.undo_clock is not None:
            fault.undo_clock()


def test_the_fault_specs_parse_strictly() -> None:
    assert parse_attack("every-other") == AttackSpec("every-other")
    assert parse_attack("hang-upload") == AttackSpec("hang-upload")
    assert parse_attack("clock-jump:3600") == AttackSpec("clock-jump", 3600.0)
    assert parse_attack("clock-jump:-90.5") == AttackSpec("clock-jump", -90.5)
    for spec, why in (("every-other:2", "takes no number"), ("hang-upload:1", "takes no number"),
                      ("clock-jump", "finite number"), ("clock-jump:1e7", "finite number"),
                      ("clock-jump:nan", "finite number"), ("clock-jump:inf", "finite number")):
        with pytest.raises(ConfigError, match=why):
            parse_attack(spec)
    assert {"silent", "every-other", "hang-upload", "clock-jump"} <= set(NEEDS_BROKER)


def test_a_fault_strikes_from_the_round_its_spec_names() -> None:
    assert parse_attack("silent@2") == AttackSpec("silent", None, 2)
    assert parse_attack("clock-jump:-60@0") == AttackSpec("clock-jump", -60.0, 0)
    assert parse_attack("every-other@1000000").start == 1_000_000
    for spec, why in (("scale:2@1", "only the faults"), ("signflip@0", "only the faults"),
                      ("silent@", "needs a round"), ("silent@-1", "needs a round"),
                      ("silent@1.5", "needs a round"), ("silent@1000001", "needs a round"),
                      ("silent@\u0663", "needs a round"), ("silent:2", "takes no number"),
                      ("hang-upload@1@2", "needs a round")):
        with pytest.raises(ConfigError, match=why):
            parse_attack(spec)
    assert [Fault(k).start for k in ("silent", "every-other", "hang-upload", "clock-jump")] == [
        0, FAULT_ROUND, FAULT_ROUND, FAULT_ROUND]
    late = Attack(parse_attack("silent@2"))
    assert late.takes("forward", ("r", 1), 1) and not late.takes("forward", ("r", 2), 2)
    assert late.takes("bundle", ("r", 3), 2)
    flaky = Attack(parse_attack("every-other@3"))
    assert all(flaky.takes("forward", ("r", i), 2) for i in range(4))
    assert [flaky.takes("forward", ("r", 10 + i), 3) for i in range(3)] == [True, False, True]
    hang = Fault("hang-upload", None, 2)
    assert hang.chunk_bytes(1) is None and hang.published([b"a", b"b"], 1) == [b"a", b"b"]
    assert hang.published([b"a", b"b"], 2) == [b"a"] and hang.hung


def test_every_other_answers_every_second_new_command_from_round_1() -> None:
    fault = Attack(parse_attack("every-other"))
    assert all(fault.takes(kind, ("r", i), 0) for i, kind in enumerate(WORK))  # round 0
    verdicts = [fault.takes("forward", ("r", 100 + i), FAULT_ROUND) for i in range(6)]
    assert verdicts == [True, False, True, False, True, False]
    # a retransmission (same run and id) gets the same verdict, and counts for nothing
    assert [fault.takes("forward", ("r", 100 + i), 2) for i in (1, 0, 3, 2)] == [
        False, True, False, True]
    assert fault.takes("backward", ("r", 200), 2) is True  # the 7th new one
    assert fault.takes("bundle", ("r", 201), 2) and fault.takes("bundle_part", ("r", 202), 2)
    assert fault.takes("backward", ("r", 203), 2) is False  # setup did not count
    honest = Attack()
    assert all(honest.takes("forward", ("r", i), 5) for i in range(4))


def test_hang_upload_sends_half_of_a_chunked_reply_then_nothing() -> None:
    fault = Fault("hang-upload")
    parts = [b"0", b"1", b"2", b"3", b"4"]
    assert fault.chunk_bytes(0) is None and fault.published(parts, 0) == parts  # round 0
    assert fault.chunk_bytes(FAULT_ROUND) == HANG_CHUNK_BYTES
    assert fault.published([b"whole"], FAULT_ROUND) == [b"whole"] and not fault.hung
    assert fault.published(parts, FAULT_ROUND) == [b"0", b"1"] and fault.hung
    assert not any(fault.takes(kind, ("r", i), 2) for i, kind in enumerate(
        (*WORK, "bundle", "bundle_part")))  # hung: not even its setup
    assert fault.chunk_bytes(2) is None
    assert Fault().chunk_bytes(3) is None and Fault().published(parts, 3) == parts


def test_a_half_message_is_dropped_once_stale_and_counted() -> None:
    """What the coordinator's endpoint does with the hanging device's half reply: holds it,
    then drops it on the next message of anyone's once the reassembly timeout passed."""
    sender = MqttEndpoint(BrokerAddress("127.0.0.1", 1), "a3", EndpointOptions())
    reply = Message(MessageType.REPLY, run="r", sender="a3", seq=7, kind="forward",
                    meta={"re": 1}, tensors={"activations": np.ones(5000, np.float32)})
    parts = sender.prepare(reply, chunk_bytes=HANG_CHUNK_BYTES)
    assert len(parts) >= 4 and len(sender.prepare(reply)) == 1  # the endpoint's own size
    half = Fault("hang-upload").published(parts, FAULT_ROUND)
    coordinator = MqttEndpoint(BrokerAddress("127.0.0.1", 1), "coordinator",
                               EndpointOptions(reassembly_timeout_s=0.2))
    for part in half:
        coordinator._receive("jetsplit/f/up/a3", part)
    assert coordinator.inbox.empty() and coordinator.rejected["ReassemblyExpired"] == 0
    other = encode_message(Message(MessageType.REPLY, run="r", sender="a0", seq=1,
                                   kind="status", meta={"re": 2}))
    coordinator._receive("jetsplit/f/up/a0", other)  # before the timeout: still held
    assert coordinator.rejected["ReassemblyExpired"] == 0
    time.sleep(0.3)
    coordinator._receive("jetsplit/f/up/a0", encode_message(Message(
        MessageType.REPLY, run="r", sender="a0", seq=2, kind="status", meta={"re": 3})))
    assert coordinator.rejected["ReassemblyExpired"] == 1
    assert [i.message.sender for i in list(coordinator.inbox.queue)] == ["a0", "a0"]
    assert MqttSection(reassembly_timeout_s=5).endpoint_options().reassembly_timeout_s == 5


def test_clock_jump_steps_the_wall_clock_once_from_round_1(clock: list[Fault]) -> None:
    fault = Fault("clock-jump", 3600.0)
    clock.append(fault)
    assert fault.takes("forward", ("r", 1), 0) and abs(time.time() - _real()) < 5
    before_mono = time.monotonic()
    assert fault.takes("set_weights", ("r", 2), FAULT_ROUND)  # it still answers this one
    assert 3595 < time.time() - _real() < 3605
    assert 3595e9 < time.time_ns() - _real() * 1e9 < 3605e9
    assert time.monotonic() - before_mono < 5  # monotonic clocks do not jump
    assert fault.takes("forward", ("r", 3), 2) and 3595 < time.time() - _real() < 3605  # once
    fault.undo_clock()
    fault.undo_clock = None
    assert abs(time.time() - _real()) < 5


def test_after_the_jump_its_stamps_and_its_replay_guard_are_an_hour_off(
        clock: list[Fault]) -> None:
    """What a signed fleet does with it: the coordinator refuses the device's messages, and
    the device refuses the coordinator's, both as replays (the skew is 300 s)."""
    key = b"k" * 32
    command = encode_message(Message(MessageType.COMMAND, run="r", sender="coordinator",
                                     seq=1, kind="forward"), fleet_key=key)
    fault = Fault("clock-jump", 3600.0)
    clock.append(fault)
    fault.takes("forward", ("r", 1), FAULT_ROUND)
    reply = decode_message(encode_message(Message(MessageType.REPLY, run="r", sender="a3",
                                                  seq=2, kind="forward"), fleet_key=key),
                           fleet_key=key)
    assert 3595 < reply.ts - _real() < 3605
    with pytest.raises(ReplayedMessage, match=r"\+3600s off now"):  # at the device
        ReplayGuard().check("coordinator", 1, decode_message(command, fleet_key=key).ts)
    with pytest.raises(ReplayedMessage, match=r"-3600s off now"):  # at the coordinator
        ReplayGuard().check("a3", 2, reply.ts, now=_real())


def test_step_wall_clock_undoes_in_any_order_of_steps() -> None:
    undo_first = step_wall_clock(100.0)
    undo_second = step_wall_clock(-30.0)
    assert 65 < time.time() - _real() < 75
    undo_second()
    assert 95 < time.time() - _real() < 105
    undo_first()
    assert abs(time.time() - _real()) < 5


def _real() -> float:
    """The real wall clock, whatever Python's `time.time` says now."""
    return time.clock_gettime(time.CLOCK_REALTIME)

"""A command captured before an agent restarted cannot be replayed after it (fleet-key
mode): the agent keeps the newest seq it accepted per sender in its state folder
(jetsplit/transport/replay_state.py) and a restarted endpoint refuses anything at or below
it. Without that file the same replay is obeyed: the finding this pins."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from jetsplit.broker_url import BrokerAddress
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import COORDINATOR, Topics
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
from jetsplit.wire import Message, MessageType, encode_message

KEY = b"k" * 32


def _agent(address: BrokerAddress, state: Path | None) -> MqttEndpoint:
    options = EndpointOptions(fleet_key=KEY, replay_state=None if state is None else str(state))
    return MqttEndpoint(address, "a0", options, subscriptions=(Topics("r").down("a0"),),
                        sender="a0").start(wait_s=15)


def _received(endpoint: MqttEndpoint, wait_s: float) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            got.append(endpoint.inbox.get(timeout=0.2).message.seq)
        except queue.Empty:
            if got:
                break
    return got


@pytest.mark.parametrize("persisted", [True, False])
def test_a_captured_command_is_refused_after_the_agent_restarts(
        mosquitto: MosquittoProcess, tmp_path: Path, persisted: bool) -> None:
    address = BrokerAddress("127.0.0.1", mosquitto.port)
    topic = Topics("r").down("a0")
    state = tmp_path / "a0" / "replay.json" if persisted else None
    seq = time.time_ns() // 1000
    captured = encode_message(Message(MessageType.COMMAND, run="run1", sender=COORDINATOR,
                                      seq=seq, kind="status"), fleet_key=KEY)
    # someone without the key replays captured bytes: a plain client on the broker
    replayer = MqttEndpoint(address, "eve", EndpointOptions()).start(wait_s=15)
    try:
        agent = _agent(address, state)
        time.sleep(0.3)
        replayer.publish_raw(topic, captured)
        assert _received(agent, 10) == [seq]  # the genuine delivery
        agent.close()
        agent = _agent(address, state)  # the restart
        time.sleep(0.3)
        replayer.publish_raw(topic, captured)
        again = _received(agent, 3)
        if persisted:
            assert again == [] and agent.rejected["ReplayedMessage"] == 1
        else:
            assert again == [seq]  # without the file, the replay is obeyed
        agent.close()
    finally:
        replayer.close()

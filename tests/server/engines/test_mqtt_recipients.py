"""Only a round's participants receive the model: the coordinator publishes weights once on
the shared down/all topic only when every device that can read it is a recipient; otherwise
it sends per device. A device whose registration was refused is still connected and still
reads down/all, so it must not get the global weights (a real Mosquitto on loopback)."""

from __future__ import annotations

import queue
import time

import numpy as np

from jetsplit.identity import KeyRing, Signer
from jetsplit.protocol import Kind
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.engines.seam import Command
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import Topics
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint, presence_payload
from jetsplit.wire import Message, MessageType

FLEET = "recipients"
_DATASET = {"name": "digits", "size": 10, "num_classes": 10, "input_shape": [1, 8, 8],
            "label_histogram": [1] * 10}


def _device(broker: MosquittoProcess, agent: str) -> MqttEndpoint:
    """A device's session: it listens on down/all and its own down topic."""
    topics = Topics(FLEET)
    return MqttEndpoint(broker.address, f"dev-{agent}", EndpointOptions(), sender=agent,
                        subscriptions=(topics.down_all, topics.down(agent))).start(wait_s=30)


def _announce(device: MqttEndpoint, agent: str, *, valid: bool, state: str = "online") -> None:
    topics = Topics(FLEET)
    device.publish_raw(topics.presence(agent),
                       presence_payload("-", agent, state, fleet_key=None), retain=True)
    if state != "online":
        return
    registration = {"agent": agent, "role": "client", "version": "0.1.0", "zoo_version": 1,
                    "dataset": _DATASET if valid else {**_DATASET, "size": -1},
                    "profile": None}
    device.send(topics.up(agent), Message(MessageType.REGISTER, run="-", sender=agent,
                                          seq=device.next_seq(), kind="register",
                                          meta=registration))


def _heard(device: MqttEndpoint, wait_s: float = 2.0) -> list[tuple[str, str]]:
    """(topic, kind) of every command the device received within `wait_s`."""
    heard, end = [], time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0:
        try:
            inbound = device.inbox.get(timeout=left)
        except queue.Empty:
            break
        heard.append((inbound.topic, inbound.message.kind))
    return heard


def _wait(check, what: str, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_refused_device_gets_no_weights_and_a_clean_fleet_gets_one_publish(
        mosquitto: MosquittoProcess) -> None:
    topics = Topics(FLEET)
    engine = MqttEngine(mosquitto.address, FLEET, run_id="r1").start(wait_s=30)
    devices = {a: _device(mosquitto, a) for a in ("a0", "a1", "x9")}
    try:
        _announce(devices["x9"], "x9", valid=False)
        _wait(lambda: engine.rejected_agents >= 1, "x9's registration was not refused")
        for agent in ("a0", "a1"):
            _announce(devices[agent], agent, valid=True)
        _wait(lambda: engine.registry.online() == ["a0", "a1"], "a0, a1 did not register")
        for device in devices.values():
            _heard(device, 0.5)  # the coordinator's DISCOVER and anything before
        weights = Command(Kind.SET_WEIGHTS.value, {}, {"client/w": np.ones(4, np.float32)})

        out = engine.broadcast(weights, ["a0", "a1"], round=0, deadline_s=1.0)
        assert sorted(out.missed) == ["a0", "a1"]  # nobody answers here: the deadline
        heard = {a: _heard(d) for a, d in devices.items()}
        assert heard["x9"] == []
        for agent in ("a0", "a1"):
            assert heard[agent] == [(topics.down(agent), "set_weights")]

        _announce(devices["x9"], "x9", valid=False, state="offline")
        _wait(lambda: "x9" not in engine._present, "x9's offline presence did not arrive")
        engine.broadcast(weights, ["a0", "a1"], round=1, deadline_s=1.0)
        for agent in ("a0", "a1"):  # now one publish reaches exactly the recipients
            assert _heard(devices[agent]) == [(topics.down_all, "set_weights")]
    finally:
        for device in devices.values():
            device.close()
        engine.close()


def test_an_enrolled_device_that_is_not_a_recipient_keeps_the_shared_topic_closed() -> None:
    """In a provisioned fleet every enrolled device can read down/all (and a persistent
    session would get it on its next connect): all of them must be recipients."""
    from jetsplit.broker_url import BrokerAddress

    keys = KeyRing({a: Signer.generate(a).public_key() for a in ("a0", "a1", "a2")})
    engine = MqttEngine(BrokerAddress("127.0.0.1", 1), FLEET, run_id="r",
                        options=EndpointOptions(keyring=keys))
    for agent in ("a0", "a1"):
        engine.registry.register(agent, {"role": "client"})
    assert not engine._only_readers(["a0", "a1"])  # a2 is enrolled, not a recipient
    assert engine._only_readers(["a0", "a1", "a2"])
    engine._present.add("x9")  # connected, never accepted
    assert not engine._only_readers(["a0", "a1", "a2"])

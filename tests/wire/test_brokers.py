"""Both brokers carry a multi-MiB jetsplit envelope intact over loopback (real paho client)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from jetsplit.broker_url import parse_broker_url
from jetsplit.errors import ConfigError
from jetsplit.server.ops.brokers import EmbeddedBroker, MosquittoProcess
from jetsplit.wire import Message, MessageType, decode_message, encode_message


def _echo_through(host: str, port: int, payload: bytes) -> bytes:
    received: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-echo")
    subscribed = threading.Event()
    client.on_message = lambda _c, _u, msg: received.put(msg.payload)
    client.on_subscribe = lambda *_args: subscribed.set()
    client.connect(host, port)
    client.loop_start()
    try:
        client.subscribe("jetsplit/v1/test/#", qos=1)
        assert subscribed.wait(10), "broker never acknowledged the subscription"
        client.publish("jetsplit/v1/test/up/a", payload, qos=1).wait_for_publish(10)
        return received.get(timeout=60)
    finally:
        client.loop_stop()
        client.disconnect()


def _payload() -> bytes:
    x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)  # 4 MB
    return encode_message(Message(MessageType.REPLY, run="r", sender="a", seq=1,
                                  tensors={"x": x}))


def test_mosquitto_carries_a_4mb_envelope(mosquitto: MosquittoProcess) -> None:
    payload = _payload()
    got = _echo_through("127.0.0.1", mosquitto.port, payload)
    assert decode_message(got).tensors["x"].shape == (1_000_000,) and got == payload


def test_embedded_broker_carries_a_4mb_envelope() -> None:
    payload = _payload()
    with EmbeddedBroker() as broker:
        assert _echo_through(broker.host, broker.port, payload) == payload


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mqtt://localhost", ("localhost", 1883, False, None)),
        ("mqtts://u:p%40ss@broker.example:8884", ("broker.example", 8884, True, "u")),
    ],
)
def test_broker_urls(url: str, expected: tuple) -> None:
    addr = parse_broker_url(url)
    assert (addr.host, addr.port, addr.tls, addr.username) == expected


@pytest.mark.parametrize("url", ["http://x", "mqtt://", "mqtt://h:99999", "mqtt://h/path"])
def test_bad_broker_urls_are_one_line(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_broker_url(url)
    assert "\n" not in str(info.value)

"""An endpoint is ready when the broker has answered its subscriptions, not at CONNACK:
a message published between the two would be lost (a daemon's first command, a test's
first probe). `start(wait_s)` waits for `subscribed`; a refused subscription is one
warning line, and the endpoint is still ready (it will never hear that topic)."""

from __future__ import annotations

import logging
import threading

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from jetsplit.broker_url import BrokerAddress
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint


def test_start_returns_once_every_subscription_is_answered(mosquitto: MosquittoProcess
                                                           ) -> None:
    """The broker's SUBACKs are held back: the endpoint is connected, not subscribed,
    and `start` still waits; let through, both are answered and `start` returns."""
    endpoint = MqttEndpoint(mosquitto.address, "test-gated", EndpointOptions(),
                            subscriptions=("t/a/#", "t/b/#"))
    gate, answered = threading.Event(), threading.Event()
    handle = endpoint._handle_subscribe
    mids: list[int] = []

    def held(client, userdata, mid, codes, properties) -> None:  # noqa: ANN001
        mids.append(mid)
        answered.set()
        gate.wait(30)
        handle(client, userdata, mid, codes, properties)

    endpoint._handle_subscribe = held  # type: ignore[method-assign]
    starting = threading.Thread(target=endpoint.start, kwargs={"wait_s": 30}, daemon=True)
    starting.start()
    try:
        assert endpoint.connected.wait(10) and answered.wait(10)
        starting.join(0.5)
        assert starting.is_alive() and not endpoint.subscribed.is_set()
        gate.set()
        starting.join(30)
        assert not starting.is_alive() and endpoint.subscribed.is_set()
        assert len(set(mids)) == 2
    finally:
        gate.set()
        endpoint.close()


def test_a_refused_subscription_is_one_warning_and_the_endpoint_is_ready(
        caplog: pytest.LogCaptureFixture) -> None:
    endpoint = MqttEndpoint(BrokerAddress("127.0.0.1", 1), "test-refused", EndpointOptions(),
                            subscriptions=("t/a/#", "t/b/#"))
    endpoint._pending_subscriptions = {3, 4}
    granted = ReasonCode(PacketTypes.SUBACK, identifier=1)
    refused = ReasonCode(PacketTypes.SUBACK, identifier=0x87)  # not authorized
    with caplog.at_level(logging.WARNING, logger="jetsplit.transport"):
        endpoint._handle_subscribe(None, None, 3, [granted], None)
        assert not endpoint.subscribed.is_set() and caplog.records == []
        endpoint._handle_subscribe(None, None, 4, [refused], None)
    assert endpoint.subscribed.is_set()
    [record] = caplog.records
    assert "refused a subscription of test-refused (Not authorized)" in record.getMessage()


def test_subscriptions_never_answered_are_one_line(mosquitto: MosquittoProcess) -> None:
    from jetsplit.errors import ConfigError

    endpoint = MqttEndpoint(mosquitto.address, "test-unanswered", EndpointOptions(),
                            subscriptions=("t/a/#",))
    endpoint._handle_subscribe = lambda *args: None  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="did not answer the subscriptions within 10s"):
        endpoint.start(wait_s=10)  # connecting to loopback takes far less

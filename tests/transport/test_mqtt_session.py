"""`MqttEndpoint`'s session, driven through a fake paho client (no broker, no network, no
sleeping): the options' defaults, the client it builds (protocol, persistent session, TLS,
login, last will, backoff bounds, callbacks), the first connection's protocol choice
(MQTT 5, then 3.1.1 when the broker refuses or drops an MQTT 5 CONNECT), which CONNACK
codes end the attempts for good and with which one-line reason, the backoff between
unreachable attempts, `start`'s wait, `close`'s last message, and the paho callbacks'
bookkeeping (subscriptions pending, connects counted, disconnects). A wrong branch here
means a device that never connects, or that retries forever against a login it lacks."""

from __future__ import annotations

import dataclasses
import logging
import socket
import ssl
import sys
import threading
import typing
from types import SimpleNamespace
from typing import Any

import paho.mqtt.client as paho_client
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import BackendUnavailable, ConfigError
from jetsplit.identity import Signer
from jetsplit.transport import mqtt as mqtt_module
from jetsplit.transport.mqtt import (
    REASSEMBLY_TIMEOUT_S,
    EndpointOptions,
    Inbound,
    MqttEndpoint,
    TlsOptions,
    _disable_nagle,
    _paho,
    presence_payload,
)
from jetsplit.wire import Limits

pytestmark = pytest.mark.fast

ADDRESS = BrokerAddress("broker.lan", 1883)
TLS_ADDRESS = BrokerAddress("broker.lan", 8883, tls=True)


# ---------------------------------------------------------------- fakes


class FakeEvent:
    """A threading.Event that never blocks: `wait` records its timeout and answers at once
    (True from the `stop_after`-th wait on, as if the event had been set meanwhile)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.flag = False
        self.waits: list[float | None] = []
        self.stop_after = stop_after

    def set(self) -> None:
        self.flag = True

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if self.stop_after is not None and len(self.waits) >= self.stop_after:
            self.flag = True
        return self.flag


class FakeInfo:
    def __init__(self, world: World, error: BaseException | None) -> None:
        self.world, self.error = world, error

    def wait_for_publish(self, timeout: float | None = None) -> None:
        self.world.events.append(("wait_for_publish", timeout))
        if self.error is not None:
            raise self.error


class FakeClient:
    """paho's Client as far as the endpoint uses it: every call lands in `world.events`;
    `connect` takes the next outcome of `world.script` (an exception to raise, a CONNACK
    code that `loop_start` answers with, "closed": the broker drops the connection before
    any CONNACK, "silent": no answer at all)."""

    def __init__(self, world: World, *args: Any, **kwargs: Any) -> None:
        self.world = world
        self.protocol = kwargs.get("protocol")
        self.outcome: Any = None
        self.mid = 10
        world.clients.append(self)
        world.events.append(("client", args, kwargs))

    def username_pw_set(self, username: str, password: str | None) -> None:
        self.world.events.append(("username_pw_set", username, password))

    def tls_set(self, **kwargs: Any) -> None:
        self.world.events.append(("tls_set", kwargs))

    def tls_insecure_set(self, value: bool) -> None:
        self.world.events.append(("tls_insecure_set", value))

    def will_set(self, topic: str, payload: bytes, **kwargs: Any) -> None:
        self.world.events.append(("will_set", topic, payload, kwargs))

    def reconnect_delay_set(self, low: int, high: int) -> None:
        self.world.events.append(("reconnect_delay_set", low, high))

    def max_inflight_messages_set(self, count: int) -> None:
        self.world.events.append(("max_inflight_messages_set", count))

    def connect(self, host: str, port: int, **kwargs: Any) -> None:
        props = kwargs.pop("properties", None)
        expiry = None if props is None else (props.packetType, props.SessionExpiryInterval)
        self.world.events.append(("connect", host, port, kwargs, expiry))
        assert self.world.script, "connected more often than the test scripted"
        self.outcome = self.world.script.pop(0)
        if isinstance(self.outcome, BaseException):
            raise self.outcome

    def loop_start(self) -> None:
        self.world.events.append(("loop_start",))
        if isinstance(self.outcome, int):
            self.on_connect(self, None, paho_client.ConnectFlags(session_present=False),
                            ReasonCode(PacketTypes.CONNACK, identifier=self.outcome), None)
        elif self.outcome == "closed":
            self.on_disconnect(self, None, None,
                               ReasonCode(PacketTypes.DISCONNECT, identifier=0), None)

    def loop_stop(self) -> None:
        self.world.events.append(("loop_stop",))

    def disconnect(self) -> None:
        self.world.events.append(("disconnect",))
        if self.world.disconnect_error is not None:
            raise self.world.disconnect_error

    def subscribe(self, topic: str, qos: int = 0) -> tuple[int, int]:
        self.mid += 1
        self.world.events.append(("subscribe", topic, qos))
        return 0, self.mid

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False
                ) -> FakeInfo:
        self.world.events.append(("publish", topic, payload, qos, retain))
        return FakeInfo(self.world, self.world.publish_wait_error)


class World:
    def __init__(self, script: list[Any] | None = None) -> None:
        self.script = list(script or [])
        self.events: list[tuple[Any, ...]] = []
        self.clients: list[FakeClient] = []
        self.disconnect_error: BaseException | None = None
        self.publish_wait_error: BaseException | None = None

    def names(self) -> list[str]:
        return [e[0] for e in self.events]

    def module(self) -> tuple[Any, Any, Any]:
        mqtt = SimpleNamespace(
            Client=lambda *args, **kwargs: FakeClient(self, *args, **kwargs),
            CallbackAPIVersion=paho_client.CallbackAPIVersion,
            MQTTv5=paho_client.MQTTv5, MQTTv311=paho_client.MQTTv311)
        return mqtt, Properties, PacketTypes


@pytest.fixture()
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    made = World()
    monkeypatch.setattr(mqtt_module, "_paho", made.module)
    return made


def endpoint(options: EndpointOptions | None = None, *, address: BrokerAddress = ADDRESS,
             subscriptions: tuple[str, ...] = (), stop_after: int = 6,
             **kwargs: Any) -> MqttEndpoint:
    """An endpoint whose connack and closed events never block (closed answers True on
    its `stop_after`-th wait, so a wrong retry loop ends instead of hanging)."""
    made = MqttEndpoint(address, "dev1", options or EndpointOptions(),
                        subscriptions=subscriptions, **kwargs)
    made._connack = FakeEvent()  # type: ignore[assignment]
    made._closed = FakeEvent(stop_after=stop_after)  # type: ignore[assignment]
    return made


V5 = {"client_id": "dev1", "clean_session": None, "protocol": 5}
V311 = {"client_id": "dev1", "clean_session": False, "protocol": 4}


def connects(world: World) -> list[tuple[Any, ...]]:
    return [e for e in world.events if e[0] == "connect"]


def client_protocols(world: World) -> list[Any]:
    return [e[2]["protocol"] for e in world.events if e[0] == "client"]


# ---------------------------------------------------------------- options and helpers


def test_module_constants() -> None:
    assert REASSEMBLY_TIMEOUT_S == 120.0
    assert mqtt_module._UNSUPPORTED_PROTOCOL == 132
    assert mqtt_module._CLOSED_BEFORE_CONNACK == -1
    assert mqtt_module._HOSTNAME_MISMATCH == 62
    assert mqtt_module._AUTH_FAILURES == {134: "bad user name or password",
                                          135: "not authorized"}


def test_endpoint_option_defaults() -> None:
    options = EndpointOptions()
    assert options.protocol == "auto"
    assert options.keepalive_s == 30
    assert options.chunk_bytes == 1024 * 1024
    assert options.fleet_key is None
    assert options.tls is None
    assert options.reconnect_min_s == 0.5
    assert options.reconnect_max_s == 30.0
    assert options.session_expiry_s == 3600
    assert options.max_inflight == 64
    assert options.connect_timeout_s == 10.0
    assert options.limits == Limits()
    assert options.reassembly_timeout_s == 120.0
    assert (options.signer, options.keyring, options.replay_state) == (None, None, None)


def test_tls_options_are_positional_and_frozen() -> None:
    tls = TlsOptions("ca.crt", "c.crt", "c.key", True)
    assert (tls.ca_file, tls.cert_file, tls.key_file, tls.insecure) == (
        "ca.crt", "c.crt", "c.key", True)
    assert TlsOptions() == TlsOptions(None, None, None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tls.insecure = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EndpointOptions().keepalive_s = 5  # type: ignore[misc]


@pytest.mark.parametrize(("fleet_key", "keyring", "expected"), [
    (None, None, False), (b"", None, False), (b"k", None, True), (None, object(), True),
    (b"k", object(), True),
])
def test_authenticated(fleet_key: bytes | None, keyring: Any, expected: bool) -> None:
    assert EndpointOptions(fleet_key=fleet_key, keyring=keyring).authenticated is expected


def test_inbound_fields() -> None:
    inbound = Inbound("t", "m", 5)  # type: ignore[arg-type]
    assert (inbound.topic, inbound.message, inbound.wire_bytes) == ("t", "m", 5)


class FakeSocket:
    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.error = error

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.calls.append((level, option, value))
        if self.error is not None:
            raise self.error


def test_disable_nagle_sets_tcp_nodelay() -> None:
    sock = FakeSocket()
    _disable_nagle(None, None, sock)
    assert sock.calls == [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as real:
        _disable_nagle(None, None, real)
        assert real.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


@pytest.mark.parametrize("sock", [FakeSocket(OSError("closed")), object()])
def test_disable_nagle_tolerates_odd_sockets(sock: Any) -> None:
    _disable_nagle(None, None, sock)  # OSError, or AttributeError of a websocket wrapper


def test_paho_loads_the_real_modules() -> None:
    mqtt, properties, packet_types = _paho()
    assert mqtt is paho_client
    assert properties is Properties
    assert packet_types is PacketTypes


def test_paho_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "paho.mqtt.client", None)
    with pytest.raises(BackendUnavailable) as err:
        _paho()
    assert str(err.value) == ("paho-mqtt is not installed: pip install 'jetsplit[agent]' or "
                              "'jetsplit[server]'")


def cert_error(code: int, message: str | None, reason: str | None) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_code = code
    exc.verify_message = message
    exc.reason = reason
    return exc


def test_trust_hint_names_the_expected_ca_for_a_foreign_issuer() -> None:
    made = endpoint(EndpointOptions(tls=TlsOptions(ca_file="/kit/ca.crt")))
    assert made._trust_hint(cert_error(20, "x", None)) == (
        " (its certificate is not signed by /kit/ca.crt: a kit or CA from another fleet?)")
    assert made._trust_hint(cert_error(63, "x", None)).startswith(" (its certificate")
    assert made._trust_hint(cert_error(61, "x", None)).startswith(" (its certificate")
    assert made._trust_hint(cert_error(62, "x", None)) == ""  # the name, not the issuer


def test_trust_hint_without_a_ca_is_empty() -> None:
    assert endpoint()._trust_hint(cert_error(20, "x", None)) == ""
    assert endpoint(EndpointOptions(tls=TlsOptions()))._trust_hint(
        cert_error(20, "x", None)) == ""


# ---------------------------------------------------------------- construction


def test_a_new_endpoint() -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    assert made.client_id == "dev1"
    assert made.sender == "dev1"
    assert made.address is ADDRESS
    assert made.connects == 0
    assert made.protocol is None
    assert made.fatal is None
    assert not made.connected.is_set()
    assert not made.subscribed.is_set()
    assert made.rejected == {}
    assert made.refused == {}
    assert made.inbox.empty()
    assert made._reassembler.timeout_s == 120.0
    assert made._reassembler.limits == Limits()
    assert made._replay is None and made._presence is None and made._replay_state is None


def test_a_named_sender_and_options_reach_the_reassembler() -> None:
    def allowance(sender: str, kind: str) -> int | None:
        return None

    limits = Limits.of_mib(2)
    made = MqttEndpoint(ADDRESS, "dev1", EndpointOptions(limits=limits,
                                                         reassembly_timeout_s=7.5),
                        sender="a0", allowance=allowance)
    assert made.sender == "a0"
    assert made._reassembler.timeout_s == 7.5
    assert made._reassembler.limits is limits
    assert made._reassembler.allowance is allowance


def test_a_device_key_makes_a_client_id_only_it_can_know() -> None:
    signer = Signer.generate("a0")
    made = MqttEndpoint(ADDRESS, "a0", EndpointOptions(signer=signer))
    suffix = signer.client_id_suffix()
    assert len(suffix) == 16
    assert made.client_id == f"a0-{suffix}"
    assert made.sender == f"a0-{suffix}"
    assert MqttEndpoint(ADDRESS, "a0", EndpointOptions(signer=signer),
                        sender="a0").sender == "a0"


# ---------------------------------------------------------------- the client it builds


def test_make_client_for_mqtt5_and_311(world: World) -> None:
    made = endpoint()
    v5 = made._make_client("5")
    v311 = made._make_client("3.1.1")
    assert world.events[0] == ("client", (paho_client.CallbackAPIVersion.VERSION2,), V5)
    assert world.events[1:3] == [("reconnect_delay_set", 1, 30),
                                 ("max_inflight_messages_set", 64)]
    assert world.events[3] == ("client", (paho_client.CallbackAPIVersion.VERSION2,), V311)
    assert world.names() == ["client", "reconnect_delay_set", "max_inflight_messages_set"] * 2
    for client in (v5, v311):
        assert client.on_connect == made._handle_connect
        assert client.on_disconnect == made._handle_disconnect
        assert client.on_subscribe == made._handle_subscribe
        assert client.on_message == made._handle_message
        assert client.on_socket_open is _disable_nagle


def test_make_client_with_login_tls_and_will(world: World) -> None:
    options = EndpointOptions(tls=TlsOptions("ca.crt", "c.crt", "c.key", True),
                              reconnect_min_s=2.7, reconnect_max_s=45.9, max_inflight=9)
    address = BrokerAddress("broker.lan", 8883, tls=True, username="u", password="p")
    made = endpoint(options, address=address, will=("presence/a0", b"offline"))
    made._make_client("5")
    assert world.events[1:] == [
        ("username_pw_set", "u", "p"),
        ("tls_set", {"ca_certs": "ca.crt", "certfile": "c.crt", "keyfile": "c.key",
                     "cert_reqs": ssl.CERT_REQUIRED}),
        ("tls_insecure_set", True),
        ("will_set", "presence/a0", b"offline", {"qos": 1, "retain": True}),
        ("reconnect_delay_set", 2, 45),
        ("max_inflight_messages_set", 9),
    ]


def test_make_client_tls_without_options_verifies_against_the_system(world: World) -> None:
    made = endpoint(EndpointOptions(reconnect_min_s=0.2, reconnect_max_s=0.4),
                    address=BrokerAddress("b", 8883, tls=True, username="u"))
    made._make_client("3.1.1")
    assert world.events[1:] == [
        ("username_pw_set", "u", None),
        ("tls_set", {"ca_certs": None, "certfile": None, "keyfile": None,
                     "cert_reqs": ssl.CERT_REQUIRED}),
        ("tls_insecure_set", False),
        ("reconnect_delay_set", 1, 1),  # at least a second each way
        ("max_inflight_messages_set", 64),
    ]


# ---------------------------------------------------------------- the first connection


def test_auto_connects_with_mqtt5_and_a_persistent_session(world: World) -> None:
    world.script = [0]
    made = endpoint(subscriptions=("t/a",))
    made._connect_until_up()
    assert client_protocols(world) == [5]
    assert connects(world) == [("connect", "broker.lan", 1883,
                                {"keepalive": 30, "clean_start": False},
                                (PacketTypes.CONNECT, 3600))]
    assert made._client is world.clients[0]
    assert made._connack.waits == [3.0]  # a probe: min(connect timeout, 3 s)
    assert made.fatal is None
    assert made.protocol == "5"
    assert made.connects == 1
    assert "loop_stop" not in world.names()
    assert made._closed.waits == []


def test_options_reach_the_connect(world: World) -> None:
    world.script = [0]
    made = endpoint(EndpointOptions(keepalive_s=9, session_expiry_s=77, connect_timeout_s=2.0))
    made._connect_until_up()
    assert connects(world) == [("connect", "broker.lan", 1883,
                                {"keepalive": 9, "clean_start": False},
                                (PacketTypes.CONNECT, 77))]
    assert made._connack.waits == [2.0]


@pytest.mark.parametrize("first", [132, "closed", "silent"])
def test_auto_falls_back_to_311(world: World, first: Any) -> None:
    """An MQTT 5 CONNECT refused as an unsupported protocol, dropped before any CONNACK, or
    never answered: the same pass tries 3.1.1 at once (no backoff, no fatal)."""
    world.script = [first, 0]
    made = endpoint()
    made._connect_until_up()
    assert client_protocols(world) == [5, 4]
    assert world.names() == [
        "client", "reconnect_delay_set", "max_inflight_messages_set", "connect", "loop_start",
        "loop_stop", "disconnect",
        "client", "reconnect_delay_set", "max_inflight_messages_set", "connect", "loop_start"]
    assert connects(world)[1] == ("connect", "broker.lan", 1883, {"keepalive": 30}, None)
    assert made._connack.waits == [3.0, 10.0]
    assert made._client is world.clients[1]
    assert made.fatal is None
    assert made.protocol == "3.1.1"
    assert made._closed.waits == []


def test_auto_as_read_from_a_file_is_auto(world: World) -> None:
    """"auto" as a config file gives it (an equal string, not the interned literal)."""
    world.script = [132, 0]
    made = endpoint(EndpointOptions(protocol="".join(["au", "to"])))  # type: ignore[arg-type]
    made._connect_until_up()
    assert client_protocols(world) == [5, 4]


@pytest.mark.parametrize(("code", "reason"), [(134, "bad user name or password"),
                                              (135, "not authorized")])
def test_a_refused_login_is_fatal_at_once(world: World, code: int, reason: str) -> None:
    world.script = [code]
    made = endpoint()
    made._connect_until_up()
    assert made.fatal == f"broker mqtt://broker.lan:1883 refused the login: {reason}"
    assert client_protocols(world) == [5]
    assert world.names()[-2:] == ["loop_stop", "disconnect"]
    assert made._closed.waits == []


@pytest.mark.parametrize("code", [128, 131, 136])
def test_another_refusal_is_fatal_with_its_code(world: World, code: int) -> None:
    world.script = [code]
    made = endpoint()
    made._connect_until_up()
    assert made.fatal == f"broker mqtt://broker.lan:1883 refused the connection ({code})"
    assert client_protocols(world) == [5]
    assert made._closed.waits == []


def test_an_explicit_protocol_is_the_only_one_tried(world: World) -> None:
    world.script = [0]
    made = endpoint(EndpointOptions(protocol="3.1.1"))
    made._connect_until_up()
    assert client_protocols(world) == [4]
    assert made._connack.waits == [10.0]  # no probe: the full connect timeout


def test_mqtt5_only_waits_the_full_timeout_and_retries_after_backoff(world: World) -> None:
    """protocol "5" against a broker that does not speak it: not fatal, not 3.1.1; the
    next pass after the backoff tries MQTT 5 again."""
    world.script = [132, 132]
    made = endpoint(EndpointOptions(protocol="5"), stop_after=2)
    made._connect_until_up()
    assert client_protocols(world) == [5, 5]
    assert made._connack.waits == [10.0, 10.0]
    assert made._closed.waits == [0.5, 1.0]
    assert made.fatal is None


def test_unreachable_backs_off_doubling_up_to_the_maximum(world: World) -> None:
    world.script = [OSError("refused"), ssl.SSLError("handshake"), OSError("refused"),
                    OSError("refused"), 0]
    made = endpoint(EndpointOptions(reconnect_min_s=0.5, reconnect_max_s=1.5))
    made._connect_until_up()
    assert made._closed.waits == [0.5, 1.0, 1.5, 1.5]
    assert client_protocols(world) == [5, 5, 5, 5, 5]  # each pass starts over with MQTT 5
    assert made._client is world.clients[4]
    assert made.fatal is None


def test_closing_while_unreachable_stops_the_attempts(world: World) -> None:
    world.script = [OSError("refused")]
    made = endpoint(stop_after=1)
    made._connect_until_up()
    assert made._closed.waits == [0.5]
    assert len(world.clients) == 1


def test_a_closed_endpoint_never_connects(world: World) -> None:
    made = endpoint()
    made._closed.set()
    made._connect_until_up()
    assert world.events == []


@pytest.mark.parametrize(("message", "reason", "shown"), [
    ("unable to get local issuer certificate", "CERTIFICATE_VERIFY_FAILED",
     "unable to get local issuer certificate"),
    (None, "CERTIFICATE_VERIFY_FAILED", "CERTIFICATE_VERIFY_FAILED"),
])
def test_a_tls_verification_failure_is_fatal(world: World, message: str | None, reason: str,
                                             shown: str) -> None:
    world.script = [cert_error(20, message, reason)]
    made = endpoint(EndpointOptions(tls=TlsOptions(ca_file="/kit/ca.crt")),
                    address=TLS_ADDRESS)
    made._connect_until_up()
    assert made.fatal == (f"broker mqtts://broker.lan:8883 failed TLS verification: {shown}"
                          " (its certificate is not signed by /kit/ca.crt: a kit or CA from "
                          "another fleet?)")
    assert len(world.clients) == 1
    assert made._client is None
    assert made._closed.waits == []


# ---------------------------------------------------------------- start and close


def test_start_runs_the_connection_in_a_named_daemon_thread(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    ran = threading.Event()
    made._connect_until_up = ran.set  # type: ignore[method-assign]
    made.subscribed = FakeEvent()  # type: ignore[assignment]
    assert made.start() is made
    made._supervisor.join(5)
    assert ran.is_set()
    assert made._supervisor.daemon is True
    assert made._supervisor.name == "mqtt-dev1"
    assert made.subscribed.waits == []  # no wait asked for


def test_start_waits_for_the_subscriptions(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    made._connect_until_up = made.subscribed.set  # type: ignore[method-assign]
    assert made.start(wait_s=30) is made
    assert made.subscribed.is_set()


def test_start_raises_the_fatal_reason(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    made._connect_until_up = lambda: None  # type: ignore[method-assign]
    made.subscribed = FakeEvent()  # type: ignore[assignment]
    made._fatal = "broker mqtt://broker.lan:1883 refused the login: not authorized"
    with pytest.raises(ConfigError) as err:
        made.start(wait_s=30)
    assert str(err.value) == "broker mqtt://broker.lan:1883 refused the login: not authorized"
    assert made._closed.is_set()
    assert made.subscribed.waits == [0.05]


class FakeClock:
    def __init__(self, readings: list[float]) -> None:
        self.readings = readings

    def monotonic(self) -> float:
        return self.readings.pop(0)


@pytest.mark.parametrize(("connected", "message"), [
    (False, "broker mqtt://broker.lan:1883 unreachable after 2s"),
    (True, "broker mqtt://broker.lan:1883 did not answer the subscriptions within 2s"),
])
def test_start_gives_up_just_past_its_deadline(world: World, monkeypatch: pytest.MonkeyPatch,
                                              connected: bool, message: str) -> None:
    """Deadline 100 + 2.4: readings before and at the deadline wait once more each, the
    first one past it gives up."""
    monkeypatch.setattr(mqtt_module, "time", FakeClock([100.0, 101.0, 102.4, 102.41]))
    made = MqttEndpoint(ADDRESS, "dev1")
    made._connect_until_up = lambda: None  # type: ignore[method-assign]
    made.subscribed = FakeEvent()  # type: ignore[assignment]
    if connected:
        made.connected.set()
    with pytest.raises(ConfigError) as err:
        made.start(wait_s=2.4)
    assert str(err.value) == message
    assert made.subscribed.waits == [0.05, 0.05, 0.05]
    assert made._closed.is_set()


def test_close_without_a_client(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    made.close(final=("t", b"x"))
    assert made._closed.is_set()
    assert world.events == []


def attached(world: World, *, connected: bool = True) -> MqttEndpoint:
    made = MqttEndpoint(ADDRESS, "dev1")
    made._client = FakeClient(world)  # type: ignore[assignment]
    world.events.clear()
    if connected:
        made.connected.set()
    return made


def test_close_publishes_the_final_message_first(world: World) -> None:
    made = attached(world)
    made.close(final=("presence/a0", b"offline"))
    assert world.events == [("publish", "presence/a0", b"offline", 1, True),
                            ("wait_for_publish", 2.0), ("disconnect",), ("loop_stop",)]
    assert not made.connected.is_set()
    assert made._closed.is_set()


@pytest.mark.parametrize(("graceful", "final", "connected"), [
    (True, None, True), (False, ("t", b"x"), True), (True, ("t", b"x"), False)])
def test_close_sends_no_final_message_unless_graceful_connected_and_given(
        world: World, graceful: bool, final: tuple[str, bytes] | None, connected: bool) -> None:
    made = attached(world, connected=connected)
    made.close(graceful=graceful, final=final)
    assert world.events == [("disconnect",), ("loop_stop",)]


@pytest.mark.parametrize("error", [RuntimeError("not queued"), ValueError("closed")])
def test_close_goes_on_when_the_final_message_cannot_be_confirmed(world: World,
                                                                  error: Exception) -> None:
    world.publish_wait_error = error
    made = attached(world)
    made.close(final=("t", b"x"))
    assert world.names() == ["publish", "wait_for_publish", "disconnect", "loop_stop"]


def test_close_stops_the_loop_even_when_disconnect_fails(world: World) -> None:
    world.disconnect_error = OSError("gone")
    made = attached(world)
    with pytest.raises(OSError):
        made.close()
    assert world.names() == ["disconnect", "loop_stop"]
    assert not made.connected.is_set()


# ---------------------------------------------------------------- paho callbacks


def connack(code: int) -> ReasonCode:
    return ReasonCode(PacketTypes.CONNACK, identifier=code)


def flags(session_present: bool = False) -> Any:
    return paho_client.ConnectFlags(session_present=session_present)


def test_handle_connect_subscribes_and_counts(world: World,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="jetsplit.transport")
    counts: list[int] = []
    made = MqttEndpoint(ADDRESS, "dev1", subscriptions=("t/a", "t/b"), on_connect=counts.append)
    client = FakeClient(world, protocol=5)
    made.subscribed.set()
    made._handle_connect(client, None, flags(True), connack(0), None)
    assert made._connack_code == 0
    assert made._connack.is_set()
    assert [e for e in world.events if e[0] == "subscribe"] == [("subscribe", "t/a", 1),
                                                                ("subscribe", "t/b", 1)]
    assert made._pending_subscriptions == {11, 12}
    assert not made.subscribed.is_set()  # until the broker answers both
    assert made.connected.is_set()
    assert made.connects == 1
    assert made.protocol == "5"
    assert counts == [1]
    assert caplog.messages[-1] == ("connected to mqtt://broker.lan:1883 (MQTT 5, session "
                                   "present: True)")
    client311 = FakeClient(world, protocol=4)
    made._handle_connect(client311, None, flags(False), connack(0), None)
    assert made.connects == 2
    assert counts == [1, 2]
    assert made.protocol == "3.1.1"
    assert caplog.messages[-1] == ("connected to mqtt://broker.lan:1883 (MQTT 3.1.1, session "
                                   "present: False)")


def test_handle_connect_without_subscriptions_is_subscribed_at_once(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(0), None)
    assert made.subscribed.is_set()
    assert made._pending_subscriptions == set()
    assert made.connects == 1


def test_a_failed_connack_is_recorded_and_nothing_else(world: World) -> None:
    counts: list[int] = []
    made = MqttEndpoint(ADDRESS, "dev1", subscriptions=("t/a",), on_connect=counts.append)
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(135), None)
    assert made._connack_code == 135
    assert made._connack.is_set()
    assert "subscribe" not in world.names()
    assert made.connects == 0
    assert not made.connected.is_set()
    assert counts == []


def suback(*codes: int) -> list[ReasonCode]:
    return [ReasonCode(PacketTypes.SUBACK, identifier=c) for c in codes]


def test_handle_subscribe_sets_subscribed_once_every_one_is_answered(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    made = MqttEndpoint(ADDRESS, "dev1", subscriptions=("t/a", "t/b"))
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(0), None)
    made._handle_subscribe(None, None, 11, suback(1), None)
    assert not made.subscribed.is_set()
    made._handle_subscribe(None, None, 99, suback(1), None)  # not ours: nothing changes
    assert not made.subscribed.is_set()
    made._handle_subscribe(None, None, 12, suback(1), None)
    assert made.subscribed.is_set()
    assert caplog.messages == []


def test_a_refused_subscription_is_one_warning(world: World,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    made = MqttEndpoint(ADDRESS, "dev1", subscriptions=("t/a",))
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(0), None)
    made._handle_subscribe(None, None, 11, suback(135, 1, 128), None)
    assert made.subscribed.is_set()
    assert caplog.messages == ["broker mqtt://broker.lan:1883 refused a subscription of dev1 "
                               "(Not authorized, Unspecified error)"]


def disconnect(made: MqttEndpoint) -> None:
    made._handle_disconnect(None, None, None, ReasonCode(PacketTypes.DISCONNECT, identifier=0),
                            None)


def test_a_lost_connection_is_one_warning(world: World,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    made = MqttEndpoint(ADDRESS, "dev1")
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(0), None)
    disconnect(made)
    assert not made.connected.is_set()
    assert not made.subscribed.is_set()
    assert made._connack_code == 0  # answered before: kept
    assert caplog.messages == [
        "lost broker mqtt://broker.lan:1883 (Normal disconnection); reconnecting"]
    disconnect(made)  # not connected any more: no second warning
    assert len(caplog.messages) == 1


def test_a_disconnect_while_closing_is_quiet(world: World,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="jetsplit.transport")
    made = MqttEndpoint(ADDRESS, "dev1")
    made._handle_connect(FakeClient(world, protocol=5), None, flags(), connack(0), None)
    made._closed.set()
    disconnect(made)
    assert not made.connected.is_set()
    assert caplog.messages == []


def test_a_disconnect_before_any_connack_answers_the_wait(world: World) -> None:
    made = MqttEndpoint(ADDRESS, "dev1")
    disconnect(made)
    assert made._connack.is_set()
    assert made._connack_code == -1


# ---------------------------------------------------------------- annotations


def test_annotations_resolve() -> None:
    """Every annotation is a real type on the Python the tests run."""
    namespace = vars(mqtt_module)
    for function in (MqttEndpoint.__init__, MqttEndpoint.start, MqttEndpoint.close,
                     MqttEndpoint.fatal.fget, MqttEndpoint._trust_hint, MqttEndpoint._decode,
                     MqttEndpoint._receive, MqttEndpoint._receive_one, MqttEndpoint._refuse,
                     MqttEndpoint.publish_raw, MqttEndpoint.next_seq, MqttEndpoint.send,
                     MqttEndpoint.prepare, MqttEndpoint.publish_parts, presence_payload,
                     _disable_nagle, MqttEndpoint._expire_partials):
        assert "return" in typing.get_type_hints(function, namespace)
    hints = typing.get_type_hints(MqttEndpoint.__init__, namespace)
    assert hints["will"] == (tuple[str, bytes] | None)
    assert hints["sender"] == (str | None)
    assert typing.get_type_hints(MqttEndpoint.fatal.fget, namespace)["return"] == (
        str | None)
    assert typing.get_type_hints(MqttEndpoint.prepare, namespace)["chunk_bytes"] == (
        int | None)
    for cls in (TlsOptions, EndpointOptions, Inbound):
        assert typing.get_type_hints(cls, namespace)

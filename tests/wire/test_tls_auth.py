"""jetsplit's MQTT endpoint against a real Mosquitto with TLS and with username/password.

Each broker is a private Mosquitto on a free loopback port (server.brokers.MosquittoProcess)
with a throwaway CA made by the openssl CLI and a password file made by mosquitto_passwd.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from jetsplit.broker_url import BrokerAddress, parse_broker_url
from jetsplit.errors import ConfigError
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint, TlsOptions
from jetsplit.wire import DEFAULT_CHUNK_BYTES, Message, MessageType, chunk_count, encode_message

# torch-free device side: `.ci/run` also runs this on Python 3.9
pytestmark = pytest.mark.device_pure

USERS = {"agent-7": "p@ss:w/rd 7", "coordinator": "other-secret"}
_ids = itertools.count()


@pytest.fixture(scope="module")
def tls_broker() -> Iterator[MosquittoProcess]:
    with MosquittoProcess(tls=True) as broker:
        yield broker


@pytest.fixture(scope="module")
def auth_broker() -> Iterator[MosquittoProcess]:
    with MosquittoProcess(users=USERS) as broker:
        yield broker


@pytest.fixture(scope="module")
def tls_auth_broker() -> Iterator[MosquittoProcess]:
    with MosquittoProcess(tls=True, users=USERS) as broker:
        yield broker


def _endpoint(address: BrokerAddress, ca: Path | str | None = None,
              topics: tuple[str, ...] = (), **options: object) -> MqttEndpoint:
    tls = TlsOptions(ca_file=str(ca) if ca else None)
    return MqttEndpoint(address, f"test-{next(_ids)}", EndpointOptions(tls=tls, **options),
                        subscriptions=topics)


def _exchange(address: BrokerAddress, ca: Path | None, tensors: dict[str, np.ndarray]) -> None:
    """Two endpoints on `address`: one sends `tensors`, the other must get them bit-exact."""
    receiver = _endpoint(address, ca, ("t/x",)).start(wait_s=10)
    try:
        sender = _endpoint(address, ca).start(wait_s=10)
        try:
            assert receiver.protocol == sender.protocol == "5"  # Mosquitto 2 speaks MQTT 5
            msg = Message(MessageType.COMMAND, run="r", sender="a", seq=sender.next_seq(),
                          kind="k", tensors=tensors)
            sent = sender.send("t/x", msg)
            inbound = receiver.inbox.get(timeout=60)
        finally:
            sender.close()
    finally:
        receiver.close()
    assert inbound.topic == "t/x" and inbound.message.kind == "k"
    assert inbound.wire_bytes == sent
    assert set(inbound.message.tensors) == set(tensors)
    for name, expected in tensors.items():
        got = inbound.message.tensors[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes(), f"tensor {name} changed in transit"


def _refused(endpoint: MqttEndpoint, wait_s: float) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        endpoint.start(wait_s=wait_s)
    message = str(info.value)
    assert "\n" not in message
    return message, time.monotonic() - start


# ---------------------------------------------------------------- (a) TLS


def test_tls_broker_config_and_address(tls_broker: MosquittoProcess) -> None:
    assert tls_broker.ca_file is not None and tls_broker.ca_file.is_file()
    assert tls_broker.address == BrokerAddress("127.0.0.1", tls_broker.port, tls=True)
    assert tls_broker.address.url().startswith("mqtts://")
    assert "cafile" in tls_broker.config.read_text()


def test_tls_carries_a_chunked_tensor_bit_exact(tls_broker: MosquittoProcess) -> None:
    rng = np.random.default_rng(7)
    big = rng.standard_normal(600_000).astype(np.float32)  # 2.4 MB: three 1 MiB chunks
    big[:3] = [np.nan, np.inf, -0.0]
    tensors = {"x": big, "small": np.arange(10, dtype=np.float32)}
    probe = encode_message(Message(MessageType.COMMAND, run="r", sender="a", seq=1, kind="k",
                                   tensors=tensors))
    assert chunk_count(len(probe), DEFAULT_CHUNK_BYTES) >= 3  # chunking runs over TLS
    _exchange(tls_broker.address, tls_broker.ca_file, tensors)


def test_tls_certificate_names_localhost(tls_broker: MosquittoProcess) -> None:
    address = BrokerAddress("localhost", tls_broker.port, tls=True)  # SAN DNS:localhost
    _exchange(address, tls_broker.ca_file, {"x": np.arange(10, dtype=np.float32)})


# ---------------------------------------------------------------- (b) TLS, untrusted server


@pytest.mark.parametrize("trust", ["unrelated-ca", "system-store"])
def test_tls_with_the_wrong_ca_does_not_connect(tls_broker: MosquittoProcess, trust: str) -> None:
    if trust == "unrelated-ca":
        other = MosquittoProcess(tls=True)  # never started: only its throwaway CA is used
        ca = other.ca_file
    else:
        other, ca = None, None  # paho falls back to the system CA store
    try:
        message, elapsed = _refused(_endpoint(tls_broker.address, ca), wait_s=2)
    finally:
        if other is not None:
            other.__exit__()
    assert tls_broker.address.url() in message
    assert elapsed < 30  # gives up at its 2 s wait, not never (a bound that holds under load)


def test_tls_verification_failure_is_named(tls_broker: MosquittoProcess) -> None:
    other = MosquittoProcess(tls=True)
    try:
        message, elapsed = _refused(_endpoint(tls_broker.address, other.ca_file), wait_s=1)
    finally:
        other.__exit__()
    assert "certificate" in message.lower() or "tls" in message.lower(), message


def test_plain_mqtt_to_a_tls_listener_does_not_connect(tls_broker: MosquittoProcess) -> None:
    plain = BrokerAddress("127.0.0.1", tls_broker.port)  # mqtt:// where mqtts:// is needed
    _, elapsed = _refused(_endpoint(plain, protocol="3.1.1", connect_timeout_s=1), wait_s=2)
    assert elapsed < 30  # gives up at its 2 s wait, not never (a bound that holds under load)


# ---------------------------------------------------------------- (c) username / password


def test_auth_broker_address_has_the_first_login(auth_broker: MosquittoProcess) -> None:
    assert auth_broker.address == BrokerAddress("127.0.0.1", auth_broker.port,
                                                username="agent-7", password=USERS["agent-7"])
    assert "allow_anonymous false" in auth_broker.config.read_text()


@pytest.mark.parametrize("user", list(USERS))
def test_right_credentials_connect_and_exchange(auth_broker: MosquittoProcess, user: str) -> None:
    address = BrokerAddress("127.0.0.1", auth_broker.port, username=user, password=USERS[user])
    _exchange(address, None, {"x": np.arange(10, dtype=np.float32)})


@pytest.mark.parametrize("protocol", ["auto", "5", "3.1.1"])
@pytest.mark.parametrize(("username", "password"),
                         [("agent-7", "wrong"), ("nobody", "whatever"), (None, None)])
def test_wrong_credentials_are_refused(auth_broker: MosquittoProcess, protocol: str,
                                       username: str | None, password: str | None) -> None:
    address = BrokerAddress("127.0.0.1", auth_broker.port, username=username, password=password)
    message, elapsed = _refused(_endpoint(address, protocol=protocol), wait_s=120)
    _assert_login_refused(message)
    assert "wrong" not in message and "whatever" not in message  # no password in the error
    assert elapsed < 60  # a CONNACK refusal is final at once, not a 120 s "unreachable"


def _assert_login_refused(message: str) -> None:
    # Mosquitto 2.0 answers a bad password with "not authorized" (CONNACK 5 / reason 135),
    # not "bad user name or password" (4 / 134); the endpoint reports either as refused.
    assert "refused the login" in message, message
    assert "not authorized" in message or "bad user name or password" in message, message


# ---------------------------------------------------------------- (d) credentials from the URL


def test_tls_and_login_from_a_broker_url(tls_auth_broker: MosquittoProcess) -> None:
    user, password = "agent-7", USERS["agent-7"]
    url = f"mqtts://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:" \
          f"{tls_auth_broker.port}"
    address = parse_broker_url(url)
    assert (address.tls, address.username, address.password) == (True, user, password)
    assert address == tls_auth_broker.address
    _exchange(address, tls_auth_broker.ca_file, {"x": np.arange(10, dtype=np.float32)})

    wrong = parse_broker_url(f"mqtts://{user}:nope@127.0.0.1:{tls_auth_broker.port}")
    message, _ = _refused(_endpoint(wrong, tls_auth_broker.ca_file), wait_s=5)
    _assert_login_refused(message)

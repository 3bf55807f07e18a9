"""One MQTT session that speaks jetsplit envelopes: used by agents and the coordinator alike.

What it adds to paho-mqtt 2.x:

* protocol choice: MQTT 5 where the broker has it, else 3.1.1 (``protocol="auto"``);
* a persistent session (MQTT 5 clean_start=False + session expiry, 3.1.1 clean_session=False),
  QoS 1 everywhere, resubscription on every connect, reconnect with exponential backoff;
* TLS and username/password from the broker URL and options;
* outgoing messages encoded, signed and chunked; incoming chunks reassembled (bounded), every
  message verified and replay-checked, and every rejection counted by its error class while
  the process keeps running.

Decoded messages land in ``inbox`` (a queue) for the owner's thread; nothing heavy runs in
paho's network thread except decoding.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import BackendUnavailable, ConfigError
from jetsplit.transport.replay_state import ReplayState
from jetsplit.wire import (
    DEFAULT_CHUNK_BYTES,
    Allowance,
    Limits,
    Message,
    MessageType,
    PresenceGuard,
    Reassembler,
    ReplayGuard,
    SequenceCounter,
    WireError,
    chunk_count,
    chunk_message,
    decode_message,
    encode_message,
)
from jetsplit.wire.errors import SenderMismatch

log = logging.getLogger("jetsplit.transport")

Protocol = Literal["auto", "5", "3.1.1"]
_UNSUPPORTED_PROTOCOL = 132  # CONNACK reason code (3.1.1's return code 1 maps to it in paho)
_CLOSED_BEFORE_CONNACK = -1  # some 3.1.1 brokers (amqtt) drop an MQTT 5 CONNECT silently
_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
# How long an unfinished chunked message waits for its other chunks: long enough for a
# large upload on a slow device link, short enough that a sender that hung mid-message
# does not hold its buffer for the rest of a run.
REASSEMBLY_TIMEOUT_S = 120.0
_AUTH_FAILURES = {134: "bad user name or password", 135: "not authorized"}


@dataclass(frozen=True)
class TlsOptions:
    """Broker TLS: a CA bundle to trust, optionally a client certificate (mutual TLS)."""

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    insecure: bool = False  # skip hostname verification (self-signed lab brokers only)


@dataclass(frozen=True)
class EndpointOptions:
    """Session behaviour; the defaults suit agents on Wi-Fi and a coordinator on a LAN."""

    protocol: Protocol = "auto"
    keepalive_s: int = 30
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fleet_key: Optional[bytes] = None
    tls: Optional[TlsOptions] = None
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    session_expiry_s: int = 3600
    max_inflight: int = 64
    connect_timeout_s: float = 10.0
    limits: Limits = field(default_factory=Limits)
    reassembly_timeout_s: float = REASSEMBLY_TIMEOUT_S
    signer: Any = None  # jetsplit.identity.Signer: sign with this device's own key
    keyring: Any = None  # jetsplit.identity.KeyRing: require and verify senders' signatures
    # Where an agent keeps its replay floors across restarts (transport/replay_state.py);
    # None: in memory only (the coordinator, tools).
    replay_state: Optional[str] = None

    @property
    def authenticated(self) -> bool:
        """Messages are signed (fleet key or device keys), so replay windows apply."""
        return bool(self.fleet_key) or self.keyring is not None


@dataclass
class Inbound:
    """One verified message and the bytes it took on the wire (all its chunks)."""

    topic: str
    message: Message
    wire_bytes: int


def _disable_nagle(client: Any, userdata: Any, sock: Any) -> None:
    """QoS 1 is publish/acknowledge ping-pong: with Nagle on, a small publish behind an
    unacknowledged one waits for the peer's delayed ACK (~40 ms on Linux). Measured: a small
    request/reply through Mosquitto took 88 ms with Nagle, 0.4 ms without (both sides)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: websocket wrappers
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _paho():  # noqa: ANN202 - lazy import keeps the wire layer importable without paho
    try:
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
    except ImportError:
        raise BackendUnavailable(
            "paho-mqtt is not installed: pip install 'jetsplit[agent]' or 'jetsplit[server]'"
        ) from None
    return mqtt, Properties, PacketTypes


class MqttEndpoint:
    """A reconnecting MQTT session with a fixed client id, subscriptions and last will."""

    def __init__(
        self,
        address: BrokerAddress,
        client_id: str,
        options: EndpointOptions = EndpointOptions(),
        *,
        subscriptions: tuple[str, ...] = (),
        will: tuple[str, bytes] | None = None,
        on_connect: Callable[[int], None] | None = None,
        sender: str | None = None,
        topic_owner: Callable[[str], str | None] | None = None,
        route: Callable[[Inbound], bool] | None = None,
        allowance: Allowance | None = None,
    ) -> None:
        """`topic_owner(topic)` names the only sender a topic may carry (the coordinator:
        up/X and presence/X belong to X); a mismatch is rejected before the replay window
        sees the message, so a forged sender cannot poison another sender's window.
        `route(inbound)`, on the MQTT thread, may take a verified message instead of the
        inbox (True), e.g. a peer's data a blocked command waits for; a WireError it raises
        is counted like any rejection. `allowance(sender, kind)` accounts for messages over
        the limits (the weights this side asked for or installed blocks declare); the last
        refusal per sender is kept in `refused` (monotonic time, reason) for the owner to
        say why a reply never came."""
        if options.signer is not None:  # per-device identity: an id no other device can know
            client_id = f"{client_id}-{options.signer.client_id_suffix()}"
        self.address, self.client_id, self.options = address, client_id, options
        self.subscriptions = subscriptions
        self.will = will
        self.sender = sender or client_id
        self._on_connect_hook = on_connect
        self._topic_owner = topic_owner
        self._route = route
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.rejected: Counter[str] = Counter()
        self.refused: dict[str, tuple[float, str]] = {}
        self._allowance = allowance
        self.connected = threading.Event()
        # set once the broker has answered every subscription of the current connection:
        # from then on a message published to them reaches this endpoint
        self.subscribed = threading.Event()
        self._pending_subscriptions: set[int] = set()
        self.connects = 0  # successful CONNACKs so far; a rise means "we reconnected"
        self.protocol: str | None = None
        self._seq = SequenceCounter()
        self._reassembler = Reassembler(options.limits, timeout_s=options.reassembly_timeout_s,
                                        allowance=allowance)
        self._chunk_bytes: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._replay_state = (ReplayState(Path(options.replay_state))
                              if options.authenticated and options.replay_state else None)
        self._replay = (ReplayGuard(floors=self._replay_state.load() if self._replay_state
                                    else None) if options.authenticated else None)
        self._presence = PresenceGuard() if options.authenticated else None
        self._client = None
        self._closed = threading.Event()
        self._fatal: str | None = None
        self._connack = threading.Event()
        self._connack_code = 0
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def fatal(self) -> str | None:
        """Why the endpoint gave up connecting for good (TLS trust, login), else None."""
        return self._fatal

    def start(self, wait_s: float | None = None) -> MqttEndpoint:
        """Connect in the background (retrying with backoff); with `wait_s`, block until the
        first connection's subscriptions are in (`subscribed`) and raise a one-line
        ConfigError if the broker is not reachable."""
        _paho()
        self._supervisor = threading.Thread(target=self._connect_until_up, daemon=True,
                                            name=f"mqtt-{self.client_id}")
        self._supervisor.start()
        if wait_s is not None:
            deadline = time.monotonic() + wait_s
            while not self.subscribed.wait(0.05):
                if self._fatal:
                    self.close(graceful=False)
                    raise ConfigError(self._fatal)
                if time.monotonic() > deadline:
                    connected = self.connected.is_set()
                    self.close(graceful=False)
                    raise ConfigError(
                        f"broker {self.address.url()} did not answer the subscriptions "
                        f"within {wait_s:.0f}s" if connected else
                        f"broker {self.address.url()} unreachable after {wait_s:.0f}s")
        return self

    def close(self, *, graceful: bool = True, final: tuple[str, bytes] | None = None) -> None:
        """Disconnect; `final` is a last retained message (e.g. presence offline) sent first."""
        self._closed.set()
        client = self._client
        if client is None:
            return
        if graceful and final is not None and self.connected.is_set():
            info = client.publish(final[0], final[1], qos=1, retain=True)
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(timeout=2.0)
        try:
            client.disconnect()
        finally:
            client.loop_stop()
            self.connected.clear()

    def _make_client(self, protocol: str):  # noqa: ANN202
        mqtt, _, _ = _paho()
        v5 = protocol == "5"
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=None if v5 else False,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
        )
        if self.address.username:
            client.username_pw_set(self.address.username, self.address.password)
        if self.address.tls:
            tls = self.options.tls or TlsOptions()
            client.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file, keyfile=tls.key_file,
                           cert_reqs=ssl.CERT_REQUIRED)
            client.tls_insecure_set(tls.insecure)
        if self.will:
            client.will_set(self.will[0], self.will[1], qos=1, retain=True)
        client.reconnect_delay_set(max(1, int(self.options.reconnect_min_s)),
                                   max(1, int(self.options.reconnect_max_s)))
        client.max_inflight_messages_set(self.options.max_inflight)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_subscribe = self._handle_subscribe
        client.on_message = self._handle_message
        client.on_socket_open = _disable_nagle  # every new socket, reconnects and TLS included
        return client

    def _trust_hint(self, exc: ssl.SSLCertVerificationError) -> str:
        """Where the name is right but the issuer is not ours: say which CA was expected."""
        ca = (self.options.tls or TlsOptions()).ca_file
        if ca is None or exc.verify_code == _HOSTNAME_MISMATCH:
            return ""
        return f" (its certificate is not signed by {ca}: a kit or CA from another fleet?)"

    def _connect_until_up(self) -> None:
        """First connection: try MQTT 5 then 3.1.1 (auto), back off while unreachable.
        Later reconnects are paho's own (same client, same session)."""
        _, Properties, PacketTypes = _paho()
        order = ["5", "3.1.1"] if self.options.protocol == "auto" else [self.options.protocol]
        delay = self.options.reconnect_min_s
        while not self._closed.is_set():
            for protocol in order:
                client = self._make_client(protocol)
                self._connack.clear()
                try:
                    if protocol == "5":
                        props = Properties(PacketTypes.CONNECT)
                        props.SessionExpiryInterval = self.options.session_expiry_s
                        client.connect(self.address.host, self.address.port,
                                       keepalive=self.options.keepalive_s, clean_start=False,
                                       properties=props)
                    else:
                        client.connect(self.address.host, self.address.port,
                                       keepalive=self.options.keepalive_s)
                except ssl.SSLCertVerificationError as exc:  # wrong CA or name: retrying won't help
                    self._fatal = (f"broker {self.address.url()} failed TLS verification: "
                                   f"{exc.verify_message or exc.reason}{self._trust_hint(exc)}")
                    return
                except (OSError, ssl.SSLError) as exc:
                    log.info("broker %s not reachable (%s); retrying in %.1fs",
                             self.address.url(), exc, delay)
                    break
                self._client = client
                client.loop_start()
                # A 3.1.1-only broker may hang on an MQTT 5 CONNECT: probe briefly first.
                probing = protocol == "5" and len(order) > 1
                timeout = self.options.connect_timeout_s
                answered = self._connack.wait(min(timeout, 3.0) if probing else timeout)
                code = self._connack_code if answered else _CLOSED_BEFORE_CONNACK
                if code == 0:
                    return
                client.loop_stop()
                client.disconnect()
                if code in _AUTH_FAILURES:
                    self._fatal = (f"broker {self.address.url()} refused the login: "
                                   f"{_AUTH_FAILURES[code]}")
                    return
                if code == _CLOSED_BEFORE_CONNACK:
                    log.info("broker %s did not accept MQTT %s", self.address.url(), protocol)
                    continue
                if code != _UNSUPPORTED_PROTOCOL:
                    self._fatal = f"broker {self.address.url()} refused the connection ({code})"
                    return
                log.info("broker %s does not speak MQTT %s", self.address.url(), protocol)
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, self.options.reconnect_max_s)

    # ------------------------------------------------------------------ paho callbacks

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._connack_code = int(reason_code.value)
        self._connack.set()
        if reason_code.is_failure:
            return
        self.subscribed.clear()
        with self._lock:
            self._pending_subscriptions = {client.subscribe(topic, qos=1)[1]
                                           for topic in self.subscriptions}
            if not self._pending_subscriptions:
                self.subscribed.set()
            self.connects += 1
            count = self.connects
        self.protocol = "5" if client.protocol == 5 else "3.1.1"
        self.connected.set()
        log.info("connected to %s (MQTT %s, session present: %s)", self.address.url(),
                 "5" if client.protocol == 5 else "3.1.1", bool(flags.session_present))
        if self._on_connect_hook is not None:
            self._on_connect_hook(count)

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        refused = [str(code) for code in reason_codes if code.is_failure]
        if refused:  # e.g. the broker's ACL: this endpoint will never hear that topic
            log.warning("broker %s refused a subscription of %s (%s)", self.address.url(),
                        self.client_id, ", ".join(refused))
        with self._lock:
            self._pending_subscriptions.discard(mid)
            if not self._pending_subscriptions:
                self.subscribed.set()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        was_connected = self.connected.is_set()
        self.connected.clear()
        self.subscribed.clear()
        if not self._connack.is_set():  # closed before any CONNACK: e.g. a 3.1.1-only broker
            self._connack_code = _CLOSED_BEFORE_CONNACK
            self._connack.set()
        if was_connected and not self._closed.is_set():
            log.warning("lost broker %s (%s); reconnecting", self.address.url(), reason_code)

    def _handle_message(self, client, userdata, msg) -> None:  # noqa: ANN001
        try:
            self._receive(msg.topic, msg.payload)
        except WireError as exc:
            self.rejected[type(exc).__name__] += 1
            log.warning("rejected message on %s: %s: %s", msg.topic, type(exc).__name__, exc)
        except Exception as exc:  # noqa: BLE001 - an unexpected bug must not kill paho's thread
            self.rejected[type(exc).__name__] += 1
            log.exception("failed to handle message on %s", msg.topic)

    # ------------------------------------------------------------------ receive / send

    def _decode(self, payload: bytes, topic: str) -> Message:
        message = decode_message(payload, fleet_key=self.options.fleet_key,
                                 limits=self.options.limits, keyring=self.options.keyring,
                                 allowance=self._allowance)
        owner = self._topic_owner(topic) if self._topic_owner is not None else None
        if owner is not None and message.sender != owner:
            raise SenderMismatch(f"sender {message.sender!r} does not own {topic}")
        # Retained presence is redelivered by design: fresh and monotonic, not once-only.
        if message.type == MessageType.PRESENCE:
            if self._presence is not None:
                self._presence.check(message.sender, message.seq, message.ts,
                                     str(message.meta.get("state", "")))
        elif self._replay is not None:
            self._replay.check(message.sender, message.seq, message.ts)
            if self._replay_state is not None:
                self._replay_state.save(message.sender, message.seq)
        return message

    def _receive(self, topic: str, payload: bytes) -> None:
        try:
            self._receive_one(topic, payload)
        finally:
            self._expire_partials()

    def _expire_partials(self) -> None:
        """Drop unfinished chunked messages older than the reassembly timeout on every
        message, not only on the next chunk: a sender that hung mid-message may send no
        chunk again, and the rest of the fleet's replies may all fit in one envelope.
        Counted as `ReassemblyExpired` with the other rejections."""
        self._reassembler.expire()
        dropped = self._reassembler.expired - self.rejected["ReassemblyExpired"]
        if dropped > 0:  # here or in the reassembler's own check on a new chunk
            self.rejected["ReassemblyExpired"] += dropped
            log.warning("dropped %d unfinished chunked message(s): no chunk for %.0f s",
                        dropped, self._reassembler.timeout_s)

    def _receive_one(self, topic: str, payload: bytes) -> None:
        message = self._decode(payload, topic)
        size = len(payload)
        if message.type == MessageType.CHUNK:
            key = (message.sender, str(message.meta.get("id", "")))
            self._chunk_bytes[key] = self._chunk_bytes.get(key, 0) + size
            while len(self._chunk_bytes) > 4 * self._reassembler.max_in_flight:
                self._chunk_bytes.popitem(last=False)
            evicted = self._reassembler.evicted
            try:
                whole = self._reassembler.feed(message)
            except WireError as exc:
                self._refuse(message.sender, exc)
                raise
            if self._reassembler.evicted > evicted:  # the sender went over its own budget
                self.rejected["ReassemblyEvicted"] += self._reassembler.evicted - evicted
                log.warning("dropped an unfinished chunked message from %s: over its budget",
                            message.sender)
            if whole is None:
                return
            size = self._chunk_bytes.pop(key, size)
            try:
                message = self._decode(whole, topic)
            except WireError as exc:
                self._refuse(message.sender, exc)
                raise
            if message.type == MessageType.CHUNK:
                raise WireError("a chunk may not carry another chunk")
        inbound = Inbound(topic, message, size)
        if self._route is None or not self._route(inbound):
            self.inbox.put(inbound)

    def _refuse(self, sender: str, exc: WireError) -> None:
        """Remember why a (verified) sender's message was refused; bounded by the senders
        that passed verification."""
        self.refused[sender] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
        while len(self.refused) > 4 * self._reassembler.max_in_flight:
            self.refused.pop(next(iter(self.refused)))

    def publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish an already-encoded envelope (presence) with QoS 1."""
        if self._client is not None:
            self._client.publish(topic, payload, qos=1, retain=retain)

    def next_seq(self) -> int:
        return self._seq.next()

    def send(
        self,
        topic: str,
        message: Message,
        *,
        codec: str = "fp32",
        compression: str = "none",
        retain: bool = False,
    ) -> int:
        """Encode, sign, chunk and publish (QoS 1); returns bytes put on the wire.

        paho queues QoS 1 messages while disconnected and sends them after reconnecting."""
        return self.publish_parts(topic, self.prepare(message, codec=codec,
                                                      compression=compression), retain=retain)

    def prepare(self, message: Message, *, codec: str = "fp32", compression: str = "none",
                chunk_bytes: int | None = None) -> list[bytes]:
        """The signed chunks `send` would publish (a device emulator sizes its link wait
        from them before they go out); `chunk_bytes` overrides the endpoint's chunk size for
        this message (a test fault that hangs mid-message: edge_agent/faults.py)."""
        size = chunk_bytes or self.options.chunk_bytes
        encoded = encode_message(message, codec=codec, compression=compression,
                                 fleet_key=self.options.fleet_key, signer=self.options.signer)
        count = chunk_count(len(encoded), size)
        return chunk_message(encoded, run=message.run, sender=message.sender,
                             seq_start=self._seq.reserve(count) if count > 1 else 0,
                             msg_id=f"{message.sender}.{message.seq}",
                             chunk_bytes=size,
                             fleet_key=self.options.fleet_key, signer=self.options.signer,
                             kind=message.kind)

    def publish_parts(self, topic: str, parts: list[bytes], *, retain: bool = False) -> int:
        """Publish prepared chunks (QoS 1); returns bytes put on the wire."""
        if self._client is None:
            raise ConfigError(f"not connected to broker {self.address.url()}")
        for part in parts:
            self._client.publish(topic, part, qos=1, retain=retain)
        return sum(len(p) for p in parts)



def presence_payload(run: str, sender: str, state: str, *, fleet_key: bytes | None,
                     extra: dict[str, Any] | None = None, signer: Any = None) -> bytes:
    """A signed PRESENCE envelope, live or precomputed as the last will."""
    msg = Message(MessageType.PRESENCE, run=run, sender=sender, seq=time.time_ns() // 1000,
                  kind="presence", meta={"state": state, **(extra or {})})
    return encode_message(msg, fleet_key=fleet_key, signer=signer)

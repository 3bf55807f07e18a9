"""Direct agent-to-agent messages (SHeRL-FL's smashed data and gradients): the peer inbox's
rules, its topics, an agent daemon refusing forged or stray direct messages on a real
Mosquitto while it keeps serving, and the provisioned ACL opening exactly the assigned
pairs' topics."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jetsplit.edge_agent.peers import PeerInbox
from jetsplit.transport import Topics
from jetsplit.wire import Message, MessageType
from jetsplit.wire import errors as wire_errors


def _peer(sender: str, kind: str = "smashed", *, run: str = "r", round_: int = 0,
          step: int = 0, seq: int = 1, type_: MessageType = MessageType.PEER) -> Message:
    return Message(type_, run=run, sender=sender, seq=seq, round=round_, step=step, kind=kind,
                   tensors={"x": np.zeros(2, np.float32)})


# ---------------------------------------------------------------- the inbox


def test_the_inbox_holds_only_what_its_commands_expect() -> None:
    inbox = PeerInbox()
    with pytest.raises(wire_errors.UnexpectedPeer):  # nothing expected yet
        inbox.accept(_peer("a0"), 10)
    inbox.expect("smashed", ["a0", "a1"], "r", 3)
    inbox.accept(_peer("a0", round_=3, step=0), 10)
    for message, error in [
        (_peer("a2", round_=3), wire_errors.UnexpectedPeer),  # not an assigned client
        (_peer("a0", "gradient", round_=3), wire_errors.UnexpectedPeer),  # wrong kind
        (_peer("a0", round_=2, step=1), wire_errors.StalePeerMessage),  # another round
        (_peer("a0", run="old", round_=3, step=1), wire_errors.StalePeerMessage),
        (_peer("a0", round_=3, step=0), wire_errors.PeerBacklog),  # a second copy
        (_peer("a1", round_=3, type_=MessageType.REPLY), wire_errors.UnexpectedPeer),
    ]:
        with pytest.raises(error):
            inbox.accept(message, 10)
    inbox.accept(_peer("a0", round_=3, step=1), 10)
    with pytest.raises(wire_errors.PeerBacklog, match="over what is held"):
        inbox.accept(_peer("a0", round_=3, step=2), 10)  # at most two steps per sender
    assert inbox.held() == [("smashed", "a0", 0), ("smashed", "a0", 1)]
    got = inbox.take("smashed", ["a0", "a1"], "r", 3, 0, wait_s=0)
    assert list(got) == ["a0"] and got["a0"][1] == 10
    with pytest.raises(wire_errors.StalePeerMessage):  # step 0 is closed for both now
        inbox.accept(_peer("a1", round_=3, step=0), 10)
    with pytest.raises(wire_errors.UnexpectedPeer):
        inbox.take("smashed", ["a2"], "r", 3, 1, wait_s=0)
    # A new round: steps start again at 0; what is left of the old one goes.
    inbox.expect("smashed", ["a1"], "r", 4)
    assert inbox.held() == []
    inbox.accept(_peer("a1", round_=4, step=0), 10)
    with pytest.raises(wire_errors.UnexpectedPeer):
        inbox.accept(_peer("a0", round_=4, step=0), 10)


def test_the_inbox_bounds_its_bytes() -> None:
    inbox = PeerInbox(max_bytes=100)
    inbox.expect("smashed", ["a0", "a1"], "r", 0)
    inbox.accept(_peer("a0"), 60)
    with pytest.raises(wire_errors.PeerBacklog):
        inbox.accept(_peer("a1"), 60)
    inbox.take("smashed", ["a0"], "r", 0, 0, wait_s=0)
    inbox.accept(_peer("a1"), 60)  # room again


def test_a_client_takes_a_gradient_only_for_its_step_and_waits_for_a_late_one() -> None:
    inbox = PeerInbox()
    inbox.expect("gradient", ["e0"], "r", 0, step=5)
    with pytest.raises(wire_errors.StalePeerMessage):
        inbox.accept(_peer("e0", "gradient", step=4), 10)
    late = threading.Timer(0.3, inbox.accept, (_peer("e0", "gradient", step=5), 10))
    late.start()
    started = time.monotonic()
    got = inbox.take("gradient", ["e0"], "r", 0, 5, wait_s=120)
    # Returned when it landed, not at wait_s: the bound holds on a busy machine.
    assert list(got) == ["e0"] and 0.2 < time.monotonic() - started < 60
    started = time.monotonic()
    assert inbox.take("gradient", ["e0"], "r", 0, 5, wait_s=0.2) == {}  # already taken
    assert time.monotonic() - started >= 0.2


def test_peer_topics_name_their_sender() -> None:
    topics = Topics("f")
    assert topics.peer("e0", "a0") == "jetsplit/v1/f/peer/e0/a0"
    assert topics.peer_inbox("e0") == "jetsplit/v1/f/peer/e0/+"
    assert topics.peer_sender("jetsplit/v1/f/peer/e0/a0") == "a0"
    for other in ("jetsplit/v1/f/up/a0", "jetsplit/v1/g/peer/e0/a0", "jetsplit/v1/f/peer/a0",
                  "jetsplit/v1/f/peer/e0/+", "jetsplit/v1/f/x/peer/e0/a0"):
        assert topics.peer_sender(other) is None, other
    assert topics.agent_of("jetsplit/v1/f/peer/e0/a0") is None  # never the coordinator's


# ---------------------------------------------------------------- a daemon on a real broker


def test_an_agent_refuses_stray_and_forged_direct_messages_and_keeps_serving(
        mosquitto: object) -> None:
    """A client agent expecting its edge e0's gradient for one step: a forged sender, an
    unassigned peer, a stale step, an unsigned copy and a replay are each refused with
    their typed error, counted, and the agent still answers the coordinator."""
    from jetsplit.broker_url import BrokerAddress
    from jetsplit.data import load_dataset_split
    from jetsplit.edge_agent.daemon import AgentDaemon
    from jetsplit.edge_agent.worker import AgentWorker
    from jetsplit.protocol import Kind
    from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
    from jetsplit.wire import encode_message

    port = mosquitto.port  # type: ignore[attr-defined]
    key = b"k" * 32
    options = EndpointOptions(fleet_key=key)
    address = BrokerAddress("127.0.0.1", port)
    topics = Topics("p")
    worker = AgentWorker("a0", load_dataset_split("digits", 0.2, 0)[0])
    worker.peers.expect(Kind.GRADIENT.value, ["e0"], "r", 0, step=1)
    daemon = AgentDaemon(worker, address, "p", options)
    stop = threading.Event()
    serving = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    serving.start()
    peers = {who: MqttEndpoint(address, f"test-{who}", options, sender=who).start(wait_s=10)
             for who in ("e0", "a1", "coordinator")}
    coordinator = peers["coordinator"]
    replies = MqttEndpoint(address, "test-replies", options,
                           subscriptions=(topics.up("a0"),)).start(wait_s=10)
    try:
        assert daemon.endpoint.subscribed.wait(10)  # its subscriptions are in
        e0, a1 = peers["e0"], peers["a1"]

        def grad(sender: str, step: int, endpoint: MqttEndpoint) -> Message:
            return _peer(sender, Kind.GRADIENT.value, step=step, seq=endpoint.next_seq())

        e0.send(topics.peer("a0", "e0"), grad("e0", 1, e0))  # the one it wants
        a1.send(topics.peer("a0", "a1"), grad("a1", 1, a1))  # not its edge
        a1.send(topics.peer("a0", "e0"), grad("a1", 1, a1))  # a1 posing on e0's topic
        e0.send(topics.peer("a0", "e0"), grad("e0", 0, e0))  # a stale step
        e0.publish_raw(topics.peer("a0", "e0"), encode_message(grad("e0", 1, e0)))  # unsigned
        again = e0.prepare(grad("e0", 2, e0))
        e0.publish_parts(topics.peer("a0", "e0"), again)
        e0.publish_parts(topics.peer("a0", "e0"), again)  # the same signed bytes: a replay
        want = {"UnexpectedPeer": 1, "SenderMismatch": 1, "StalePeerMessage": 2,
                "BadSignature": 1, "ReplayedMessage": 1}
        deadline = time.monotonic() + 60
        while dict(daemon.endpoint.rejected) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dict(daemon.endpoint.rejected) == want
        assert worker.peers.held() == [("gradient", "e0", 1)]
        status = Message(MessageType.COMMAND, run="r", sender="coordinator",
                         seq=coordinator.next_seq(), kind=Kind.STATUS.value, meta={"cmd": 7})
        coordinator.send(topics.down("a0"), status)
        # its registration may land on the up topic after the watcher subscribed: skip it
        reply = replies.inbox.get(timeout=60).message
        while reply.type == MessageType.REGISTER:
            reply = replies.inbox.get(timeout=60).message
        assert reply.type == MessageType.REPLY and reply.meta["re"] == 7
    finally:
        stop.set()
        serving.join(10)
        for endpoint in [*peers.values(), replies]:
            endpoint.close()


# ---------------------------------------------------------------- the provisioned ACL


@pytest.fixture(scope="module")
def sherl_kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetsplit.server.fleet.provision import provision

    out = tmp_path_factory.mktemp("kits") / "sh"
    provision("sh", ["a0", "a1", "a2", "e0", "e1"], out, edges={"e0": ["a0", "a1"],
                                                                 "e1": ["a2"]})
    return out


@pytest.fixture(scope="module")
def sherl_broker(sherl_kits: Path) -> Iterator[object]:
    from jetsplit.server.ops.brokers import MosquittoProcess

    with MosquittoProcess(provisioned=sherl_kits / "broker") as process:
        yield process


class _Device:
    """A plain MQTT 5 client with `who`'s certificate: PUBACK codes, what it received."""

    def __init__(self, kits: Path, who: str, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.acks: dict[int, int] = {}
        self.received: list[str] = []
        self.subscribed = threading.Event()
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"acl-{who}",
                                  protocol=mqtt.MQTTv5)
        self.client.tls_set(ca_certs=str(kits / who / "ca.crt"),
                            certfile=str(kits / who / "client.crt"),
                            keyfile=str(kits / who / "client.key"),
                            cert_reqs=ssl.CERT_REQUIRED)
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.connect("localhost", port)
        self.client.loop_start()

    def _on_publish(self, c, userdata, mid, reason, properties) -> None:  # noqa: ANN001
        with self._lock:
            self.acks[mid] = reason.value

    def _on_message(self, c, userdata, msg) -> None:  # noqa: ANN001
        with self._lock:
            self.received.append(msg.topic)

    def publish(self, topics: list[str]) -> list[int]:
        mids = [self.client.publish(t, b"x", qos=1).mid for t in topics]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self._lock:
                if all(m in self.acks for m in mids):
                    return [self.acks[m] for m in mids]
            time.sleep(0.02)
        raise AssertionError("no PUBACK")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


NOT_AUTHORIZED = 135


def test_the_provisioned_acl_opens_exactly_the_assigned_pairs(sherl_kits: Path,
                                                              sherl_broker: object) -> None:
    """Each agent may publish only peer/<its peer>/<itself> and receives only its own
    peer/<itself>/+ topics, even when it subscribes to all of peer/#."""
    base = "jetsplit/v1/sh/peer"
    port = sherl_broker.port  # type: ignore[attr-defined]
    allowed = {"a0": [f"{base}/e0/a0"], "a1": [f"{base}/e0/a1"], "a2": [f"{base}/e1/a2"],
               "e0": [f"{base}/a0/e0", f"{base}/a1/e0"], "e1": [f"{base}/a2/e1"],
               "coordinator": []}
    denied = {"a0": [f"{base}/e1/a0", f"{base}/e0/a1", f"{base}/a1/a0", f"{base}/a0/a0"],
              "a1": [f"{base}/e1/a1"], "a2": [f"{base}/e0/a2"],
              "e0": [f"{base}/a2/e0", f"{base}/e1/e0", f"{base}/a0/a1"],
              "e1": [f"{base}/a0/e1"], "coordinator": [f"{base}/a0/coordinator",
                                                       f"{base}/e0/a0"]}
    devices = {who: _Device(sherl_kits, who, port) for who in allowed}
    try:
        for device in devices.values():
            device.client.subscribe(f"{base}/#", qos=1)
            assert device.subscribed.wait(10)
        for who, device in devices.items():
            codes = device.publish(allowed[who] + denied[who])
            assert all(c in (0, 16) for c in codes[:len(allowed[who])]), (who, codes)
            assert codes[len(allowed[who]):] == [NOT_AUTHORIZED] * len(denied[who]), who
        time.sleep(0.5)
        received = {who: sorted(d.received) for who, d in devices.items()}
    finally:
        for device in devices.values():
            device.close()
    assert received == {"a0": [f"{base}/a0/e0"], "a1": [f"{base}/a1/e0"],
                        "a2": [f"{base}/a2/e1"], "e0": [f"{base}/e0/a0", f"{base}/e0/a1"],
                        "e1": [f"{base}/e1/a2"], "coordinator": []}
    trusted = {who: sorted(p.stem for p in (sherl_kits / who / "trusted").iterdir())
               for who in ("a0", "a2", "e0", "e1")}
    assert trusted == {"a0": ["coordinator", "e0"], "a2": ["coordinator", "e1"],
                       "e0": ["a0", "a1", "coordinator"], "e1": ["a2", "coordinator"]}
    acl = (sherl_kits / "broker" / "acl").read_text()
    assert acl.count("/peer/") == 2 * 3 + (1 + 2) + (1 + 1)  # reads + writes, nothing wider
    assert "peer/#" not in acl and "peer/+/" not in acl


@pytest.mark.parametrize(("edges", "message"), [
    (["e0=a0", "e0=a1"], "once per edge"),
    (["e0"], "EDGE=CLIENT"),
    (["e0=a0,a9"], "a9, not in --agents"),
    (["e0=a0", "e1=a0"], "under two edges"),
])
def test_provision_edge_mistakes_end_in_one_line(tmp_path: Path, edges: list[str],
                                                 message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from jetsplit.cli import main as cli

    args = [x for e in edges for x in ("--edge", e)]
    code = cli(["provision", "--fleet", "f", "--agents", "a0,a1,e0,e1", "--out",
                str(tmp_path / "k"), *args])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "k").exists()

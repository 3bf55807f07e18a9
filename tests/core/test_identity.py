"""Per-device identity: Ed25519-signed envelopes, `jetsplit provision` kits, and a real
Mosquitto running the provisioned config (mutual TLS, identities from certificates, ACL)."""

from __future__ import annotations

import itertools
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jetsplit.broker_url import BrokerAddress
from jetsplit.errors import ConfigError
from jetsplit.identity import load_keyring, load_signer
from jetsplit.server.fleet.provision import provision
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
from jetsplit.transport.settings import MqttSection
from jetsplit.wire import Message, MessageType, decode_message, encode_message
from jetsplit.wire import errors as wire_errors

_ids = itertools.count()


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kits") / "sec"
    provision("sec", ["a0", "a1", "x9"], out)
    return out


def kit_section(kit: Path, broker: str = "mqtts://localhost:1") -> MqttSection:
    return MqttSection(broker=broker, tls_ca=str(kit / "ca.crt"),
                       tls_cert=str(kit / "client.crt"), tls_key=str(kit / "client.key"),
                       signing_key=str(kit / "signing.key"),
                       trusted_keys=str(kit / "trusted"))


def _msg(sender: str, **kw: object) -> Message:
    return Message(MessageType.REPLY, run="r", sender=sender, seq=kw.pop("seq", 1),  # type: ignore[arg-type]
                   kind="status", tensors={"x": np.arange(4, dtype=np.float32)}, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- signatures, in process


def test_a_thousand_fuzzed_device_signed_frames_raise_only_typed_errors() -> None:
    """The wire fuzzer (tests/wire/test_wire_hostile.py) with per-device signatures: mutated
    frames are re-signed, so the header and codec checks behind the signature get fuzzed."""
    from jetsplit.identity import KeyRing, Signer

    import wire_fuzz as fuzz  # testing/ (see conftest.py)

    signer = Signer.generate("s")
    counts = fuzz.run(1_000, 11, key=signer, keyring=KeyRing({"s": signer.public_key()}))
    assert 1_000 - counts.get("accepted", 0) > 850
    assert {"MalformedHeader", "CodecError", "OversizedMessage"} <= set(counts)
    other = Signer.generate("s")  # the right name, the wrong key: nothing gets through
    counts = fuzz.run(200, 12, key=signer, keyring=KeyRing({"s": other.public_key()}))
    assert "accepted" not in counts and counts.get("BadSignature", 0) > 50


def test_each_device_signs_as_itself_only(kits: Path) -> None:
    a0 = load_signer(kits / "a0" / "signing.key", "a0")
    coordinator_ring = load_keyring(kits / "coordinator" / "trusted")
    agent_ring = load_keyring(kits / "a0" / "trusted")
    assert coordinator_ring.senders == ["a0", "a1", "x9"]
    assert agent_ring.senders == ["coordinator"]

    good = encode_message(_msg("a0"), signer=a0)
    msg = decode_message(good, keyring=coordinator_ring)
    assert msg.signed and msg.sender == "a0"
    with pytest.raises(wire_errors.BadSignature, match="a1"):  # a0's key, a1's name
        decode_message(encode_message(_msg("a1"), signer=a0), keyring=coordinator_ring)
    with pytest.raises(wire_errors.BadSignature, match="coordinator"):  # a0 cannot command
        decode_message(encode_message(_msg("coordinator"), signer=a0), keyring=agent_ring)
    with pytest.raises(wire_errors.BadSignature, match="without a device signature"):
        decode_message(encode_message(_msg("a0")), keyring=coordinator_ring)
    with pytest.raises(wire_errors.BadSignature, match="without a device signature"):
        decode_message(encode_message(_msg("a0"), fleet_key=b"k" * 32), keyring=coordinator_ring)
    tampered = bytearray(good)
    tampered[-70] ^= 1  # in the body; CRC fixed up so only the signature can notice
    import zlib

    covered = len(tampered) - 64 - 4
    tampered[covered:covered + 4] = zlib.crc32(bytes(tampered[:covered])).to_bytes(4, "big")
    with pytest.raises(wire_errors.BadSignature):
        decode_message(bytes(tampered), keyring=coordinator_ring)


def test_settings_load_a_kit_and_refuse_half_or_mixed_setups(kits: Path, tmp_path: Path) -> None:
    options = kit_section(kits / "a0").endpoint_options()
    assert options.signer is not None and options.keyring.senders == ["coordinator"]
    assert options.authenticated
    with pytest.raises(ConfigError, match="go together"):
        MqttSection(signing_key=str(kits / "a0" / "signing.key")).endpoint_options()
    key = tmp_path / "fleet.key"
    key.write_text("k" * 32)
    mixed = kit_section(kits / "a0").model_copy(update={"fleet_key_file": str(key)})
    with pytest.raises(ConfigError, match="not both"):
        mixed.endpoint_options()
    with pytest.raises(ConfigError, match="not a PEM private key"):
        load_signer(kits / "a0" / "ca.crt", "a0")


@pytest.mark.parametrize(("args", "expected"), [
    (["--agents", "a0,coordinator"], "reserved"),
    (["--agents", "a0,a0"], "repeat"),
    (["--agents", "a b"], "agent 'a b'"),
    (["--agents", "a0", "--broker-host", ","], "at least one host"),
    (["--agents", "a0", "--size", "a1=5"], "--size names a1, not in --agents"),
    (["--agents", "a0", "--size", "a0=0"], "--size a0=0: a size is a whole number"),
    (["--agents", "a0", "--size", "a0=-3"], "write AGENT=SAMPLES"),
    (["--agents", "a0", "--size", "a0=1e9"], "write AGENT=SAMPLES"),
    (["--agents", "a0", "--size", "a0=" + "9" * 5000], "write AGENT=SAMPLES"),
])
def test_provision_mistakes_end_in_one_line(tmp_path: Path, args: list[str], expected: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from jetsplit.cli import main as cli

    code = cli(["provision", "--fleet", "f", "--out", str(tmp_path / "k"), *args])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0]
    assert not (tmp_path / "k").exists()


def test_provisioned_sizes_land_in_the_coordinators_server_toml(tmp_path: Path) -> None:
    """`--size` writes each device's size into the coordinator's starting server.toml,
    which loads as it stands: the kit's files and the sizes the claims are bounded by."""
    from jetsplit.cli import main as cli
    from jetsplit.server.run.config import load_server_config

    out = tmp_path / "odd \"name\""  # a path TOML has to escape
    assert cli(["provision", "--fleet", "f", "--agents", "a0,a1,a2", "--out", str(out),
                "--size", "a2=265", "--size", " a0 = 1200"]) == 0
    cfg = load_server_config(out / "coordinator" / "server.toml")
    assert cfg.settings().provisioned_sizes == {"a0": 1200, "a2": 265}
    assert cfg.fleet == "f" and cfg.mqtt.tls_ca == str((out / "coordinator" / "ca.crt").resolve())
    assert cfg.mqtt.endpoint_options().keyring.senders == ["a0", "a1", "a2"]
    assert "    a2 = 265" in (out / "coordinator" / "README.md").read_text()
    plain = tmp_path / "plain"
    provision("f", ["a0"], plain)
    assert load_server_config(plain / "coordinator" / "server.toml").train.provisioned_sizes \
        == {}
    assert not (plain / "a0" / "server.toml").exists()


def test_provision_never_overwrites_keys(kits: Path) -> None:
    with pytest.raises(ConfigError, match="not empty"):
        provision("sec", ["a0"], kits)
    assert (kits / "ca" / "ca.key").stat().st_mode & 0o077 == 0
    assert (kits / "a0" / "signing.key").stat().st_mode & 0o077 == 0
    assert "use_identity_as_username true" in (kits / "broker" / "mosquitto.conf").read_text()
    assert "require_certificate true" in (kits / "broker" / "mosquitto.conf").read_text()
    readme = (kits / "README.md").read_text()
    assert "peer_cert_as_username = cn" in readme and "peer_cert_as_clientid = cn" in readme


# ---------------------------------------------------------------- the provisioned broker


@pytest.fixture(scope="module")
def broker(kits: Path) -> Iterator[MosquittoProcess]:
    with MosquittoProcess(provisioned=kits / "broker") as process:
        yield process


def _endpoint(kits: Path, who: str, broker: MosquittoProcess,
              topics: tuple[str, ...] = (), **kw: object) -> MqttEndpoint:
    options = kit_section(kits / who, f"mqtts://localhost:{broker.port}").endpoint_options()
    return MqttEndpoint(BrokerAddress("localhost", broker.port, tls=True),
                        f"{who}-{next(_ids)}", options, subscriptions=topics,
                        **kw).start(wait_s=15)  # type: ignore[arg-type]


def _raw_publish_codes(kits: Path, who: str, port: int, topics: list[str]) -> list[int]:
    """PUBACK reason codes the broker answers an MQTT 5 client with `who`'s certificate."""
    import paho.mqtt.client as mqtt

    codes: dict[int, int] = {}
    done = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"raw-{next(_ids)}",
                         protocol=mqtt.MQTTv5)
    client.tls_set(ca_certs=str(kits / who / "ca.crt"), certfile=str(kits / who / "client.crt"),
                   keyfile=str(kits / who / "client.key"), cert_reqs=ssl.CERT_REQUIRED)

    def on_publish(c, userdata, mid, reason, properties) -> None:  # noqa: ANN001
        codes[mid] = reason.value
        if len(codes) == len(topics):
            done.set()

    client.on_publish = on_publish
    client.connect("localhost", port)
    client.loop_start()
    try:
        mids = [client.publish(t, b"forged", qos=1).mid for t in topics]
        assert done.wait(10)
    finally:
        client.loop_stop()
        client.disconnect()
    return [codes[m] for m in mids]


NOT_AUTHORIZED = 135


def test_broker_refuses_publishing_outside_the_acl(kits: Path, broker: MosquittoProcess) -> None:
    base = "jetsplit/v1/sec"
    watcher = _endpoint(kits, "coordinator", broker, (f"{base}/up/+", f"{base}/presence/+"))
    try:
        codes = _raw_publish_codes(kits, "a0", broker.port, [
            f"{base}/up/a1", f"{base}/presence/a1", f"{base}/down/all", f"{base}/down/a1",
            f"{base}/up/a0"])
        assert codes[:4] == [NOT_AUTHORIZED] * 4
        assert codes[4] in (0, 16)  # its own topic: accepted (16: no subscriber matched yet)
        coordinator_codes = _raw_publish_codes(kits, "coordinator", broker.port,
                                               [f"{base}/up/a0", f"{base}/down/a0"])
        assert coordinator_codes[0] == NOT_AUTHORIZED and coordinator_codes[1] in (0, 16)
        time.sleep(0.5)
        assert watcher.inbox.qsize() == 0 or all(
            i.topic == f"{base}/up/a0" for i in list(watcher.inbox.queue))
    finally:
        watcher.close()


def test_signed_messages_cross_the_broker_and_forgeries_are_counted(
        kits: Path, broker: MosquittoProcess) -> None:
    from jetsplit.transport import Topics

    topics = Topics("sec")
    coordinator = _endpoint(kits, "coordinator", broker, (topics.up_any, topics.presence_any),
                            topic_owner=topics.agent_of)
    a0 = _endpoint(kits, "a0", broker)
    try:
        a0.send(topics.up("a0"), _msg("a0", seq=a0.next_seq()))
        got = coordinator.inbox.get(timeout=60)
        assert got.message.sender == "a0" and got.message.signed
        # a0 signs a message in a1's name, on its own topic: a1's key does not verify it
        forged = encode_message(_msg("a1", seq=a0.next_seq()),
                                signer=load_signer(kits / "a0" / "signing.key", "a0"))
        a0.publish_raw(topics.up("a0"), forged)
        unsigned = encode_message(_msg("a0", seq=a0.next_seq()))
        a0.publish_raw(topics.up("a0"), unsigned)
        again = a0.prepare(_msg("a0", seq=a0.next_seq()))
        a0.publish_parts(topics.up("a0"), again)
        a0.publish_parts(topics.up("a0"), again)  # the same signed bytes twice: a replay
        deadline = time.monotonic() + 60
        while sum(coordinator.rejected.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.rejected["BadSignature"] == 2
        assert coordinator.rejected["ReplayedMessage"] == 1
        assert coordinator.inbox.get(timeout=60).message.seq == decode_message(again[0]).seq
    finally:
        a0.close()
        coordinator.close()


def test_a_kit_from_another_fleet_is_refused_at_connect_in_one_line(
        broker: MosquittoProcess, tmp_path: Path) -> None:
    provision("other", ["a0"], tmp_path / "other")
    config = tmp_path / "a0.toml"
    kit = tmp_path / "other" / "a0"
    config.write_text(
        f'fleet = "sec"\nagent = "a0"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nbroker = "mqtts://localhost:{broker.port}"\ntls_ca = "{kit / "ca.crt"}"\n'
        f'tls_cert = "{kit / "client.crt"}"\ntls_key = "{kit / "client.key"}"\n'
        f'signing_key = "{kit / "signing.key"}"\ntrusted_keys = "{kit / "trusted"}"\n'
        '[data]\ndataset = "digits"\n')
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "agent", "run", "--config",
                           str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failed TLS verification" in errors[0], done.stderr[-2000:]
    assert f"not signed by {kit / 'ca.crt'}" in errors[0]
    assert "Traceback" not in done.stderr


def test_agent_install_with_a_kit_points_the_config_at_it(kits: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    from jetsplit.cli import main as cli
    from jetsplit.edge_agent import install as inst
    from jetsplit.edge_agent.config import load_agent_config

    flags = ["agent", "install", "--kit", str(kits / "a1"), "--broker", "mqtts://broker:8883",
             "--root", str(tmp_path), "--no-enable", "--no-user", "--no-venv"]
    assert cli(flags) == 0, capsys.readouterr().err
    cfg = load_agent_config(tmp_path / inst.CONFIG.lstrip("/"))
    assert (cfg.agent, cfg.fleet) == ("a1", "sec")
    installed = tmp_path / inst.KIT_DIR.lstrip("/")
    assert cfg.mqtt.signing_key == f"{inst.KIT_DIR}/signing.key"
    assert cfg.mqtt.trusted_keys == f"{inst.KIT_DIR}/trusted" and cfg.mqtt.fleet_key_file is None
    assert (installed / "signing.key").read_bytes() == (kits / "a1" / "signing.key").read_bytes()
    assert (installed / "signing.key").stat().st_mode & 0o777 == 0o640
    assert (installed / "trusted" / "coordinator.pub").is_file()
    # the installed files load (paths re-rooted under the fake root)
    rooted = cfg.mqtt.model_copy(update={k: str(tmp_path) + getattr(cfg.mqtt, k) for k in (
        "tls_ca", "tls_cert", "tls_key", "signing_key", "trusted_keys")})
    assert rooted.endpoint_options().keyring.senders == ["coordinator"]
    capsys.readouterr()
    assert cli([*flags, "--agent", "a0"]) == 2
    assert capsys.readouterr().err == "error: --agent a0 disagrees with the kit (a1)\n"
    assert cli(["agent", "install", "--kit", str(kits / "coordinator"), "--broker",
                "mqtt://h", "--root", str(tmp_path)]) == 2
    assert "coordinator's kit" in capsys.readouterr().err


def test_a_forged_sender_cannot_poison_another_senders_replay_window(
        mosquitto: MosquittoProcess) -> None:
    """The shared-key attack: a key holder signs as a0 with seq 2^62 on up/a1. The topic
    owner check runs before the replay window, so a0's genuine messages still pass."""
    from jetsplit.transport import Topics

    key = b"shared-fleet-key-0123456789"
    topics = Topics("poison")
    options = EndpointOptions(fleet_key=key)
    coordinator = MqttEndpoint(mosquitto.address, f"c-{next(_ids)}", options,
                               subscriptions=(topics.up_any,),
                               topic_owner=topics.agent_of).start(wait_s=10)
    a1 = MqttEndpoint(mosquitto.address, f"a1-{next(_ids)}", options).start(wait_s=10)
    try:
        a1.publish_raw(topics.up("a1"), encode_message(_msg("a0", seq=2**62), fleet_key=key))
        a1.send(topics.up("a0"), _msg("a0", seq=a1.next_seq()))  # stands in for genuine a0
        got = coordinator.inbox.get(timeout=60)
        assert got.message.sender == "a0" and got.topic == topics.up("a0")
        assert coordinator.rejected["SenderMismatch"] == 1
        assert "ReplayedMessage" not in coordinator.rejected
    finally:
        a1.close()
        coordinator.close()


def test_the_last_will_is_accepted_after_newer_online_presence(
        kits: Path, broker: MosquittoProcess) -> None:
    """An agent's signed will is built at connect, before its online presence; when the
    agent dies the coordinator must still take it (ordered among offline messages)."""
    from jetsplit.transport import Topics
    from jetsplit.transport.mqtt import presence_payload

    topics = Topics("sec")
    coordinator = _endpoint(kits, "coordinator", broker, (topics.presence_any,),
                            topic_owner=topics.agent_of)
    signer = load_signer(kits / "a1" / "signing.key", "a1")
    will = presence_payload("-", "a1", "offline", fleet_key=None, signer=signer)
    time.sleep(0.01)
    a1 = _endpoint(kits, "a1", broker, will=(topics.presence("a1"), will))
    try:
        a1.publish_raw(topics.presence("a1"), presence_payload(
            "-", "a1", "online", fleet_key=None, signer=signer), retain=True)
        states = [coordinator.inbox.get(timeout=60).message.meta["state"]]
        a1._client.socket().close()  # dies without DISCONNECT: the broker sends the will
        while "offline" not in states:
            states.append(coordinator.inbox.get(timeout=60).message.meta["state"])
        assert states[-1] == "offline" and "StalePresence" not in coordinator.rejected
    finally:
        a1.close(graceful=False)
        coordinator.close()

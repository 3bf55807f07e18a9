"""The provisioned Mosquitto config refuses an oversized message itself: a device with a
genuine kit publishing 3 MiB on its own topic is disconnected by the broker, and the
coordinator's subscription never sees it; a message the size of one full chunk still goes
through. (A live device once pushed one 200 MiB message through the provisioned broker and
the coordinator peaked at 1.27 GB RSS refusing it.)"""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from jetsplit.errors import ConfigError
from jetsplit.server.fleet.provision import broker_max_packet, provision
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import Topics
from jetsplit.transport.topics import COORDINATOR


def _client(kit: Path, port: int, client_id: str) -> tuple[mqtt.Client, dict]:
    seen: dict = {"messages": [], "disconnects": [], "connected": threading.Event()}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5)
    client.tls_set(ca_certs=str(kit / "ca.crt"), certfile=str(kit / "client.crt"),
                   keyfile=str(kit / "client.key"), cert_reqs=ssl.CERT_REQUIRED)
    client.on_connect = lambda c, u, f, reason, p: seen["connected"].set()
    client.on_message = lambda c, u, m: seen["messages"].append(len(m.payload))
    client.on_disconnect = lambda c, u, f, reason, p: seen["disconnects"].append(reason.value)
    client.connect("localhost", port)
    client.loop_start()
    assert seen["connected"].wait(30)
    return client, seen


def test_the_provisioned_broker_refuses_a_message_over_its_packet_limit(tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision("lim", ["a0"], kits)
    conf = (kits / "broker" / "mosquitto.conf").read_text()
    assert f"max_packet_size {broker_max_packet()}\n" in conf
    assert 1 << 20 < broker_max_packet() < 2 << 20  # one 1 MiB chunk and its envelope
    topics = Topics("lim")
    with MosquittoProcess(provisioned=kits / "broker") as broker:
        coordinator, heard = _client(kits / COORDINATOR, broker.port, COORDINATOR)
        coordinator.subscribe(topics.up_any, qos=1)
        time.sleep(1.0)
        device, device_seen = _client(kits / "a0", broker.port, "a0")
        chunk = b"\0" * (1 << 20)  # a full default chunk's payload: legitimate
        device.publish(topics.up("a0"), chunk, qos=1).wait_for_publish(30)
        deadline = time.monotonic() + 30
        while not heard["messages"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert heard["messages"] == [len(chunk)]
        device.publish(topics.up("a0"), b"\0" * (3 << 20), qos=1)
        deadline = time.monotonic() + 30
        while not device_seen["disconnects"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert device_seen["disconnects"], "the broker kept a client that sent 3 MiB"
        time.sleep(1.0)
        assert heard["messages"] == [len(chunk)]  # the coordinator never saw it
        for client in (device, coordinator):
            client.loop_stop()
            client.disconnect()


def test_an_enrolled_device_cannot_take_over_another_devices_session(tmp_path: Path) -> None:
    """A broker hands a session to whoever connects with its client id. The provisioned
    Mosquitto config names every session by the certificate's CN
    (`use_username_as_clientid`), so a1's genuine kit connecting with a0's real client id
    (as if it had leaked), with a0's plain id, or with the coordinator's, kicks nobody: not
    a0, not the coordinator. Without that line the same connect does kick a0 (the broker
    behaviour it defends against), and only the secret suffix of a0's id stands between."""
    from jetsplit.broker_url import BrokerAddress
    from jetsplit.transport.mqtt import MqttEndpoint
    from jetsplit.transport.settings import MqttSection

    kits = tmp_path / "kits"
    provision("tk", ["a0", "a1"], kits)
    conf = kits / "broker" / "mosquitto.conf"
    assert "use_username_as_clientid true\n" in conf.read_text()

    def endpoint(port: int, who: str) -> MqttEndpoint:
        kit = kits / who
        options = MqttSection(
            broker=f"mqtts://localhost:{port}", tls_ca=str(kit / "ca.crt"),
            tls_cert=str(kit / "client.crt"), tls_key=str(kit / "client.key"),
            signing_key=str(kit / "signing.key"),
            trusted_keys=str(kit / "trusted")).endpoint_options()
        return MqttEndpoint(BrokerAddress("localhost", port, tls=True), f"jetsplit-tk-{who}",
                            options, sender=who)

    def impostors(port: int, ids: list[str]) -> None:
        for guess in ids:
            impostor, _ = _client(kits / "a1", port, guess)
            time.sleep(1.5)
            impostor.loop_stop()
            impostor.disconnect()

    with MosquittoProcess(provisioned=kits / "broker") as broker:
        victim = endpoint(broker.port, "a0").start(30)
        coordinator = endpoint(broker.port, COORDINATOR).start(30)
        try:
            suffix = victim.client_id.removeprefix("jetsplit-tk-a0-")
            assert len(suffix) == 16 and int(suffix, 16) >= 0
            assert endpoint(broker.port, "a0").client_id == victim.client_id  # every start
            impostors(broker.port, [victim.client_id, coordinator.client_id, "a0",
                                    COORDINATOR, "jetsplit-tk-a0"])
            assert victim.connects == 1 and victim.connected.is_set()
            assert coordinator.connects == 1 and coordinator.connected.is_set()
        finally:
            victim.close()
            coordinator.close()
    # the same broker without the binding: the leaked id takes a0's session over
    conf.write_text(conf.read_text().replace("use_username_as_clientid true\n", ""))
    with MosquittoProcess(provisioned=kits / "broker") as broker:
        victim = endpoint(broker.port, "a0").start(30)
        try:
            leaked, _ = _client(kits / "a1", broker.port, victim.client_id)
            deadline = time.monotonic() + 30
            while victim.connects < 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # kicked, it reconnects (and kicks the impostor back)
            leaked.loop_stop()
            leaked.disconnect()
            assert victim.connects >= 2
        finally:
            victim.close()


def test_the_fleet_cli_has_its_own_identity_beside_a_running_coordinator(
        tmp_path: Path) -> None:
    """The fleet CLI reads the coordinator's server.toml, but connects with the kit's
    `operator` certificate: it lists the fleet while the coordinator stays connected (on
    the coordinator's own certificate the broker would hand it the coordinator's session)."""
    from jetsplit.broker_url import BrokerAddress
    from jetsplit.server.run.fleet_cli import FleetClient
    from jetsplit.transport.mqtt import MqttEndpoint
    from jetsplit.transport.settings import MqttSection

    kits = tmp_path / "kits"
    provision("op", ["a0"], kits)
    kit = kits / COORDINATOR
    acl = (kits / "broker" / "acl").read_text()
    assert "user operator\ntopic write jetsplit/v1/op/down/#" in acl
    with MosquittoProcess(provisioned=kits / "broker") as broker:
        section = MqttSection(
            broker=f"mqtts://localhost:{broker.port}", tls_ca=str(kit / "ca.crt"),
            tls_cert=str(kit / "client.crt"), tls_key=str(kit / "client.key"),
            signing_key=str(kit / "signing.key"), trusted_keys=str(kit / "trusted"),
            operator_cert=str(kit / "operator.crt"), operator_key=str(kit / "operator.key"))
        coordinator = MqttEndpoint(BrokerAddress("localhost", broker.port, tls=True),
                                   "jetsplit-op-coordinator", section.endpoint_options(),
                                   sender=COORDINATOR).start(30)
        try:
            with FleetClient(section.broker, "op", section=section) as cli:
                assert cli.endpoint.connected.is_set()
                time.sleep(1.5)
            assert coordinator.connects == 1 and coordinator.connected.is_set()
            # on the coordinator's own certificate the CLI takes its session: it is kicked
            plain = section.model_copy(update={"operator_cert": None, "operator_key": None})
            with FleetClient(section.broker, "op", section=plain):
                deadline = time.monotonic() + 30
                while coordinator.connects < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
            assert coordinator.connects >= 2
            lone = section.model_copy(update={"operator_key": None})
            with pytest.raises(ConfigError, match="operator_cert and operator_key together"):
                FleetClient(section.broker, "op", section=lone)
        finally:
            coordinator.close()

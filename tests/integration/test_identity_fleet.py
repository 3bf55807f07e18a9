"""A provisioned fleet under attack: 3 agent processes and `jetsplit server run` over mutual
TLS on a real Mosquitto with the provisioned ACL, while a fourth provisioned device (x9)
forges, replays, publishes outside its ACL and floods the reassembler. Every attempt is
refused by the broker or counted as rejected by the coordinator, and the run ends with the
same weights as the same run in one process."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import kit_lines, run_in_process, run_weights

from jetsplit.broker_url import BrokerAddress
from jetsplit.identity import load_signer
from jetsplit.server.fleet.provision import provision
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import Topics
from jetsplit.transport.mqtt import MqttEndpoint
from jetsplit.transport.settings import MqttSection
from jetsplit.wire import Message, MessageType, encode_message

NOT_AUTHORIZED = 135


class Attacker:
    """Device x9 (a genuine kit, not in the run) trying everything, until stopped."""

    def __init__(self, kits: Path, port: int) -> None:
        self.kits, self.port, self.topics = kits, port, Topics("live")
        kit = kits / "x9"
        options = MqttSection(broker=f"mqtts://localhost:{port}", tls_ca=str(kit / "ca.crt"),
                              tls_cert=str(kit / "client.crt"), tls_key=str(kit / "client.key"),
                              signing_key=str(kit / "signing.key"),
                              trusted_keys=str(kit / "trusted")).endpoint_options()
        self.endpoint = MqttEndpoint(BrokerAddress("localhost", port, tls=True), "x9", options)
        self.signer = load_signer(kit / "signing.key", "x9")
        self.acl_codes: list[int] = []
        self.sent: dict[str, int] = {}
        self.stop = threading.Event()

    def _raw(self):  # noqa: ANN202 - a plain MQTT 5 client with x9's certificate
        import paho.mqtt.client as mqtt

        codes: dict[int, int] = {}
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="x9-raw",
                             protocol=mqtt.MQTTv5)
        kit = self.kits / "x9"
        client.tls_set(ca_certs=str(kit / "ca.crt"), certfile=str(kit / "client.crt"),
                       keyfile=str(kit / "client.key"), cert_reqs=ssl.CERT_REQUIRED)
        client.on_publish = lambda c, u, mid, reason, p: codes.__setitem__(mid, reason.value)
        client.connect("localhost", self.port)
        client.loop_start()
        return client, codes

    def _count(self, what: str) -> None:
        self.sent[what] = self.sent.get(what, 0) + 1

    def run(self) -> None:
        t = self.topics
        self.endpoint.start(wait_s=30)
        raw, codes = self._raw()
        mids = []
        try:
            while not self.stop.wait(0.5):
                ep = self.endpoint
                # outside the ACL: another agent's up and presence, every down topic
                for topic in (t.up("a1"), t.presence("a0"), t.down_all, t.down("a2")):
                    forged = encode_message(Message(MessageType.COMMAND, run="-",
                                                    sender="coordinator", seq=ep.next_seq(),
                                                    kind="status"), signer=self.signer)
                    mids.append(raw.publish(topic, forged, qos=1).mid)
                    self._count("cross-topic")
                # spoof: signed by x9, claiming a1
                ep.publish_raw(t.up("x9"), encode_message(Message(
                    MessageType.ACK, run="-", sender="a1", seq=ep.next_seq()),
                    signer=self.signer))
                self._count("spoof")
                # unsigned
                ep.publish_raw(t.up("x9"), encode_message(Message(
                    MessageType.ACK, run="-", sender="x9", seq=ep.next_seq())))
                self._count("unsigned")
                # replay: the same signed bytes twice (the second is the attack), and a
                # message with an hour-old timestamp
                once = encode_message(Message(MessageType.ACK, run="-", sender="x9",
                                              seq=ep.next_seq()), signer=self.signer)
                ep.publish_raw(t.up("x9"), once)
                ep.publish_raw(t.up("x9"), once)
                ep.publish_raw(t.up("x9"), encode_message(Message(
                    MessageType.ACK, run="-", sender="x9", seq=ep.next_seq(),
                    ts=time.time() - 3600), signer=self.signer))
                self._count("replay")
                self._count("replay")
                # presence forgery: a year-old retained presence
                ep.publish_raw(t.presence("x9"), encode_message(Message(
                    MessageType.PRESENCE, run="-", sender="x9", seq=ep.next_seq(),
                    kind="presence", meta={"state": "online"}, ts=time.time() - 365 * 86400),
                    signer=self.signer), retain=True)
                self._count("presence")
                # reassembly flooding: first chunks of 8 messages that never finish
                for _ in range(8):
                    chunk = Message(MessageType.CHUNK, run="-", sender="x9",
                                    seq=ep.next_seq(), kind="chunk",
                                    meta={"id": f"x9.flood.{ep.next_seq()}", "index": 0,
                                          "count": 600, "total": 60_000_000, "size": 100_000},
                                    tensors={"data": np.zeros(100_000, np.uint8)})
                    ep.publish_raw(t.up("x9"), encode_message(chunk, signer=self.signer))
                    self._count("flood")
        finally:
            time.sleep(1.0)
            raw.loop_stop()
            raw.disconnect()
            self.acl_codes = [codes.get(m, -1) for m in mids]
            self.endpoint.close()


@pytest.mark.slow  # minutes on a busy 2-core machine: the attacker floods the broker
def test_attacked_mtls_fleet_matches_the_in_process_run(agent_fleet: Any,
                                                        tmp_path: Path) -> None:
    kits = tmp_path / "kits"
    provision("live", ["a0", "a1", "a2", "x9"], kits)
    with MosquittoProcess(provisioned=kits / "broker") as broker:
        url = f"mqtts://localhost:{broker.port}"
        fleet = agent_fleet(url, "live", 3, kits=kits).start()
        config = tmp_path / "server.toml"
        config.write_text(
            f'fleet = "live"\nagents = 3\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
            'run = "mqtt"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
            'split = 2\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\nalgorithm = "psl"\n'
            "rounds = 1\nlocal_steps = 20\nbatch = 48\nlr = 0.05\n"
            f'[mqtt]\nbroker = "{url}"\n' + kit_lines(kits / "coordinator"))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen([sys.executable, "-m", "jetsplit.cli", "server", "run",
                                   "--config", str(config)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        attacker = Attacker(kits, broker.port)
        thread = threading.Thread(target=attacker.run, daemon=True)
        thread.start()
        try:
            stdout, stderr = server.communicate(timeout=400)
        finally:
            attacker.stop.set()
            thread.join(30)
            if server.poll() is None:
                server.kill()
    assert server.returncode == 0, stderr[-3000:]
    assert "1 rounds with 3 agents" in stdout
    rounds = attacker.sent.get("spoof", 0)
    assert rounds >= 1, "the run ended before the attacker got a turn"
    assert attacker.acl_codes and set(attacker.acl_codes) == {NOT_AUTHORIZED}
    match = re.search(r"rejected messages: (.*)", stdout)
    assert match, stdout[-2000:]
    rejected = {k: int(n) for k, n in (p.rsplit(" ", 1) for p in match.group(1).split(", "))}
    # Each attack round the coordinator saw: a spoof and an unsigned message fail their
    # signatures, two replays are refused, the year-old presence is stale, and x9's flood
    # only ever evicts x9's own unfinished messages (its budget holds two of them).
    seen = rejected.get("StalePresence", 0)
    assert 3 <= seen <= rounds
    assert 2 * seen - 2 <= rejected.get("BadSignature", 0) <= 2 * seen + 2
    assert 2 * seen - 2 <= rejected.get("ReplayedMessage", 0) <= 2 * seen + 2
    assert rejected.get("ReassemblyEvicted", 0) >= 6 * (seen - 1)
    assert "SenderMismatch" not in rejected  # the broker's ACL stops those first

    run_in_process(fleet, config, tmp_path / "runs" / "local")
    a, b = run_weights(tmp_path / "runs" / "mqtt"), run_weights(tmp_path / "runs" / "local")
    assert set(a) == set(b) and len(a) > 50
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []

"""SHeRL-FL over a real broker: client and edge agent processes with `jetsplit server run`,
the direct client↔edge topics, a site broker bridged to the cloud, and the same fleet in one
process ending bit-identical."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import run_in_process, server_run

from jetsplit.protocol import Kind
from jetsplit.server.ops.brokers import MosquittoProcess

# ---------------------------------------------------------------- contrastive loss

D_45 = 1 - 1 / math.sqrt(2)  # cosine distance of two vectors 45° apart


EDGE_KINDS = {Kind.EDGE_LOAD.value, Kind.EDGE_STEP.value, Kind.GET_WEIGHTS.value}
SETUP_KINDS = {Kind.BUNDLE.value, Kind.BUNDLE_PART.value, Kind.STATUS.value,
               Kind.REGISTER.value}


class _Watcher:
    """A plain MQTT subscriber that decodes every jetsplit envelope it sees (unsigned
    fleets) and keeps (topic, kind) pairs: what crossed a broker."""

    def __init__(self, port: int, pattern: str) -> None:
        import threading

        import paho.mqtt.client as mqtt

        from jetsplit.wire import MessageType, Reassembler, decode_message

        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        reassembler = Reassembler()

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            try:
                message = decode_message(msg.payload)
                if message.type == MessageType.CHUNK:
                    whole = reassembler.feed(message)
                    if whole is None:
                        return
                    message = decode_message(whole)
                kind = message.kind
            except Exception as exc:  # noqa: BLE001 - recorded, so a test sees it
                kind = f"undecodable: {exc}"
            with self._lock:
                self.seen.append((msg.topic, kind))

        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"watch-{port}-{os.getpid()}")
        self.client.on_message = on_message
        self.client.on_subscribe = lambda *a: self._ready.set()
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(pattern, qos=1)
        self.client.loop_start()
        assert self._ready.wait(10)

    def topics(self, part: str) -> list[tuple[str, str]]:
        with self._lock:
            return [(t, k) for t, k in self.seen if f"/{part}/" in t]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _server_config(tmp_path: Path, fleet: str, agents: int, run: str, train: str,
                   topology: str) -> Path:
    config = tmp_path / f"{run}.toml"
    config.write_text(
        f'fleet = "{fleet}"\nagents = {agents}\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        f'run = "{run}"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 2\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\nalgorithm = "sherl"\n'
        f"{train}[topology]\n{topology}")
    return config


def _assert_same_as_in_process(fleet: Any, config: Path, tmp_path: Path, run: str) -> None:
    """The same fleet and config in process end with the same weights and accuracies as
    the MQTT run `run`, bit for bit."""
    from safetensors.numpy import load_file

    run_in_process(fleet, config, tmp_path / "runs" / f"{run}-local")

    runs = tmp_path / "runs"
    for name in ("server.safetensors", "client.safetensors"):
        a, b = (load_file(str(runs / r / name)) for r in (run, f"{run}-local"))
        assert all(a[k].tobytes() == b[k].tobytes() for k in a) and set(a) == set(b), name
    mqtt_rows, local_rows = ([json.loads(line) for line in (runs / r / "metrics.jsonl").open()]
                             for r in (run, f"{run}-local"))
    assert [r["accuracy"] for r in mqtt_rows] == [r["accuracy"] for r in local_rows]


def test_sherl_over_mqtt_two_edges_four_clients(mosquitto: MosquittoProcess, agent_fleet: Any,
                                                 tmp_path: Path) -> None:
    """`jetsplit server run` with 4 client and 2 edge agent processes: 3 rounds; edges
    only ever receive edge commands and models, never a backward or a gradient; smashed
    data and gradients travel only on the assigned pairs' direct topics; and the same fleet
    in one process ends with the same model, bit for bit."""
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    watcher = _Watcher(mosquitto.port, "jetsplit/v1/sherl/#")
    fleet = agent_fleet(url, "sherl", 4, edges=2).start()
    config = _server_config(tmp_path, "sherl", 6, "mqtt",
                            "rounds = 3\nlocal_steps = 4\ntau1 = 2\nbatch = 32\nlr = 0.05\n",
                            'edges.e0 = ["a0", "a2"]\nedges.e1 = ["a1", "a3"]\n')
    done = server_run(config, url, timeout=500)
    watcher.close()
    assert "3 rounds with 6 agents" in done.stdout
    run = tmp_path / "runs" / "mqtt"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    summary = json.loads((run / "summary.json").read_text())
    assert len(rows) == 3 and summary["missed"] == []
    assert all(r["selected"] == ["a0", "a1", "a2", "a3"] for r in rows)
    assert [r["aggregations"] for r in rows] == [{"edge": 2 * i, "cloud": i} for i in (1, 2, 3)]
    assert rows[0]["edge_split"] == 13  # planned: the cloud keeps the classifier head
    for row in rows:
        assert sum(row["tier_bytes"].values()) == row["bytes_up"] + row["bytes_down"]
        assert "relay" not in row["tier_bytes"]
    counters = summary["bytes"]
    for edge in ("e0", "e1"):
        assert set(counters[edge]["down"]) - SETUP_KINDS == EDGE_KINDS
        assert set(counters[edge]["up"]) - SETUP_KINDS == EDGE_KINDS | {Kind.GRADIENT.value}
    # Role-true bundles: edges hold their middle block only, clients their client block;
    # no device ever received the server block (nor the classifier with it).
    state = tmp_path / "state" / "sherl"
    for edge in ("e0", "e1"):
        (installed,) = (state / edge / "bundles").iterdir()
        assert {p.name for p in installed.iterdir()} == {"manifest.json", "edge.safetensors"}
    assert not list(state.rglob("server.safetensors"))
    for client in ("a0", "a1", "a2", "a3"):
        assert counters[client]["down"][Kind.BACKWARD.value] > 0
        assert counters[client]["up"][Kind.SMASHED.value] > 0
        assert not set(counters[client]["down"]) & {Kind.EDGE_STEP.value, Kind.EDGE_LOAD.value,
                                                    Kind.GRADIENT.value, Kind.SMASHED.value}
    # What crossed the broker: smashed data only client → its edge, gradients only edge →
    # its client, 3 rounds × 4 steps each; nothing of the kind on the coordinator's topics.
    base = "jetsplit/v1/sherl"
    pairs = {"a0": "e0", "a2": "e0", "a1": "e1", "a3": "e1"}
    direct = watcher.topics("peer")
    assert sorted(set(direct)) == sorted(
        [(f"{base}/peer/{e}/{c}", "smashed") for c, e in pairs.items()]
        + [(f"{base}/peer/{c}/{e}", "gradient") for c, e in pairs.items()])
    assert len(direct) == 2 * 4 * 3 * 4
    assert not {k for _, k in watcher.topics("up") + watcher.topics("down")} & {
        "smashed", "gradient"}
    _assert_same_as_in_process(fleet, config, tmp_path, "mqtt")


@pytest.mark.slow
def test_sherl_with_a_site_broker_bridged_to_the_cloud(agent_fleet: Any, tmp_path: Path
                                                       ) -> None:
    """The field deployment: the coordinator on the cloud broker; an edge and its two
    clients on a site broker bridged to it (`site_bridge_conf`). Training gives the same
    weights as the in-process run, and the client↔edge topics never cross the bridge: a
    subscriber on the cloud broker sees the fleet's up/, presence/ and down/ traffic but no
    direct message, while the site broker carried all of them."""
    from jetsplit.server.ops.brokers import site_bridge_conf

    base = "jetsplit/v1/site"
    with MosquittoProcess() as cloud, \
            MosquittoProcess(extra=site_bridge_conf("site", cloud.address)) as site:
        on_cloud = _Watcher(cloud.port, f"{base}/#")
        on_site = _Watcher(site.port, f"{base}/peer/#")
        fleet = agent_fleet(f"mqtt://127.0.0.1:{site.port}", "site", 2, edges=1).start()
        config = _server_config(tmp_path, "site", 3, "bridged",
                                "rounds = 2\nlocal_steps = 2\ntau1 = 1\nbatch = 16\n"
                                'lr = 0.05\ncodec = "fp16"\n', 'edges.e0 = ["a0", "a1"]\n')
        done = server_run(config, f"mqtt://127.0.0.1:{cloud.port}", timeout=500)
        on_cloud.close()
        on_site.close()
    assert "2 rounds with 3 agents" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "bridged" / "metrics.jsonl").open()]
    assert [r["missed"] for r in rows] == [{}, {}]
    assert all(r["tier_bytes"]["client_to_edge"] > 0 for r in rows)
    assert len(on_site.topics("peer")) == 2 * 2 * 2 * 2  # 2 clients, 2 kinds, 2 steps, 2 rounds
    assert on_cloud.topics("peer") == []
    crossed = {t.split("/")[3] for t, _ in on_cloud.seen}
    assert crossed == {"up", "presence", "down"}  # the bridge carried the rest both ways
    assert {k for _, k in on_cloud.seen} >= {Kind.EDGE_STEP.value, Kind.FORWARD.value}
    _assert_same_as_in_process(fleet, config, tmp_path, "bridged")

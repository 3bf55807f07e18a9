"""The coordinator's Prometheus exporter: served on loopback, scraped with urllib, parsed
line by line against the text exposition format (0.0.4)."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

from jetsplit.errors import ConfigError
from jetsplit.server.fleet.books import FleetBooks
from jetsplit.server.ops.prometheus import MetricsExporter, round_callback


def escape_label(value: str) -> str:
    """A label value as the exposition format writes it: \\, " and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

ROW = {"round": 2, "algorithm": "scala", "accuracy": 0.8125, "balanced_accuracy": 0.79,
       "train_loss": 0.4321, "seconds": 3.5, "bytes_up_total": 123456,
       "bytes_down_total": 654321}
SNAPSHOT = [
    {"agent": "nano-01", "state": "online", "stragglers": 1, "errors": 0},
    {"agent": "nano-02", "state": "busy", "stragglers": 0, "errors": 2},
    {"agent": "orin-1", "state": "offline", "stragglers": 4, "errors": 0},
]
TELEMETRY = {
    "nano-01": {"rss_mb": 512.0, "mem_available_mb": 1024.0, "mem_total_mb": 3964.0,
                "cpu_process_pct": 180.5, "cpu_system_pct": 55.0, "temp_c": 51.5,
                "gpu": {"gpu_load_pct": 99.0, "power_mw": 8912.0}},
    'we"ird\\agent\n': {"rss_mb": 1.0, "temp_c": None, "gpu": None},
}
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, labels); every family has HELP and TYPE before its samples."""
    assert text.endswith("\n")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    typed: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("gauge", "counter") and name in helped
            typed[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, line
            name, labels = match.group(1), match.group(3) or ""
            assert name in typed, name
            if typed[name] == "counter":
                assert name.endswith("_total"), name
            pairs = tuple(
                (k, v.replace('\\n', "\n").replace('\\"', '"').replace("\\\\", "\\"))
                for k, v, _ in LABEL.findall(labels))
            assert ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) == labels
            samples[(name, pairs)] = float(match.group(4))
    return samples


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_exporter_serves_rounds_bytes_and_fleet() -> None:
    with MetricsExporter(0) as exporter:
        assert exporter.port > 0
        ctype, body = scrape(exporter.port)
        assert ctype.startswith("text/plain; version=0.0.4") and body == ""
        exporter.update_round(ROW)
        exporter.update_round({**ROW, "round": 3, "train_loss": None})
        exporter.update_bytes({"up": {"forward": 1000, "train": 24}, "down": {"bundle": 77}})
        exporter.update_agents(SNAPSHOT, TELEMETRY)
        _, body = scrape(exporter.port)
    got = parse_exposition(body)
    assert got[("jetsplit_round", ())] == 3
    assert got[("jetsplit_rounds_completed_total", ())] == 2
    assert got[("jetsplit_accuracy", ())] == 0.8125
    assert got[("jetsplit_balanced_accuracy", ())] == 0.79
    assert ("jetsplit_train_loss", ()) not in got  # None: no sample rather than a fake 0
    assert got[("jetsplit_bytes_total", (("direction", "up"),))] == 123456
    assert got[("jetsplit_bytes_by_kind_total", (("direction", "up"), ("kind", "forward")))
               ] == 1000
    assert got[("jetsplit_bytes_by_kind_total", (("direction", "down"), ("kind", "bundle")))
               ] == 77
    for state, count in (("online", 1), ("busy", 1), ("offline", 1)):
        assert got[("jetsplit_agents", (("state", state),))] == count
    assert got[("jetsplit_agent_missed_steps_total",
                (("agent", "orin-1"), ("reason", "straggler")))] == 4
    nano = (("agent", "nano-01"),)
    assert got[("jetsplit_agent_rss_bytes", nano)] == 512 * 2**20
    assert got[("jetsplit_agent_memory_available_bytes", nano)] == 1024 * 2**20
    assert got[("jetsplit_agent_cpu_percent", nano)] == 180.5
    assert got[("jetsplit_agent_temperature_celsius", nano)] == 51.5
    assert got[("jetsplit_agent_gpu_load_percent", nano)] == 99.0
    assert got[("jetsplit_agent_power_watts", nano)] == pytest.approx(8.912)
    weird = (("agent", 'we"ird\\agent\n'),)  # escaped on the wire, intact after parsing
    assert got[("jetsplit_agent_rss_bytes", weird)] == 2**20
    assert ("jetsplit_agent_temperature_celsius", weird) not in got
    assert 'agent="we\\"ird\\\\agent\\n"' in body


def test_exporter_404s_elsewhere_and_binds_loopback() -> None:
    with MetricsExporter(0) as exporter:
        with pytest.raises(urllib.error.HTTPError) as info:
            scrape(exporter.port, "/")
        assert info.value.code == 404
        assert exporter._server is not None
        assert exporter._server.server_address[0] == "127.0.0.1"


def test_exporter_rejects_bad_settings_in_one_line() -> None:
    with pytest.raises(ConfigError, match="metrics port must be 0-65535"):
        MetricsExporter(70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot serve metrics on 127.0.0.1"):
            MetricsExporter(taken.getsockname()[1]).start()


def test_round_callback_exports_the_books_telemetry() -> None:
    from jetsplit.data import ArrayDataset
    from jetsplit.edge_agent.worker import AgentWorker
    from jetsplit.server.engines.seam import InProcessEngine

    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    engine = InProcessEngine({f"a{i}": AgentWorker(f"a{i}", data) for i in range(2)})
    books = FleetBooks(engine)
    with MetricsExporter(0) as exporter:
        row = {**ROW, "round": 0}
        row.update(books.collect(row))  # run_training's row_extras, then on_round
        round_callback(exporter, engine, books)(row)
        _, body = scrape(exporter.port)
    got = parse_exposition(body)
    assert got[("jetsplit_agents", (("state", "online"),))] == 2
    for agent in ("a0", "a1"):
        assert got[("jetsplit_agent_rss_bytes", (("agent", agent),))] > 0
    assert got[("jetsplit_bytes_by_kind_total", (("direction", "up"), ("kind", "status")))] > 0
    assert set(row["agents"]) == {"a0", "a1"}
    assert row["agents"]["a0"]["state"] == "online" and row["agents"]["a0"]["rss_mb"] > 0

"""`jetsplit server run --metrics-port N`: the coordinator's progress and its fleet's health
as Prometheus metrics (text exposition format 0.0.4) on http://127.0.0.1:N/metrics.

The values are a snapshot replaced once per round; `prometheus_client` turns it into metric
families (a custom collector on a private registry, so nothing leaks into its global one)
and writes the exposition text, escaping included. A stdlib `http.server` in a daemon
thread serves exactly `/metrics` (404 elsewhere), bound to loopback by default; expose it
further only on purpose (`--metrics-host`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from jetsplit.errors import ConfigError
from jetsplit.server.defences.untrusted_numbers import finite

if TYPE_CHECKING:
    from jetsplit.server.engines.seam import Engine
    from jetsplit.server.fleet.books import FleetBooks

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MB = 1024 * 1024
STATES = ("online", "busy", "offline")

# name → (type, help). Every family the exporter can emit, in output order.
FAMILIES: dict[str, tuple[str, str]] = {
    "jetsplit_round": ("gauge", "Index of the last finished training round."),
    "jetsplit_rounds_completed_total": ("counter", "Training rounds finished by this run."),
    "jetsplit_accuracy": ("gauge", "Top-1 accuracy on the held-out test split."),
    "jetsplit_balanced_accuracy": ("gauge", "Balanced (mean per-class) test accuracy."),
    "jetsplit_train_loss": ("gauge", "Mean training loss of the last round."),
    "jetsplit_round_seconds": ("gauge", "Wall time of the last round."),
    "jetsplit_bytes_total": ("counter", "Bytes on the wire, by direction (up: to the "
                             "coordinator)."),
    "jetsplit_bytes_by_kind_total": ("counter", "Bytes on the wire, by direction and "
                                     "message kind."),
    "jetsplit_agents": ("gauge", "Registered agents, by state."),
    "jetsplit_agent_missed_steps_total": ("counter", "Steps an agent missed, by reason "
                                          "(straggler: deadline or offline)."),
    "jetsplit_agent_rss_bytes": ("gauge", "Resident memory of the agent process."),
    "jetsplit_agent_memory_available_bytes": ("gauge", "Memory available on the device "
                                              "(MemAvailable; unified with the GPU on Jetson)."),
    "jetsplit_agent_memory_total_bytes": ("gauge", "Memory installed on the device."),
    "jetsplit_agent_cpu_percent": ("gauge", "CPU used by the agent process (100 = one core)."),
    "jetsplit_agent_system_cpu_percent": ("gauge", "CPU used by the whole device."),
    "jetsplit_agent_temperature_celsius": ("gauge", "Hottest thermal zone of the device."),
    "jetsplit_agent_gpu_load_percent": ("gauge", "Jetson GPU (GR3D) load."),
    "jetsplit_agent_power_watts": ("gauge", "Device power draw (input rail, else the sum of "
                                   "rails)."),
}
# telemetry key → (family, scale to the family's unit)
_TELEMETRY = {
    "rss_mb": ("jetsplit_agent_rss_bytes", MB),
    "mem_available_mb": ("jetsplit_agent_memory_available_bytes", MB),
    "mem_total_mb": ("jetsplit_agent_memory_total_bytes", MB),
    "cpu_process_pct": ("jetsplit_agent_cpu_percent", 1),
    "cpu_system_pct": ("jetsplit_agent_system_cpu_percent", 1),
    "temp_c": ("jetsplit_agent_temperature_celsius", 1),
}

Sample = tuple[str, dict[str, str], float]  # (family, labels, value)


class _Snapshot:
    """A prometheus_client collector over the exporter's latest samples."""

    def __init__(self, samples: Callable[[], list[Sample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        by_family: dict[str, list[Sample]] = {}
        for sample in self._samples():
            if sample[0] not in FAMILIES:
                raise ValueError(f"unknown metric family {sample[0]!r}")
            by_family.setdefault(sample[0], []).append(sample)
        for name, (kind, text) in FAMILIES.items():
            samples = by_family.get(name)
            if not samples:
                continue
            labels = sorted({k for _, lab, _ in samples for k in lab})
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, text, labels=labels)
            for _, lab, value in sorted(samples, key=lambda s: sorted(s[1].items())):
                family.add_metric([lab.get(k, "") for k in labels], value)
            yield family


class MetricsExporter:
    """Holds the latest values and serves them; `update_*` may be called from any thread."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be 0-65535 (0 picks a free one), got {port!r}")
        if not host or any(c.isspace() for c in host):
            raise ConfigError(f"metrics host must be an address or host name, got {host!r}")
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._round: list[Sample] = []
        self._bytes: list[Sample] = []
        self._agents: list[Sample] = []
        self._rounds_done = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        from prometheus_client import CollectorRegistry

        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Snapshot(self._snapshot))  # type: ignore[arg-type]

    # -- serving ---------------------------------------------------------------------------
    def start(self) -> MetricsExporter:
        """Bind and serve in a daemon thread; `port` then holds the bound port."""
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._answer(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(head=True)

            def _answer(self, head: bool) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    body, status, ctype = b"not found: try /metrics\n", 404, "text/plain"
                else:
                    body, status, ctype = exporter.render().encode(), 200, CONTENT_TYPE
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("metrics %s: " + format, self.address_string(), *args)

        try:
            server = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: "
                              f"{exc.strerror or exc}") from None
        server.daemon_threads = True
        self._server, self.port = server, int(server.server_address[1])
        self._thread = threading.Thread(target=server.serve_forever, args=(0.1,),
                                        daemon=True, name="jetsplit-metrics")
        self._thread.start()
        log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- updates ---------------------------------------------------------------------------
    def update_round(self, row: Mapping[str, Any]) -> None:
        """One metrics row of `run_training` (round, accuracies, loss, byte totals)."""
        samples: list[Sample] = []
        for key, family in (("round", "jetsplit_round"), ("accuracy", "jetsplit_accuracy"),
                            ("balanced_accuracy", "jetsplit_balanced_accuracy"),
                            ("train_loss", "jetsplit_train_loss"),
                            ("seconds", "jetsplit_round_seconds")):
            value = finite(row.get(key))
            if value is not None:
                samples.append((family, {}, value))
        for direction in ("up", "down"):
            value = finite(row.get(f"bytes_{direction}_total"))
            if value is not None:
                samples.append(("jetsplit_bytes_total", {"direction": direction}, value))
        with self._lock:
            self._rounds_done += 1
            samples.append(("jetsplit_rounds_completed_total", {}, float(self._rounds_done)))
            self._round = samples

    def update_bytes(self, by_kind: Mapping[str, Mapping[str, int]]) -> None:
        """Run totals by direction and kind (`engine.counters.by_kind()`)."""
        samples = [("jetsplit_bytes_by_kind_total", {"direction": d, "kind": str(k)}, float(n))
                   for d in ("up", "down") for k, n in (by_kind.get(d) or {}).items()
                   if finite(n) is not None]
        with self._lock:
            self._bytes = samples

    def update_agents(self, registry_snapshot: Iterable[Mapping[str, Any]] |
                      Mapping[str, Mapping[str, Any]],
                      telemetry: Mapping[str, Mapping[str, Any]]) -> None:
        """Fleet state (`engine.registry.snapshot()`: a list of agent records, or a mapping of
        agent → record) and each agent's last `status` telemetry, keyed by agent id."""
        records = (list(registry_snapshot.values()) if isinstance(registry_snapshot, Mapping)
                   else list(registry_snapshot))
        counts = dict.fromkeys(STATES, 0)
        samples: list[Sample] = []
        for record in records:
            agent = str(record.get("agent", ""))
            state = record.get("state")
            if state in counts:
                counts[state] += 1
            for reason, key in (("straggler", "stragglers"), ("error", "errors")):
                value = finite(record.get(key))
                if agent and value is not None:
                    samples.append(("jetsplit_agent_missed_steps_total",
                                    {"agent": agent, "reason": reason}, value))
        samples += [("jetsplit_agents", {"state": s}, float(n)) for s, n in counts.items()]
        for agent, reading in telemetry.items():
            if not isinstance(reading, Mapping):
                continue
            labels = {"agent": str(agent)}
            for key, (family, scale) in _TELEMETRY.items():
                value = finite(reading.get(key))
                if value is not None:  # bytes as whole numbers, percent/°C as sent
                    samples.append((family, labels, float(round(value * scale))
                                    if scale != 1 else value))
            gpu = reading.get("gpu")
            if isinstance(gpu, Mapping):
                load, power = finite(gpu.get("gpu_load_pct")), finite(gpu.get("power_mw"))
                if load is not None:
                    samples.append(("jetsplit_agent_gpu_load_percent", labels, load))
                if power is not None:
                    samples.append(("jetsplit_agent_power_watts", labels, power / 1000))
        with self._lock:
            self._agents = samples

    def _snapshot(self) -> list[Sample]:
        with self._lock:
            return [*self._round, *self._bytes, *self._agents]

    def render(self) -> str:
        """The exposition text (prometheus_client's writer)."""
        from prometheus_client import generate_latest

        return generate_latest(self._registry).decode()


def round_callback(exporter: MetricsExporter, engine: Engine, books: FleetBooks
                   ) -> Callable[[dict[str, Any]], None]:
    """The `on_round` hook for `run_training`: the row, the byte counters and the fleet
    (with the telemetry `books` polled for the row) into the exporter. A failure is
    logged, never raised: metrics must not stop training."""

    def on_round(row: dict[str, Any]) -> None:
        try:
            exporter.update_round(row)
            exporter.update_bytes(engine.counters.by_kind())
            exporter.update_agents(engine.registry.snapshot(), books.telemetry)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("metrics: update failed: %s", exc)

    return on_round

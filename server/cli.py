"""`jetsplit server run --config server.toml`: the coordinator over MQTT (flags override)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="The coordinator.")


@app.command("run")
def run(
    config: Annotated[Path, typer.Option("--config", help="server.toml to read.")],
    broker: Annotated[str | None, typer.Option(
        "--broker", help="mqtt[s]://[user:pass@]host:port (overrides mqtt.broker).")] = None,
    fleet: Annotated[str | None, typer.Option("--fleet", help="Overrides fleet.")] = None,
    agents: Annotated[int | None, typer.Option("--agents", help="Overrides agents.")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Overrides out.")] = None,
    run_id: Annotated[str | None, typer.Option("--run", help="Overrides run.")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics at /metrics on this port (0: any "
        "free port); off by default.")] = None,
    metrics_host: Annotated[str, typer.Option(
        "--metrics-host", help="Address the metrics endpoint binds to.")] = "127.0.0.1",
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="Continue the run in DIR from its last checkpoint (same config).")
    ] = None,
) -> None:
    """Wait for the fleet, ship the bundle, train, write metrics, summary and weights."""
    from jetsplit.config_io import model_from_dict
    from jetsplit.data import load_dataset_split
    from jetsplit.errors import ConfigError
    from jetsplit.server.config import ServerConfig, load_server_config
    from jetsplit.server.coordinator import prepare_bundle
    from jetsplit.server.fleet_books import FleetBooks
    from jetsplit.server.mqtt_engine import MqttEngine
    from jetsplit.server.prometheus import round_callback
    from jetsplit.server.training import run_training

    cfg = load_server_config(config)
    data = cfg.model_dump()
    overrides = {"fleet": fleet, "agents": agents, "out": out, "run": run_id}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if broker:
        data["mqtt"]["broker"] = broker
    cfg = model_from_dict(ServerConfig, data, "server config", str(config))
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_name = cfg.run or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    out_dir = Path(cfg.out) / run_name
    if resume is not None:
        out_dir, run_name = resume, resume.name
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:
        shutil.copyfile(config, out_dir / "config.toml")  # what this run used, for its report
    engine = MqttEngine(cfg.mqtt.address(), cfg.fleet, run_id=run_name,
                        options=cfg.mqtt.endpoint_options()).start(cfg.mqtt.connect_wait_s)
    exporter = None
    try:
        if metrics_port is not None:
            from jetsplit.server.prometheus import MetricsExporter

            exporter = MetricsExporter(metrics_port, metrics_host).start()
            typer.echo(f"metrics on http://{metrics_host}:{exporter.port}/metrics")
        online = engine.wait_for_agents(cfg.agents, cfg.wait_s)
        if len(online) < cfg.agents:
            raise ConfigError(f"only {len(online)} of {cfg.agents} agents registered within "
                              f"{cfg.wait_s:.0f}s ({', '.join(online) or 'none'})")
        _, test = load_dataset_split(cfg.data.dataset, cfg.data.test_fraction, cfg.data.seed)
        with tempfile.TemporaryDirectory(prefix="jetsplit-server-") as tmp:
            archive = (out_dir / "checkpoint" / "bundle.tar.gz" if resume is not None
                       else prepare_bundle(cfg, Path(tmp)))
            books = FleetBooks(engine)  # per-agent time split and telemetry per round
            on_round = None if exporter is None else round_callback(exporter, engine, books)
            summary = run_training(engine, archive, cfg.settings(), test, out_dir,
                                   on_round=on_round, row_extras=books.collect,
                                   resume=resume is not None)
    finally:
        engine.close()
        if exporter is not None:
            exporter.close()
    from jetsplit.server.report import write_report

    report = write_report(out_dir, title=f"jetsplit run {run_name}: {summary['algorithm']}")
    accuracy = summary["final_accuracy"]
    typer.echo(f"{summary['algorithm']}: {summary['rounds']} rounds with {len(online)} agents "
               f"in {summary['seconds']:.1f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}; "
               f"metrics and summary in {out_dir}; report: {report}")
    rejected = sorted(engine.endpoint.rejected.items())
    if rejected:  # forged, replayed, malformed or flooding messages that were dropped
        typer.echo("rejected messages: " + ", ".join(f"{k} {n}" for k, n in rejected))

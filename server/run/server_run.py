"""`jetsplit server run --config server.toml`: the coordinator over MQTT (flags override)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from jetsplit.server.run.flags import train_flags

app = typer.Typer(no_args_is_help=True, help="The coordinator.")


@app.command("run")
@train_flags("algorithm", "rounds", "local_steps", "batch", "lr", "fraction", "deadline_s",
             "codec", "compression", "size_cap", "max_misses",
             "aggregator", "clip_factor", "robust_fraction", "outlier_bound", "activation_bound",
             "loss_bound", "histogram_check", "label_check", "direction_check",
             "gradient_bound", "gradient_shares",
             "replan", "replan_threshold", "replan_clock")
def run(
    train: dict[str, Any],
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
    auto_resume: Annotated[bool, typer.Option(
        "--auto-resume", help="Continue OUT/RUN from its checkpoint when it has one, else "
        "start it (for a service restarted after a crash; needs --run or `run`).")] = False,
    tensorboard: Annotated[str | None, typer.Option(
        "--tensorboard", help="Also write per-round scalars for TensorBoard into DIR.")
    ] = None,
    mlflow: Annotated[str | None, typer.Option(
        "--mlflow", help="Also log per-round metrics to this MLflow tracking URI.")] = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="auto | cpu | cuda: where server blocks and evaluation run "
        "(overrides server.device).")] = None,
) -> None:
    """Wait for the fleet, ship the bundle, train, write metrics, summary and weights."""
    from jetsplit.cli_types import check_port
    from jetsplit.config_io import model_from_dict
    from jetsplit.data import load_dataset_split
    from jetsplit.data.checks import check_data_options
    from jetsplit.devices import resolve_device
    from jetsplit.errors import ConfigError
    from jetsplit.server.engines.mqtt import MqttEngine
    from jetsplit.server.fleet.books import FleetBooks
    from jetsplit.server.ops.prometheus import round_callback
    from jetsplit.server.ops.tracking import Trackers
    from jetsplit.server.run.assembly import (
        RunSpec,
        bundle_for,
        execute,
        folder_run_id,
        prepare_bundle,
    )
    from jetsplit.server.run.config import ServerConfig, TrainSection, load_server_config
    from jetsplit.server.run.preflight import (
        check_split,
        validate_options,
    )

    check_port(metrics_port, "--metrics-port")
    if resume is not None and auto_resume:
        raise ConfigError("--resume and --auto-resume: give one of them")
    cfg = load_server_config(config)
    data = cfg.model_dump()
    overrides = {"fleet": fleet, "agents": agents, "out": out, "run": run_id}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if train:
        data["train"] = validate_options(TrainSection, {**data["train"], **train}, {}
                                         ).model_dump()
    if broker:
        data["mqtt"]["broker"] = broker
    if device is not None:
        data["server"]["device"] = device
    cfg = model_from_dict(ServerConfig, data, "server config", str(config))
    resolve_device(cfg.server.device, "--device" if device is not None else "server.device")
    check_data_options(cfg.data.dataset)
    if cfg.train.replan == "on" and (cfg.model.split != "auto" or cfg.model.cuts):
        raise ConfigError('[train] replan = "on" re-plans the planner\'s cuts: it needs '
                          '[model] split = "auto" and no [model.cuts] by hand')
    if auto_resume:
        if cfg.run is None:
            raise ConfigError("--auto-resume needs a fixed run name (--run NAME or `run`)")
        candidate = Path(cfg.out) / cfg.run
        if (candidate / "checkpoint" / "state.json").is_file():
            resume = candidate
            typer.echo(f"resuming {candidate} from its checkpoint")
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_name = cfg.run or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    out_dir = Path(cfg.out) / run_name
    if resume is not None:
        out_dir, run_name = resume, folder_run_id(resume, "run", "--resume")
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:
        shutil.copyfile(config, out_dir / "config.toml")  # what this run used, for its report
    _, test = load_dataset_split(cfg.data.dataset, cfg.data.test_fraction, cfg.data.seed)
    if cfg.model.bundle is None and cfg.model.split != "auto":
        check_split(cfg.model.name, tuple(cfg.model.input_shape), cfg.model.classes,
                    cfg.model.split, flag="model.split")
    for who, cut in sorted(cfg.model.cuts.items()):  # agent id or profile name
        check_split(cfg.model.name, tuple(cfg.model.input_shape), cfg.model.classes, cut,
                    flag=f"model.cuts.{who} (device {who})")
    trackers = Trackers(tensorboard, mlflow, run_name=run_name,
                        params=cfg.train.model_dump())
    engine = MqttEngine(cfg.mqtt.address(), cfg.fleet, run_id=run_name,
                        options=cfg.mqtt.endpoint_options(),
                        retry_s=cfg.train.retry_s).start(cfg.mqtt.connect_wait_s)
    exporter = None
    try:
        if metrics_port is not None:
            from jetsplit.server.ops.prometheus import MetricsExporter

            exporter = MetricsExporter(metrics_port, metrics_host).start()
            typer.echo(f"metrics on http://{metrics_host}:{exporter.port}/metrics")
        online = engine.wait_for_agents(cfg.agents, cfg.wait_s)
        if len(online) < cfg.agents:
            raise ConfigError(f"only {len(online)} of {cfg.agents} agents registered within "
                              f"{cfg.wait_s:.0f}s ({', '.join(online) or 'none'})")
        cuts: dict[str, int] = {}
        replanner = None
        if cfg.model.split == "auto" or cfg.model.cuts:
            from jetsplit.server.cuts.planning import fleet_cuts, fleet_replanner

            t = cfg.train
            server_cut, cuts = fleet_cuts(
                cfg, {a: engine.registry.registration(a) for a in online},
                batch=max(1, t.batch // max(1, len(online))), local_steps=t.local_steps,
                rounds=t.rounds, codec=t.codec)
            if cfg.model.bundle:  # its split is the server cut; devices get shallower blocks
                from jetsplit.bundle import load_bundle

                server_cut = load_bundle(Path(cfg.model.bundle)).split
                deeper = sorted(a for a, c in cuts.items() if c > server_cut)
                if deeper:
                    raise ConfigError(f"agent {deeper[0]}: cut {cuts[deeper[0]]} is deeper "
                                      f"than the bundle's split {server_cut}")
            replanner = fleet_replanner(cfg, {a: engine.registry.registration(a)
                                              for a in online}, server_cut) \
                if t.replan == "on" else None
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
                update={"split": server_cut})})
            typer.echo(f"cuts: {cuts} (server cut {server_cut})")
        with tempfile.TemporaryDirectory(prefix="jetsplit-server-") as tmp:
            books = FleetBooks(engine)  # per-agent time split and telemetry per round
            spec = RunSpec(
                cfg.settings(), bundle_for(out_dir, resume is not None,
                                           lambda: prepare_bundle(cfg, Path(tmp))),
                test, out_dir, server_cut=int(cfg.model.split), cuts=cuts,
                resume=resume is not None, row_extras=[books.collect],
                on_round=[None if exporter is None else round_callback(exporter, engine, books),
                          trackers.log_round if trackers.active else None],
                report_title=f"jetsplit run {run_name}: {cfg.train.algorithm}",
                replanner=replanner)
            summary = execute(engine, spec)
    finally:
        engine.close()
        if exporter is not None:
            exporter.close()
        trackers.close()
    report = summary["report"]
    accuracy = summary["final_accuracy"]
    typer.echo(f"{summary['algorithm']}: {summary['rounds']} rounds with {len(online)} agents "
               f"in {summary['seconds']:.1f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}; "
               f"metrics and summary in {out_dir}; report: {report}")
    rejected = sorted(engine.endpoint.rejected.items())
    if rejected:  # forged, replayed, malformed or flooding messages that were dropped
        typer.echo("rejected messages: " + ", ".join(f"{k} {n}" for k, n in rejected))

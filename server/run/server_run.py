"""`jetsplit server run --config server.toml`: the coordinator over MQTT (flags override)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jetsplit.server.run.flags import train_flags

if TYPE_CHECKING:
    from jetsplit.data import Dataset
    from jetsplit.server.cuts.replanning import Replanner
    from jetsplit.server.engines.mqtt import MqttEngine
    from jetsplit.server.run.config import ServerConfig

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
    from jetsplit.errors import ConfigError
    from jetsplit.server.engines.mqtt import MqttEngine
    from jetsplit.server.ops.tracking import Trackers
    from jetsplit.server.run.assembly import LiveFleet, RunSpec, bundle_for, prepare_bundle
    from jetsplit.server.run.held_out import run_classes

    check_port(metrics_port, "--metrics-port")
    if resume is not None and auto_resume:
        raise ConfigError("--resume and --auto-resume: give one of them")
    cfg = _config(config, train, broker, device,
                  {"fleet": fleet, "agents": agents, "out": out, "run": run_id})
    if auto_resume:
        resume = _auto_resume(cfg)
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out_dir, run_name = _run_folder(cfg, config, resume)
    test = _held_out(cfg)
    classes = run_classes(test)
    trackers = Trackers(tensorboard, mlflow, run_name=run_name, params=cfg.train.model_dump())
    engine = MqttEngine(cfg.mqtt.address(), cfg.fleet, run_id=run_name,
                        options=cfg.mqtt.endpoint_options(),
                        retry_s=cfg.train.retry_s, classes=classes
                        ).start(cfg.mqtt.connect_wait_s)
    try:
        with LiveFleet(engine, metrics_port=metrics_port, metrics_host=metrics_host,
                       trackers=trackers) as live:
            address = live.serve_metrics()
            if address is not None:
                typer.echo(f"metrics on {address}")
            online = _wait(engine, cfg)
            cfg, cuts, replanner = _plan(cfg, engine, online)
            predicted = _predicted_steps(cfg, engine, online, cuts)
            with tempfile.TemporaryDirectory(prefix="jetsplit-server-") as tmp:
                summary = live.execute(RunSpec(
                    cfg.settings(), bundle_for(out_dir, resume is not None,
                                               lambda: prepare_bundle(cfg, Path(tmp), classes)),
                    test, out_dir, server_cut=int(cfg.model.split), cuts=cuts,
                    resume=resume is not None,
                    report_title=f"jetsplit run {run_name}: {cfg.train.algorithm}",
                    replanner=replanner, predicted_step_s=predicted))
    finally:
        trackers.close()
    _tell(summary, len(online), out_dir, sorted(engine.endpoint.rejected.items()))


def _config(path: Path, train: dict[str, Any], broker: str | None, device: str | None,
            overrides: dict[str, Any]) -> ServerConfig:
    """server.toml with the flags given laid over it, checked as a whole (one line naming
    the field or flag at fault)."""
    from jetsplit.config_io import model_from_dict
    from jetsplit.data.checks import check_data_options
    from jetsplit.devices import resolve_device
    from jetsplit.errors import ConfigError
    from jetsplit.server.run.config import ServerConfig, TrainSection, load_server_config
    from jetsplit.server.run.preflight import validate_options

    data = load_server_config(path).model_dump()
    data.update({k: v for k, v in overrides.items() if v is not None})
    if train:
        data["train"] = validate_options(TrainSection, {**data["train"], **train}, {}
                                         ).model_dump()
    if broker:
        data["mqtt"]["broker"] = broker
    if device is not None:
        data["server"]["device"] = device
    cfg = model_from_dict(ServerConfig, data, "server config", str(path))
    resolve_device(cfg.server.device, "--device" if device is not None else "server.device")
    check_data_options(cfg.data.dataset)
    if cfg.train.replan == "on" and (cfg.model.split != "auto" or cfg.model.cuts):
        raise ConfigError('[train] replan = "on" re-plans the planner\'s cuts: it needs '
                          '[model] split = "auto" and no [model.cuts] by hand')
    return cfg


def _auto_resume(cfg: ServerConfig) -> Path | None:
    """`--auto-resume`: OUT/RUN when it holds a checkpoint, else None (start it)."""
    from jetsplit.errors import ConfigError

    if cfg.run is None:
        raise ConfigError("--auto-resume needs a fixed run name (--run NAME or `run`)")
    candidate = Path(cfg.out) / cfg.run
    if not (candidate / "checkpoint" / "state.json").is_file():
        return None
    typer.echo(f"resuming {candidate} from its checkpoint")
    return candidate


def _run_folder(cfg: ServerConfig, config: Path, resume: Path | None) -> tuple[Path, str]:
    """The run folder and run id (a resumed run's own); a new run keeps its config.toml."""
    from jetsplit.server.run.assembly import folder_run_id

    run_name = cfg.run or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())
    out_dir = Path(cfg.out) / run_name
    if resume is not None:
        out_dir, run_name = resume, folder_run_id(resume, "run", "--resume")
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None:
        shutil.copyfile(config, out_dir / "config.toml")  # what this run used, for its report
    return out_dir, run_name


def _held_out(cfg: ServerConfig) -> Dataset:
    """The set the coordinator evaluates on; the configured cuts checked first."""
    from jetsplit.server.run.held_out import held_out_set
    from jetsplit.server.run.preflight import check_split

    shape, m = tuple(cfg.model.input_shape), cfg.model
    if m.bundle is None and m.split != "auto":
        check_split(m.name, shape, m.classes, m.split, flag="model.split")
    for who, cut in sorted(m.cuts.items()):  # agent id or profile name
        check_split(m.name, shape, m.classes, cut, flag=f"model.cuts.{who} (device {who})")
    return held_out_set(cfg.data, shape, m.classes)


def _wait(engine: MqttEngine, cfg: ServerConfig) -> list[str]:
    """The agents online once `cfg.agents` registered; one line when too few did in time."""
    from jetsplit.errors import ConfigError

    online = engine.wait_for_agents(cfg.agents, cfg.wait_s)
    if len(online) < cfg.agents:
        raise ConfigError(f"only {len(online)} of {cfg.agents} agents registered within "
                          f"{cfg.wait_s:.0f}s ({', '.join(online) or 'none'})")
    return online


def _plan(cfg: ServerConfig, engine: MqttEngine, online: list[str]
          ) -> tuple[ServerConfig, dict[str, int], Replanner | None]:
    """The cuts for the registered fleet ([model] split "auto" or [model.cuts]; none: every
    device at the config's split) and the live re-planner; the config's split becomes the
    server cut."""
    if cfg.model.split != "auto" and not cfg.model.cuts:
        return cfg, {}, None
    from jetsplit.errors import ConfigError
    from jetsplit.server.cuts.planning import fleet_cuts, fleet_replanner

    t = cfg.train
    registrations = {a: engine.registry.registration(a) for a in online}
    server_cut, cuts = fleet_cuts(cfg, registrations,
                                  batch=max(1, t.batch // max(1, len(online))),
                                  local_steps=t.local_steps, rounds=t.rounds, codec=t.codec)
    if cfg.model.bundle:  # its split is the server cut; devices get shallower blocks
        from jetsplit.bundle import load_bundle

        server_cut = load_bundle(Path(cfg.model.bundle)).split
        deeper = sorted(a for a, c in cuts.items() if c > server_cut)
        if deeper:
            raise ConfigError(f"agent {deeper[0]}: cut {cuts[deeper[0]]} is deeper "
                              f"than the bundle's split {server_cut}")
    replanner = (fleet_replanner(cfg, registrations, server_cut) if t.replan == "on"
                 else None)
    typer.echo(f"cuts: {cuts} (server cut {server_cut})")
    return cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"split": server_cut})}), cuts, replanner


def _predicted_steps(cfg: ServerConfig, engine: MqttEngine, online: list[str],
                     cuts: dict[str, int]) -> dict[str, float]:
    """Agent → the planner's seconds for its longest exchange, from the profiles the agents
    registered with: the step deadlines' floor covers the slowest
    (server/defences/step_deadlines.py)."""
    from jetsplit.server.cuts.planning import registered_steps

    t = cfg.train
    registrations = {a: engine.registry.registration(a) for a in online}
    return registered_steps(cfg, registrations, cuts,
                            batch=max(1, t.batch // max(1, len(online))),
                            local_steps=t.local_steps, rounds=t.rounds, codec=t.codec)


def _tell(summary: dict[str, Any], agents: int, out_dir: Path,
          rejected: list[tuple[str, int]]) -> None:
    """The run's last lines: what it trained, where its results are, what was dropped."""
    accuracy = summary["final_accuracy"]
    typer.echo(f"{summary['algorithm']}: {summary['rounds']} rounds with {agents} agents "
               f"in {summary['seconds']:.1f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}; "
               f"metrics and summary in {out_dir}; report: {summary['report']}")
    if rejected:  # forged, replayed, malformed or flooding messages that were dropped
        typer.echo("rejected messages: " + ", ".join(f"{k} {n}" for k, n in rejected))

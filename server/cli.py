"""`jetsplit server run --config server.toml`: the coordinator over MQTT (flags override)."""

from __future__ import annotations

import logging
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
) -> None:
    """Wait for the fleet, ship the bundle, train, write metrics, summary and weights."""
    from jetsplit.config_io import model_from_dict
    from jetsplit.data import load_dataset_split
    from jetsplit.errors import ConfigError
    from server.config import ServerConfig, load_server_config
    from server.coordinator import prepare_bundle
    from server.mqtt_engine import MqttEngine
    from server.training import run_training

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
    engine = MqttEngine(cfg.mqtt.address(), cfg.fleet, run_id=run_name,
                        options=cfg.mqtt.endpoint_options()).start(cfg.mqtt.connect_wait_s)
    try:
        online = engine.wait_for_agents(cfg.agents, cfg.wait_s)
        if len(online) < cfg.agents:
            raise ConfigError(f"only {len(online)} of {cfg.agents} agents registered within "
                              f"{cfg.wait_s:.0f}s ({', '.join(online) or 'none'})")
        _, test = load_dataset_split(cfg.data.dataset, cfg.data.test_fraction, cfg.data.seed)
        with tempfile.TemporaryDirectory(prefix="jetsplit-server-") as tmp:
            archive = prepare_bundle(cfg, Path(tmp))
            summary = run_training(engine, archive, cfg.settings(), test, out_dir)
    finally:
        engine.close()
    accuracy = summary["final_accuracy"]
    typer.echo(f"{summary['algorithm']}: {summary['rounds']} rounds with {len(online)} agents "
               f"in {summary['seconds']:.1f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}; "
               f"metrics and summary in {out_dir}")

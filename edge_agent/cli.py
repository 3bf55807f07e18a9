"""`jetsplit agent run --config agent.toml`: the device daemon (flags override the file)."""

# No `from __future__ import annotations` here: typer reads this module's signatures, and on
# Python < 3.10 it does not evaluate string annotations (every typer.Option would be lost).

import logging
import signal
import threading
from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated

app = typer.Typer(no_args_is_help=True, help="The edge agent daemon.")


@app.command("run")
def run(
    config: Annotated[Path, typer.Option("--config", help="agent.toml to read.")],
    broker: Annotated[Optional[str], typer.Option(
        "--broker", help="mqtt[s]://[user:pass@]host:port (overrides mqtt.broker).")] = None,
    fleet: Annotated[Optional[str], typer.Option("--fleet", help="Overrides fleet.")] = None,
    agent: Annotated[Optional[str], typer.Option("--agent", help="Overrides agent.")] = None,
    state_dir: Annotated[Optional[str], typer.Option("--state-dir", help="Overrides state_dir.")
                         ] = None,
) -> None:
    """Connect to the broker and serve the coordinator's commands until SIGTERM."""
    from jetsplit.edge_agent.config import load_agent_config

    cfg = load_agent_config(config)  # a bad file is one line before torch is even imported
    from jetsplit.edge_agent.daemon import AgentDaemon
    from jetsplit.edge_agent.worker_factory import build_worker

    updates = {k: v for k, v in {"fleet": fleet, "agent": agent, "state_dir": state_dir}.items()
               if v is not None}
    mqtt = cfg.mqtt.model_copy(update={"broker": broker}) if broker else cfg.mqtt
    cfg = cfg.model_copy(update={**updates, "mqtt": mqtt})
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    address, options = cfg.mqtt.address(), cfg.mqtt.endpoint_options()
    worker = build_worker(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    AgentDaemon(worker, address, cfg.fleet, options).run(stop)


@app.command("host")
def host(
    config: Annotated[Path, typer.Option("--config", help="agent.toml every hosted agent "
                                         "starts from (agent = the id prefix).")],
    count: Annotated[int, typer.Option("--count", help="Agents to host in this process.")],
    first: Annotated[int, typer.Option("--first", help="Number of the first agent (its id "
                                       "is <agent><n>, its data shard n).")] = 0,
    stride: Annotated[int, typer.Option("--stride", help="Step between agent numbers.")] = 1,
    broker: Annotated[Optional[str], typer.Option(
        "--broker", help="mqtt[s]://[user:pass@]host:port (overrides mqtt.broker).")] = None,
    fleet: Annotated[Optional[str], typer.Option("--fleet", help="Overrides fleet.")] = None,
    state_dir: Annotated[Optional[str], typer.Option("--state-dir", help="Overrides state_dir.")
                         ] = None,
) -> None:
    """Run COUNT emulated agents in one process (one MQTT session each; a load generator
    and a cheap large trial) until SIGTERM."""
    from jetsplit.edge_agent.config import load_agent_config
    from jetsplit.edge_agent.host import FleetHost, hosted_indices

    indices = hosted_indices(count, first, stride)
    cfg = load_agent_config(config)
    updates = {k: v for k, v in {"fleet": fleet, "state_dir": state_dir}.items()
               if v is not None}
    mqtt = cfg.mqtt.model_copy(update={"broker": broker}) if broker else cfg.mqtt
    cfg = cfg.model_copy(update={**updates, "mqtt": mqtt})
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("jetsplit").setLevel(cfg.log_level.upper())
    fleet_host = FleetHost(cfg, indices).build()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet_host.run(stop)


@app.command("install", add_help_option=False, context_settings={
    "allow_extra_args": True, "ignore_unknown_options": True})
def install(ctx: typer.Context) -> None:
    """Install the agent as a systemd service: venv, user, /etc/jetsplit, unit (--help)."""
    from jetsplit.edge_agent.install import main  # its flags are defined once, there

    code = main(list(ctx.args))
    if code:
        raise typer.Exit(code)

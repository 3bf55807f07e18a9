"""`jetsplit fleet ls | status AGENT | logs AGENT | stop`: see and steer a fleet through its
broker, without a shell on any device.

The broker keeps every agent's last presence (retained; the last will turns it `offline`
when an agent dies), so listening on the presence topics for a moment lists the whole
fleet; presence envelopes are decoded here, so nothing readable has to be published twice.
Online agents are then asked for their `status` (answered idle or busy: memory,
temperature, bundle, cut, last round, last error, and on request the last log lines).
"""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from jetsplit.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="See and steer a fleet through its broker.")

PRESENCE_SETTLE_S = 1.0  # retained presence arrives right after subscribing
CLI_RUN = "fleet-cli"


@dataclass
class AgentView:
    """One row of `fleet ls`: presence plus, for online agents, their status reply."""

    agent: str
    state: str = "unknown"
    role: str | None = None
    status: dict[str, Any] | None = None
    error: str | None = None  # the agent answered the status request with an error

    def row(self) -> dict[str, Any]:
        from jetsplit.server.fleet.books import power_mode
        from jetsplit.server.fleet.live_estimates import LiveEstimates

        s = self.status or {}
        tele = s.get("telemetry") or {}
        books = s.get("time") if isinstance(s.get("time"), dict) else {}
        # the agent's links over its life so far (the coordinator's per-round estimates,
        # with its speed, are in each metrics row's `agents`)
        links = LiveEstimates().measure(self.agent, None, books)
        rss = tele.get("rss_mb")
        temp = tele.get("temp_c")
        state = self.state
        if state == "online" and s.get("pending_forwards"):
            state = "busy"
        elif state == "online" and self.status is None:
            state = "online (no status reply)"
        return {
            "agent": self.agent, "state": state, "role": s.get("role") or self.role,
            "profile": s.get("profile"), "bundle": (s.get("bundle") or "")[:12] or None,
            "cut": s.get("split"), "last_round": s.get("last_round"),
            "rss_mb": rss if isinstance(rss, (int, float)) else None,
            "temp_c": temp if isinstance(temp, (int, float)) else None,
            "power_mode": power_mode(books, tele) if self.status is not None else None,
            "up_mbps": links.get("uplink_mbps"), "down_mbps": links.get("downlink_mbps"),
            "last_error": s.get("last_error") or self.error,
        }


@dataclass
class FleetClient:
    """An ephemeral MQTT session that listens to presence and replies, and sends commands as
    the coordinator would (signed with the fleet key when there is one)."""

    broker: str
    fleet: str
    fleet_key_file: str | None = None
    tls_ca: str | None = None
    section: Any = None  # a coordinator config's [mqtt] (TLS, keys, signing) instead
    views: dict[str, AgentView] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from jetsplit.transport import COORDINATOR, Topics
        from jetsplit.transport.mqtt import MqttEndpoint
        from jetsplit.transport.settings import MqttSection

        section = self.section or MqttSection(broker=self.broker,
                                              fleet_key_file=self.fleet_key_file,
                                              tls_ca=self.tls_ca)
        if (section.operator_cert is None) != (section.operator_key is None):
            raise ConfigError("mqtt: set operator_cert and operator_key together")
        if section.operator_cert is not None:  # its own identity, not the coordinator's TLS
            section = section.model_copy(update={"tls_cert": section.operator_cert,
                                                 "tls_key": section.operator_key})
        # Leave no session behind on the broker.
        options = replace(section.endpoint_options(), session_expiry_s=0)
        self.topics = Topics(self.fleet)
        self.endpoint = MqttEndpoint(
            section.address(), f"jetsplit-fleet-cli-{os.getpid()}", options,
            subscriptions=(self.topics.presence_any, self.topics.up_any),
            sender=COORDINATOR)

    def __enter__(self) -> FleetClient:
        self.endpoint.start(10.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.endpoint.close()

    def _drain(self, until: float, replies: dict[int, Any]) -> None:
        """Book presence and replies arriving before `until` (monotonic)."""
        from jetsplit.wire import MessageType

        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                inbound = self.endpoint.inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            msg = inbound.message
            agent = self.topics.agent_of(inbound.topic)
            if agent is None or msg.sender != agent:
                continue
            view = self.views.setdefault(agent, AgentView(agent))
            if msg.type == MessageType.PRESENCE:
                view.state = str(msg.meta.get("state", "unknown"))
                role = msg.meta.get("role")
                view.role = role if isinstance(role, str) else view.role
            elif msg.type in (MessageType.REPLY, MessageType.ERROR):
                re = msg.meta.get("re")
                if isinstance(re, int) and re in replies:
                    replies[re] = msg

    def presence(self) -> dict[str, AgentView]:
        self._drain(time.monotonic() + PRESENCE_SETTLE_S, {})
        return self.views

    def ask(self, agents: list[str], kind: str, wait_s: float,
            args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one command to each agent; their REPLY/ERROR messages within `wait_s`."""
        from jetsplit.wire import Message, MessageType

        ids: dict[int, str] = {}
        for agent in agents:
            seq = self.endpoint.next_seq()
            ids[seq] = agent
            msg = Message(MessageType.COMMAND, run=CLI_RUN, sender="coordinator", seq=seq,
                          kind=kind, meta={"cmd": seq, **(args or {})})
            self.endpoint.send(self.topics.down(agent), msg)
        replies: dict[int, Any] = dict.fromkeys(ids)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(v is None for v in replies.values()):
            self._drain(min(deadline, time.monotonic() + 0.2), replies)
        return {ids[k]: v for k, v in replies.items() if v is not None}


def survey(client: FleetClient, wait_s: float, logs: int = 0) -> list[AgentView]:
    """Every agent the broker knows, with a status reply from each online one."""
    from jetsplit.wire import MessageType

    views = client.presence()
    online = sorted(a for a, v in views.items() if v.state == "online")
    args = {"logs": logs} if logs else None
    for agent, msg in client.ask(online, "status", wait_s, args).items():
        if msg.type == MessageType.ERROR:
            views[agent].error = str(msg.meta.get("error"))
        else:
            views[agent].status = {k: v for k, v in msg.meta.items() if k != "re"}
    return [views[a] for a in sorted(views)]


# --------------------------------------------------------------------------- commands

DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
Broker = Annotated[str | None, typer.Option(
    "--broker", help=f"mqtt[s]://[user:pass@]host:port (default {DEFAULT_BROKER}).")]
Fleet = Annotated[str | None, typer.Option(
    "--fleet", help="Fleet name (topic jetsplit/v1/FLEET; default: default).")]
Config = Annotated[Path | None, typer.Option(
    "--config", help="Take fleet and [mqtt] (TLS, keys) from this server.toml.")]
KeyFile = Annotated[str | None, typer.Option(
    "--fleet-key-file", help="HMAC fleet key (else $JETSPLIT_FLEET_KEY).")]
TlsCa = Annotated[str | None, typer.Option("--tls-ca", help="CA certificate for mqtts://.")]
Wait = Annotated[float, typer.Option("--wait", help="Seconds to wait for status replies.")]


def _client(broker: str | None, fleet: str | None, key: str | None, ca: str | None,
            config: Path | None = None) -> FleetClient:
    """From flags, or from a coordinator's server.toml (its fleet and [mqtt]: TLS, fleet key
    or the coordinator's signing kit); flags given next to it win."""
    if config is None:
        return FleetClient(broker or DEFAULT_BROKER, fleet or "default", key, ca)
    from jetsplit.server.run.config import load_server_config

    cfg = load_server_config(config)
    updates = {k: v for k, v in {"broker": broker, "fleet_key_file": key, "tls_ca": ca}.items()
               if v is not None}
    section = cfg.mqtt.model_copy(update=updates)
    return FleetClient(section.broker, fleet or cfg.fleet, section=section)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


@app.command("ls")
def ls(broker: Broker = None, fleet: Fleet = None, config: Config = None,
       fleet_key_file: KeyFile = None, tls_ca: TlsCa = None, wait: Wait = 3.0,
       as_json: Annotated[bool, typer.Option("--json", help="One JSON list.")] = False) -> None:
    """List every agent with state, role, profile, bundle, cut, last round, RSS,
    temperature, power mode, measured link rates and last error."""
    if wait <= 0:
        raise ConfigError("--wait: must be > 0")
    with _client(broker, fleet, fleet_key_file, tls_ca, config) as client:
        rows = [v.row() for v in survey(client, wait)]
        fleet = client.fleet
    if as_json:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo(f"no agents have announced themselves in fleet {fleet!r}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fleet {fleet} ({sum(r['state'] != 'offline' for r in rows)} of "
                  f"{len(rows)} online)")
    columns = ("agent", "state", "role", "profile", "bundle", "cut", "last_round", "rss_mb",
               "temp_c", "power_mode", "up_mbps", "down_mbps", "last_error")
    for name in columns:
        table.add_column(name.replace("_", " "), overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r[k]) for k in columns))
    Console(width=160).print(table)


def _one(client: FleetClient, agent: str, wait: float, logs: int = 0) -> AgentView:
    views = {v.agent: v for v in survey(client, wait, logs)}
    if agent not in views:
        raise ConfigError(f"agent {agent!r} has never announced itself in fleet "
                          f"{client.fleet!r} (known: {', '.join(views) or 'none'})")
    return views[agent]


@app.command("status")
def status(agent: Annotated[str, typer.Argument(help="Agent id.")],
           broker: Broker = None, fleet: Fleet = None, config: Config = None,
           fleet_key_file: KeyFile = None, tls_ca: TlsCa = None, wait: Wait = 5.0) -> None:
    """One agent's full status reply (JSON): telemetry, time books, bundle, last error."""
    with _client(broker, fleet, fleet_key_file, tls_ca, config) as client:
        view = _one(client, agent, wait)
    typer.echo(json.dumps({"agent": agent, "state": view.row()["state"],
                           "status": view.status, "error": view.error}, indent=2))


@app.command("logs")
def logs(agent: Annotated[str, typer.Argument(help="Agent id.")],
         broker: Broker = None, fleet: Fleet = None, config: Config = None,
         fleet_key_file: KeyFile = None, tls_ca: TlsCa = None, wait: Wait = 5.0,
         lines: Annotated[int, typer.Option("--lines", "-n", help="How many lines (≤ 500).")
                          ] = 50) -> None:
    """The agent's last log lines, fetched over MQTT."""
    if not 1 <= lines <= 500:
        raise ConfigError("--lines: must be 1..500")
    with _client(broker, fleet, fleet_key_file, tls_ca, config) as client:
        view = _one(client, agent, wait, logs=lines)
    if view.status is None:
        raise ConfigError(f"agent {agent} is {view.row()['state']}: no logs over MQTT (on the "
                          "device: journalctl -u jetsplit-agent)")
    for line in view.status.get("logs") or []:
        typer.echo(line)


@app.command("stop")
def stop(agents: Annotated[list[str] | None, typer.Argument(
             help="Agent ids (default: every online agent).")] = None,
         broker: Broker = None, fleet: Fleet = None, config: Config = None,
         fleet_key_file: KeyFile = None, tls_ca: TlsCa = None, wait: Wait = 5.0) -> None:
    """Ask agents to exit cleanly (a systemd unit with Restart=on-failure stays stopped)."""
    with _client(broker, fleet, fleet_key_file, tls_ca, config) as client:
        fleet = client.fleet
        views = client.presence()
        online = sorted(a for a, v in views.items() if v.state == "online")
        targets = agents or online
        unknown = [a for a in targets if a not in online]
        if unknown:
            raise ConfigError(f"not online in fleet {fleet!r}: {', '.join(unknown)}")
        replies = client.ask(targets, "shutdown", wait)
    for agent in targets:
        typer.echo(f"{agent}: {'stopping' if agent in replies else 'no reply'}")
    if len(replies) < len(targets):
        raise typer.Exit(1)

"""A trial's fleet: what a trial is (`TrialSpec`, saved as trial.json) and the agents it
emulates on this machine: each agent's agent.toml (its shard, emulated device, attack and
trace) and the `jetsplit agent run` / `jetsplit agent host` processes that run them.

`jetsplit trial` (server/run/trial.py) plans the fleet, starts these processes and drives
them over MQTT.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetsplit.data import ImageOptions
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.edge_agent.traces import Trace
from jetsplit.errors import ConfigError
from jetsplit.server.run.config import TrainSection
from jetsplit.server.run.preflight import validate_options
from jetsplit.server.run.simulate import agent_name, edge_name, shard_sizes

if TYPE_CHECKING:
    from jetsplit.data import Dataset

DEFAULT_PROFILES = ["jetson-nano-4gb", "orin-nx-16gb"]
FLEET_KEY_FILE = "fleet.key"  # a signed trial's key, in its agents folder
#: A trial's own [train] defaults: it re-plans its emulated fleet's cuts live.
TRIAL_TRAIN: dict[str, Any] = {"replan": "on"}


@dataclass
class TrialSpec:
    """Everything a trial depends on; saved as trial.json so `--resume` needs nothing else."""

    # The [train] keys given (flags; server/training/settings.py declares them all): the
    # rest are [train]'s defaults, but for TRIAL_TRAIN's.
    train: dict[str, Any] = field(default_factory=dict)
    agents: int = 4
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    model: str = "alexnet"
    dataset: str = "mnist"
    image_size: int | None = None  # folder:/csv: images come out N×N ([data] image_size)
    weights: str | None = None  # the model's initial weights file ([model] weights)
    partition: str = "dirichlet:0.5"
    seed: int = 0
    test_fraction: float = 0.2
    broker: str | None = None
    emulate: bool = True
    server_profile: str = "x86-cpu"
    split: int | None = None  # None: the planner's choice (a cut per device where it can)
    common_split: bool = False  # the planner's best one cut for every device
    cuts: dict[str, int] | None = None  # per-agent cuts by hand (checked against memory)
    edges: int = 0  # SHeRL-FL: edge agents e0… (clients dealt to them round-robin)
    edge_profile: str = "orin-nx-16gb"
    device: str = "auto"  # the coordinator's: auto | cpu | cuda (agents emulate on the CPU)
    agents_per_process: int = 1  # >1: clients run in `jetsplit agent host` processes
    # {agent: attack spec}: tests and benchmarks only (JETSPLIT_ALLOW_ATTACKS=1), written
    # into those agents' [attack] (edge_agent/attacks.py)
    attacks: dict[str, str] = field(default_factory=dict)
    # provision each client's shard size into the coordinator's config, as `jetsplit
    # provision --size` would: a registered size weighs at most that
    # (server/defences/size_claims.py)
    provision_sizes: bool = False
    # {agent: trace name or file}: how that agent's device changes during the run
    # (edge_agent/traces.py), replayed by its emulation
    traces: dict[str, str] = field(default_factory=dict)
    # sign every message with a fleet key made for the trial ([mqtt] fleet_key_file), so
    # replay windows and timestamp checks apply as in a keyed field fleet
    signed: bool = False

    def image_options(self) -> ImageOptions:
        """How the trial's `folder:`/`csv:` images are sized (every agent alike)."""
        return ImageOptions(image_size=self.image_size, seed=self.seed)

    def training(self) -> TrainSection:
        """The trial's [train] section, checked (one line naming the flag at fault)."""
        return validate_options(TrainSection, {**TRIAL_TRAIN, **self.train}, {})

    def host_groups(self) -> list[tuple[str, int, int, int]]:
        """(profile, first, stride, count) per fleet-host process: clients of one profile
        (a profile's agents are `stride` = len(profiles) apart), at most
        `agents_per_process` each."""
        stride = len(self.profiles)
        groups = []
        for p in range(min(stride, self.agents)):
            numbers = list(range(p, self.agents, stride))
            for k in range(0, len(numbers), self.agents_per_process):
                chunk = numbers[k:k + self.agents_per_process]
                groups.append((self.profiles[p], chunk[0], stride, len(chunk)))
        return groups

    def device_profiles(self) -> dict[str, str]:
        """Profile of each agent: clients cycle through `profiles`, edges use
        `edge_profile`."""
        out = {agent_name(i): self.profiles[i % len(self.profiles)] for i in range(self.agents)}
        out.update({edge_name(j): self.edge_profile for j in range(self.edges)})
        return out


def trial_shard_sizes(spec: TrialSpec, train: Dataset) -> dict[str, int]:
    """The samples each trial client holds of the training split `train`: its shard as its
    agent cuts it (`client_shards`, from the `[data]` that `agent_config` writes), what
    `provision_sizes` provisions."""
    from jetsplit.data import client_shards

    return shard_sizes(client_shards(train.y, spec.agents, spec.partition, spec.seed,
                                     train.num_classes))


def trial_traces(spec: TrialSpec) -> dict[str, Trace]:
    """Each traced agent's trace, loaded and checked: agents of this trial only, one per
    process (a fleet host's agents share one config)."""
    from jetsplit.edge_agent.traces import load_trace

    if spec.traces and spec.agents_per_process > 1:
        raise ConfigError("--trace needs one agent per process (--agents-per-process 1)")
    known = spec.device_profiles()
    for agent in spec.traces:
        if agent not in known:
            raise ConfigError(f"--trace {agent}={spec.traces[agent]}: no trial agent "
                              f"{agent!r} (they are {', '.join(known)})")
    return {agent: load_trace(name) for agent, name in spec.traces.items()}


def agent_config(spec: TrialSpec, agent: str, broker_url: str, state_dir: Path,
                 emulation: EmulationSection, *, index: int | None = None,
                 fleet_key: Path | None = None) -> str:
    """agent.toml for a trial agent: client aN keeps shard N of the dataset; edge eN has
    no data; each emulates its device. A fleet host's base config is agent `a`, index 0:
    the host makes agent n of it `a<n>` with shard n and seed + n."""
    import tomli_w

    protocol = "3.1.1" if spec.broker is None else "auto"  # amqtt speaks 3.1.1 only
    edge = agent.startswith("e")
    index = int(agent[1:]) if index is None else index
    doc: dict[str, Any] = {
        "fleet": "trial", "agent": agent, "role": "edge" if edge else "client",
        "profile": emulation.profile, "state_dir": str(state_dir), "device": "cpu",
        "threads": 1, "seed": spec.seed + index, "log_level": "info",
        "mqtt": {"broker": broker_url, "protocol": protocol,
                 **({"fleet_key_file": str(fleet_key)} if fleet_key else {})},
        "data": {"dataset": spec.dataset, "partition": spec.partition,
                 "clients": spec.agents, "index": 0 if edge else index, "seed": spec.seed,
                 "test_fraction": spec.test_fraction},
        "emulation": emulation.model_dump(exclude_none=True),
    }
    if spec.image_size is not None:
        doc["data"]["image_size"] = spec.image_size
    if agent in spec.attacks:
        doc["attack"] = {"kind": spec.attacks[agent]}
    return tomli_w.dumps(doc)


class AgentProcesses:
    """The trial's agent daemons: `jetsplit agent run` processes (or `jetsplit agent host`
    ones, given the host's arguments per config), logs in DIR/agents."""

    def __init__(self, configs: list[Path], host_args: dict[Path, list[str]] | None = None
                 ) -> None:
        self.configs = configs
        self.host_args = host_args or {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> AgentProcesses:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for path in self.configs:
            extra = self.host_args.get(path)
            command = ["run"] if extra is None else ["host", *extra]
            path = path.resolve()
            log_file = path.with_suffix(".log").open("ab")
            # `python -m` puts the working directory first on sys.path: run in the trial's own
            # agents folder so a user's jetsplit.py (or any stray module) cannot shadow ours.
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "jetsplit.cli", "agent", *command, "--config",
                 str(path)],
                stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=path.parent))
            log_file.close()
        return self

    def dead(self) -> list[str]:
        return [p.stem for p, proc in zip(self.configs, self.procs, strict=False)
                if proc.poll() is not None]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def trial_fleet_key(spec: TrialSpec, agent_dir: Path) -> bytes | None:
    """A signed trial's fleet key, made once and kept in `agent_dir` (a resumed trial signs
    with the same one); None when the trial is not signed."""
    if not spec.signed:
        return None
    path = agent_dir / FLEET_KEY_FILE
    if not path.is_file():
        agent_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_bytes().strip()


def write_agent_configs(spec: TrialSpec, broker_url: str, agent_dir: Path,
                        sections: dict[str, EmulationSection], traces: dict[str, Trace]
                        ) -> tuple[list[Path], dict[Path, list[str]]]:
    """Each agent process's agent.toml in `agent_dir`, and the fleet-host arguments of
    those that host several clients (`agents_per_process` > 1: one base config each)."""
    agent_dir.mkdir(exist_ok=True)
    key = agent_dir / FLEET_KEY_FILE if trial_fleet_key(spec, agent_dir) else None
    configs = []
    host_args: dict[Path, list[str]] = {}
    hosted = spec.agents_per_process > 1
    if hosted:
        for profile, first, stride, count in spec.host_groups():
            path = agent_dir / f"host-a{first}.toml"
            path.write_text(agent_config(spec, "a", broker_url, agent_dir / "state",
                                         sections[profile], index=0, fleet_key=key))
            configs.append(path)
            host_args[path] = ["--count", str(count), "--first", str(first),
                               "--stride", str(stride)]
    for agent, name in spec.device_profiles().items():
        if hosted and not agent.startswith("e"):
            continue
        path = agent_dir / f"{agent}.toml"
        section = sections[name]
        if agent in traces:
            section = section.model_copy(update={"trace": traces[agent]})
        path.write_text(agent_config(spec, agent, broker_url, agent_dir / "state", section,
                                     fleet_key=key))
        configs.append(path)
    return configs, host_args

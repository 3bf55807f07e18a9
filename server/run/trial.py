"""`jetsplit trial`: a field trial on one machine, the README's main job.

It starts a broker (the embedded one unless `--broker` names one), N agent processes that
each emulate a device profile, and the coordinator; the planner picks the split from the
profiles; training runs over MQTT exactly as in the field, with live progress; the run
folder gets `metrics.jsonl`, `summary.json`, `plan.json`, `trial.json` (the settings) and
`report.md` with plots.

Emulation. This machine measures its own training throughput once (one torch thread, the
trial's model). A profile slower than the fastest one in the trial has its compute
stretched by their speed ratio; the fastest runs at half this machine's speed (a CPU
cannot run faster than it does, so the whole trial's compute clock is dilated by one
factor and the ratios between devices hold; the half leaves room for the agents sharing
this machine's cores). Links run at the profiles' own bandwidths.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jetsplit import catalog
from jetsplit.cli_types import check_port, parse_agent_options
from jetsplit.data.checks import check_data_options
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.edge_agent.traces import Trace
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.server.run.flags import train_flags
from jetsplit.server.run.preflight import (
    check_split,
    validate_options,
    wait_for_fleet,
)
from jetsplit.server.run.simulate import (
    agent_name,
    edge_name,
    parse_attack_options,
    shard_sizes,
    sherl_topology,
    simulated_attacks,
)

if TYPE_CHECKING:
    from jetsplit.data import ArrayDataset

log = logging.getLogger("jetsplit.trial")

DEFAULT_PROFILES = ["jetson-nano-4gb", "orin-nx-16gb"]
EMULATION_HEADROOM = 2.0  # the fastest emulated device runs at half this machine's speed
SPEC_FILE = "trial.json"


@dataclass
class TrialSpec:
    """Everything a trial depends on; saved as trial.json so `--resume` needs nothing else."""

    algorithm: str = catalog.DEFAULT_METHOD
    agents: int = 4
    rounds: int = 10
    profiles: list[str] = field(default_factory=lambda: list(DEFAULT_PROFILES))
    model: str = "alexnet"
    dataset: str = "mnist"
    partition: str = "dirichlet:0.5"
    local_steps: int = 10
    batch: int = 64
    lr: float | None = None  # None: the method's default rate
    fraction: float = 1.0
    seed: int = 0
    codec: str = "fp32"
    aggregator: str = "mean"  # how device uploads are combined (server/defences/aggregators.py)
    replan: str = "on"  # live re-planning of the cuts (server/cuts/replanning.py)
    replan_threshold: float = 0.2
    replan_clock: str = "measured"  # or "model" (server/cuts/replanning.py)
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


def trial_shard_sizes(spec: TrialSpec, train: ArrayDataset) -> dict[str, int]:
    """The samples each trial client holds of the training split `train`: its shard as its
    agent cuts it (`client_shards`, from the `[data]` that `agent_config` writes), what
    `provision_sizes` provisions."""
    from jetsplit.data import client_shards

    return shard_sizes(client_shards(train.y, spec.agents, spec.partition, spec.seed,
                                     train.num_classes))


# --------------------------------------------------------------------------- planning


def host_gflops(model: str, input_shape: tuple[int, int, int], classes: int,
                batch: int) -> float:
    """This machine's training throughput on the trial's model with one torch thread, as
    each trial agent runs (counted FLOPs / measured time)."""
    import torch

    from jetsplit.export.cost_model import get_costs
    from jetsplit.export.profiler import achieved_gflops, measure_layers
    from jetsplit.models import ModelSpec, build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = ModelSpec(model, input_shape, classes)
        layers = measure_layers(build_model(spec, seed=0), batch, repeats=3, warmup=1,
                                device="cpu")
        return achieved_gflops(get_costs(model, input_shape, classes), layers, batch)
    finally:
        torch.set_num_threads(threads)


def emulations(profiles: dict[str, Any], host: float, enabled: bool,
               headroom: float = EMULATION_HEADROOM
               ) -> tuple[dict[str, EmulationSection], float]:
    """Per profile name: the emulation section, and the trial's compute dilation: how much
    slower than the fastest profile this machine is (at least 1), times `headroom` so that
    even the fastest device's compute is stretched and absorbs CPU contention between the
    agents sharing this machine (it sleeps less instead of running late)."""
    speeds = {name: p.effective_gflops() for name, p in profiles.items()}
    fastest = max(speeds.values())
    dilation = max(1.0, fastest / host) * headroom
    out = {}
    for name, profile in profiles.items():
        if not enabled:
            out[name] = EmulationSection(profile=name)
            continue
        out[name] = EmulationSection(
            profile=name, compute_slowdown=max(1.0, host * dilation / speeds[name]),
            uplink_mbps=profile.network.uplink_mbps,
            downlink_mbps=profile.network.downlink_mbps)
    return out, dilation


def plan_split(spec: TrialSpec, input_shape: tuple[int, int, int], classes: int,
               per_agent_batch: int, dataset_size: int, dilation: float = 1.0
               ) -> tuple[int, dict[str, int], dict[str, Any]]:
    """The planner's cuts for this fleet: (server cut, cut per agent, plan). The split
    methods get a cut per device unless `--split` or `--common-split`; `cuts` by hand are
    checked against each device's memory."""
    from jetsplit.server.cuts.planning import check_cut_fits, plan_cuts

    agent_profiles = {a: p for a, p in spec.device_profiles().items() if a.startswith("a")}
    server_cut, cuts, plan = plan_cuts(
        spec.algorithm, spec.model, input_shape, classes, agent_profiles,
        batch=per_agent_batch, local_steps=spec.local_steps, rounds=spec.rounds,
        dataset_size=dataset_size, codec=spec.codec, server_profile=spec.server_profile,
        common_split=spec.common_split, split=spec.split, compute_dilation=dilation)
    if spec.cuts:
        unknown = sorted(set(spec.cuts) - set(agent_profiles))
        if unknown:
            raise ConfigError(f"--cut {unknown[0]}: no such agent (agents are "
                              f"{', '.join(sorted(agent_profiles))})")
        n = len(plan["devices"][0]["rows"]) if plan["devices"] else 0
        for agent, cut in sorted(spec.cuts.items()):
            if not isinstance(cut, int) or not 1 <= cut <= n:
                raise ConfigError(f"agent {agent}: cut {cut} is out of range for "
                                  f"{spec.model}: choose 1..{n}")
            check_cut_fits(agent, agent_profiles[agent], cut, plan)
        cuts = {**cuts, **spec.cuts}
        server_cut = max(cuts.values())
        plan["used_split"] = server_cut
        for agent, cut in cuts.items():
            plan["agents"][agent]["cut"] = cut
    return server_cut, cuts, plan


def trial_replanner(spec: TrialSpec, input_shape: tuple[int, int, int], classes: int,
                    per_agent_batch: int, dataset_size: int, dilation: float, server_cut: int,
                    deadline_s: float) -> Any:
    """The live re-planner for this fleet, planned as `plan_split` plans it; None when
    `replan` is off, the cuts were fixed by hand (`--split`, `--cut`, `--common-split`),
    or the method keeps one cut."""
    if spec.replan != "on" or spec.split is not None or spec.cuts or spec.common_split:
        return None
    from jetsplit.server.cuts.planning import replanner_for

    agent_profiles = {a: p for a, p in spec.device_profiles().items() if a.startswith("a")}
    return replanner_for(
        spec.algorithm, spec.model, input_shape, classes, agent_profiles,
        batch=per_agent_batch, local_steps=spec.local_steps, rounds=spec.rounds,
        dataset_size=dataset_size, codec=spec.codec, server_profile=spec.server_profile,
        server_cut=server_cut, threshold=spec.replan_threshold,
        deadline_s=deadline_s, compute_dilation=dilation, clock=spec.replan_clock)


def predicted_row(plan: dict[str, Any]) -> Any:
    """run_training row extras: each agent's cut and the planner's predicted compute and
    transfer seconds per round beside the measured ones."""
    def extras(row: dict[str, Any]) -> dict[str, Any]:
        agents = row.get("agents") or {}
        for agent, info in plan.get("agents", {}).items():
            if agent in agents:
                agents[agent].update({k: v for k, v in info.items() if k != "profile"})
        return {"agents": agents} if agents else {}
    return extras


# --------------------------------------------------------------------------- agents


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
                 emulation: EmulationSection, *, index: int | None = None) -> str:
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
        "mqtt": {"broker": broker_url, "protocol": protocol},
        "data": {"dataset": spec.dataset, "partition": spec.partition,
                 "clients": spec.agents, "index": 0 if edge else index, "seed": spec.seed,
                 "test_fraction": spec.test_fraction},
        "emulation": emulation.model_dump(exclude_none=True),
    }
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


# --------------------------------------------------------------------------- the trial


def run_trial(spec: TrialSpec, out_dir: Path, *, resume: bool = False,
              metrics_port: int | None = None, live: bool | None = None,
              trackers: Any = None) -> dict[str, Any]:
    """Run (or resume) a whole trial; returns the training summary plus the report path."""
    from jetsplit.broker_url import parse_broker_url
    from jetsplit.data import load_dataset_split
    from jetsplit.devices import resolve_device
    from jetsplit.profiles import resolve_profile
    from jetsplit.server.engines.mqtt import MqttEngine
    from jetsplit.server.fleet.books import FleetBooks
    from jetsplit.server.ops.brokers import EmbeddedBroker
    from jetsplit.server.ops.progress import TrialProgress
    from jetsplit.server.ops.prometheus import MetricsExporter, round_callback
    from jetsplit.server.report.document import write_report
    from jetsplit.server.run.assembly import (
        RunSpec,
        bundle_for,
        execute,
        folder_run_id,
        prepare_bundle,
    )
    from jetsplit.server.run.config import (
        ModelSection,
        ServerConfig,
        ServerSection,
        TopologySection,
        TrainSection,
    )
    from jetsplit.server.training.settings import Settings
    from jetsplit.transport.mqtt import EndpointOptions

    # Every option is checked before anything expensive (benchmark, broker, agents).
    train = validate_options(TrainSection, {
        "algorithm": spec.algorithm, "rounds": spec.rounds, "local_steps": spec.local_steps,
        "batch": spec.batch, "lr": spec.lr, "fraction": spec.fraction, "codec": spec.codec,
        "aggregator": spec.aggregator, "replan": spec.replan,
        "replan_threshold": spec.replan_threshold, "replan_clock": spec.replan_clock},
        {})
    if spec.agents < 1:
        raise ConfigError(f"--agents must be at least 1, got {spec.agents}")
    if spec.attacks:
        if spec.agents_per_process > 1:
            raise ConfigError("--attack needs one agent per process (--agents-per-process 1)")
        simulated_attacks(spec.attacks, spec.agents, spec.seed, who="trial agent")  # names,
        # specs and permission, before any process starts
    traces = trial_traces(spec)  # names and rows, before any process starts
    if spec.agents_per_process < 1:
        raise ConfigError(f"--agents-per-process must be at least 1, got "
                          f"{spec.agents_per_process}")
    server = validate_options(ServerSection, {"device": spec.device}, {})
    resolve_device(server.device, "--device")
    check_port(metrics_port, "--metrics-port")
    check_data_options(spec.dataset, spec.partition)
    run_name = folder_run_id(out_dir, "trial", "--resume" if resume else "--out")
    if spec.broker is not None:
        parse_broker_url(spec.broker)
    device_profiles = spec.device_profiles()
    topology = sherl_topology(spec.algorithm, spec.edges, spec.agents)
    profiles = {name: resolve_profile(name) for name in sorted(set(device_profiles.values()))}
    resolve_profile(spec.server_profile)
    training, test = load_dataset_split(spec.dataset, spec.test_fraction, spec.seed)
    check_split(spec.model, test.input_shape, test.num_classes, spec.split)
    if spec.provision_sizes:
        train = train.model_copy(update={"provisioned_sizes": trial_shard_sizes(spec, training)})
    del training  # the agents hold their shards; the coordinator keeps the test split only
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2))

    per_agent = max(1, spec.batch // max(1, round(spec.agents * spec.fraction)))
    dataset_size = int(len(test) / spec.test_fraction * (1 - spec.test_fraction)) // spec.agents
    host = host_gflops(spec.model, test.input_shape, test.num_classes, per_agent)
    sections, dilation = emulations(profiles, host, spec.emulate)
    # The planner plans the fleet as emulated: compute dilated, links as the profiles say.
    split, cuts, plan = plan_split(spec, test.input_shape, test.num_classes, per_agent,
                                   dataset_size, dilation if spec.emulate else 1.0)
    replanner = trial_replanner(spec, test.input_shape, test.num_classes, per_agent,
                                dataset_size, dilation if spec.emulate else 1.0, split,
                                train.deadline_s)
    plan["emulation"] = {"host_gflops_1_thread": round(host, 2),
                         "compute_dilation": round(dilation, 3),
                         "profiles": {n: s.model_dump() for n, s in sections.items()},
                         "traces": dict(spec.traces)}
    (out_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    log.info("cuts %s, server cut %d (planner); this machine %.1f GFLOPS on one thread; "
             "emulated compute runs %.2f× slower than the profiles say (the fastest at half "
             "this machine's speed)", cuts, split, host, dilation)

    broker = None
    if spec.broker is None:
        broker = EmbeddedBroker().start()
        address = broker.address
    else:
        address = parse_broker_url(spec.broker)
    agent_dir = (out_dir / "agents").resolve()
    agent_dir.mkdir(exist_ok=True)
    configs = []
    host_args: dict[Path, list[str]] = {}
    hosted = spec.agents_per_process > 1
    if hosted:  # clients in fleet-host processes, one base config per process
        for profile, first, stride, count in spec.host_groups():
            path = agent_dir / f"host-a{first}.toml"
            path.write_text(agent_config(spec, "a", address.url(), agent_dir / "state",
                                         sections[profile], index=0))
            configs.append(path)
            host_args[path] = ["--count", str(count), "--first", str(first),
                               "--stride", str(stride)]
    for agent, name in device_profiles.items():
        if hosted and not agent.startswith("e"):
            continue
        path = agent_dir / f"{agent}.toml"
        section = sections[name]
        if agent in traces:
            section = section.model_copy(update={"trace": traces[agent]})
        path.write_text(agent_config(spec, agent, address.url(), agent_dir / "state",
                                     section))
        configs.append(path)
    cfg = ServerConfig(fleet="trial", agents=len(device_profiles), seed=spec.seed,
                       model=ModelSection(name=spec.model, input_shape=list(test.input_shape),
                                          classes=test.num_classes, split=split),
                       train=train, topology=TopologySection(edges=topology), server=server)
    (out_dir / "config.toml").write_text(_server_toml(cfg, address.url()))
    agents = AgentProcesses(configs, host_args).start()
    engine = MqttEngine(address, "trial", run_id=run_name,
                        options=EndpointOptions(protocol="3.1.1" if broker else "auto"),
                        retry_s=train.retry_s)
    exporter = None
    try:
        engine.start(10.0)
        fleet = len(device_profiles)
        online = wait_for_fleet(engine.wait_for_agents, fleet, 60.0 + 10.0 * fleet,
                                agents.dead, lambda name: agent_dir / f"{name}.log")
        if len(online) < fleet:
            raise JetsplitError(f"only {len(online)} of {fleet} agents registered "
                                f"(dead: {', '.join(agents.dead()) or 'none'}; logs in "
                                f"{agent_dir})")
        books = FleetBooks(engine)
        if metrics_port is not None:
            exporter = MetricsExporter(metrics_port).start()
        settings = Settings(seed=spec.seed, edges=topology, **server.model_dump(),
                            **train.model_dump())
        with TrialProgress(spec.rounds, title="jetsplit trial", live=live) as progress:
            archive = bundle_for(out_dir, resume, lambda: prepare_bundle(cfg, out_dir / "build"))
            run = RunSpec(
                settings, archive, test, out_dir, server_cut=split, cuts=cuts, resume=resume,
                on_round=[progress.update,
                          None if exporter is None else round_callback(exporter, engine, books),
                          None if trackers is None else trackers.log_round],
                row_extras=[books.collect, predicted_row(plan)], replanner=replanner)
            summary = execute(engine, run)
    finally:
        if exporter is not None:
            exporter.close()
        engine.close()
        agents.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(out_dir / "build", ignore_errors=True)  # the checkpoint keeps the bundle
    summary["report"] = str(write_report(out_dir, title=f"jetsplit trial: {spec.algorithm}"))
    return summary


def _server_toml(cfg: Any, broker_url: str) -> str:
    """The coordinator config this trial ran with, as a server.toml users can reuse."""
    import tomli_w

    m = cfg.model
    doc: dict[str, Any] = {
        "fleet": cfg.fleet, "agents": cfg.agents, "seed": cfg.seed,
        "mqtt": {"broker": broker_url},
        "model": {"name": m.name, "input_shape": list(m.input_shape), "classes": m.classes,
                  "split": m.split},
        "server": cfg.server.model_dump(),
        "train": {k: v for k, v in cfg.train.model_dump().items() if v is not None},
    }
    if cfg.topology.edges:
        doc["topology"] = {"edges": {e: list(c) for e, c in cfg.topology.edges.items()}}
    return tomli_w.dumps(doc)


def parse_cuts(values: list[str] | None) -> dict[str, int] | None:
    """`--cut a0=2 --cut a1=5` → {"a0": 2, "a1": 5}; one error line otherwise."""
    if not values:
        return None
    out = {}
    for value in values:
        agent, _, k = value.partition("=")
        try:
            out[agent.strip()] = int(k)
        except ValueError:
            raise ConfigError(f"--cut {value!r}: expected AGENT=K with K an integer") from None
    return out


def load_spec(run_dir: Path) -> TrialSpec:
    """The spec a trial in `run_dir` started with (for --resume)."""
    path = run_dir / SPEC_FILE
    try:
        return TrialSpec(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no {SPEC_FILE} there (not a trial folder)"
                          ) from None
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"--resume {run_dir}: {SPEC_FILE} is damaged ({exc})") from None


@train_flags("algorithm", "rounds", "local_steps", "batch", "lr", "fraction", "codec",
             "aggregator", "replan", "replan_threshold", "replan_clock")
def trial_command(
    train: dict[str, Any],
    agents: Annotated[int, typer.Option("--agents", help="Agents to start.")] = 4,
    agents_per_process: Annotated[int, typer.Option(
        "--agents-per-process", help="Clients per process (>1: `jetsplit agent host` "
        "processes; one torch and dataset for many agents).")] = 1,
    broker: Annotated[str | None, typer.Option(
        "--broker", help="mqtt[s]://host:port; default: start the embedded broker.")] = None,
    profiles: Annotated[list[str] | None, typer.Option(
        "--profile", "--profiles",
        help="Device profile per agent (repeat; cycled over the agents).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run folder (default "
                                             "runs/trial-<UTC time>).")] = None,
    model: Annotated[str, typer.Option("--model", help="Zoo model id.")] = "alexnet",
    dataset: Annotated[str, typer.Option("--dataset", help="mnist | digits | npz:PATH | "
                                         "cifar10:DIR | folder:DIR")] = "mnist",
    partition: Annotated[str, typer.Option(
        "--partition", help="iid | quantity:A | dirichlet:B | ampere:A (label skew by "
        "default)")] = "dirichlet:0.5",
    seed: Annotated[int, typer.Option("--seed", help="Seeds data, selection, weights.")] = 0,
    split: Annotated[int | None, typer.Option(
        "--split", help="One cut for every device, overriding the planner.")] = None,
    common_split: Annotated[bool, typer.Option(
        "--common-split", help="The planner's best one cut for every device (default: a "
        "cut per device for the split methods).")] = False,
    cut: Annotated[list[str] | None, typer.Option(
        "--cut", help="AGENT=K: train agent AGENT at cut K (repeat); checked against its "
        "profile's memory.")] = None,
    edges: Annotated[int, typer.Option(
        "--edges", help="sherl: edge agents (emulating --edge-profile) serving the clients.")
    ] = 0,
    edge_profile: Annotated[str, typer.Option(
        "--edge-profile", help="sherl: device profile of the edge agents.")] = "orin-nx-16gb",
    no_emulation: Annotated[bool, typer.Option(
        "--no-emulation", help="Run agents at this machine's speed, links unlimited.")
    ] = False,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on 127.0.0.1:PORT.")] = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="Continue the trial in DIR from its last checkpoint.")] = None,
    device: Annotated[str, typer.Option(
        "--device", help="auto | cpu | cuda: where the coordinator's server blocks and "
        "evaluation run.")] = "auto",
    tensorboard: Annotated[str | None, typer.Option(
        "--tensorboard", help="Also write per-round scalars for TensorBoard into DIR.")
    ] = None,
    mlflow: Annotated[str | None, typer.Option(
        "--mlflow", help="Also log per-round metrics to this MLflow tracking URI.")] = None,
    attack: Annotated[list[str] | None, typer.Option(
        "--attack", help="Tests and benchmarks only (JETSPLIT_ALLOW_ATTACKS=1): AGENT=SPEC "
        "makes that agent process misbehave (repeat), e.g. a3=scale:1000.")] = None,
    trace: Annotated[list[str] | None, typer.Option(
        "--trace", help="AGENT=TRACE: that agent's device changes during the run as the "
        "trace says (a file, or a name in profiles/traces/, e.g. a0=link-drop-recover); "
        "repeat per agent.")] = None,
    provision_sizes: Annotated[bool, typer.Option(
        "--provision-sizes", help="Provision each agent's shard size, as `jetsplit "
        "provision --size` would: a registered size weighs at most that.")] = False,
) -> None:
    """Field trial on this machine: broker, coordinator and emulated agents; report."""
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("jetsplit.trial").setLevel(logging.INFO)
    if resume is not None:
        spec, out_dir = load_spec(resume), resume
    else:
        spec = TrialSpec(**train, agents=agents,
                         profiles=profiles or list(DEFAULT_PROFILES), model=model,
                         dataset=dataset, partition=partition, seed=seed, broker=broker,
                         emulate=not no_emulation, split=split, edges=edges,
                         edge_profile=edge_profile, device=device,
                         common_split=common_split, cuts=parse_cuts(cut),
                         agents_per_process=agents_per_process,
                         attacks=parse_attack_options(attack or []),
                         traces=parse_agent_options(trace or [], "--trace", "TRACE",
                                                    "a0=link-drop-recover"),
                         provision_sizes=provision_sizes)
        out_dir = out or Path("runs") / time.strftime("trial-%Y%m%d-%H%M%S", time.gmtime())
    from jetsplit.server.ops.tracking import Trackers

    trackers = Trackers(tensorboard, mlflow, run_name=out_dir.name, params=asdict(spec))
    try:
        summary = run_trial(spec, out_dir, resume=resume is not None,
                            metrics_port=metrics_port, trackers=trackers)
    finally:
        trackers.close()
    accuracy = summary["final_accuracy"]
    typer.echo(f"{spec.algorithm}: {spec.rounds} rounds with {spec.agents} agents in "
               f"{summary['seconds']:.0f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}, "
               f"up {summary['bytes_up'] / 1e6:.1f} MB, down {summary['bytes_down'] / 1e6:.1f}"
               f" MB")
    typer.echo(f"report: {summary['report']}")

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

import contextlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jetsplit import catalog
from jetsplit.cli_types import check_port, parse_agent_options, parse_cuts
from jetsplit.data.checks import check_data_options
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.edge_agent.traces import Trace
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.server.run.config import TrainSection
from jetsplit.server.run.flags import ImageSizeFlag, WeightsFlag, train_flags
from jetsplit.server.run.preflight import (
    check_split,
    validate_options,
    wait_for_fleet,
)
from jetsplit.server.run.simulate import (
    default_edges,
    parse_attack_options,
    sherl_topology,
    simulated_attacks,
)
from jetsplit.server.run.trial_fleet import (
    DEFAULT_PROFILES,
    AgentProcesses,
    TrialSpec,
    trial_fleet_key,
    trial_shard_sizes,
    trial_traces,
    write_agent_configs,
)

if TYPE_CHECKING:
    from jetsplit.data import Dataset
    from jetsplit.server.run.config import ServerConfig, ServerSection

log = logging.getLogger("jetsplit.trial")

EMULATION_HEADROOM = 2.0  # the fastest emulated device runs at half this machine's speed
SPEC_FILE = "trial.json"


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


def plan_split(spec: TrialSpec, train: TrainSection, input_shape: tuple[int, int, int],
               classes: int, per_agent_batch: int, dataset_size: int, dilation: float = 1.0
               ) -> tuple[int, dict[str, int], dict[str, Any]]:
    """The planner's cuts for this fleet: (server cut, cut per agent, plan). The split
    methods get a cut per device unless `--split` or `--common-split`; `cuts` by hand are
    checked against each device's memory."""
    from jetsplit.server.cuts.planning import check_cut_fits, plan_cuts

    agent_profiles = {a: p for a, p in spec.device_profiles().items() if a.startswith("a")}
    server_cut, cuts, plan = plan_cuts(
        train.algorithm, spec.model, input_shape, classes, agent_profiles,
        batch=per_agent_batch, local_steps=train.local_steps, rounds=train.rounds,
        dataset_size=dataset_size, codec=train.codec, server_profile=spec.server_profile,
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


def trial_replanner(spec: TrialSpec, train: TrainSection, input_shape: tuple[int, int, int],
                    classes: int, per_agent_batch: int, dataset_size: int, dilation: float,
                    server_cut: int) -> Any:
    """The live re-planner for this fleet, planned as `plan_split` plans it; None when
    `replan` is off, the cuts were fixed by hand (`--split`, `--cut`, `--common-split`),
    or the method keeps one cut."""
    if train.replan != "on" or spec.split is not None or spec.cuts or spec.common_split:
        return None
    from jetsplit.server.cuts.planning import replanner_for

    agent_profiles = {a: p for a, p in spec.device_profiles().items() if a.startswith("a")}
    return replanner_for(
        train.algorithm, spec.model, input_shape, classes, agent_profiles,
        batch=per_agent_batch, local_steps=train.local_steps, rounds=train.rounds,
        dataset_size=dataset_size, codec=train.codec, server_profile=spec.server_profile,
        server_cut=server_cut, threshold=train.replan_threshold,
        deadline_s=train.deadline_s, compute_dilation=dilation, clock=train.replan_clock)


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


def predicted_steps(plan: dict[str, Any]) -> dict[str, float]:
    """Agent → the planner's seconds for its longest exchange (the step deadlines' floor
    covers the slowest emulated device: server/defences/step_deadlines.py)."""
    return {a: float(info["predicted_step_s"]) for a, info in plan.get("agents", {}).items()
            if isinstance(info.get("predicted_step_s"), (int, float))}


# --------------------------------------------------------------------------- agents


# --------------------------------------------------------------------------- the trial


def run_trial(spec: TrialSpec, out_dir: Path, *, resume: bool = False,
              metrics_port: int | None = None, live: bool | None = None,
              trackers: Any = None, restart_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) a whole trial; returns the training summary plus the report path.

    `restart_after` R rehearses a coordinator restart: the coordinator stops once round R is
    checkpointed and a new one resumes from that checkpoint, the broker and the agent
    processes up throughout, as a field fleet's daemons outlive the server process
    (`summary["restarted"]`: the round and the first coordinator's training seconds)."""
    from jetsplit.broker_url import parse_broker_url
    from jetsplit.data import load_dataset_split
    from jetsplit.profiles import resolve_profile
    from jetsplit.server.report.document import write_report
    from jetsplit.server.run.assembly import folder_run_id
    from jetsplit.server.run.config import (
        DataSection,
        ModelSection,
        ServerConfig,
        TopologySection,
    )

    train, server, traces = check_trial(spec, metrics_port)
    if restart_after is not None and not 0 <= restart_after < train.rounds - 1:
        raise ConfigError(f"restart_after {restart_after} must lie in 0..{train.rounds - 2} "
                          f"(a round the restarted coordinator has rounds after)")
    run_name = folder_run_id(out_dir, "trial", "--resume" if resume else "--out")
    if spec.broker is not None:
        parse_broker_url(spec.broker)
    topology = sherl_topology(train.algorithm, spec.edges, spec.agents)
    profiles = {name: resolve_profile(name)
                for name in sorted(set(spec.device_profiles().values()))}
    resolve_profile(spec.server_profile)
    training, test = load_dataset_split(spec.dataset, spec.test_fraction, spec.seed,
                                        spec.image_options())
    check_split(spec.model, test.input_shape, test.num_classes, spec.split)
    if spec.provision_sizes:
        train = train.model_copy(update={"provisioned_sizes": trial_shard_sizes(spec, training)})
    del training  # the agents hold their shards; the coordinator keeps the test split only
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2))
    planned = plan_trial(spec, train, test, profiles, out_dir)
    cfg = ServerConfig(fleet="trial", agents=len(spec.device_profiles()), seed=spec.seed,
                       model=ModelSection(name=spec.model, input_shape=list(test.input_shape),
                                          classes=test.num_classes, split=planned.split,
                                          weights=spec.weights),
                       data=DataSection(dataset=spec.dataset, test_fraction=spec.test_fraction,
                                        seed=spec.seed, image_size=spec.image_size),
                       train=train, topology=TopologySection(edges=topology), server=server)
    try:
        summary = _drive(spec, cfg, planned, traces, test, out_dir, run_name=run_name,
                         resume=resume, metrics_port=metrics_port, live=live,
                         trackers=trackers, restart_after=restart_after)
    finally:
        shutil.rmtree(out_dir / "build", ignore_errors=True)  # the checkpoint keeps the bundle
    summary["report"] = str(write_report(out_dir, title=f"jetsplit trial: {train.algorithm}"))
    return summary


def check_trial(spec: TrialSpec, metrics_port: int | None
                ) -> tuple[TrainSection, ServerSection, dict[str, Trace]]:
    """Every option checked before anything expensive (benchmark, broker, agents): the
    [train] and [server] sections and the traces, or one line naming the flag at fault."""
    from jetsplit.devices import resolve_device
    from jetsplit.server.run.config import ServerSection

    train = spec.training()
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
    return train, server, traces


@dataclass
class TrialPlan:
    """What the planner decided for the emulated fleet (plan.json), before it starts."""

    split: int  # the server cut
    cuts: dict[str, int]
    plan: dict[str, Any]
    sections: dict[str, EmulationSection]  # per profile
    replanner: Any


def plan_trial(spec: TrialSpec, train: TrainSection, test: Dataset,
               profiles: dict[str, Any], out_dir: Path) -> TrialPlan:
    """Measure this machine, emulate the profiles on it and plan the fleet as emulated
    (compute dilated, links as the profiles say); writes plan.json."""
    per_agent = max(1, train.batch // max(1, round(spec.agents * train.fraction)))
    dataset_size = int(len(test) / spec.test_fraction * (1 - spec.test_fraction)) // spec.agents
    host = host_gflops(spec.model, test.input_shape, test.num_classes, per_agent)
    sections, dilation = emulations(profiles, host, spec.emulate)
    planned = dilation if spec.emulate else 1.0
    split, cuts, plan = plan_split(spec, train, test.input_shape, test.num_classes, per_agent,
                                   dataset_size, planned)
    replanner = trial_replanner(spec, train, test.input_shape, test.num_classes, per_agent,
                                dataset_size, planned, split)
    plan["emulation"] = {"host_gflops_1_thread": round(host, 2),
                         "compute_dilation": round(dilation, 3),
                         "profiles": {n: s.model_dump() for n, s in sections.items()},
                         "traces": dict(spec.traces)}
    (out_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    log.info("cuts %s, server cut %d (planner); this machine %.1f GFLOPS on one thread; "
             "emulated compute runs %.2f× slower than the profiles say (the fastest at half "
             "this machine's speed)", cuts, split, host, dilation)
    return TrialPlan(split, cuts, plan, sections, replanner)


def _drive(spec: TrialSpec, cfg: ServerConfig, planned: TrialPlan, traces: dict[str, Trace],
           test: Dataset, out_dir: Path, *, run_name: str, resume: bool,
           metrics_port: int | None, live: bool | None, trackers: Any,
           restart_after: int | None = None) -> dict[str, Any]:
    """Broker and agent processes up; the coordinator trains over MQTT (twice, the second
    resuming the first's checkpoint, with `restart_after`); all of them down."""
    from jetsplit.broker_url import parse_broker_url
    from jetsplit.server.ops.brokers import EmbeddedBroker

    with contextlib.ExitStack() as stack:
        broker = None
        if spec.broker is None:
            broker = EmbeddedBroker().start()
            stack.callback(broker.stop)
            address = broker.address
        else:
            address = parse_broker_url(spec.broker)
        agent_dir = (out_dir / "agents").resolve()
        configs, host_args = write_agent_configs(spec, address.url(), agent_dir,
                                                 planned.sections, traces)
        (out_dir / "config.toml").write_text(_server_toml(cfg, address.url()))
        agents = AgentProcesses(configs, host_args).start()
        stack.callback(agents.stop)
        coordinator = _Coordinator(spec, planned, test, out_dir, address, agents, agent_dir,
                                   run_name=run_name, metrics_port=metrics_port, live=live,
                                   trackers=trackers, embedded=broker is not None)
        if restart_after is None:
            return coordinator.run(cfg, resume)
        first = coordinator.run(cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"rounds": restart_after + 1})}), resume)
        log.info("coordinator restart after round %d: a new coordinator resumes from the "
                 "checkpoint, broker and agents up", restart_after)
        summary = coordinator.run(cfg, True)
        summary["restarted"] = {"after_round": restart_after, "first_seconds": first["seconds"]}
        return summary


@dataclass
class _Coordinator:
    """One coordinator over a trial's running broker and agents: each `run` is a new engine
    (its own MQTT session) and fleet, as a restarted server process would be."""

    spec: TrialSpec
    planned: TrialPlan
    test: Dataset
    out_dir: Path
    address: Any
    agents: AgentProcesses
    agent_dir: Path
    run_name: str
    metrics_port: int | None
    live: bool | None
    trackers: Any
    embedded: bool

    def run(self, cfg: ServerConfig, resume: bool) -> dict[str, Any]:
        """Connect, wait for every agent, train `cfg`'s rounds (from the checkpoint when
        `resume`), disconnect."""
        from jetsplit.server.engines.mqtt import MqttEngine
        from jetsplit.server.ops.progress import TrialProgress
        from jetsplit.server.run.assembly import LiveFleet, RunSpec, bundle_for, prepare_bundle
        from jetsplit.server.run.held_out import run_classes
        from jetsplit.transport.mqtt import EndpointOptions

        planned, agent_dir = self.planned, self.agent_dir
        engine = MqttEngine(self.address, "trial", run_id=self.run_name,
                            options=EndpointOptions(
                                protocol="3.1.1" if self.embedded else "auto",
                                fleet_key=trial_fleet_key(self.spec, agent_dir)),
                            retry_s=cfg.train.retry_s)
        with LiveFleet(engine, metrics_port=self.metrics_port, trackers=self.trackers) as fleet:
            engine.start(10.0)
            count = cfg.agents
            online = wait_for_fleet(engine.wait_for_agents, count, 60.0 + 10.0 * count,
                                    self.agents.dead, lambda name: agent_dir / f"{name}.log")
            if len(online) < count:
                raise JetsplitError(f"only {len(online)} of {count} agents registered "
                                    f"(dead: {', '.join(self.agents.dead()) or 'none'}; logs "
                                    f"in {agent_dir})")
            fleet.serve_metrics()
            with TrialProgress(cfg.train.rounds, title="jetsplit trial",
                               live=self.live) as progress:
                archive = bundle_for(self.out_dir, resume, lambda: prepare_bundle(
                    cfg, self.out_dir / "build", run_classes(self.test)))
                return fleet.execute(RunSpec(
                    cfg.settings(), archive, self.test, self.out_dir,
                    server_cut=planned.split, cuts=planned.cuts, resume=resume,
                    on_round=[progress.update], row_extras=[predicted_row(planned.plan)],
                    replanner=planned.replanner,
                    predicted_step_s=predicted_steps(planned.plan)))


def trial_edges(train: dict[str, Any], edges: int | None, agents: int) -> int:
    """`--edges`, or for a three-tier method without it `default_edges` (as `simulate`);
    0 for the other methods."""
    if edges is not None:
        return edges
    algorithm = TrialSpec(train=train).training().algorithm
    return default_edges(agents) if catalog.three_tier(algorithm) else 0


def _server_toml(cfg: Any, broker_url: str) -> str:
    """The coordinator config this trial ran with, as a server.toml users can reuse."""
    import tomli_w

    m = cfg.model
    doc: dict[str, Any] = {
        "fleet": cfg.fleet, "agents": cfg.agents, "seed": cfg.seed,
        "mqtt": {"broker": broker_url},
        "model": {"name": m.name, "input_shape": list(m.input_shape), "classes": m.classes,
                  "split": m.split, **({"weights": m.weights} if m.weights else {})},
        "data": cfg.data.model_dump(exclude_defaults=True),
        "server": cfg.server.model_dump(),
        "train": {k: v for k, v in cfg.train.model_dump().items() if v is not None},
    }
    if cfg.topology.edges:
        doc["topology"] = {"edges": {e: list(c) for e, c in cfg.topology.edges.items()}}
    return tomli_w.dumps(doc)


def load_spec(run_dir: Path) -> TrialSpec:
    """The spec a trial in `run_dir` started with (for --resume)."""
    path = run_dir / SPEC_FILE
    try:
        saved = json.loads(path.read_text())
        train = saved.pop("train", {})
        # A trial.json written before `train` held its [train] keys flat.
        flat = {k: saved.pop(k) for k in list(saved) if k in TrainSection.model_fields}
        return TrialSpec(**saved, train={**flat, **train})
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no {SPEC_FILE} there (not a trial folder)"
                          ) from None
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--resume {run_dir}: {SPEC_FILE} is damaged ({exc})") from None


# The trial's own options (its [train] flags come from the one declaration).
_AgentsPerProcess = Annotated[int, typer.Option(
    "--agents-per-process", help="Clients per process (>1: `jetsplit agent host` "
    "processes; one torch and dataset for many agents).")]
_Broker = Annotated[str | None, typer.Option(
    "--broker", help="mqtt[s]://host:port; default: start the embedded broker.")]
_Profiles = Annotated[list[str] | None, typer.Option(
    "--profile", "--profiles", help="Device profile per agent (repeat; cycled over the agents).")]
_Out = Annotated[Path | None, typer.Option(
    "--out", help="Run folder (default runs/trial-<UTC time>).")]
_Dataset = Annotated[str, typer.Option(
    "--dataset", help="mnist | digits | npz:PATH | cifar10:DIR | folder:DIR | csv:FILE")]
_Partition = Annotated[str, typer.Option(
    "--partition", help="iid | quantity:A | dirichlet:B | ampere:A (label skew by "
    "default)")]
_Split = Annotated[int | None, typer.Option(
    "--split", help="One cut for every device, overriding the planner.")]
_CommonSplit = Annotated[bool, typer.Option(
    "--common-split", help="The planner's best one cut for every device (default: a "
    "cut per device for the split methods).")]
_Cut = Annotated[list[str] | None, typer.Option(
    "--cut", help="AGENT=K: train agent AGENT at cut K (repeat); checked against its "
    "profile's memory.")]
_Edges = Annotated[int | None, typer.Option(
    "--edges", help="sherl: edge agents (emulating --edge-profile) serving the clients "
    "(default: √agents, rounded).")]
_EdgeProfile = Annotated[str, typer.Option(
    "--edge-profile", help="sherl: device profile of the edge agents.")]
_NoEmulation = Annotated[bool, typer.Option(
    "--no-emulation", help="Run agents at this machine's speed, links unlimited.")]
_MetricsPort = Annotated[int | None, typer.Option(
    "--metrics-port", help="Serve Prometheus metrics on 127.0.0.1:PORT.")]
_Resume = Annotated[Path | None, typer.Option(
    "--resume", help="Continue the trial in DIR from its last checkpoint.")]
_Device = Annotated[str, typer.Option(
    "--device", help="auto | cpu | cuda: where the coordinator's server blocks and "
    "evaluation run.")]
_Tensorboard = Annotated[str | None, typer.Option(
    "--tensorboard", help="Also write per-round scalars for TensorBoard into DIR.")]
_Mlflow = Annotated[str | None, typer.Option(
    "--mlflow", help="Also log per-round metrics to this MLflow tracking URI.")]
_Attack = Annotated[list[str] | None, typer.Option(
    "--attack", help="Tests and benchmarks only (JETSPLIT_ALLOW_ATTACKS=1): AGENT=SPEC "
    "makes that agent process misbehave (repeat), e.g. a3=scale:1000.")]
_Trace = Annotated[list[str] | None, typer.Option(
    "--trace", help="AGENT=TRACE: that agent's device changes during the run as the "
    "trace says (a file, or a name in profiles/traces/, e.g. a0=link-drop-recover); "
    "repeat per agent.")]
_ProvisionSizes = Annotated[bool, typer.Option(
    "--provision-sizes", help="Provision each agent's shard size, as `jetsplit "
    "provision --size` would: a registered size weighs at most that.")]


@train_flags("algorithm", "rounds", "local_steps", "batch", "lr", "fraction", "codec",
             "aggregator", "replan", "replan_threshold", "replan_clock")
def trial_command(
    train: dict[str, Any],
    agents: Annotated[int, typer.Option("--agents", help="Agents to start.")] = 4,
    agents_per_process: _AgentsPerProcess = 1,
    broker: _Broker = None,
    profiles: _Profiles = None,
    out: _Out = None,
    model: Annotated[str, typer.Option(
        "--model", help="A zoo name, module.path:factory, torchvision:NAME or timm:NAME."
    )] = "alexnet",
    dataset: _Dataset = "mnist",
    image_size: ImageSizeFlag = None,
    weights: WeightsFlag = None,
    partition: _Partition = "dirichlet:0.5",
    seed: Annotated[int, typer.Option("--seed", help="Seeds data, selection, weights.")] = 0,
    split: _Split = None,
    common_split: _CommonSplit = False,
    cut: _Cut = None,
    edges: _Edges = None,
    edge_profile: _EdgeProfile = "orin-nx-16gb",
    no_emulation: _NoEmulation = False,
    metrics_port: _MetricsPort = None,
    resume: _Resume = None,
    device: _Device = "auto",
    tensorboard: _Tensorboard = None,
    mlflow: _Mlflow = None,
    attack: _Attack = None,
    trace: _Trace = None,
    provision_sizes: _ProvisionSizes = False,
) -> None:
    """Field trial on this machine: broker, coordinator and emulated agents; report."""
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("jetsplit.trial").setLevel(logging.INFO)
    if resume is not None:
        spec, out_dir = load_spec(resume), resume
    else:
        spec = TrialSpec(train=train, agents=agents,
                         profiles=profiles or list(DEFAULT_PROFILES), model=model,
                         dataset=dataset, image_size=image_size, weights=weights,
                         partition=partition, seed=seed, broker=broker,
                         emulate=not no_emulation, split=split,
                         edges=trial_edges(train, edges, agents),
                         edge_profile=edge_profile, device=device,
                         common_split=common_split, cuts=parse_cuts(cut),
                         agents_per_process=agents_per_process,
                         attacks=parse_attack_options(attack or []),
                         traces=parse_agent_options(trace or [], "--trace", "TRACE",
                                                    "a0=link-drop-recover"),
                         provision_sizes=provision_sizes)
        out_dir = out or Path("runs") / time.strftime("trial-%Y%m%d-%H%M%S", time.gmtime())
    from jetsplit.server.ops.tracking import Trackers

    params = {k: v for k, v in asdict(spec).items() if k != "train"}
    trackers = Trackers(tensorboard, mlflow, run_name=out_dir.name,
                        params={**params, **spec.training().model_dump()})
    try:
        summary = run_trial(spec, out_dir, resume=resume is not None,
                            metrics_port=metrics_port, trackers=trackers)
    finally:
        trackers.close()
    accuracy = summary["final_accuracy"]
    typer.echo(f"{summary['algorithm']}: {summary['rounds']} rounds with {spec.agents} agents in "
               f"{summary['seconds']:.0f}s, final accuracy "
               f"{'n/a' if accuracy is None else f'{accuracy:.4f}'}, "
               f"up {summary['bytes_up'] / 1e6:.1f} MB, down {summary['bytes_down'] / 1e6:.1f}"
               f" MB")
    typer.echo(f"report: {summary['report']}")

"""`jetsplit simulate`: a whole fleet in one process (the in-process engine), for experiments.

The same methods, agent code and metrics as a field run over MQTT; one copy of the data
(each simulated client holds only its shard) and one verified bundle shared by all clients.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jetsplit import catalog
from jetsplit.cli_types import parse_agent_options, parse_cuts
from jetsplit.server.run.flags import ImageSizeFlag, WeightsFlag, train_flags
from jetsplit.server.training.settings import Settings

if TYPE_CHECKING:
    from jetsplit.data import Dataset
    from jetsplit.edge_agent.attacks import Attack


def simulate(
    settings: Settings,
    *,
    model: str,
    split: int,
    dataset: str,
    clients: int,
    partition_scheme: str,
    out_dir: Path,
    test_fraction: float = 0.2,
    aux_ratio: float | None = 0.5,
    resume: bool = False,
    profiles: list[str] | None = None,
    common_split: bool = False,
    bundle: Path | None = None,
    checkpoint: bool = True,
    attacks: dict[str, str] | None = None,
    validation: float = 0.0,
    absent: Sequence[str] = (),
    provision_sizes: bool = False,
    image_size: int | None = None,
    weights: str | None = None,
    hand_cuts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Partition `dataset` over `clients` in-process agents and train; returns the summary.
    The simulated agents compute on the coordinator's device (`settings.device`): one GPU
    runs the whole fleet.
    The arguments go to `out_dir/simulation.json`, so `--resume DIR` needs nothing else.
    The edges of `settings.edges` (SHeRL-FL) join as data-less agents with role `edge`.
    With `profiles` (cycled over the clients) the fleet planner gives each client a cut
    for its profile, `split` then being ignored unless `common_split`.
    `bundle` reuses an archive written earlier for the same model, split, aux ratio and
    seed (benchmarks run many methods on one); `checkpoint=False` skips the per-round
    checkpoint (and with it `--resume`).
    `attacks` ({agent: spec}, tests and benchmarks only, see `edge_agent.attacks`) makes
    those simulated clients misbehave; refused unless JETSPLIT_ALLOW_ATTACKS=1.
    `validation` > 0 holds that fraction of the training data out (stratified) and
    evaluates on it instead of the test split, so a learning-rate sweep never sees the
    test data it is later reported on.
    `absent` clients get their shard as usual but never join: the same partition without
    their data (a benchmark's floor, what the fleet learns without an attacker at all).
    `provision_sizes` provisions each client's shard size, as `jetsplit provision --size`
    would (`settings.provisioned_sizes`): a claim then weighs at most the truth.
    `image_size` sizes a `folder:`/`csv:` dataset's images (their eval crop, training
    random-resized crop and flip); `weights` is the initial weights file the model starts
    from (jetsplit/models/initial_weights.py). `hand_cuts` ({agent: cut}) sets those
    clients' cuts over the planner's (or `split`); the deepest is the server cut."""
    from jetsplit.data import client_shards
    from jetsplit.devices import resolve_device
    from jetsplit.server.engines.seam import InProcessEngine
    from jetsplit.server.run.allocator import keep_freed_memory
    from jetsplit.server.run.assembly import RunSpec, bundle_for, execute, folder_run_id

    device = resolve_device(settings.device, "--device")
    keep_freed_memory()  # the fleet's blocks and gradients, reused rather than re-faulted
    run_name = folder_run_id(out_dir, "simulation", "--resume" if resume else "--out")
    attackers = simulated_attacks(attacks or {}, clients, settings.seed)
    in_process_attacks(attacks or {})
    _check_absent(absent, clients)
    train, test = simulation_data(dataset, test_fraction, validation, settings.seed,
                                  image_size)
    shards = client_shards(train.y, clients, partition_scheme, settings.seed, train.num_classes)
    if provision_sizes:
        settings = settings.model_copy(update={"provisioned_sizes": shard_sizes(shards)})
    workers = simulated_fleet(settings, train, shards, device, attackers, absent)
    mean_shard = max(1, round(sum(len(s) for s in shards) / max(1, len(shards))))
    del train, shards  # from here on each client's shard is the only copy of its data
    cuts: dict[str, int] | None = None
    if profiles:
        split, cuts = _profiled_cuts(settings, workers, model, test, clients, profiles,
                                     common_split, mean_shard)
    if hand_cuts:
        split, cuts = _with_hand_cuts(hand_cuts, cuts, split, model, test, clients)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out_dir / RUN_FILE).write_text(json.dumps({
            "settings": settings.model_dump(), "model": model, "split": split,
            "dataset": dataset, "clients": clients, "partition_scheme": partition_scheme,
            "test_fraction": test_fraction, "aux_ratio": aux_ratio, "profiles": profiles,
            "common_split": common_split, "attacks": attacks, "validation": validation,
            "absent": list(absent), "provision_sizes": provision_sizes,
            "image_size": image_size, "weights": weights, "hand_cuts": hand_cuts},
            indent=2))
    with tempfile.TemporaryDirectory(prefix="jetsplit-sim-") as tmp:
        archive = bundle_for(out_dir, resume, lambda: bundle or fresh_bundle(
            model, test, split, Path(tmp), aux_ratio=aux_ratio, seed=settings.seed,
            weights=weights))
        engine = InProcessEngine(workers, run_id=run_name)
        summary = execute(engine, RunSpec(settings, archive, test, out_dir, server_cut=split,
                                          cuts=cuts or {}, resume=resume,
                                          checkpoint=checkpoint))
    summary["peak_rss_mb"] = peak_rss_mb()
    summary["peak_agents_holding_blocks"] = engine.peak_agents_holding_blocks
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _check_absent(absent: Sequence[str], clients: int) -> None:
    """`absent` names some of the clients, not all (before any data loads)."""
    from jetsplit.errors import ConfigError

    names = [agent_name(i) for i in range(clients)]
    if not set(absent) <= set(names) or len(set(absent)) >= clients:
        raise ConfigError(f"absent clients {sorted(absent)}: name some of a0..a{clients - 1}, "
                          "not all")


def simulated_fleet(settings: Settings, train: Dataset, shards: Sequence[Sequence[int]],
                    device: Any, attackers: dict[str, Attack], absent: Sequence[str]
                    ) -> dict[str, Any]:
    """The in-process agents: client aN on shard N (but the `absent` ones), seeded
    seed + N and running its attack if any, and SHeRL-FL's data-less edges; all share one
    verified bundle."""
    from jetsplit.bundle import Bundle
    from jetsplit.edge_agent.edge import no_data
    from jetsplit.edge_agent.worker import AgentWorker

    cache: dict[str, Bundle] = {}
    workers = {agent_name(i): AgentWorker(agent_name(i), train.subset(shard),
                                          seed=settings.seed + i, bundle_cache=cache,
                                          device=device, attack=attackers.get(agent_name(i)))
               for i, shard in enumerate(shards) if agent_name(i) not in absent}
    workers.update({edge: AgentWorker(edge, no_data(), role="edge", seed=settings.seed,
                                      bundle_cache=cache, device=device)
                    for edge in sorted(settings.edges)})
    return workers


def _profiled_cuts(settings: Settings, workers: dict[str, Any], model: str,
                   test: Dataset, clients: int, profiles: list[str], common_split: bool,
                   mean_shard: int) -> tuple[int, dict[str, int]]:
    """The planner's (server cut, cut per client) for clients of these profiles (cycled);
    each worker registers its profile."""
    from jetsplit.profiles import resolve_profile
    from jetsplit.server.cuts.planning import plan_cuts

    by_agent = {agent_name(i): profiles[i % len(profiles)] for i in range(clients)}
    for agent, name in by_agent.items():
        if agent in workers:
            workers[agent].profile = resolve_profile(name).model_dump(mode="json")
    split, cuts, _ = plan_cuts(
        settings.algorithm, model, test.input_shape, test.num_classes, by_agent,
        batch=max(1, settings.batch // clients), local_steps=settings.local_steps,
        rounds=settings.rounds, dataset_size=mean_shard, codec=settings.codec,
        server_profile="x86-cpu", common_split=common_split)
    return split, cuts


def _with_hand_cuts(hand: dict[str, int], cuts: dict[str, int] | None, split: int,
                    model: str, test: Dataset, clients: int) -> tuple[int, dict[str, int]]:
    """(server cut, cut per client) with `--cut` laid over the planner's cuts (or `split`
    for everyone); each named client and cut checked in one line."""
    from jetsplit.errors import ConfigError
    from jetsplit.server.run.preflight import check_split

    names = [agent_name(i) for i in range(clients)]
    for agent, cut in sorted(hand.items()):
        if agent not in names:
            raise ConfigError(f"--cut {agent}={cut}: no simulated client {agent!r} (they are "
                              f"a0..a{clients - 1})")
        check_split(model, test.input_shape, test.num_classes, cut, flag=f"--cut {agent}")
    merged = {**{a: split for a in names}, **(cuts or {}), **hand}
    return max(merged.values()), merged


def fresh_bundle(model: str, test: Dataset, split: int, workdir: Path, *,
                 aux_ratio: float | None, seed: int, weights: str | None = None) -> Path:
    """A bundle archive of `model` (shaped for `test`, naming its classes) split at
    `split`, written in `workdir`, starting from `weights` when given; stored
    uncompressed (gzip level 0): only this process reads it (the agents get device
    bundles cut from it), and deflating the weights cost seconds of CPU per run for a few
    percent of their size."""
    from jetsplit.export.bundle_writer import write_bundle
    from jetsplit.models import ModelSpec
    from jetsplit.server.run.assembly import tell_bundle_notes
    from jetsplit.server.run.held_out import run_classes

    spec = ModelSpec(model, test.input_shape, test.num_classes)
    report = write_bundle(spec, split, workdir / "bundle", aux_ratio=aux_ratio, seed=seed,
                          tar=True, initial_weights=weights, classes=run_classes(test),
                          compresslevel=0)
    tell_bundle_notes(report.notes)
    assert report.tar_path is not None
    return report.tar_path


RUN_FILE = "simulation.json"


def simulation_data(dataset: str, test_fraction: float, validation: float, seed: int,
                    image_size: int | None = None) -> tuple[Dataset, Dataset]:
    """(training data, evaluated data): the test split, or with `validation` > 0 that
    fraction of the training data (stratified), so that a sweep never scores on the test.
    Images of a `folder:`/`csv:` dataset come out `image_size` square."""
    from jetsplit.data import ImageOptions, load_dataset_split, train_test_split

    train, test = load_dataset_split(dataset, test_fraction, seed,
                                     ImageOptions(image_size=image_size, seed=seed))
    if validation:
        return train_test_split(train, test_fraction=validation, seed=seed)
    return train, test


def resume_simulation(run_dir: Path) -> dict[str, Any]:
    """Continue a simulation from its last checkpoint, with the arguments it started with."""
    from jetsplit.errors import ConfigError

    path = run_dir / RUN_FILE
    try:
        saved = json.loads(path.read_text())
        settings = Settings(**saved.pop("settings"))
        return simulate(settings, out_dir=run_dir, resume=True, **saved)
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no {RUN_FILE} there (not a simulation run "
                          f"folder)") from None
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--resume {run_dir}: {RUN_FILE} is damaged ({exc})") from None


def simulated_attacks(attacks: dict[str, str], clients: int, seed: int,
                      who: str = "simulated client") -> dict[str, Attack]:
    """{agent: spec} as the attacks the clients a0… run (seeded like the agent), checked
    before any data loads: only client names, and only where attacks are allowed. `who`
    names the clients in the error (a trial's are agents)."""
    from jetsplit.edge_agent.attacks import build_attack
    from jetsplit.errors import ConfigError

    names = [agent_name(i) for i in range(clients)]
    built = {}
    for agent, spec in attacks.items():
        if agent not in names:
            raise ConfigError(f"--attack {agent}={spec}: no {who} {agent!r} (they "
                              f"are a0..a{clients - 1})")
        built[agent] = build_attack(spec, seed + names.index(agent), f"--attack {agent}")
    return built


def in_process_attacks(attacks: dict[str, str]) -> None:
    """Refuse the faults the in-process engine cannot show (it has no clock: a `silent`
    agent would answer anyway), in one line."""
    from jetsplit.edge_agent.attacks import NEEDS_BROKER, parse_attack
    from jetsplit.errors import ConfigError

    for agent, spec in sorted(attacks.items()):
        if parse_attack(spec).kind in NEEDS_BROKER:
            raise ConfigError(f"--attack {agent}={spec}: needs agents over a broker "
                              f"(jetsplit trial --attack {agent}={spec})")


def parse_attack_options(options: list[str]) -> dict[str, str]:
    """`--attack a3=scale:1000` options as {agent: spec}; a malformed one is one line."""
    return parse_agent_options(options, "--attack", "SPEC", "a3=scale:1000")


def shard_sizes(shards: Sequence[Sequence[int]]) -> dict[str, int]:
    """Each client's shard size by agent name (what `--provision-sizes` provisions); an
    empty shard claims nothing, so it is left out."""
    return {agent_name(i): len(shard) for i, shard in enumerate(shards) if len(shard)}


def agent_name(index: int) -> str:
    """Simulated agents are named like field agents in trials: a0, a1, …"""
    return f"a{index}"


def edge_name(index: int) -> str:
    """Simulated edges (SHeRL-FL's tier 2): e0, e1, …"""
    return f"e{index}"


def default_edges(clients: int) -> int:
    """SHeRL-FL's edge count when `--edges` is not given: √K rounded (at least 1, at most
    K), so the edge tier is about as wide as each edge's group of clients (4 clients: 2
    edges of 2; 10: 3 edges of 3 or 4; 1: 1)."""
    return max(1, min(clients, round(math.sqrt(max(clients, 0)))))


def sherl_topology(algorithm: str, edges: int | None, clients: int) -> dict[str, list[str]]:
    """`--edges N`: N edge agents, clients dealt round-robin (sherl only; unset:
    `default_edges`)."""
    from jetsplit.errors import ConfigError
    from jetsplit.server.fleet.topology import round_robin

    if not catalog.three_tier(algorithm):
        if edges:
            three = [n for n in catalog.NAMES if catalog.three_tier(n)]
            raise ConfigError(f"--edges is for --algorithm {' or '.join(three)} (three tiers), "
                              f"not {algorithm}")
        return {}
    if edges is None:
        edges = default_edges(clients)
    if not 1 <= edges <= clients:
        raise ConfigError(f"--algorithm {algorithm} needs 1..{clients} --edges (each edge serves "
                          f"at least one client), got {edges}")
    return round_robin([edge_name(j) for j in range(edges)],
                       [agent_name(i) for i in range(clients)])


# Every [train] key but those of a live fleet (deadlines, compression of MQTT payloads).
SIMULATE_TRAIN_FLAGS = (
    "algorithm", "rounds", "local_steps", "batch", "lr", "fraction", "codec", "preset",
    "optimizer", "momentum", "weight_decay", "client_lr", "server_lr", "client_batch",
    "psl_reduction", "k_min", "k_max", "lam", "eta", "patience", "device_epochs",
    "server_batch", "server_epochs", "tau1", "tau2", "margin", "edge_lr", "cloud_lr",
    "size_cap", "max_misses", "aggregator", "clip_factor", "robust_fraction",
    "outlier_bound", "activation_bound", "loss_bound", "histogram_check",
    "label_check", "direction_check", "gradient_bound",
    "gradient_shares")


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


@train_flags(*SIMULATE_TRAIN_FLAGS)
def simulate_command(
    train: dict[str, Any],
    model: Annotated[str, typer.Option(
        "--model", help="A zoo name, module.path:factory, torchvision:NAME or timm:NAME."
    )] = "alexnet",
    split: Annotated[int, typer.Option("--split", help="Layers on the device.")] = 2,
    dataset: Annotated[str, typer.Option(
        "--dataset", help="mnist | digits | npz:PATH | cifar10:DIR | folder:DIR | csv:FILE"
    )] = "mnist",
    image_size: ImageSizeFlag = None,
    weights: WeightsFlag = None,
    cut: Annotated[list[str] | None, typer.Option(
        "--cut", help="AGENT=K: train simulated client AGENT at cut K (repeat); the others "
        "at --split or the planner's.")] = None,
    clients: Annotated[int, typer.Option("--agents", "--clients", help="Simulated agents K."
                                         )] = 4,
    partition: Annotated[str, typer.Option(
        "--partition", help="iid | quantity:A | dirichlet:B | ampere:A")] = "dirichlet:0.5",
    seed: Annotated[int, typer.Option("--seed", help="Seeds data, selection, weights.")] = 0,
    out: Annotated[Path | None, typer.Option("--out", help="Run folder (default runs/<id>).")
                   ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Last stdout line: summary JSON.")
                       ] = False,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="Continue the run in DIR from its last checkpoint (other options "
        "come from DIR).")] = None,
    edges: Annotated[int | None, typer.Option(
        "--edges", help="sherl: edge agents; clients are dealt to them round-robin "
        "(default: √K rounded).")] = None,
    edge_split: Annotated[int | None, typer.Option(
        "--edge-split", help="sherl: k2, the first cloud layer (default: the planner's).")
    ] = None,
    device: Annotated[str, typer.Option(
        "--device", help="auto | cpu | cuda: where the server blocks, evaluation and the "
        "simulated agents compute.")] = "auto",
    autocast: Annotated[str, typer.Option(
        "--autocast", help="off | bf16 | fp16: mixed precision on the server block.")
    ] = "off",
    profiles: Annotated[list[str] | None, typer.Option(
        "--profile", "--profiles", help="Device profile per client (repeat; cycled): the "
        "planner gives each client a cut for its profile (--split is then ignored).")] = None,
    common_split: Annotated[bool, typer.Option(
        "--common-split", help="With --profile: the planner's best one cut for all.")
    ] = False,
    attack: Annotated[list[str] | None, typer.Option(
        "--attack", help="Tests and benchmarks only (JETSPLIT_ALLOW_ATTACKS=1): AGENT=SPEC "
        "makes that simulated client misbehave (repeat), e.g. a3=scale:1000.")] = None,
    provision_sizes: Annotated[bool, typer.Option(
        "--provision-sizes", help="Provision each client's shard size, as `jetsplit provision "
        "--size` would: a registered size weighs at most that.")] = False,
) -> None:
    """Simulate a fleet in one process: same methods and metrics as over MQTT."""
    from jetsplit.config_io import model_from_dict
    from jetsplit.devices import resolve_device
    from jetsplit.errors import ConfigError
    from jetsplit.server.run.config import ServerSection, TrainSection
    from jetsplit.server.run.preflight import validate_options

    attacks = parse_attack_options(attack or [])
    if attacks and resume is not None:
        raise ConfigError("--attack and --resume: a resumed run keeps the attacks it began with")
    train_section = validate_options(TrainSection, train, {})
    algorithm = train_section.algorithm
    server = model_from_dict(ServerSection, {"device": device, "autocast": autocast},
                             "option", "--")
    resolve_device(server.device, "--device")  # fail before loading any data
    if clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {clients}")
    logging.basicConfig(level=logging.WARNING if as_json else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if resume is not None:
        out_dir = resume
        summary = resume_simulation(resume)
        algorithm = summary["algorithm"]
    else:
        out_dir = out or Path("runs") / time.strftime("sim-%Y%m%d-%H%M%S", time.gmtime())
        topology = sherl_topology(algorithm, edges, clients)
        settings = Settings(seed=seed, edges=topology, edge_split=edge_split,
                            **server.model_dump(), **train_section.model_dump())
        summary = simulate(settings, model=model, split=split, dataset=dataset, clients=clients,
                           partition_scheme=partition, out_dir=out_dir, profiles=profiles,
                           common_split=common_split, attacks=attacks,
                           provision_sizes=provision_sizes, image_size=image_size,
                           weights=weights, hand_cuts=parse_cuts(cut))
    _tell(summary, out_dir, algorithm, as_json)


def _tell(summary: dict[str, Any], out_dir: Path, algorithm: str, as_json: bool) -> None:
    """The run's last line: its summary as JSON (`--json`), or in words."""
    short = {k: summary[k] for k in ("algorithm", "rounds", "final_accuracy",
                                     "balanced_accuracy", "final_accuracy_std", "bytes_up",
                                     "bytes_down", "device_gflops", "seconds", "peak_rss_mb")}
    short["out"] = str(out_dir)
    if as_json:
        typer.echo(json.dumps(short))
    else:
        acc, bal = summary["final_accuracy"], summary["balanced_accuracy"]
        typer.echo(f"{algorithm}: final accuracy {acc:.4f} (balanced {bal:.4f}), "
                   f"up {summary['bytes_up'] / 1e6:.1f} MB,"
                   f" down {summary['bytes_down'] / 1e6:.1f} MB, device "
                   f"{summary['device_gflops']:.1f} GFLOPs; metrics in {out_dir}")

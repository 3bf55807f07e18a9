"""The training driver: rounds of a method over any engine, with evaluation and metrics.

Per round it selects a seeded fraction of eligible agents, makes sure they hold the bundle,
lets the method run its T local iterations, evaluates on the held-out test split (which
never leaves the coordinator) and writes one JSON line: top-1 and balanced accuracy,
per-class accuracy, loss, bytes up/down per message kind (training and evaluation apart),
device GFLOPs per agent (from the cost model and the samples each agent processed) and wall
time per phase.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jetsplit.bundle import Bundle, load_bundle
from jetsplit.data import ArrayDataset
from jetsplit.devices import resolve_device, torch_threads
from jetsplit.errors import JetsplitError
from jetsplit.models import ZOO_VERSION
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.compute import autocast, to_device, to_host
from jetsplit.server.divergence import DivergenceGuard
from jetsplit.server.engine import Command, Engine, Outcome
from jetsplit.server.evaluation import Evaluation, evaluate, summarize
from jetsplit.wire import accounted_bound

log = logging.getLogger("jetsplit.coordinator")
Arrays = dict[str, np.ndarray]
REJOIN_GRACE_S = 3.0  # after an outage, how long to wait for the rest of the fleet
MIN_CLIENT_BATCH = 2  # BatchNorm in training mode needs more than one value per channel


class RoundFailed(JetsplitError):
    """A round ended without the update it exists for (no weights, no server step):
    reporting it as done would train nothing while looking like a completed run."""


@dataclass(frozen=True)
class Settings:
    """How to train; names as in docs/methods.md (T local steps, fraction r, total batch B)."""

    algorithm: str = "psl"
    rounds: int = 10
    local_steps: int = 10
    fraction: float = 1.0
    batch: int = 64  # B: per iteration over all selected agents, B_k ∝ |D_k|
    lr: float = 0.01
    seed: int = 0
    deadline_s: float = 60.0
    bundle_deadline_s: float = 300.0
    retry_s: float = 30.0  # MQTT: silence before a command is re-sent (then backs off)
    codec: str = "fp32"
    compression: str = "none"
    # GAPSL (gapsl.txt §III): selection-ratio bounds, alignment weight λ, threshold width η.
    k_min: float = 0.2
    k_max: float = 0.8
    lam: float = 5e-4
    eta: float = 1.0
    # PSL's L and GAPSL's L_g: "mean" over the clients or their "sum" (eq. 8); unset: the
    # preset's (server/optim.py). `preset`: "default" (what trains the shipped models) or
    # "paper" (the papers' own settings, for their models).
    psl_reduction: str | None = None
    preset: str = "default"
    # Ampere (ampere.txt §3.3): phase 1 ends after `patience` epochs without a better
    # validation accuracy of client+aux, or after N_d = `device_epochs`; the validation part
    # is carved from the coordinator's held-out split. Phase 2 uploads activations in
    # replies of at most `upload_mb` into a store bounded by `activation_gb`, kept in
    # `activation_dir` (default: a folder per run in the system temp dir, removed at the end).
    patience: int = 5
    device_epochs: int = 100
    validation_fraction: float = 0.2
    upload_mb: float = 8.0
    activation_dir: str | None = None
    activation_gb: float = 64.0
    # SHeRL-FL (sherl-fl.txt): edges FedAvg their clients every `tau1` iterations and the
    # cloud FedAvg-s the edge tier every `tau2` (None: once per round, after iteration T);
    # `margin` m of the edge's contrastive loss; `edges` maps edge → clients (empty:
    # round-robin over the registered edges); `edge_split` k2 is the first cloud layer
    # (None: the planner picks it from the agents' profiles).
    tau1: int | None = None
    tau2: int | None = None
    margin: float = 0.5
    cloud_lr: float | None = None  # SHeRL-FL's cloud head (paper: Adam, 1e-3)
    # Per-tier training (server/optim.py): unset = the method's paper default, else the
    # general `lr` / plain SGD. `client_batch` fixes every client's batch (GAPSL's 128,
    # Ampere's B(d)) instead of B_k ∝ |D_k|; `server_batch` is Ampere's B(s) (default B);
    # `server_epochs` is Ampere's N_s (default: every round left after phase 1).
    optimizer: str | None = None
    momentum: float | None = None
    weight_decay: float = 0.0
    client_lr: float | None = None
    server_lr: float | None = None
    edge_lr: float | None = None
    client_batch: int | None = None
    server_batch: int | None = None
    server_epochs: int | None = None
    edges: dict[str, list[str]] = field(default_factory=dict)
    edge_split: int | None = None
    # Where the coordinator computes ([server] in server.toml): device auto|cpu|cuda for the
    # server blocks and evaluation; autocast off|bf16|fp16 on the server block's steps;
    # intra-op torch threads for the coordinator's compute (0: the process's setting).
    device: str = "auto"
    autocast: str = "off"
    threads: int = 0


class Trainer:
    """Shared machinery the methods use: exchanges, weights, timing, FLOP and byte books."""

    def __init__(self, engine: Engine, archive: Path, settings: Settings, test: ArrayDataset,
                 *, bundle: Bundle | None = None, cuts: Mapping[str, int] | None = None
                 ) -> None:
        """`archive` is the whole model split at the server cut c*; `cuts` gives agents
        that train at a shallower cut theirs (the rest train at c*; see server/hetero.py)."""
        from jetsplit.server.coordinator import CLIENT_CONTENT, BundleShipper
        from jetsplit.server.hetero import Completions, check_cuts

        self.engine, self.settings, self.test = engine, settings, test
        self.bundle = bundle or load_bundle(archive)
        # Devices get only what they run: the client block (+ aux head), or for FedAvg
        # the whole model; per-device cuts (`cuts`, agent → k) get their cut's block.
        from jetsplit.server.optim import tier_optimizer

        self.client_optimizer = tier_optimizer(settings, "client")
        self.server_optimizer = tier_optimizer(settings, "server")
        self.shipper = BundleShipper(engine, archive, lr=self.client_optimizer.lr,
                                     deadline_s=settings.bundle_deadline_s,
                                     optimizer=self.client_optimizer.wire(),
                                     content=CLIENT_CONTENT.get(settings.algorithm, "client"),
                                     seed=settings.seed, bundle=self.bundle)
        self.cuts: dict[str, int] = check_cuts(cuts or {}, self.bundle.split,
                                               self.bundle.spec.name)
        self.device = torch.device(resolve_device(settings.device, "device"))
        self.server: nn.Module = self.bundle.server_module().to(self.device)
        self.optimizer = self.server_optimizer.for_module(self.server)
        client = self.bundle.client_module()
        self.global_client: Arrays = to_arrays(client, "client")
        self.weight_template: Arrays = {**self.global_client,
                                        **to_arrays(self.server, "server")}
        # What a device at cut k holds beyond its client layers, where that differs from
        # the server cut's (Ampere: the aux head built for k); replaces those blocks.
        self.cut_templates: dict[int, Arrays] = {}
        with eval_mode(client), torch.no_grad():
            probe = client(torch.zeros(1, *self.bundle.spec.input_shape))
        self.activation_shape = tuple(probe.shape[1:])
        k = self.bundle.split
        self.completions = Completions(  # client layers: the client tier's optimiser
            self.bundle.client_module(), self.cuts, self.client_optimizer.build,
            self.bundle.spec.input_shape, self.device)
        self._activation_shapes = {k: self.activation_shape}
        self.rng = np.random.default_rng(settings.seed)
        self.phases: dict[str, float] = defaultdict(float)
        self.fwd_samples: dict[str, int] = defaultdict(int)
        self.bwd_samples: dict[str, int] = defaultdict(int)
        self.full_samples: dict[str, int] = defaultdict(int)
        self.missed: dict[str, str] = {}
        self.missed_kind: dict[str, str] = {}  # what each agent in `missed` missed
        self.guard = DivergenceGuard(settings, self.bundle.spec.num_classes)
        self.round = 0
        self._last_pool = 0
        self._flops: dict[int, dict[str, float]] = {}

    # ------------------------------------------------------------------ cuts

    def cut(self, agent: str) -> int:
        """The last layer agent's device trains (c_k; the server cut c* by default)."""
        return self.completions.cut(agent)

    def cuts_of(self, agents: list[str]) -> dict[str, int]:
        return {a: self.cut(a) for a in agents}

    def needs_bundle(self, agent: str) -> bool:
        return bool(self.shipper.needs(agent, self.cuts.get(agent)))

    def client_names(self, cut: int) -> list[str]:
        from jetsplit.server.hetero import block_names

        return block_names(self.completions.template, cut)

    def device_part(self, agent: str, arrays: Arrays) -> Arrays:
        """The client tensors of `arrays` that agent's device holds (its cut's layers)."""
        cut = self.cut(agent)
        if cut == self.bundle.split:
            return arrays
        keep = set(self.client_names(cut))
        return {n: v for n, v in arrays.items() if n in keep}

    def by_cut(self, agents: list[str]) -> dict[int, list[str]]:
        """Agents grouped by their cut, deepest first."""
        groups: dict[int, list[str]] = defaultdict(list)
        for agent in agents:
            groups[self.cut(agent)].append(agent)
        return {cut: groups[cut] for cut in sorted(groups, reverse=True)}

    def push_client(self, agents: list[str], arrays: Arrays,
                    per_cut: Mapping[int, Arrays] | None = None) -> list[str]:
        """Install a whole client block (1..c*) on agents, each getting its cut's layers
        (plus `per_cut[c_k]`: Ampere's aux head for that cut)."""
        done: list[str] = []
        for cut, group in self.by_cut(agents).items():
            part = self.device_part(group[0], arrays)
            done += self.push(group, {**part, **(per_cut or {}).get(cut, {})})
        return sorted(done)

    def activation_shape_at(self, cut: int) -> tuple[int, ...]:
        """Per-sample activation shape a device at `cut` sends."""
        if cut not in self._activation_shapes:
            self._activation_shapes[cut] = self.completions.activation_shape(cut)
        return self._activation_shapes[cut]

    # ------------------------------------------------------------------ books

    def _per_sample_flops(self, k: int) -> dict[str, float]:
        from jetsplit.export.cost_model import client_block, get_costs, server_block

        if k not in self._flops:
            spec = self.bundle.spec
            costs = get_costs(spec.name, spec.input_shape, spec.num_classes)
            client = client_block(costs, k)
            server = server_block(costs, k, input_grad=False)
            self._flops[k] = {"fwd": client.fwd_flops, "bwd": client.bwd_flops,
                              "full": client.train_flops + server.train_flops}
        return self._flops[k]

    def device_gflops(self) -> dict[str, float]:
        agents = sorted(set(self.fwd_samples) | set(self.bwd_samples) | set(self.full_samples))
        out = {}
        for a in agents:
            flops = self._per_sample_flops(self.cut(a))
            out[a] = (self.fwd_samples[a] * flops["fwd"] + self.bwd_samples[a] * flops["bwd"]
                      + self.full_samples[a] * flops["full"]) / 1e9
        return out

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - started

    @contextlib.contextmanager
    def server_compute(self) -> Iterator[None]:
        """A server-block step: timed as "server", under the configured autocast."""
        with self.timed("server"), autocast(self.device, self.settings.autocast):
            yield

    def inputs(self, out: Outcome) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """The forward replies' activations and labels on the server's device, per agent in
        id order: one transfer each for all agents' activations and labels, then views."""
        agents = out.agents
        acts = to_device([out[a].tensors["activations"] for a in agents], np.float32,
                         self.device)
        labels = to_device([out[a].tensors["labels"] for a in agents], np.int64, self.device)
        return agents, acts, labels

    def require_update(self, selected: list[str], got: Mapping[str, Any]) -> None:
        """Fail the round, in one line naming who missed what and why, when agents were
        selected and none delivered its update (`got` empty)."""
        if not selected or got:
            return
        why = "; ".join(f"{a} missed {self.missed_kind.get(a, 'the round')}: "
                        f"{self.missed.get(a, 'not live (offline or without the bundle)')}"
                        for a in selected)
        raise RoundFailed(f"{self.settings.algorithm} round {self.round}: no update from any "
                          f"of the {len(selected)} selected agents ({why})")

    def note(self, outcome: Outcome) -> Outcome:
        """Remember who missed this exchange (for the round's report)."""
        self.missed.update(outcome.missed)
        self.missed_kind.update(dict.fromkeys(outcome.missed, outcome.kind))
        return outcome

    # ------------------------------------------------------------------ selection

    def sizes(self, agents: list[str]) -> dict[str, int]:
        """|D_k| as each agent registered it (FedAvg weights, batch shares)."""
        return {a: int(self.engine.registry.registration(a)["dataset"]["size"]) for a in agents}

    def label_prior(self, agent: str) -> torch.Tensor:
        """P_k: the agent's local label distribution from the histogram it registered
        (SCALA eq. 15); uniform, with a warning, if that histogram is unusable."""
        from jetsplit.server.algorithms.scala_math import prior_from_counts

        classes = self.bundle.spec.num_classes
        dataset = self.engine.registry.registration(agent).get("dataset") or {}
        try:
            return prior_from_counts(dataset.get("label_histogram") or [], classes)
        except ValueError as exc:
            log.warning("agent %s: unusable label histogram (%s); uniform prior", agent, exc)
            return torch.full((classes,), 1.0 / classes)

    def batches(self, agents: list[str]) -> dict[str, int]:
        """B_k = B·|D_k| / Σ_j |D_j| (at least 2: BatchNorm in training mode needs more
        than one value per channel, and SplitFed V2 serves one client's batch alone): SCALA's
        size-proportional batches; or the fixed per-client batch where one is set
        (server/optim.client_batch)."""
        from jetsplit.server.optim import client_batch

        fixed = client_batch(self.settings)
        if fixed is not None:
            return dict.fromkeys(agents, fixed)
        sizes = self.sizes(agents)
        total = sum(sizes.values()) or 1
        return {a: max(MIN_CLIENT_BATCH, round(self.settings.batch * sizes[a] / total))
                for a in agents}

    def live(self, agents: list[str]) -> list[str]:
        """The selected agents not known to be offline, with the bundle installed."""
        registry = self.engine.registry
        online = [a for a in agents if registry.state(a) != "offline"]
        return self.shipper.ensure(online, self.round, self.cuts)

    def select(self) -> list[str]:
        """A seeded fraction of the eligible agents. When none is online (say, a broker
        restart sent every last will), wait up to the step deadline for them to return,
        then briefly for the rest of the previous round's pool."""
        registry = self.engine.registry
        pool = registry.eligible(zoo_version=ZOO_VERSION)
        if not pool:
            log.warning("no eligible agent online; waiting up to %.0fs",
                        self.settings.deadline_s)
            registry.wait_for(1, self.settings.deadline_s)
            registry.wait_for(self._last_pool, REJOIN_GRACE_S)
            pool = registry.eligible(zoo_version=ZOO_VERSION)
        self._last_pool = len(pool)
        if not pool:
            return []
        count = max(1, min(len(pool), round(self.settings.fraction * len(pool))))
        return sorted(str(a) for a in self.rng.choice(pool, size=count, replace=False))

    # ------------------------------------------------------------------ exchanges

    def forward(self, batches: dict[str, int], step: int) -> Outcome:
        s = self.settings
        commands = {a: Command(Kind.FORWARD.value, {"batch": b, "codec": s.codec,
                                                    "compression": s.compression})
                    for a, b in batches.items()}
        with self.timed("forward"):
            out = self.note(self._checked(self.engine.send_and_receive(
                commands, round=self.round, step=step, deadline_s=s.deadline_s),
                lambda agent, t: self._activation_problem(t, batches[agent], agent)))
        for agent, reply in out.replies.items():
            self.fwd_samples[agent] += int(len(reply.tensors["labels"]))
        return out

    def _activation_problem(self, tensors: Arrays, batch: int, agent: str = "") -> str | None:
        """Why a forward reply cannot be trained on, or None (replies are untrusted)."""
        shape = self.activation_shape_at(self.cut(agent))
        acts, labels = tensors.get("activations"), tensors.get("labels")
        if acts is None or labels is None:
            return "reply lacks activations or labels"
        n = len(labels)
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or not 0 < n <= batch:
            return f"labels must be 1..{batch} integers"
        if labels.min() < 0 or labels.max() >= self.bundle.spec.num_classes:
            return "labels out of range"
        if acts.dtype != np.float32 or tuple(acts.shape) != (n, *shape):
            return (f"activations {acts.dtype} {list(acts.shape)}, expected float32 "
                    f"{[n, *shape]}")
        if not np.isfinite(acts).all():
            return "activations contain NaN or infinity"
        return None

    def _expected_weights(self, blocks: tuple[str, ...], agent: str | None = None, *,
                          cut: int | None = None) -> Arrays:
        """The tensors `blocks` of a device at `cut` hold (default: the agent's cut, or the
        server cut's whole template): names, shapes and dtypes to check replies against."""
        cut = self.cut(agent) if cut is None and agent is not None else cut
        template = self.weight_template
        if cut is not None and cut < self.bundle.split:
            keep = set(self.client_names(cut))
            template = {k: v for k, v in template.items()
                        if not k.startswith("client/") or k in keep}
        own = None if cut is None else self.cut_templates.get(cut)
        if own:
            replaced = {k.split("/", 1)[0] for k in own}
            template = {**{k: v for k, v in template.items()
                           if k.split("/", 1)[0] not in replaced}, **own}
        return {k: v for k, v in template.items() if k.split("/", 1)[0] in blocks}

    def weights_bytes(self, blocks: tuple[str, ...], agents: list[str]) -> int:
        """The most raw bytes `blocks` of any of `agents` hold: what a weights reply is
        accounted for (`accounted_bound`), whatever the model's size."""
        return max((sum(v.nbytes for v in self._expected_weights(blocks, a).values())
                    for a in agents), default=0)

    def _weights_problem(self, tensors: Arrays, blocks: tuple[str, ...],
                         agent: str | None = None, *, cut: int | None = None) -> str | None:
        """Why `tensors` (untrusted) are not `blocks` of a device at `cut` (default: the
        agent's cut, or the server cut's whole template), or None."""
        expected = self._expected_weights(blocks, agent, cut=cut)
        if set(tensors) != set(expected):
            return "weights do not match the model's tensors"
        for name, want in expected.items():
            got = tensors[name]
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"tensor {name} is {got.dtype} {list(got.shape)}"
            if got.dtype.kind == "f" and not np.isfinite(got).all():
                return f"tensor {name} contains NaN or infinity"
        return None

    def _checked(self, out: Outcome, problem: Callable[[str, Arrays], str | None]) -> Outcome:
        """Move replies that fail validation to the misses, with the reason, and log it."""
        for agent in list(out.replies):
            reason = problem(agent, out.replies[agent].tensors)
            if reason is not None:
                log.warning("dropped %s's reply: %s", agent, reason)
                del out.replies[agent]
                out.missed[agent] = f"error: bad reply: {reason}"
        return out

    def backward(self, grads: dict[str, torch.Tensor], step: int) -> Outcome:
        s = self.settings
        host = to_host(list(grads.values()))  # one transfer back for all agents
        commands = {a: Command(Kind.BACKWARD.value, {}, {"grad": g}, codec=s.codec,
                               compression=s.compression) for a, g in zip(grads, host, strict=True)}
        with self.timed("backward"):
            out = self.note(self.engine.send_and_receive(
                commands, round=self.round, step=step, deadline_s=s.deadline_s))
        for agent in out.replies:
            self.bwd_samples[agent] += int(grads[agent].shape[0])
        return out

    def push(self, agents: list[str], arrays: Arrays) -> list[str]:
        """Install `arrays` (client/…, server/… names) on agents; returns who has them."""
        if not agents:
            return []
        with self.timed("distribute"):
            out = self.note(self.engine.broadcast(
                Command(Kind.SET_WEIGHTS.value, {}, arrays), agents, round=self.round,
                deadline_s=self.settings.deadline_s))
        return out.agents

    def pull(self, agents: list[str], blocks: tuple[str, ...] = ("client",)) -> dict[str, Arrays]:
        if not agents:
            return {}
        with self.timed("collect"):
            bound = accounted_bound(self.weights_bytes(blocks, agents))
            out = self.note(self._checked(self.engine.broadcast(
                Command(Kind.GET_WEIGHTS.value, {"blocks": list(blocks)}, reply_bytes=bound),
                agents,
                round=self.round, deadline_s=self.settings.deadline_s),
                lambda agent, t: self._weights_problem(t, blocks, agent)))
        return {a: r.tensors for a, r in out.replies.items()}

    def release(self, agents: list[str]) -> None:
        """Agents whose block was just averaged away free it (memory on small devices; in
        simulations, at most the active clients hold blocks)."""
        if agents:
            self.note(self.engine.broadcast(Command(Kind.RELEASE.value), agents,
                                             round=self.round,
                                             deadline_s=self.settings.deadline_s))

    # ------------------------------------------------------------------ evaluation

    def composed(self, client: Arrays, server: nn.Module | None = None) -> nn.Module:
        """client∘server as one module, with the client block's weights from `client`."""
        block = self.bundle.client_module()
        load_strict(block, from_arrays(client, "client"), "client weights")
        return nn.Sequential(*block.to(self.device).children(),
                             *(server or self.server).children())

    def evaluate_global(self) -> dict[str, Any]:
        return evaluate(self.composed(self.global_client), self.test).as_dict()

    def evaluate_each(self, states: dict[str, Arrays]) -> dict[str, Any]:
        results: list[Evaluation] = [evaluate(self.composed(states[a]), self.test)
                                     for a in sorted(states)]
        if not results:  # nobody reachable to evaluate: say so rather than guess
            return {"accuracy": None, "balanced_accuracy": None}
        return summarize(results)


def run_training(
    engine: Engine,
    archive: Path,
    settings: Settings,
    test: ArrayDataset,
    out_dir: Path,
    *,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    bundle: Bundle | None = None,
    checkpoint: bool = True,
    resume: bool = False,
    row_extras: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    cuts: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Train `settings.algorithm` for `settings.rounds` rounds; returns the summary.

    With `checkpoint`, the state after every round goes to `out_dir/checkpoint`; with
    `resume`, training continues after the last checkpointed round (its bundle is shipped,
    its metrics rows are kept) and ends exactly where an uninterrupted run would.
    `row_extras(row)` may add fields to each metrics row before it is written. The
    coordinator's compute runs with `settings.threads` intra-op threads (0: as it is).
    `cuts` trains a fleet of per-device cuts (see Trainer and server/hetero.py)."""
    with torch_threads(settings.threads):
        return _train(engine, archive, settings, test, out_dir, on_round=on_round,
                      bundle=bundle, checkpoint=checkpoint, resume=resume,
                      row_extras=row_extras, cuts=cuts)


def _train(engine: Engine, archive: Path, settings: Settings, test: ArrayDataset,
           out_dir: Path, *, on_round: Callable[[dict[str, Any]], None] | None,
           bundle: Bundle | None, checkpoint: bool, resume: bool,
           row_extras: Callable[[dict[str, Any]], dict[str, Any]] | None,
           cuts: Mapping[str, int] | None) -> dict[str, Any]:
    from jetsplit.server.algorithms.methods import build_method
    from jetsplit.server.checkpoint import load_checkpoint

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    saved = load_checkpoint(out_dir / "checkpoint") if resume else None
    if saved is not None:
        archive, bundle = saved.bundle, None
    trainer = Trainer(engine, archive, settings, test, bundle=bundle, cuts=cuts)
    method = build_method(settings.algorithm, trainer)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    first = 0
    if saved is not None:
        _restore(saved, settings, trainer, method)
        rows = _kept_rows(out_dir / "metrics.jsonl", saved.round + 1)
        first = saved.round + 1
        log.info("resuming %s after round %d of %d from %s", settings.algorithm,
                 first, settings.rounds, out_dir / "checkpoint")
    with (out_dir / "metrics.jsonl").open("w") as metrics:
        metrics.writelines(json.dumps(r) + "\n" for r in rows)
        for round_ in range(first, settings.rounds):
            trainer.round = round_
            trainer.phases.clear()
            trainer.fwd_samples.clear()
            trainer.bwd_samples.clear()
            trainer.full_samples.clear()
            trainer.missed, trainer.missed_kind = {}, {}
            round_started = time.perf_counter()
            before = engine.counters.by_kind()
            selected = trainer.select()
            loss = method.run_round(selected)
            trainer.guard.check(loss, round_, method.loss_tier)
            train_bytes = _delta(engine.counters.by_kind(), before)
            # Installing the bundle is setup, not training: reported apart.
            setup_bytes = sum(train_bytes[d].pop(kind, 0) for d in ("up", "down")
                              for kind in (Kind.BUNDLE.value, Kind.BUNDLE_PART.value))
            with trainer.timed("evaluate"):
                before_eval = engine.counters.by_kind()
                scores = method.evaluate()
                eval_bytes = _delta(engine.counters.by_kind(), before_eval)
            row = {
                "round": round_, "algorithm": settings.algorithm, "selected": selected,
                "missed": dict(sorted(trainer.missed.items())), "train_loss": loss, **scores,
                "bytes_up": sum(train_bytes["up"].values()),
                "bytes_down": sum(train_bytes["down"].values()),
                "bytes_by_kind": train_bytes, "eval_bytes": eval_bytes,
                "bundle_bytes": setup_bytes,
                "bytes_up_total": engine.counters.total("up"),
                "bytes_down_total": engine.counters.total("down"),
                "device_gflops": trainer.device_gflops(),
                "phases_s": {k: round(v, 4) for k, v in sorted(trainer.phases.items())},
                "seconds": time.perf_counter() - round_started,
                "cuts": trainer.cuts_of(selected),
                **getattr(method, "extra_metrics", {}),  # a method's own (sherl: tier_bytes)
            }
            if row_extras is not None:  # e.g. a trial's per-agent time and telemetry
                row.update(row_extras(row))
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            log.info("round %d/%d %s: accuracy %.4f (balanced %.4f), train loss %.4f, "
                     "%d agents, up %.2f MB, down %.2f MB", round_ + 1, settings.rounds,
                     settings.algorithm, _or_nan(row["accuracy"]),
                     _or_nan(row["balanced_accuracy"]),
                     float("nan") if loss is None else loss, len(selected),
                     row["bytes_up"] / 1e6, row["bytes_down"] / 1e6)
            if checkpoint:
                with trainer.timed("checkpoint"):
                    _save(out_dir / "checkpoint", round_, settings, trainer, method, archive)
            if on_round is not None:
                on_round(row)
    if not rows:
        raise JetsplitError(f"nothing to train: the checkpoint already covers all "
                            f"{settings.rounds} rounds")
    last = rows[-1]
    gflops: dict[str, float] = defaultdict(float)
    for row in rows:
        for agent, value in row["device_gflops"].items():
            gflops[agent] += value
    summary = {
        "algorithm": settings.algorithm, "rounds": settings.rounds, "run": engine.run_id,
        "final_accuracy": last["accuracy"], "balanced_accuracy": last["balanced_accuracy"],
        "final_accuracy_std": last.get("accuracy_std"),
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_down": sum(r["bytes_down"] for r in rows),
        "bundle_bytes": sum(r["bundle_bytes"] for r in rows),
        "device_gflops": float(sum(gflops.values())),
        "device_gflops_per_agent": dict(sorted(gflops.items())),
        "seconds": time.perf_counter() - started,
        "bundle_sha256": trainer.shipper.sha256,
        "settings": settings.__dict__,
        "agents": engine.registry.snapshot(),
        "missed": [m.__dict__ for m in engine.registry.missed],
        "bytes": engine.counters.snapshot(),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    method.save(out_dir)
    return summary


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]
           ) -> dict[str, dict[str, int]]:
    return {d: {k: v - before[d].get(k, 0) for k, v in sorted(after[d].items())
                if v - before[d].get(k, 0)} for d in ("up", "down")}


# Settings a resumed run may change: how long to wait, how far to go and where the
# coordinator computes, not what to train.
RESUMABLE_CHANGES = {"rounds", "deadline_s", "bundle_deadline_s", "retry_s", "device", "threads"}


def _save(directory: Path, round_: int, settings: Settings, trainer: Trainer,
          method: Any, archive: Path) -> None:
    """Round `round_`'s checkpoint: the method's state, the RNGs, the fleet's books."""
    from jetsplit.server.checkpoint import save_checkpoint

    arrays, method_meta = method.checkpoint()
    arrays = {**arrays, "trainer/torch_rng": torch.get_rng_state().numpy()}
    engine = trainer.engine
    meta = {
        "settings": settings.__dict__, "bundle_sha256": trainer.shipper.sha256,
        "numpy_rng": trainer.rng.bit_generator.state, "last_pool": trainer._last_pool,
        "method": method_meta, "bytes": engine.counters.snapshot(),
        "missed": [m.__dict__ for m in engine.registry.missed],
    }
    save_checkpoint(directory, round_, meta, arrays, archive)


def _restore(saved: Any, settings: Settings, trainer: Trainer, method: Any) -> None:
    """Put a fresh trainer and method back into the checkpointed state."""
    from jetsplit.server.checkpoint import CheckpointError
    from jetsplit.server.registry import MissedStep

    meta = saved.meta
    before = meta.get("settings") or {}
    defaults = {f.name: f.default for f in fields(Settings)}  # keys older runs lack
    changed = sorted(k for k, v in settings.__dict__.items()
                     if k not in RESUMABLE_CHANGES and before.get(k, defaults[k]) != v)
    if changed:
        raise CheckpointError(f"cannot resume: setting {changed[0]!r} was "
                              f"{before.get(changed[0])!r}, now {getattr(settings, changed[0])!r}")
    if meta.get("bundle_sha256") != trainer.shipper.sha256:
        raise CheckpointError("cannot resume: the checkpoint's bundle does not match its hash")
    try:
        trainer.rng.bit_generator.state = meta["numpy_rng"]
        torch.set_rng_state(torch.from_numpy(np.array(saved.arrays["trainer/torch_rng"])))
        trainer._last_pool = int(meta.get("last_pool", 0))
        engine = trainer.engine
        engine.counters.load(meta.get("bytes", {}))
        for miss in meta.get("missed", []):
            engine.registry.missed.append(MissedStep(**miss))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint state is damaged: {exc}") from None
    method.restore({k: v for k, v in saved.arrays.items() if not k.startswith("trainer/")},
                   meta.get("method", {}))


def _kept_rows(path: Path, count: int) -> list[dict[str, Any]]:
    """The metrics rows of the checkpointed rounds (later ones, if any, are discarded)."""
    rows: list[dict[str, Any]] = []
    if path.is_file():
        with path.open() as fh:
            for line in fh:
                if len(rows) == count:
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a row cut short by the kill
    if len(rows) < count:
        log.warning("metrics.jsonl holds %d of the %d checkpointed rounds", len(rows), count)
    return rows

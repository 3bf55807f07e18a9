"""The trainer: the shared machinery every method trains through.

Exchanges with the fleet (forward, backward, push and pull of weights, release), the books
(bytes, phases, samples and FLOPs per agent), public checks on untrusted replies
(`activation_problem`, `weights_problem`, `checked`), per-device cuts and their
completions, seeded selection and size-proportional batches. The round loop
(server/run/round_loop.py) drives it; the methods (server/methods/) call it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jetsplit import catalog
from jetsplit.bundle import Bundle, load_bundle
from jetsplit.data import ArrayDataset
from jetsplit.devices import resolve_device
from jetsplit.errors import JetsplitError
from jetsplit.models import ZOO_VERSION
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.defences.aggregators import aggregate
from jetsplit.server.defences.label_check import PROBE_BATCH, LabelConsistency
from jetsplit.server.defences.sitting_out import Bench
from jetsplit.server.defences.size_claims import ClaimBooks, LabelTally, registered_size
from jetsplit.server.defences.step_bounds import (
    LOSS_FLOOR,
    ActivationBound,
    LossBound,
    StepGradientBound,
    gradient_norm,
    gradient_shares,
)
from jetsplit.server.defences.update_direction import UpdateDirection
from jetsplit.server.engines.seam import Command, Engine, Outcome, Reply
from jetsplit.server.training.divergence import DivergenceGuard
from jetsplit.server.training.evaluation import Evaluation, evaluate, summarize
from jetsplit.server.training.placement import autocast, to_device, to_host
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings
from jetsplit.wire import accounted_bound

log = logging.getLogger("jetsplit.coordinator")
Arrays = dict[str, np.ndarray]
REJOIN_GRACE_S = 3.0  # after an outage, how long to wait for the rest of the fleet
MIN_CLIENT_BATCH = 2  # BatchNorm in training mode needs more than one value per channel


class RoundFailed(JetsplitError):
    """A round ended without the update it exists for (no weights, no server step):
    reporting it as done would train nothing while looking like a completed run."""


def _client_content(algorithm: str) -> str:
    """What the method's client devices run (a name the catalog lacks: the client block;
    the method factory is where an unknown name fails)."""
    entry = catalog.METHODS.get(algorithm)
    return catalog.CLIENT_BLOCK if entry is None else entry.client_content


class Trainer:
    """Shared machinery the methods use: exchanges, weights, timing, FLOP and byte books."""

    def __init__(self, engine: Engine, archive: Path, settings: Settings, test: ArrayDataset,
                 *, bundle: Bundle | None = None, cuts: Mapping[str, int] | None = None
                 ) -> None:
        """`archive` is the whole model split at the server cut c*; `cuts` gives agents
        that train at a shallower cut theirs (the rest train at c*; see
        server/cuts/completions.py)."""
        from jetsplit.server.cuts.completions import Completions, check_cuts

        self.engine, self.settings, self.test = engine, settings, test
        self.bundle = bundle or load_bundle(archive)
        # Devices get only what they run: the client block (+ aux head), or for FedAvg
        # the whole model; per-device cuts (`cuts`, agent → k) get their cut's block.
        from jetsplit.server.training.optimisers import tier_optimizer

        self.client_optimizer = tier_optimizer(settings, "client")
        self.server_optimizer = tier_optimizer(settings, "server")
        self.shipper = BundleShipper(engine, archive, lr=self.client_optimizer.lr,
                                     deadline_s=settings.bundle_deadline_s,
                                     optimizer=self.client_optimizer.wire(),
                                     content=_client_content(settings.algorithm),
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
        self.bench = Bench(settings.max_misses)  # who keeps missing deadlines sits out
        self.activation_bound = ActivationBound(settings.activation_bound)
        self.loss_bound = LossBound(  # a fitted device is no outlier, however small the median
            settings.loss_bound, floor=LOSS_FLOOR * math.log(self.bundle.spec.num_classes))
        self.step_gradient_bound = StepGradientBound(settings.gradient_bound)  # SplitFed V2
        self.books = RoundBooks(listener=self.bench.note)  # this round's phases, samples, misses
        # |D_k| as weights; whose registered claim was capped, at what
        self.claims = ClaimBooks(settings.provisioned_sizes)
        # the labels each device sent, against the histogram it registered
        self.labels = LabelTally(self.bundle.spec.num_classes, settings.histogram_check == "on")
        # whose labels do not fit their activations (server/defences/label_check.py)
        self.consistency = LabelConsistency(self.bundle.spec.num_classes,
                                            settings.label_check == "on", settings.seed)
        # whose uploads pull against the fleet's (server/defences/update_direction.py)
        self.direction = UpdateDirection(settings.direction_check == "on")
        # block → the devices the outlier bound left out of its latest average
        self.outliers: dict[str, frozenset[str]] = {}
        self.guard = DivergenceGuard(settings, self.bundle.spec.num_classes)
        self.round = 0
        self.last_pool = 0
        self._flops: dict[int, dict[str, float]] = {}

    # ------------------------------------------------------------------ cuts

    def cut(self, agent: str) -> int:
        """The last layer agent's device trains (c_k; the server cut c* by default)."""
        return self.completions.cut(agent)

    def cuts_of(self, agents: list[str]) -> dict[str, int]:
        return {a: self.cut(a) for a in agents}

    def set_cut(self, agent: str, cut: int) -> None:
        """Move agent's cut within 1..c* between rounds (live re-planning,
        server/cuts/replanning.py): it gets the new cut's bundle when next live (its bundle
        cache makes a cut it held before free), the weights a method pushes are cut there,
        and its completion copy is rebuilt for the new cut."""
        from jetsplit.server.cuts.completions import check_cuts

        self.cuts.update(check_cuts({agent: cut}, self.bundle.split, self.bundle.spec.name))
        self.completions.move(agent, cut)

    def needs_bundle(self, agent: str) -> bool:
        return bool(self.shipper.needs(agent, self.cuts.get(agent)))

    def client_names(self, cut: int) -> list[str]:
        from jetsplit.server.cuts.completions import block_names

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
        """This round's device GFLOPs per agent: its samples times its cut's FLOPs each."""
        b, out = self.books, {}
        for a in b.agents():
            flops = self._per_sample_flops(self.cut(a))
            out[a] = (b.fwd_samples[a] * flops["fwd"] + b.bwd_samples[a] * flops["bwd"]
                      + b.full_samples[a] * flops["full"]) / 1e9
        return out

    @contextlib.contextmanager
    def server_compute(self) -> Iterator[None]:
        """A server-block step: timed as "server", under the configured autocast."""
        with self.books.timed("server"), autocast(self.device, self.settings.autocast):
            yield

    def inputs(self, out: Outcome) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """The forward replies' activations and labels on the server's device, per agent in
        id order: one transfer each for all agents' activations and labels, then views;
        each sample's activation norm bounded against the fleet's
        (server/defences/step_bounds.py)."""
        agents = out.agents
        acts = to_device([out[a].tensors["activations"] for a in agents], np.float32,
                         self.device)
        acts = self.activation_bound.apply(agents, acts, self.books.bounded,
                                           self.books.activation_scale)
        labels = to_device([out[a].tensors["labels"] for a in agents], np.int64, self.device)
        self.consistency.observe(agents, acts, labels)
        return agents, acts, labels

    def trusted(self, agents: list[str], acts: list[torch.Tensor], labels: list[torch.Tensor]
                ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """This step's inputs without the devices whose labels do not fit their activations
        (server/defences/label_check.py): they sit out the server update and get no gradient
        (their forwards still come, so they are judged again each step); noted per round."""
        excluded = self.consistency.excluded(agents)
        if not excluded:
            return agents, acts, labels
        books = self.books
        for agent in excluded:
            books.excluded_steps[agent] = books.excluded_steps.get(agent, 0) + 1
            books.excluded[agent] = (f"{books.excluded_steps[agent]} steps left out of the "
                                     f"server update, last: {self.consistency.inconsistent[agent]}")
        kept = [i for i, a in enumerate(agents) if a not in excluded]
        return [agents[i] for i in kept], [acts[i] for i in kept], [labels[i] for i in kept]

    def gradient_weights(self, agents: list[str], norms: torch.Tensor | list[float]
                         ) -> list[float] | None:
        """Per device, the weight that keeps its share of the server gradient (`norms`, its
        own term's gradient norm) within `gradient_bound` × the step's median; None: all 1
        (server/influence.gradient_shares). One host read of the norms."""
        if self.settings.gradient_bound <= 0:
            return None
        books = self.books
        values = norms if isinstance(norms, list) else norms.detach().tolist()
        return gradient_shares(agents, values, self.settings.gradient_bound,
                               books.gradient_clipped, books.gradient_clipped_steps)

    def measured_gradient_weights(self, agents: list[str]
                                  ) -> Callable[[list[float]], list[float] | None] | None:
        """For a shared step whose per-device gradients are not otherwise computed (SCALA's
        family, PSL): given each device's share norm, its weight (`gradient_weights`);
        None unless `[train] gradient_shares = "all"`, since measuring the shares
        costs one backward per device per step."""
        if self.settings.gradient_bound <= 0 or self.settings.gradient_shares != "all":
            return None
        return lambda norms: self.gradient_weights(agents, norms)

    def step_gradient_weight(self, agent: str, grads: list[torch.Tensor]) -> float | None:
        """SplitFed V2 (one device per step): the weight that keeps this step's server
        gradient norm (over `grads`) within `gradient_bound` × the recent steps' median
        (server/influence.StepGradientBound); None: 1. One host read. Only under
        `[train] gradient_shares = "all"`: in a clean 30-round run it clipped 7 to 10 honest
        devices a round (each device's first steps after the block fitted the last one)."""
        if (self.step_gradient_bound.factor <= 0 or not grads
                or self.settings.gradient_shares != "all"):
            return None
        books = self.books
        weights = self.step_gradient_bound.weights(
            [agent], [gradient_norm(grads)], books.gradient_clipped, books.gradient_clipped_steps)
        return None if weights is None else weights[0]

    def loss_weights(self, agents: list[str]
                     ) -> Callable[[list[float]], list[float] | None] | None:
        """For a shared server block's step over `agents`: given each device's loss, the
        weights of their terms (None: all 1, the unweighted step), a device far above the
        fleet's loss down-weighted and noted (server/influence.LossBound); None when the
        bound is off (`loss_bound = 0`: nothing is even measured)."""
        if self.loss_bound.factor <= 0:
            return None
        books = self.books
        return lambda losses: self.loss_bound.weights(agents, losses, books.down_weighted,
                                                      books.down_weighted_steps)

    def require_update(self, selected: list[str], got: Mapping[str, Any]) -> None:
        """Fail the round, in one line naming who missed what and why, when agents were
        selected and none delivered its update (`got` empty)."""
        if not selected or got:
            return
        why = "; ".join(f"{a} missed {self.books.missed_kind.get(a, 'the round')}: "
                        f"{self.books.missed.get(a, 'not live (offline or without the bundle)')}"
                        for a in selected)
        raise RoundFailed(f"{self.settings.algorithm} round {self.round}: no update from any "
                          f"of the {len(selected)} selected agents ({why})")

    # ------------------------------------------------------------------ selection

    def aggregate(self, states: Mapping[str, Arrays], weights: Mapping[str, float], *,
                  reference: Arrays | None = None, block: str = "client",
                  uploaded: bool = True) -> Arrays:
        """The blocks devices uploaded, combined by `[train] aggregator`
        (server/defences/aggregators.py)
        layer by layer; `reference` is the block they started from. What the rule did to a
        device (clipped, left out) goes into this round's books, named by `block` (a round
        may combine several: client blocks, server copies, aux heads). `uploaded` False: the
        coordinator trained these blocks itself (SplitFed V1's and Ampere's server copies), so
        no device can have reversed them, and the direction check skips them (a label-skewed
        device's copy honestly points away from the median:
        docs/results-robustness.md#reversed-updates-the-direction-check)."""
        s = self.settings
        notes: dict[str, str] = {}
        excluded = self.consistency.excluded(sorted(states))
        for agent in excluded:  # labels that do not fit its activations: so may its upload
            notes[agent] = f"left out: {self.consistency.inconsistent[agent]}"
        if uploaded:
            self.direction.observe(block, states, reference)
        opposed = self.direction.excluded(block, sorted(set(states) - excluded))
        for agent in opposed:  # an update reversed against the fleet's
            notes[agent] = f"left out: {self.direction.opposed[block, agent]}"
        excluded |= opposed
        for agent in excluded:  # a share of 0 over every float parameter it uploaded
            self.books.influence.add({agent: 0.0}, sum(
                int(v.size) for v in states[agent].values() if v.dtype.kind == "f"))
        states = {a: v for a, v in states.items() if a not in excluded}
        outliers: set[str] = set()
        merged = aggregate(states, weights, s.aggregator, reference=reference, notes=notes,
                           shares=self.books.influence, clip_factor=s.clip_factor,
                           robust_fraction=s.robust_fraction, outlier_bound=s.outlier_bound,
                           outliers=outliers)
        self.outliers[block] = frozenset(outliers)
        books = self.books.aggregation
        for agent, note in sorted(notes.items()):
            books[agent] = "; ".join(filter(None, (books.get(agent), f"{block}: {note}")))
        return merged

    def left_out(self, block: str, agents: list[str]) -> set[str]:
        """Those of `agents` whose next upload of `block` is not expected to count: opposed
        by the direction check, or left out of the block's latest average by the outlier
        bound (a verdict each upload renews: one back under the bound counts again)."""
        return self.direction.excluded(block, agents) | (
            set(self.outliers.get(block, ())) & set(agents))

    def claimed_sizes(self, agents: list[str]) -> dict[str, int]:
        """|D_k| as each agent registered it, uncapped: for its own work only (an Ampere
        epoch's steps, the rows of its upload), where a lie costs nobody but the liar."""
        registry = self.engine.registry
        return {a: registered_size(registry.registration(a)) or 0 for a in agents}

    def sizes(self, agents: list[str]) -> dict[str, int]:
        """|D_k| as weights (every average, batch shares): each registered claim at most
        its provisioned size and at most `size_cap` × the median claim of the fleet's
        clients (server/defences/size_claims.py)."""
        return self.claims.weights(self.claimed_sizes(agents),
                                   self.engine.registry.client_claims(), self.settings.size_cap)

    def batches(self, agents: list[str], left_out: set[str] | frozenset[str] = frozenset()
                ) -> dict[str, int]:
        """B_k = B·|D_k| / Σ_j |D_j| (at least 2: BatchNorm in training mode needs more
        than one value per channel, and SplitFed V2 serves one client's batch alone): SCALA's
        size-proportional batches; or the fixed per-client batch where one is set
        (server/optim.client_batch). A device whose labels do not fit its activations takes
        no share of B, only a probe of PROBE_BATCH samples (server/defences/label_check.py):
        its share goes to the devices whose work counts, and it is judged again. So does a
        device in `left_out`: one whose work this round cannot count (FedAvg: its model
        uploads are left out by the direction check or the outlier bound, `left_out()`, and
        its upload is all it contributes;
        in a split method its activations still train the server block)."""
        from jetsplit.server.training.optimisers import client_batch

        fixed = client_batch(self.settings)
        if fixed is not None:
            return dict.fromkeys(agents, fixed)
        sizes = self.sizes(agents)
        probing = self.consistency.excluded(agents) | (set(left_out) & set(agents))
        if len(probing) == len(agents):  # never all of them
            probing = set()
        total = sum(n for a, n in sizes.items() if a not in probing) or 1
        return {a: PROBE_BATCH if a in probing
                else max(MIN_CLIENT_BATCH, round(self.settings.batch * sizes[a] / total))
                for a in agents}

    def live(self, agents: list[str]) -> list[str]:
        """The selected agents not known to be offline nor benched for missing deadlines,
        with the bundle installed."""
        registry = self.engine.registry
        online = [a for a in self.bench.playing(agents) if registry.state(a) != "offline"]
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
            registry.wait_for(self.last_pool, REJOIN_GRACE_S)
            pool = registry.eligible(zoo_version=ZOO_VERSION)
        self.last_pool = len(pool)
        pool = self.bench.playing(pool) or pool  # all benched: better slow than nothing
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
        with self.books.timed("forward"):
            out = self.books.note(self.checked(self.engine.send_and_receive(
                commands, round=self.round, step=step, deadline_s=s.deadline_s),
                lambda agent, r: self.activation_problem(r.tensors, batches[agent], agent)))
        for agent, reply in out.replies.items():
            self.books.fwd_samples[agent] += int(len(reply.tensors["labels"]))
            self.labels.add(agent, reply.tensors["labels"])
        return out

    def activation_problem(self, tensors: Arrays, batch: int, agent: str = "") -> str | None:
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

    def expected_weights(self, blocks: tuple[str, ...], agent: str | None = None, *,
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
        return max((sum(v.nbytes for v in self.expected_weights(blocks, a).values())
                    for a in agents), default=0)

    def weights_problem(self, tensors: Arrays, blocks: tuple[str, ...],
                         agent: str | None = None, *, cut: int | None = None) -> str | None:
        """Why `tensors` (untrusted) are not `blocks` of a device at `cut` (default: the
        agent's cut, or the server cut's whole template), or None."""
        expected = self.expected_weights(blocks, agent, cut=cut)
        if set(tensors) != set(expected):
            return "weights do not match the model's tensors"
        for name, want in expected.items():
            got = tensors[name]
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"tensor {name} is {got.dtype} {list(got.shape)}"
            if got.dtype.kind == "f" and not np.isfinite(got).all():
                return f"tensor {name} contains NaN or infinity"
        return None

    def checked(self, out: Outcome, problem: Callable[[str, Reply], str | None]) -> Outcome:
        """Move replies that fail `problem` (agent, reply → reason or None) to the misses,
        with the reason, and log it: every method's one check on untrusted replies."""
        for agent in list(out.replies):
            reason = problem(agent, out.replies[agent])
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
        with self.books.timed("backward"):
            out = self.books.note(self.engine.send_and_receive(
                commands, round=self.round, step=step, deadline_s=s.deadline_s))
        for agent in out.replies:
            self.books.bwd_samples[agent] += int(grads[agent].shape[0])
        return out

    def push(self, agents: list[str], arrays: Arrays) -> list[str]:
        """Install `arrays` (client/…, server/… names) on agents; returns who has them."""
        if not agents:
            return []
        with self.books.timed("distribute"):
            out = self.books.note(self.engine.broadcast(
                Command(Kind.SET_WEIGHTS.value, {}, arrays), agents, round=self.round,
                deadline_s=self.settings.deadline_s))
        return out.agents

    def pull(self, agents: list[str], blocks: tuple[str, ...] = ("client",)) -> dict[str, Arrays]:
        if not agents:
            return {}
        with self.books.timed("collect"):
            bound = accounted_bound(self.weights_bytes(blocks, agents))
            out = self.books.note(self.checked(self.engine.broadcast(
                Command(Kind.GET_WEIGHTS.value, {"blocks": list(blocks)}, reply_bytes=bound),
                agents,
                round=self.round, deadline_s=self.settings.deadline_s),
                lambda agent, r: self.weights_problem(r.tensors, blocks, agent)))
        return {a: r.tensors for a, r in out.replies.items()}

    def release(self, agents: list[str]) -> None:
        """Agents whose block was just averaged away free it (memory on small devices; in
        simulations, at most the active clients hold blocks)."""
        if agents:
            self.books.note(self.engine.broadcast(Command(Kind.RELEASE.value), agents,
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

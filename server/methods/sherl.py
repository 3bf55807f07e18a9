"""SHeRL-FL (the SHeRL-FL paper): split learning in a client / edge / cloud hierarchy, with
representation learning at the edge.

Clients run the bundle's client block [:k1] and send smashed data toward their edge; the
edge runs layers [k1:k2], trains them on the cosine-distance contrastive loss of its batch's
pairs and returns activation gradients to its clients; it sends its detached embeddings
and labels to the cloud (this coordinator), which trains the task head [k2:] with
cross-entropy and sends nothing back but aggregated models. Edges FedAvg their clients'
blocks every τ1 iterations; the cloud FedAvg-s the edge tier (edge blocks, and the edges'
client averages) every τ2.

How it maps onto this runtime:

* Clients and their edge talk directly, on their own topics through the broker
  (`peer/<recipient>/<sender>` under `jetsplit/v1/<fleet>/`), never through the
  coordinator, which only commands each phase of an iteration: `forward` (each client sends
  its smashed data, activations + labels, to its edge as a `smashed` message and answers
  with its sample count), `edge_step` (the edge trains on the listed clients' smashed data,
  concatenated in client-id order, sends each client its gradient slice as a `gradient`
  message, and answers with who it served and the detached embeddings + labels for the
  cloud), `backward` (each served client applies the gradient its edge sent). An edge
  accepts smashed data only from the clients `edge_load` assigned it for this run and
  round, a client a gradient only from the edge its forward went to, for that step; any
  other direct message is a typed, counted rejection (`edge_agent.peers`). With a local
  broker per site bridged to the cloud's (docs/field-guide.md), client↔edge traffic never
  leaves the site. The coordinator still averages each edge's client blocks on that edge's
  behalf (the weights only pass through; averaging is arithmetic, the edge's real work is
  its block).
* Bytes per tier, from the engine's per-agent × kind counters (`tier_bytes` in each
  metrics row): `client_to_edge` (the clients' `smashed` messages), `edge_to_client` (the
  edge's `gradient` messages), `edge_to_cloud` (the `edge_step` replies: embeddings +
  labels), `model_client_edge` and `model_edge_cloud` (model exchange per tier), `control`
  (commands and small replies). Every message is booked once, on its sender's side: direct
  messages on the sending agent's `up` (its reply reports their wire bytes, as the
  coordinator never sees them), so the tiers add up to the row's bytes up + down.
* A round is T = local_steps iterations; τ1 divides τ2 and τ2 divides T, so every round
  ends with a cloud aggregation and is evaluated as client∘edge∘head of one global model.
* k2 (`edge_split`) is configured or chosen by `export.planner.plan_three_tier` from the
  clients' and edges' registered profiles, with k1 fixed by the bundle.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.defences.aggregators import fedavg
from jetsplit.server.defences.step_bounds import ActivationBound
from jetsplit.server.engines.seam import Command, Outcome, Reply
from jetsplit.server.fleet.topology import Topology, resolve
from jetsplit.server.methods.base import Method
from jetsplit.server.methods.scala_math import slice_losses, weighted_loss
from jetsplit.server.training.checkpoints import CheckpointError
from jetsplit.server.training.optimisers import tier_optimizer
from jetsplit.server.training.placement import autocast, to_device
from jetsplit.server.training.trainer import Arrays, Settings, Trainer
from jetsplit.tiers import carve, check_edge_layers

log = logging.getLogger("jetsplit.coordinator")
FALLBACK_PROFILE = "x86-cpu"  # for agents that announce no profile (simulations)

# (role, direction, kind) → tier; anything else is control traffic.
TIERS: dict[tuple[str, str, str], str] = {
    ("client", "up", Kind.SMASHED.value): "client_to_edge",
    ("edge", "up", Kind.GRADIENT.value): "edge_to_client",
    ("edge", "up", Kind.EDGE_STEP.value): "edge_to_cloud",
    ("client", "up", Kind.GET_WEIGHTS.value): "model_client_edge",
    ("client", "down", Kind.SET_WEIGHTS.value): "model_client_edge",
    ("edge", "up", Kind.GET_WEIGHTS.value): "model_edge_cloud",
    ("edge", "down", Kind.EDGE_LOAD.value): "model_edge_cloud",
}
TIER_NAMES = ("client_to_edge", "edge_to_client", "edge_to_cloud", "model_client_edge",
              "model_edge_cloud", "control")
Snapshot = dict[str, dict[str, dict[str, int]]]


def periods(settings: Settings) -> tuple[int, int]:
    """(τ1, τ2) in iterations: τ2 defaults to T, τ1 to τ2; τ1 | τ2 | T."""
    steps = settings.local_steps
    tau2 = settings.tau2 or steps
    tau1 = settings.tau1 or tau2
    if tau2 % tau1:
        raise ConfigError(f"train.tau2 ({tau2}) must be a multiple of train.tau1 ({tau1}): "
                          f"the cloud aggregates what the edges have just aggregated")
    if steps % tau2:
        raise ConfigError(f"train.local_steps ({steps}) must be a multiple of train.tau2 "
                          f"({tau2}): every round ends with a cloud aggregation")
    return tau1, tau2


def _count(value: object, most: int) -> bool:
    """Whether a reply's sample count is an int in 1..most (replies are untrusted)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= most


def tier_bytes(before: Snapshot, after: Snapshot, edges: set[str]) -> dict[str, int]:
    """Bytes moved between two counter snapshots, by tier (bundle installs excluded: the
    metrics report them as setup)."""
    out = dict.fromkeys(TIER_NAMES, 0)
    for agent, directions in after.items():
        role = "edge" if agent in edges else "client"
        for direction, kinds in directions.items():
            for kind, total in kinds.items():
                moved = total - before.get(agent, {}).get(direction, {}).get(kind, 0)
                if moved and kind not in (Kind.BUNDLE.value, Kind.BUNDLE_PART.value):
                    out[TIERS.get((role, direction, kind), "control")] += moved
    return out


@dataclass
class _Period:
    """Who did what since the last edge (τ1) and cloud (τ2) aggregation."""

    trained: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    served: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    edge_clients: dict[str, Arrays] = field(default_factory=dict)  # edge → client average
    edge_weight: dict[str, int] = field(default_factory=dict)  # Σ|D_k| behind that average


class SHeRL(Method):
    """SHeRL-FL over edge agents (role `edge`); see the module docstring."""

    name = "sherl"
    loss_tier = "cloud"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        s = trainer.settings
        self.tau1, self.tau2 = periods(s)
        self.topology: Topology = resolve(dict(self.options.edges), trainer.engine.registry)
        self.edges = set(self.topology.edges)
        planned = self.options.edge_split is None
        self.edge_split = self._plan_edge_split() if planned else self.options.edge_split
        self._carve(self.edge_split, "the planned edge split" if planned else "edge_split")
        self.ready: set[str] = set()  # edges holding this round's edge model
        self.groups: dict[str, list[str]] = {}
        self.steps_done = 0
        self.aggregations = {"edge": 0, "cloud": 0}
        # the cloud believes no edge's embeddings far larger than the others'
        self.embedding_bound = ActivationBound(s.activation_bound)
        self.edge_samples: dict[str, int] = defaultdict(int)  # this round's, per edge
        self.extra_metrics: dict[str, Any] = {}
        log.info("sherl: %d edges, clients [:%d], edges [%d:%d], cloud [%d:], tau1 %d, "
                 "tau2 %d", len(self.edges), trainer.bundle.split, trainer.bundle.split,
                 self.edge_split, self.edge_split, self.tau1, self.tau2)

    # ------------------------------------------------------------------ tiers

    def _carve(self, k2: int, where: str) -> None:
        """Edge block and cloud head as views of the trainer's server block (which thus
        stays the global edge model ∘ head: evaluation, saving, checkpoints see both)."""
        t = self.trainer
        k1, layers = t.bundle.split, len(t.server)
        try:
            check_edge_layers(layers, k2 - k1)
        except JetsplitError:
            raise ConfigError(f"{where} {k2} must lie in {k1 + 1}..{k1 + layers - 1} for "
                              f"{t.bundle.spec.name} split at {k1}") from None
        self.edge_split = k2
        t.shipper.edge_layers = k2 - k1  # edges receive their middle block [k1:k2] only
        self.edge_view, self.head = carve(t.server, k2 - k1)
        self.edge_names = sorted(to_arrays(self.edge_view, "edge"))
        with eval_mode(self.edge_view), torch.no_grad():
            probe = self.edge_view(torch.zeros(1, *t.activation_shape, device=t.device))
        self.embedding_shape = tuple(probe.shape[1:])
        from jetsplit.export.cost_model import edge_block, get_costs

        spec = t.bundle.spec
        costs = get_costs(spec.name, spec.input_shape, spec.num_classes)
        self.edge_flops = edge_block(costs, k1, k2).train_flops
        # The cloud head trains with the cloud tier's optimiser: by default Adam, as the
        # paper trains every tier (server/optim.PAPER). The edge's
        # contrastive loss ignores the embeddings' scale and lets it shrink, which stalls SGD
        # on the head, while Adam, blind to the scale, trains it on the same features
        # (docs/results.md#measurements-behind-the-defaults). The base class checkpoints
        # this optimizer.
        t.optimizer = tier_optimizer(t.settings, "cloud").for_module(self.head)

    def _plan_edge_split(self) -> int:
        """k2 from the three-tier planner on the registered profiles (k1 is the bundle's)."""
        from jetsplit.export.cost_model import get_costs
        from jetsplit.export.planner import PlanSettings, check_three_tier, plan_three_tier

        t, s = self.trainer, self.trainer.settings
        clients = [c for cs in self.topology.edges.values() for c in cs]
        spec = t.bundle.spec
        plan = plan_three_tier(
            get_costs(spec.name, spec.input_shape, spec.num_classes),
            self._profiles(clients), self._profiles(sorted(self.edges)),
            PlanSettings(batch=max(1, round(s.batch / max(1, len(clients)))),
                         local_steps=s.local_steps, codec=s.codec),
            clients_per_edge=max(len(cs) for cs in self.topology.edges.values()),
            k1=t.bundle.split, tau1=self.tau1, tau2=self.tau2)
        return check_three_tier(plan)[1]

    def _profiles(self, agents: list[str]) -> list[Any]:
        """Distinct device profiles the agents registered (a fallback for those with none
        or a malformed one: registrations are untrusted)."""
        from jetsplit.profiles import profile_from_dict, resolve_profile

        out: dict[str, Any] = {}
        for agent in agents:
            data = self.trainer.engine.registry.registration(agent).get("profile")
            try:
                profile = profile_from_dict(data, agent) if data else None
            except JetsplitError as exc:
                log.warning("agent %s: unusable profile (%s); planning with %s", agent, exc,
                            FALLBACK_PROFILE)
                profile = None
            profile = profile or resolve_profile(FALLBACK_PROFILE)
            out.setdefault(profile.name, profile)
        return list(out.values())

    # ------------------------------------------------------------------ round

    def run_round(self, selected: list[str]) -> float | None:
        t = self.trainer
        before = t.engine.counters.snapshot()
        self.groups = self.topology.groups(selected)
        self._load_edges()
        if t.round > 0:
            t.push(t.live(self._clients()), t.global_client)
        period = _Period()
        cloud_losses: list[float] = []
        edge_losses: list[float] = []
        self.edge_samples.clear()
        for step in range(t.settings.local_steps):
            losses = self._iterate(step, period)
            if losses is None:
                break
            cloud_loss, step_edge_losses = losses
            if cloud_loss is not None:
                cloud_losses.append(cloud_loss)
            edge_losses += step_edge_losses
            self.steps_done += 1
            more = step + 1 < t.settings.local_steps
            if more and (step + 1) % self.tau1 == 0:
                self._edge_aggregate(period, push=True)
            if more and (step + 1) % self.tau2 == 0:
                self._cloud_aggregate(period, push=True)
        self._edge_aggregate(period, push=False)  # the round ends globally aggregated
        self._cloud_aggregate(period, push=False)
        t.release(self._clients())
        self.extra_metrics = {
            "tier_bytes": tier_bytes(before, t.engine.counters.snapshot(), self.edges),
            "edge_loss": float(np.mean(edge_losses)) if edge_losses else None,
            "edge_gflops": {e: n * self.edge_flops / 1e9
                            for e, n in sorted(self.edge_samples.items())},
            "edge_split": self.edge_split, "aggregations": dict(self.aggregations),
        }
        return float(np.mean(cloud_losses)) if cloud_losses else None

    def _clients(self) -> list[str]:
        return [c for e in sorted(self.groups) for c in self.groups[e]]

    def _load_edges(self) -> None:
        """The cloud's edge-tier model to this round's edges (after each cloud
        aggregation too): their edge blocks start every period from it."""
        t = self.trainer
        edges = t.live(sorted(self.groups))
        self.ready = set()
        if not edges:
            return
        weights = to_arrays(self.edge_view, "edge")
        optimizer = tier_optimizer(t.settings, "edge").wire()
        commands = {e: Command(Kind.EDGE_LOAD.value,  # each edge learns its own clients
                               {"layers": len(self.edge_view), "optimizer": optimizer,
                                "clients": list(self.groups[e])}, weights)
                    for e in edges}
        with t.books.timed("distribute"):
            out = t.books.note(t.engine.send_and_receive(
                commands, round=t.round, deadline_s=t.step_deadline(Kind.EDGE_LOAD.value)))
        self.ready = set(out.agents)

    def _iterate(self, step: int, period: _Period) -> tuple[float | None, list[float]] | None:
        """One iteration: client forward (smashed data to the edges) → edge step
        (gradients to the clients, embeddings to the cloud) → client backward → cloud step.
        Returns (cloud loss, edge losses), or None when nobody can train."""
        t = self.trainer
        clients = t.live([c for e in sorted(self.ready) for c in self.groups.get(e, [])])
        if not clients:
            return None
        samples = self._forward(t.defences.batches(clients), step)
        stepped = self._edge_step(self._by_edge(samples), samples, step)
        served = {e: list(r.meta["clients"]) for e, r in stepped.replies.items()}
        backward = self._backward([c for e in stepped.agents for c in served[e]], samples,
                                  step)
        for edge in stepped.agents:
            period.trained[edge].update(c for c in served[edge] if c in backward.replies)
            period.served[edge].update(served[edge])
            self.edge_samples[edge] += int(stepped[edge].meta["samples"])
        edge_losses = [float(r.meta["loss"]) for r in stepped.replies.values()]
        uploads = stepped.replies
        with t.books.timed("cloud"):
            loss = self._cloud_step({e: r.tensors["embeddings"] for e, r in uploads.items()},
                                    {e: r.tensors["labels"] for e, r in uploads.items()})
        return loss, edge_losses

    def _forward(self, batches: dict[str, int], step: int) -> dict[str, int]:
        """Each client sends its smashed data straight to its edge; returns the samples
        each one reports having sent."""
        t, s = self.trainer, self.trainer.settings
        commands = {c: Command(Kind.FORWARD.value,
                               {"batch": b, "codec": s.codec, "compression": s.compression,
                                "edge": self.topology.edge_of(c)})
                    for c, b in batches.items()}
        with t.books.timed("forward"):
            out = t.books.note(t.checked(t.engine.send_and_receive(
                commands, round=t.round, step=step,
                deadline_s=t.step_deadline(Kind.FORWARD.value)),
                lambda c, r: None if _count(r.meta.get("samples"), batches[c])
                else f"samples {r.meta.get('samples')!r}, expected 1..{batches[c]}"))
        for client, reply in out.replies.items():
            t.books.fwd_samples[client] += int(reply.meta["samples"])
        return {c: int(r.meta["samples"]) for c, r in out.replies.items()}

    def _by_edge(self, samples: dict[str, int]) -> dict[str, list[str]]:
        """Each edge's clients whose smashed data went out, in id order."""
        members: dict[str, list[str]] = defaultdict(list)
        for client in sorted(samples):
            edge = self.topology.edge_of(client)
            if edge is not None:
                members[edge].append(client)
        return dict(sorted(members.items()))

    def _edge_step(self, members: dict[str, list[str]], samples: dict[str, int], step: int
                   ) -> Outcome:
        """Each edge trains on its clients' smashed data and answers with the embeddings;
        edges that fail sit out the rest of the round (their clients' forwards would be
        wasted)."""
        t, s = self.trainer, self.trainer.settings
        deadline_s = t.step_deadline(Kind.EDGE_STEP.value)
        wait_s = deadline_s / 2  # late smashed data: still time to reply without it
        commands = {e: Command(Kind.EDGE_STEP.value,
                               {"clients": cs, "margin": self.options.margin, "codec": s.codec,
                                "compression": s.compression, "wait_s": wait_s},
                               work=sum(samples[c] for c in cs))  # the cutoff: its share
                    for e, cs in members.items()}
        with t.books.timed("edge"):
            out = t.books.note(t.checked(
                t.engine.send_and_receive(commands, round=t.round, step=step,
                                          deadline_s=deadline_s),
                lambda e, r: self._step_problem(r, members[e], samples)))
        for edge in out.missed:
            self.ready.discard(edge)
        return out

    def _backward(self, clients: list[str], samples: dict[str, int], step: int) -> Outcome:
        """Clients apply the gradients their edge sent them directly; nothing from the
        cloud reaches the clients or the edges."""
        t = self.trainer
        deadline_s = t.step_deadline(Kind.BACKWARD.value)
        command = Command(Kind.BACKWARD.value, {"direct": True, "wait_s": deadline_s / 2})
        if not clients:
            return Outcome({})
        with t.books.timed("backward"):
            out = t.books.note(t.engine.broadcast(command, clients, round=t.round, step=step,
                                                  deadline_s=deadline_s))
        for client in out.replies:
            t.books.bwd_samples[client] += samples[client]
        return out

    def _cloud_step(self, embeddings: dict[str, np.ndarray], labels: dict[str, np.ndarray]
                    ) -> float | None:
        """One cross-entropy step of the head on every edge's detached embeddings, each
        edge's bounded against the others' and each edge's share of the loss down-weighted
        where it sits far above the others' (server/defences/step_bounds.py); returns the
        unweighted loss."""
        if not embeddings:
            return None
        t = self.trainer
        order = sorted(embeddings)
        [x] = to_device([np.concatenate([embeddings[e] for e in order])], np.float32, t.device)
        parts = self.embedding_bound.apply(
            order, list(torch.split(x, [len(embeddings[e]) for e in order])), t.books.bounded,
            t.books.activation_scale)
        x = torch.cat(parts) if len(parts) > 1 else parts[0]
        [y] = to_device([np.concatenate([labels[e] for e in order])], np.int64, t.device)
        with autocast(t.device, t.settings.autocast):
            self.head.train()
            t.optimizer.zero_grad(set_to_none=True)
            logits = self.head(x)
            loss = nn.functional.cross_entropy(logits, y)
            ce, d = nn.functional.cross_entropy, t.defences
            sizes = [len(embeddings[e]) for e in order]
            weights = (d.loss_weights(order, slice_losses(ce, logits, y, sizes))
                       if d.weighs_losses else None)
            step_loss = weighted_loss(ce, logits, y, sizes, weights)
            (loss if step_loss is None else step_loss).backward()  # x is detached: nothing
            t.optimizer.step()  # reaches the edge block
        return float(loss.detach())

    # ------------------------------------------------------------------ aggregation

    def _edge_aggregate(self, period: _Period, *, push: bool) -> None:
        """τ1: each edge's trained clients FedAvg-ed (weights |D_k|) into that edge's
        client block; pushed back to the edge's clients when iterations follow."""
        t = self.trainer
        trained = sorted(c for cs in period.trained.values() for c in cs)
        if not trained:
            return
        states = t.pull(trained)
        for edge, clients in sorted(period.trained.items()):
            mine = {c: states[c] for c in sorted(clients) if c in states}
            if not mine:
                continue
            sizes = t.defences.sizes(sorted(mine))
            with t.books.timed("aggregate"):
                period.edge_clients[edge] = t.defences.aggregate(
                    mine, sizes, reference=period.edge_clients.get(edge, t.global_client))
            period.edge_weight[edge] = sum(sizes.values())
            if push:
                t.push(t.live(self.groups.get(edge, [])), period.edge_clients[edge])
        period.trained.clear()
        self.aggregations["edge"] += 1

    def _cloud_aggregate(self, period: _Period, *, push: bool) -> None:
        """τ2: the edges' blocks FedAvg-ed into the global edge model and their client
        averages into the global client block (weights: Σ|D_k| behind each edge)."""
        t = self.trainer
        served = {e: sorted(cs) for e, cs in sorted(period.served.items()) if cs}
        if not served:
            return
        states = self._pull_edges(sorted(served))
        weights = {e: sum(t.defences.sizes(cs).values()) for e, cs in served.items()}
        with t.books.timed("aggregate"):
            if states:
                merged = t.defences.aggregate(states, {e: weights[e] for e in states},
                                              reference=to_arrays(self.edge_view, "edge"),
                                              block="edge block")
                load_strict(self.edge_view, from_arrays(merged, "edge"), "edge average")
            if period.edge_clients:
                t.global_client = fedavg(period.edge_clients, period.edge_weight)
        period.served.clear()
        period.edge_clients.clear()
        period.edge_weight.clear()
        self.aggregations["cloud"] += 1
        if push:
            self._load_edges()
            t.push(t.live(self._clients()), t.global_client)

    def _pull_edges(self, edges: list[str]) -> dict[str, Arrays]:
        t = self.trainer
        command = Command(Kind.GET_WEIGHTS.value, {"blocks": ["edge"]})
        with t.books.timed("collect"):
            out = t.books.note(t.checked(
                t.engine.broadcast(command, t.live(edges), round=t.round,
                                   deadline_s=t.step_deadline(Kind.GET_WEIGHTS.value)),
                lambda e, r: self._edge_weights_problem(r.tensors)))
        return {e: r.tensors for e, r in out.replies.items()}

    # ------------------------------------------------------------------ validation

    def _step_problem(self, reply: Reply, clients: list[str], samples: dict[str, int]
                      ) -> str | None:
        """Why an edge step's reply cannot be trained on, or None: it must name a non-empty
        subsequence of the clients asked, with the sample counts they reported, and carry
        finite embeddings and in-range labels for exactly those samples."""
        served, sizes, loss = (reply.meta.get(k) for k in ("clients", "sizes", "loss"))
        if not isinstance(served, list) or not served or \
                [c for c in clients if c in served] != served:
            return f"served clients {served!r} are not a subsequence of {clients}"
        if sizes != [samples[c] for c in served]:
            return f"sizes {sizes!r} differ from what the clients sent"
        if not isinstance(loss, float) or not np.isfinite(loss):
            return f"loss {loss!r}"
        return self._embeddings_problem(reply, sum(sizes))

    def _embeddings_problem(self, reply: Reply, count: int) -> str | None:
        """Why an edge step's tensors are not finite embeddings and in-range labels of
        `count` samples, or None."""
        emb, labels = reply.tensors.get("embeddings"), reply.tensors.get("labels")
        want = (count, *self.embedding_shape)
        if emb is None or emb.dtype != np.float32 or tuple(emb.shape) != want:
            shape = None if emb is None else f"{emb.dtype} {list(emb.shape)}"
            return f"embeddings are {shape}, expected float32 {list(want)}"
        if not np.isfinite(emb).all():
            return "embeddings contain NaN or infinity"
        classes = self.trainer.bundle.spec.num_classes
        if labels is None or labels.shape != (want[0],) or labels.dtype.kind not in "iu" or \
                (len(labels) and (labels.min() < 0 or labels.max() >= classes)):
            return f"labels must be {want[0]} integers in 0..{classes - 1}"
        return None

    def _edge_weights_problem(self, tensors: Arrays) -> str | None:
        if sorted(tensors) != self.edge_names:
            return "edge weights do not match the edge block's tensors"
        state = self.edge_view.state_dict()
        for name, value in tensors.items():
            want = state[name.split("/", 1)[1]]
            if tuple(value.shape) != tuple(want.shape) or str(value.dtype) != \
                    str(want.dtype).removeprefix("torch."):
                return f"tensor {name} is {value.dtype} {list(value.shape)}"
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                return f"tensor {name} contains NaN or infinity"
        return None

    # ------------------------------------------------------------------ checkpoint

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        """Rounds end globally aggregated, so the base state (server block = global edge
        block ∘ cloud head, its optimizer, the global client block) is the model; the
        tiers' cut and the step counters come along."""
        arrays, meta = super().checkpoint()
        return arrays, {**meta, "sherl": {"edge_split": self.edge_split,
                                          "steps": self.steps_done,
                                          "aggregations": dict(self.aggregations)}}

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        state = meta.get("sherl")
        try:
            k2, steps = int(state["edge_split"]), int(state["steps"])
            aggregations = {k: int(state["aggregations"][k]) for k in ("edge", "cloud")}
        except (KeyError, TypeError, ValueError):
            raise CheckpointError("checkpoint lacks SHeRL-FL's tier state") from None
        if k2 != self.edge_split:  # the checkpointed model's tiers win over a new plan
            try:  # (before the base restore: the head's optimizer depends on the cut)
                self._carve(k2, "checkpoint edge_split")
            except ConfigError as exc:
                raise CheckpointError(str(exc)) from None
        super().restore(arrays, meta)
        self.steps_done, self.aggregations = steps, aggregations

"""The trainer: the shared machinery every method trains through.

Exchanges with the fleet (forward, backward, push and pull of weights, release), the books
(bytes, phases, samples and FLOPs per agent), public checks on untrusted replies
(`activation_problem`, `weights_problem`, `checked`), per-device cuts and their
completions, seeded selection. It holds the run's `Defences` (server/defences/defences.py:
screening, weights, aggregation, size caps), which the methods call directly. The round
loop (server/run/round_loop.py) drives it; the methods (server/methods/) call it.
"""

from __future__ import annotations

import contextlib
import logging
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
from jetsplit.models.weights import from_arrays, load_strict, stand_ins, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.step_deadlines import StepDeadlines, predicted_floor
from jetsplit.server.engines.cutoff import DEFAULT_CUTOFF_K, Cutoff
from jetsplit.server.engines.seam import Command, Engine, Outcome, Reply
from jetsplit.server.training.divergence import DivergenceGuard
from jetsplit.server.training.evaluation import Evaluation, evaluate, summarize
from jetsplit.server.training.placement import all_finite, autocast, to_device, to_host
from jetsplit.server.training.rejoin import Rejoin
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings
from jetsplit.wire import accounted_bound

log = logging.getLogger("jetsplit.coordinator")
Arrays = dict[str, np.ndarray]
NON_FINITE = "activations contain NaN or infinity"
REJOIN_GRACE_S = 3.0  # after an outage, how long to wait for the rest of the fleet


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
                 *, bundle: Bundle | None = None, cuts: Mapping[str, int] | None = None,
                 predicted_step_s: Mapping[str, float] | None = None) -> None:
        """`archive` is the whole model split at the server cut c*; `cuts` gives agents
        that train at a shallower cut theirs (the rest train at c*; see
        server/cuts/completions.py); `predicted_step_s` (agent → the planner's seconds for
        its longest exchange) raises the step deadlines' floor."""
        from jetsplit.server.cuts.completions import Completions, check_cuts

        self.engine, self.settings, self.test = engine, settings, test
        self.bundle = bundle or load_bundle(archive)
        # Devices get only what they run: the client block (+ aux head), or for FedAvg
        # the whole model; per-device cuts (`cuts`, agent → k) get their cut's block.
        from jetsplit.server.training.optimisers import client_batch, tier_optimizer

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
        # On CUDA a forward's finiteness is checked where its activations land: one pass at
        # the card's bandwidth and one host read, not a host pass over every byte.
        self.finite_on_device = self.device.type == "cuda"
        self.server: nn.Module = self.bundle.server_module().to(self.device)
        self.optimizer = self.server_optimizer.for_module(self.server)
        client = self.bundle.client_module()
        self.global_client: Arrays = to_arrays(client, "client")
        # names, shapes and dtypes only (replies are checked against it): no weights held
        self.weight_template: Arrays = {**stand_ins(client, "client"),
                                        **stand_ins(self.server, "server")}
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
        self.books = RoundBooks()  # this round's phases, samples, misses and verdicts
        # every defence's state, on the data path (server/defences/defences.py)
        self.defences = Defences(settings, self.bundle.spec.num_classes, engine.registry,
                                 self.books, fixed_batch=client_batch(settings))
        # the step deadlines follow the fleet (server/defences/step_deadlines.py)
        self.deadlines = StepDeadlines(
            settings.deadline_s, k=settings.deadline_k, window=settings.deadline_window,
            floor_s=predicted_floor(predicted_step_s or {}, settings.deadline_floor_s),
            predicted_floor_s=predicted_floor(predicted_step_s or {}, 0.0))
        # Within an exchange, the silent are cut off once the others answered
        # (server/engines/cutoff.py), above each device's floor (its own record's, or the
        # fleet's); a miss sits out the round's later steps until a probe is answered
        # (server/training/rejoin.py). Both only where a miss costs wall time: the
        # in-process engine stays as it was.
        engine.cutoff = Cutoff(self.deadlines.floor_s,
                               k=DEFAULT_CUTOFF_K if settings.deadline_k > 0 else 0.0,
                               predicted_s=dict(predicted_step_s or {}),
                               floor_of=self.deadlines.floor_of)
        self.rejoin = Rejoin(engine) if engine.clocked else None
        self.books.listener = self._heard
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

    def _heard(self, outcome: Outcome) -> None:
        """Every booked exchange: who keeps missing deadlines sits out, and its step time
        joins its kind's window."""
        self.defences.bench.note(outcome)
        self.deadlines.observe(outcome)
        if self.rejoin is not None:
            self.rejoin.missed(outcome, round=self.round)

    def step_deadline(self, kind: str) -> float:
        """Seconds an exchange of `kind` waits now (server/defences/step_deadlines.py)."""
        return self.deadlines.deadline(kind)

    # ------------------------------------------------------------------ selection

    def probe(self, agents: list[str]) -> list[str]:
        """Proof of life: a `status` to agents that sat out or missed their last exchange,
        with the short probe deadline; who answered (server/training/proof_of_life.py)."""
        from jetsplit.server.training.proof_of_life import probe

        return probe(self.engine, self.books, agents, round=self.round,
                     wait_s=min(self.settings.probe_deadline_s, self.settings.deadline_s))

    def playing(self, agents: list[str]) -> list[str]:
        """`agents` without those benched for missing deadlines, nor sitting out the round
        until they answer a probe (server/training/rejoin.py)."""
        agents = self.defences.bench.playing(agents)
        return agents if self.rejoin is None else self.rejoin.playing(agents)

    def sitting_out(self) -> list[str]:
        """Agents out of this round for silence but not benched: probed, not yet answered
        (the round's status poll skips them too)."""
        return [] if self.rejoin is None else self.rejoin.sitting_out()

    def live(self, agents: list[str]) -> list[str]:
        """The selected agents not known to be offline nor sitting out (`playing`), with
        the bundle installed."""
        registry = self.engine.registry
        online = [a for a in self.playing(agents) if registry.state(a) != "offline"]
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
        bench = self.defences.bench
        if self.rejoin is None:
            self.probe(bench.to_probe(bench.playing(pool)))  # the silent are benched again
            pool = bench.playing(pool) or pool  # all benched: better slow than nothing
        else:  # last round's probes booked (silence benches again), this round's posted
            self.rejoin.settle(self.books)
            self.rejoin.probe(bench.to_probe(bench.playing(pool)), round=self.round)
            playing = self.playing(pool)
            if not playing:
                self.rejoin.let_play(pool)  # all out: better slow than nothing
            pool = playing or pool
        if not pool:
            return []
        count = max(1, min(len(pool), round(self.settings.fraction * len(pool))))
        return sorted(str(a) for a in self.rng.choice(pool, size=count, replace=False))

    # ------------------------------------------------------------------ exchanges

    def forward(self, batches: dict[str, int], step: int
                ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """The agents' forwards: the replies that pass `activation_problem`, their
        activations and labels on the server's device per agent in id order (one transfer
        each for all agents' activations and labels, then views)."""
        s = self.settings
        commands = {a: Command(Kind.FORWARD.value, {"batch": b, "codec": s.codec,
                                                    "compression": s.compression})
                    for a, b in batches.items()}
        on_device = self.finite_on_device
        with self.books.timed("forward"):
            out = self.checked(self.engine.send_and_receive(
                commands, round=self.round, step=step,
                deadline_s=self.step_deadline(Kind.FORWARD.value)),
                lambda agent, r: self.activation_problem(r.tensors, batches[agent], agent,
                                                         finite=not on_device))
        agents = out.agents
        acts = to_device([out[a].tensors["activations"] for a in agents], np.float32,
                         self.device)
        labels = to_device([out[a].tensors["labels"] for a in agents], np.int64, self.device)
        if on_device:
            agents, acts, labels = self._finite_only(out, agents, acts, labels)
        self.books.note(out)
        for agent, reply in out.replies.items():
            self.books.fwd_samples[agent] += int(len(reply.tensors["labels"]))
            self.defences.labels.add(agent, reply.tensors["labels"])
        return agents, acts, labels

    def _finite_only(self, out: Outcome, agents: list[str], acts: list[torch.Tensor],
                     labels: list[torch.Tensor]
                     ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """The replies whose activations, on the device, are all finite; the others move
        to `out`'s misses with the reason the host check would have given."""
        finite = dict(zip(agents, all_finite(acts), strict=True))
        if all(finite.values()):
            return agents, acts, labels
        self.checked(out, lambda agent, r: None if finite[agent] else NON_FINITE)
        kept = [i for i, a in enumerate(agents) if finite[a]]
        return ([agents[i] for i in kept], [acts[i] for i in kept],
                [labels[i] for i in kept])

    def activation_problem(self, tensors: Arrays, batch: int, agent: str = "", *,
                           finite: bool = True) -> str | None:
        """Why a forward reply cannot be trained on, or None (replies are untrusted);
        `finite` False leaves the NaN/infinity check to the caller (on the device)."""
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
        if finite and not np.isfinite(acts).all():
            return NON_FINITE
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

    @staticmethod
    def read_step(loss: float | torch.Tensor, grads: dict[str, torch.Tensor]
                  ) -> tuple[float, dict[str, np.ndarray]]:
        """A server step's loss and its gradients for the agents, on the host after one
        transfer for all of them (a float32 loss tensor rides with the gradients: on CUDA
        one wait for the card, not two)."""
        if not (isinstance(loss, torch.Tensor) and loss.dtype == torch.float32):
            return float(loss), dict(zip(grads, to_host(list(grads.values())), strict=True))
        *host, value = to_host([*grads.values(), loss])
        return float(value), dict(zip(grads, host, strict=True))

    def backward(self, grads: dict[str, np.ndarray], step: int) -> Outcome:
        """Each agent's gradient at its activations (on the host: `read_step`) sent back."""
        s = self.settings
        commands = {a: Command(Kind.BACKWARD.value, {}, {"grad": g}, codec=s.codec,
                               compression=s.compression) for a, g in grads.items()}
        with self.books.timed("backward"):
            out = self.books.note(self.engine.send_and_receive(
                commands, round=self.round, step=step,
                deadline_s=self.step_deadline(Kind.BACKWARD.value)))
        for agent in out.replies:
            self.books.bwd_samples[agent] += int(grads[agent].shape[0])
        return out

    def push(self, agents: list[str], arrays: Arrays) -> list[str]:
        """Install `arrays` (client/…, server/… names) on agents; returns who has them
        (agents sitting out are not asked)."""
        agents = self.playing(agents)
        if not agents:
            return []
        with self.books.timed("distribute"):
            out = self.books.note(self.engine.broadcast(
                Command(Kind.SET_WEIGHTS.value, {}, arrays), agents, round=self.round,
                deadline_s=self.step_deadline(Kind.SET_WEIGHTS.value)))
        return out.agents

    def pull(self, agents: list[str], blocks: tuple[str, ...] = ("client",), *,
             release: bool = False) -> dict[str, Arrays]:
        """`blocks` from agents (those sitting out are not asked: benched mid-round, their
        silence would cost the round another deadline); `release`: each agent drops its
        blocks in the same exchange (`release` then needs no exchange of its own)."""
        agents = self.playing(agents)
        if not agents:
            return {}
        with self.books.timed("collect"):
            bound = accounted_bound(self.weights_bytes(blocks, agents))
            out = self.books.note(self.checked(self.engine.broadcast(
                Command(Kind.GET_WEIGHTS.value,
                        {"blocks": list(blocks), **({"release": True} if release else {})},
                        reply_bytes=bound),
                agents,
                round=self.round, deadline_s=self.step_deadline(Kind.GET_WEIGHTS.value)),
                lambda agent, r: self.weights_problem(r.tensors, blocks, agent)))
        return {a: r.tensors for a, r in out.replies.items()}

    def release(self, agents: list[str]) -> None:
        """Agents whose block was just averaged away free it (memory on small devices; in
        simulations, at most the active clients hold blocks); agents sitting out are not
        asked."""
        agents = self.playing(agents)
        if agents:
            self.books.note(self.engine.broadcast(Command(Kind.RELEASE.value), agents,
                                             round=self.round,
                                             deadline_s=self.step_deadline(Kind.RELEASE.value)))

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

"""The training methods, each written once against the engine interface (via `Trainer`).

A split method's iteration is always: every live selected agent runs its client block on a
batch of B_k samples (`forward`), the server turns the activations into a server update and
per-agent activation gradients (`server_update`, the part the methods differ in), and the
agents apply their gradients (`backward`). Methods that average client blocks install the
global block at round start and FedAvg the returned blocks at round end.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from jetsplit.errors import ConfigError
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.aggregation import fedavg
from jetsplit.server.algorithms import gapsl_math, scala_math
from jetsplit.server.checkpoint import (
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
    save_arrays,
    subset,
)
from jetsplit.server.engine import Command
from jetsplit.server.optim import reduction
from jetsplit.server.training import Arrays, Trainer

Grads = dict[str, torch.Tensor]


def _save_arrays(arrays: Arrays, path: Path) -> None:
    save_arrays(arrays, path)


class Method(ABC):
    """One training method; `run_round` returns the mean training loss (None if no data)."""

    name: ClassVar[str]
    per_device_cuts: ClassVar[bool] = False  # trains a fleet of per-device cuts
    loss_tier: str = "server"  # where `run_round`'s loss is measured (divergence reports)

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.num_classes = trainer.bundle.spec.num_classes
        if trainer.completions.heterogeneous and not self.per_device_cuts:
            raise ConfigError(f"{self.name} trains every device at one common cut; give "
                              f"per-device cuts only to the split methods")

    @abstractmethod
    def run_round(self, selected: list[str]) -> float | None: ...

    def evaluate(self) -> dict[str, Any]:
        return self.trainer.evaluate_global()

    def save(self, out_dir: Path) -> None:
        """Final weights: the server block and the global client block."""
        _save_arrays(to_arrays(self.trainer.server, "server"), out_dir / "server.safetensors")
        _save_arrays(self.trainer.global_client, out_dir / "client.safetensors")

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        """State that outlives a round: server block, its optimizer, the global client
        block. Methods with more (GAPSL's ν range, PSL's per-agent blocks) extend it."""
        t = self.trainer
        opt_arrays, opt_meta = optimizer_state(t.optimizer, "optimizer")
        return ({**to_arrays(t.server, "server"), **t.global_client, **opt_arrays},
                {"optimizer": opt_meta})

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        """Inverse of `checkpoint` (the arrays are untrusted: names and shapes checked)."""
        t = self.trainer
        client = subset(arrays, "client")
        problem = t._weights_problem(client, ("client",))
        if problem is not None:
            raise CheckpointError(f"checkpoint client block: {problem}")
        load_strict(t.server, from_arrays(subset(arrays, "server"), "server"),
                    "checkpoint server block", CheckpointError)
        t.global_client = {k: np.array(v) for k, v in client.items()}
        load_optimizer_state(t.optimizer, "optimizer", arrays, meta.get("optimizer", {}))


class SplitMethod(Method):
    """Parallel split learning with a shared server block; subclasses pick the loss.

    Every split method trains per-device cuts the same way (server/hetero.py): a shallow
    agent's activations pass its completion copy before `server_update`, and its gradient
    passes back through it; at round end each agent's device block plus its completion
    copy is one whole client block, so FedAvg over those is the layer-wise average."""

    aggregate_clients: ClassVar[bool] = True
    per_device_cuts = True

    def run_round(self, selected: list[str]) -> float | None:
        t = self.trainer
        participants: set[str] = set()
        if self.aggregate_clients and t.round > 0:
            t.push_client(t.live(selected), t.global_client)
        t.completions.begin_round(selected, t.global_client, fresh=self.aggregate_clients)
        self.begin_round(selected)
        losses = self.local_pass(selected, participants)
        self.end_round(sorted(participants))
        if self.aggregate_clients and participants:
            states = t.pull(sorted(participants))
            t.release(sorted(participants))
            states = {a: t.completions.whole(a, s) for a, s in states.items()}
            if states:
                with t.timed("aggregate"):
                    t.global_client = fedavg(states, t.sizes(sorted(states)))
            t.require_update(selected, states)
        t.require_update(selected, participants)
        return float(np.mean(losses)) if losses else None

    def local_pass(self, selected: list[str], participants: set[str]) -> list[float]:
        """T iterations, every live selected agent in each (parallel split learning);
        adds who trained to `participants` and returns the iterations' losses."""
        t, losses = self.trainer, []
        for step in range(t.settings.local_steps):
            live = t.live(selected)
            if not live:
                break
            loss = self.iterate(live, step)
            if loss is not None:
                losses.append(loss)
                participants.update(live)
        return losses

    def iterate(self, live: list[str], step: int) -> float | None:
        return self.split_step(self.trainer.batches(live), step)

    def split_step(self, batches: dict[str, int], step: int) -> float | None:
        """One split iteration for these agents: their forwards, the server's update (through
        any completion layers), their backwards."""
        t = self.trainer
        out = t.forward(batches, step)
        if not out.agents:
            return None
        agents, acts, labels = t.inputs(out)
        with t.server_compute():
            acts = t.completions.forward(agents, acts)
            loss, grads = self.server_update(agents, acts, labels)
            t.guard.check(loss, t.round, "server")  # before its gradients reach the clients
            grads = t.completions.backward(grads)
        t.backward(grads, step)
        return loss

    def begin_round(self, selected: list[str]) -> None:  # noqa: B027 - optional hook
        """Before the first iteration (SplitFed V1 copies the server block here)."""

    def end_round(self, participants: list[str]) -> None:  # noqa: B027 - optional hook
        """After the last iteration, before client aggregation."""

    @abstractmethod
    def server_update(self, agents: list[str], acts: list[torch.Tensor],
                      labels: list[torch.Tensor]) -> tuple[float, Grads]: ...


def _sum_of_client_losses(server: nn.Module, optimizer: torch.optim.Optimizer,
                          acts: list[torch.Tensor], labels: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One server forward over the concatenation; returns (Σ_i L_i, leaves, per-client
    losses) with L_i each client's mean cross-entropy (PSL/GAPSL's L = Σ_i L_i)."""
    leaves = [a.clone().requires_grad_(True) for a in acts]
    server.train()
    optimizer.zero_grad(set_to_none=True)
    logits = server(torch.cat(leaves)).split([len(a) for a in acts])
    losses = [nn.functional.cross_entropy(lg, y) for lg, y in zip(logits, labels, strict=True)]
    return torch.stack(losses).sum(), leaves, losses


def _step_averaged(server: nn.Module, optimizer: torch.optim.Optimizer,
                   losses: list[torch.Tensor], chosen: list[int], leaves: list[torch.Tensor],
                   server_loss: torch.Tensor) -> list[torch.Tensor]:
    """Client i gets ∂L_i/∂A_i (its own mean loss, like SCALA's G_k); the server steps on
    `server_loss` (a sum over clients as gapsl.txt eq. 8, or their mean: see `_reduced`).

    With the sum the server's step grows with the number of clients: PSL on AlexNet/MNIST
    with 10 clients per step at plain-SGD lr 0.01 diverged (NaN in round 0). The mean
    variant keeps the step size independent of |S|; selection and directions are the
    same either way."""
    grads = torch.autograd.grad(torch.stack([losses[i] for i in chosen]).sum(),
                                [leaves[i] for i in chosen], retain_graph=True)
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in server.parameters() if p.requires_grad]
    torch.autograd.backward(server_loss, inputs=params)
    optimizer.step()
    return [g.detach() for g in grads]


def _reduced(total: torch.Tensor, count: int, settings: Any) -> torch.Tensor:
    """PSL's L = Σ_i L_i and GAPSL's L_g = Σ_{Ŝ} L̃_i are sums (gapsl.txt eq. 8, the
    `paper` preset); by default they are divided by the number of summed clients, which
    keeps the server's step independent of how many clients are selected."""
    return total / count if reduction(settings) == "mean" else total


class PSL(SplitMethod):
    """Parallel split learning: one server block trained on the clients' mean loss; client
    blocks are never aggregated, each stays with its agent (gapsl.txt §II-A)."""

    name = "psl"
    aggregate_clients = False

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t = self.trainer
        total, leaves, losses = _sum_of_client_losses(t.server, t.optimizer, acts, labels)
        grads = _step_averaged(t.server, t.optimizer, losses, list(range(len(losses))),
                               leaves, _reduced(total, len(losses), t.settings))
        return float(torch.stack(losses).mean().detach()), dict(zip(agents, grads, strict=True))

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.agent_blocks: dict[str, Arrays] = {}  # each agent's block as last evaluated
        self.to_restore: dict[str, Arrays] = {}  # blocks to reinstall after a resume

    def begin_round(self, selected: list[str]) -> None:
        """After a resume, every agent gets its own checkpointed block back first (fresh
        agents start from the bundle's; survivors may have trained past the checkpoint)."""
        t = self.trainer
        if self.to_restore:
            for agent in t.live(sorted(self.to_restore)):
                block = self.to_restore[agent]
                if t.push([agent], t.device_part(agent, block)):
                    t.completions.load(agent, block)
                    del self.to_restore[agent]

    def evaluate(self) -> dict[str, Any]:
        """Each agent's own client block with the shared server block, mean and spread."""
        t = self.trainer
        agents = t.engine.registry.eligible()
        states = t.pull([a for a in agents if not t.needs_bundle(a)])
        t.completions.begin_round(sorted(states), t.global_client, fresh=False)
        self.agent_blocks = {a: t.completions.whole(
            a, {k: v for k, v in s.items() if k.startswith("client/")})
            for a, s in states.items()}
        return t.evaluate_each(self.agent_blocks)

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        arrays, meta = super().checkpoint()
        blocks = {**self.agent_blocks, **self.to_restore}
        for agent, state in blocks.items():
            arrays.update({f"agents/{agent}/{k}": v for k, v in state.items()})
        return arrays, {**meta, "agents": sorted(blocks)}

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        super().restore(arrays, meta)
        t = self.trainer
        for agent in meta.get("agents", []):
            state = {k.split("/", 2)[2]: v for k, v in subset(arrays, f"agents/{agent}").items()}
            problem = t._weights_problem(state, ("client",))
            if problem is not None:
                raise CheckpointError(f"checkpoint block of agent {agent}: {problem}")
            self.to_restore[str(agent)] = state

    def save(self, out_dir: Path) -> None:
        _save_arrays(to_arrays(self.trainer.server, "server"), out_dir / "server.safetensors")
        (out_dir / "clients").mkdir(exist_ok=True)
        t = self.trainer
        for agent, state in t.pull(t.engine.registry.eligible()).items():
            _save_arrays(t.completions.whole(agent, state),
                         out_dir / "clients" / f"{agent}.safetensors")


class GAPSL(PSL):
    """PSL with leader-gradient identification and gradient-direction alignment
    (gapsl.txt §III, Algorithms 1–2): only directionally consistent clients' losses train
    the server block and get gradients back."""

    name = "gapsl"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.tracker = gapsl_math.NuTracker()
        self.step = 0  # the iteration within the round (eq. 2's t counts iterations)
        self.last_selection: gapsl_math.GapslSelection | None = None

    def iterate(self, live: list[str], step: int) -> float | None:
        self.step = step
        return super().iterate(live, step)

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        arrays, meta = super().checkpoint()
        nu = (self.tracker.nu_min, self.tracker.nu_max)
        return arrays, {**meta, "nu": [v if math.isfinite(v) else None for v in nu]}

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        super().restore(arrays, meta)
        low, high = meta.get("nu") or [None, None]
        self.tracker.nu_min = math.inf if low is None else float(low)
        self.tracker.nu_max = -math.inf if high is None else float(high)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t, s = self.trainer, self.trainer.settings
        _, leaves, losses = _sum_of_client_losses(t.server, t.optimizer, acts, labels)
        params = [p for p in t.server.parameters() if p.requires_grad]
        per_client = []
        for loss in losses:  # g_i: each client's server-side gradient (eq. 1)
            g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            per_client.append(torch.cat([
                (x if x is not None else torch.zeros_like(p)).reshape(-1)
                for x, p in zip(g, params, strict=True)]))
        # Eq. 2's t is the training iteration (one minibatch per client; Algorithm 1 runs
        # once per iteration), 1-based, and T the scheduled number of iterations.
        iteration = t.round * s.local_steps + self.step + 1
        selection = gapsl_math.select_clients(
            torch.stack(per_client), iteration, s.rounds * s.local_steps, self.tracker,
            s.k_min, s.k_max, s.eta)
        self.last_selection = selection
        chosen = [int(i) for i in selection.selected]
        server_loss = _reduced(gapsl_math.gapsl_server_loss(losses, selection, s.lam),
                               len(chosen), s)
        grads = _step_averaged(t.server, t.optimizer, losses, chosen, leaves, server_loss)
        return (float(torch.stack(losses).mean().detach()),
                {agents[i]: g for i, g in zip(chosen, grads, strict=True)})


class SplitFedV1(SplitMethod):
    """SplitFed V1: a server-block copy per client, trained in parallel; copies and client
    blocks are FedAvg-ed (weights |D_k|) at round end."""

    name = "splitfed-v1"

    def begin_round(self, selected: list[str]) -> None:
        t = self.trainer
        self.copies = {a: copy.deepcopy(t.server) for a in selected}
        self.optimizers = {a: t.server_optimizer.for_module(m)
                           for a, m in self.copies.items()}

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        grads, losses = {}, []
        for agent, x, y in zip(agents, acts, labels, strict=True):
            server, optimizer = self.copies[agent], self.optimizers[agent]
            leaf = x.clone().requires_grad_(True)
            server.train()
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(server(leaf), y)
            loss.backward()
            optimizer.step()
            grads[agent] = leaf.grad
            losses.append(float(loss.detach()))
        return float(np.mean(losses)), grads

    def end_round(self, participants: list[str]) -> None:
        t = self.trainer
        if participants:
            states = {a: to_arrays(self.copies[a], "server") for a in participants}
            with t.timed("aggregate"):
                merged = fedavg(states, t.sizes(participants))
            load_strict(t.server, from_arrays(merged, "server"), "server average")
        self.copies, self.optimizers = {}, {}


class LLASFL(SplitFedV1):
    """LLA-SFL (scala-journal §5.2): SplitFed V1 (a server-block copy per client, copies
    and client blocks FedAvg-ed every T iterations) with only the local logit adjustment:
    client k's copy steps on CE(s(A_k) + log P_k, Y_k), P_k its registered local label
    distribution. Differs from `splitfed-v1` in the loss alone."""

    name = "lla-sfl"

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t, grads, losses = self.trainer, {}, []
        for agent, x, y in zip(agents, acts, labels, strict=True):
            self.copies[agent].train()
            loss, (grad,) = scala_math.lla_sfl_server_step(
                self.copies[agent], [x], [y], self.num_classes, self.optimizers[agent],
                client_priors=[t.label_prior(agent)])
            grads[agent] = grad
            losses.append(loss)
        return float(np.mean(losses)), grads


class SplitFedV2(SplitMethod):
    """SplitFed V2 as the SplitFed reference implementation runs it: one server block; the
    selected clients, in a random order, each run their WHOLE local pass (T iterations:
    forward, server update, backward) before the next client starts; client blocks are
    FedAvg-ed (weights |D_k|) at round end. This sequential pass is what lets the server
    block drift towards the last clients' labels under skew (SCALA's V2 tables)."""

    name = "splitfed-v2"

    def local_pass(self, selected: list[str], participants: set[str]) -> list[float]:
        t, losses = self.trainer, []
        batches = t.batches(t.live(selected))  # B_k over the round's clients, as V1
        for agent in [str(a) for a in t.rng.permutation(sorted(batches))]:
            for step in range(t.settings.local_steps):
                if not t.live([agent]):
                    break
                loss = self._serve(agent, batches[agent], step)
                if loss is None:
                    break
                losses.append(loss)
                participants.add(agent)
        return losses

    def _serve(self, agent: str, batch: int, step: int) -> float | None:
        """One client's iteration: its forward, the server's update, its backward."""
        return self.split_step({agent: batch}, step)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t = self.trainer
        leaf = acts[0].clone().requires_grad_(True)
        t.server.train()
        t.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(t.server(leaf), labels[0])
        loss.backward()
        t.optimizer.step()
        return float(loss.detach()), {agents[0]: leaf.grad}


class SplitFedV2Interleaved(SplitFedV2):
    """Variant: within each iteration the clients are served one after another in a fresh
    random order, so every client advances one step per iteration (less drift than the
    reference's client-after-client pass; kept to compare the two schedules)."""

    name = "splitfed-v2-interleaved"

    def local_pass(self, selected: list[str], participants: set[str]) -> list[float]:
        return SplitMethod.local_pass(self, selected, participants)

    def iterate(self, live: list[str], step: int) -> float | None:
        t = self.trainer
        losses = []
        batches = t.batches(live)
        for agent in [str(a) for a in t.rng.permutation(live)]:
            loss = self._serve(agent, batches[agent], step)
            if loss is not None:
                losses.append(loss)
        return float(np.mean(losses)) if losses else None


class _ScalaFamily(SplitMethod):
    """SCALA and its ablations: concatenated activations, logit adjustment (scala-icml §3)."""

    step_fn: ClassVar[Any]

    adjusted: ClassVar[bool] = True  # takes client priors P_k (eq. 15)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t = self.trainer
        extra = {"client_priors": [t.label_prior(a) for a in agents]} if self.adjusted else {}
        loss, grads = type(self).step_fn(t.server, acts, labels, self.num_classes, t.optimizer,
                                         **extra)
        return loss, dict(zip(agents, grads, strict=True))


class SCALA(_ScalaFamily):
    """SCALA: P_s from the concatenated labels of the iteration (eq. 14), P_k from client
    k's local label distribution as it registered it (eq. 15)."""

    name = "scala"
    step_fn = staticmethod(scala_math.scala_server_step)


class CASFL(_ScalaFamily):
    name = "ca-sfl"
    adjusted = False
    step_fn = staticmethod(scala_math.ca_sfl_server_step)


class LLASFLShared(_ScalaFamily):
    """Variant: LLA-SFL's loss on ONE shared server block stepped every iteration on
    Σ_k (B_k/B)·L_k, i.e. SplitFed V1 averaged every iteration (see
    `scala_math.lla_sfl_server_step`); compare it with `splitfed-v1` only knowing that
    the aggregation period differs too."""

    name = "lla-sfl-shared"
    step_fn = staticmethod(scala_math.lla_sfl_server_step)


class FedAvg(Method):
    """FedAvg: the whole model trains on each device for T local steps; client and server
    parts are averaged (weights |D_k|) at round end."""

    name = "fedavg"
    loss_tier = "device"

    def run_round(self, selected: list[str]) -> float | None:
        t = self.trainer
        live = t.live(selected)
        global_state = {**t.global_client, **to_arrays(t.server, "server")}
        if t.round > 0:
            live = t.push(live, global_state)
        batches = t.batches(live)
        commands = {a: Command(Kind.TRAIN.value, {"target": "full", "batch": batches[a],
                                                  "steps": t.settings.local_steps,
                                                  "lr": t.client_optimizer.lr})
                    for a in live}
        with t.timed("local_train"):
            out = t.note(t.engine.send_and_receive(commands, round=t.round,
                                                    deadline_s=t.settings.deadline_s))
        losses = []
        for agent, reply in out.replies.items():
            samples, loss = reply.meta.get("samples"), reply.meta.get("loss")
            if isinstance(samples, int) and isinstance(loss, float) and math.isfinite(loss):
                t.full_samples[agent] += samples
                losses.append(loss)
        states = t.pull(out.agents, ("client", "server"))
        t.require_update(selected, states)
        t.release(out.agents)
        if states:
            with t.timed("aggregate"):
                merged = fedavg(states, t.sizes(sorted(states)))
            t.global_client = {k: v for k, v in merged.items() if k.startswith("client/")}
            load_strict(t.server, from_arrays(merged, "server"), "server average")
        return float(np.mean(losses)) if losses else None


from jetsplit.server.algorithms.ampere import Ampere, AmpereNoConsolidation  # noqa: E402 (subclasses)
from jetsplit.server.algorithms.sherl import SHeRL  # noqa: E402 (subclass)

METHODS: dict[str, type[Method]] = {m.name: m for m in (
    FedAvg, SplitFedV1, SplitFedV2, SplitFedV2Interleaved, PSL, SCALA, CASFL, LLASFL,
    LLASFLShared, GAPSL, Ampere, AmpereNoConsolidation, SHeRL)}


def build_method(name: str, trainer: Trainer) -> Method:
    """The method called `name` (the names used in configs, the CLI and reports)."""
    if name not in METHODS:
        raise ConfigError(f"unknown algorithm {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name](trainer)

"""The training methods, each written once against the engine interface (via `Trainer`).

A split method's iteration is always: every live selected agent runs its client block on a
batch of B_k samples (`forward`), the server turns the activations into a server update and
per-agent activation gradients (`server_update`, the part the methods differ in), and the
agents apply their gradients (`backward`). Methods that average client blocks install the
global block at round start and FedAvg the returned blocks at round end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from jetsplit import catalog
from jetsplit.errors import ConfigError
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.server.training.checkpoints import (
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
    save_arrays,
    subset,
)
from jetsplit.server.training.trainer import Arrays, Trainer

Grads = dict[str, torch.Tensor]


class Method(ABC):
    """One training method; `run_round` returns the mean training loss (None if no data)."""

    name: ClassVar[str]
    loss_tier: str = "server"  # where `run_round`'s loss is measured (divergence reports)

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.num_classes = trainer.bundle.spec.num_classes
        if trainer.completions.heterogeneous and catalog.method(self.name).common_cut:
            raise ConfigError(f"{self.name} trains every device at one common cut; give "
                              f"per-device cuts only to the split methods")

    @property
    def options(self) -> Any:
        """This method's own options (its dataclass in the method catalog)."""
        return catalog.method(self.name).options_from(self.trainer.settings)

    @abstractmethod
    def run_round(self, selected: list[str]) -> float | None: ...

    @property
    def switches_cuts(self) -> bool:
        """Whether `switch_cuts` may move devices now (live re-planning asks first)."""
        return True

    def switch_cuts(self, cuts: Mapping[str, int]) -> list[str]:
        """Move agents to these cuts before the next round (live re-planning); returns who
        moved. Averaging split methods need nothing more: every round starts from the
        global block, pushed cut at each agent's cut, and completion copies rebuilt from it.
        (Methods at one common cut are never asked: the catalog's `replans`.)"""
        t = self.trainer
        moved = [a for a, k in sorted(cuts.items()) if t.cut(a) != k]
        for agent in moved:
            t.set_cut(agent, cuts[agent])
        return moved

    def evaluate(self) -> dict[str, Any]:
        return self.trainer.evaluate_global()

    def save(self, out_dir: Path) -> None:
        """Final weights: the server block and the global client block."""
        save_arrays(to_arrays(self.trainer.server, "server"), out_dir / "server.safetensors")
        save_arrays(self.trainer.global_client, out_dir / "client.safetensors")

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
        problem = t.weights_problem(client, ("client",))
        if problem is not None:
            raise CheckpointError(f"checkpoint client block: {problem}")
        load_strict(t.server, from_arrays(subset(arrays, "server"), "server"),
                    "checkpoint server block", CheckpointError)
        t.global_client = {k: np.array(v) for k, v in client.items()}
        load_optimizer_state(t.optimizer, "optimizer", arrays, meta.get("optimizer", {}))


class SplitMethod(Method):
    """Parallel split learning with a shared server block; subclasses pick the loss.

    Every split method trains per-device cuts the same way (server/cuts/completions.py): a shallow
    agent's activations pass its completion copy before `server_update`, and its gradient
    passes back through it; at round end each agent's device block plus its completion
    copy is one whole client block, so FedAvg over those is the layer-wise average."""

    aggregate_clients: ClassVar[bool] = True

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
                with t.books.timed("aggregate"):
                    t.global_client = t.defences.aggregate(
                        states, t.defences.sizes(sorted(states)), reference=t.global_client)
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
        return self.split_step(self.trainer.defences.batches(live), step)

    def split_step(self, batches: dict[str, int], step: int) -> float | None:
        """One split iteration for these agents: their forwards, screened by the defences,
        the server's update (through any completion layers), their backwards."""
        t = self.trainer
        agents, acts, labels = t.forward(batches, step)
        if not agents:
            return None
        agents, acts, labels = t.defences.screen(agents, acts, labels)
        if not agents:
            return None
        with t.server_compute():
            acts = t.completions.forward(agents, acts)
            loss, grads = self.server_update(agents, acts, labels)
            grads = t.completions.backward(grads)
        loss, host = t.read_step(loss, grads)  # one wait for the card, not two
        t.guard.check(loss, t.round, "server")  # before its gradients reach the clients
        t.backward(host, step)
        return loss

    def begin_round(self, selected: list[str]) -> None:  # noqa: B027 - optional hook
        """Before the first iteration (SplitFed V1 copies the server block here)."""

    def end_round(self, participants: list[str]) -> None:  # noqa: B027 - optional hook
        """After the last iteration, before client aggregation."""

    @abstractmethod
    def server_update(self, agents: list[str], acts: list[torch.Tensor],
                      labels: list[torch.Tensor]) -> tuple[float | torch.Tensor, Grads]:
        """The server's part of one step: its loss (a float, or a 0-dim tensor the trainer
        reads with the gradients) and each agent's gradient at its activations."""

"""GAPSL: PSL with leader-gradient identification and gradient-direction alignment
(its math in gapsl_math.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

from jetsplit.server.methods import gapsl_math
from jetsplit.server.methods.psl import (
    PSL,
    loss_weights,
    read,
    reduced,
    step_averaged,
    sum_of_client_losses,
    weighted,
)
from jetsplit.server.training.trainer import Arrays, Trainer


class GAPSL(PSL):
    """PSL with leader-gradient identification and gradient-direction alignment
    (the GAPSL paper §III, Algorithms 1–2): only directionally consistent clients' losses train
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
        o = self.options
        _, leaves, losses = sum_of_client_losses(t.server, t.optimizer, acts, labels)
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
            o.k_min, o.k_max, o.eta)
        self.last_selection = selection
        chosen = [int(i) for i in selection.selected]
        values = read(losses)
        scaled = weighted(losses, loss_weights(t.defences, agents, values))  # bounded influence
        shares = t.defences.share_weights(agents, torch.stack(per_client).norm(dim=1))
        if shares is not None:  # no device's share of the server gradient far over the rest
            scaled = [x * w for x, w in zip(scaled or losses, shares, strict=True)]
        server_loss = reduced(gapsl_math.gapsl_server_loss(scaled or losses, selection, o.lam),
                               len(chosen), s)
        grads = step_averaged(t.server, t.optimizer, losses, chosen, leaves, server_loss)
        return (sum(values) / len(values),
                {agents[i]: g for i, g in zip(chosen, grads, strict=True)})

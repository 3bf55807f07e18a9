"""SCALA and its ablations (CA-SFL, LLA-SFL, LLA-SFL on a shared server block): logit
adjustment by the label priors the clients registered (the math in scala_math.py)."""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np
import torch

from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.step_bounds import share_norms
from jetsplit.server.methods import scala_math
from jetsplit.server.methods.base import SplitMethod
from jetsplit.server.methods.splitfed import SplitFedV1
from jetsplit.server.training.trainer import Trainer

log = logging.getLogger("jetsplit.coordinator")


def registered_prior(defences: Defences, agent: str, classes: int) -> torch.Tensor:
    """P_k: the agent's local label distribution from the histogram it registered (SCALA
    eq. 15), or from the labels it sent once those show the claim wrong
    (server/defences/size_claims.LabelTally); uniform, with a warning, if that histogram is
    unusable (it is untrusted)."""
    try:
        return scala_math.prior_from_counts(defences.prior_counts(agent) or [], classes)
    except ValueError as exc:
        log.warning("agent %s: unusable label histogram (%s); uniform prior", agent, exc)
        return torch.full((classes,), 1.0 / classes)


class _RegisteredPriors:
    """The logit-adjusted methods' P_k, one per agent, from its registration."""

    trainer: Trainer
    num_classes: int

    def label_prior(self, agent: str) -> torch.Tensor:
        return registered_prior(self.trainer.defences, agent, self.num_classes)

    def step_priors(self, agents: list[str]) -> list[torch.Tensor]:
        """P_k of each agent on the server block's device, crossing in one transfer (on
        CUDA, one small pageable copy per agent would wait for the GPU each time)."""
        priors, device = torch.stack([self.label_prior(a) for a in agents]), self.trainer.device
        if device.type == "cuda":
            priors = priors.pin_memory()
        return list(priors.to(device, non_blocking=True).unbind())


class LLASFL(_RegisteredPriors, SplitFedV1):
    """LLA-SFL (SCALA's journal version §5.2): SplitFed V1 (a server-block copy per client, copies
    and client blocks FedAvg-ed every T iterations) with only the local logit adjustment:
    client k's copy steps on CE(s(A_k) + log P_k, Y_k), P_k its registered local label
    distribution. Differs from `splitfed-v1` in the loss alone."""

    name = "lla-sfl"

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        grads, losses = {}, []
        for agent, x, y in zip(agents, acts, labels, strict=True):
            self.copies[agent].train()
            loss, (grad,) = scala_math.lla_sfl_server_step(
                self.copies[agent], [x], [y], self.num_classes, self.optimizers[agent],
                client_priors=[self.label_prior(agent)])
            self.optimizers[agent].zero_grad(set_to_none=True)  # as SplitFed V1: freed now
            grads[agent] = grad
            losses.append(loss)
        return float(np.mean(losses)), grads


class _ScalaFamily(_RegisteredPriors, SplitMethod):
    """SCALA and its ablations: concatenated activations, logit adjustment (the SCALA
    paper (ICML) §3)."""

    adjusted: ClassVar[bool] = True  # takes client priors P_k (eq. 15)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        """One forward over every device's activations, each slice bounded by the
        defences (given the slices' losses, and under `gradient_shares = "all"` their
        shares of the server gradient), then the two backwards (scala_math)."""
        t, d = self.trainer, self.trainer.defences
        priors = self.step_priors(agents) if self.adjusted else None
        step = scala_math.concatenated_forward(t.server, acts, labels, self.num_classes,
                                               adjust=self.adjusted,
                                               tau=1.0 if self.adjusted else 0.0,
                                               client_priors=priors,
                                               labels_checked=True)  # by Trainer.forward
        weights = d.loss_weights(agents, step.slice_losses()) if d.weighs_losses else None
        terms = clipped = None
        if d.measures_shares:  # each device's share of ∇w_s, after the loss bound
            terms = step.terms(weights)
            norms = share_norms(terms, scala_math.server_params(t.server))
            clipped = d.share_weights(agents, norms)
        loss, grads = scala_math.concatenated_update(t.server, t.optimizer, step, weights,
                                                     clipped, terms)
        return loss, dict(zip(agents, grads, strict=True))


class SCALA(_ScalaFamily):
    """SCALA: P_s from the concatenated labels of the iteration (eq. 14), P_k from client
    k's local label distribution as it registered it (eq. 15)."""

    name = "scala"


class CASFL(_ScalaFamily):
    name = "ca-sfl"
    adjusted = False


class LLASFLShared(_RegisteredPriors, SplitMethod):
    """Variant: LLA-SFL's loss on ONE shared server block stepped every iteration on
    Σ_k (B_k/B)·L_k, i.e. SplitFed V1 averaged every iteration (see
    `scala_math.lla_sfl_server_step`); compare it with `splitfed-v1` only knowing that
    the aggregation period differs too."""

    name = "lla-sfl-shared"

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t = self.trainer
        loss, grads = scala_math.lla_sfl_server_step(
            t.server, acts, labels, self.num_classes, t.optimizer,
            client_priors=self.step_priors(agents))
        return loss, dict(zip(agents, grads, strict=True))

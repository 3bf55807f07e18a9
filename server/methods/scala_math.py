"""The server-side math of SCALA and its two ablations, with no I/O.

SCALA (Yang & Liu, the SCALA paper (ICML 2024) §3; SCALA's journal version §3, and its §5.2
for the ablations):

- the server concatenates the activations A = ∪A_k and labels Y = ∪Y_k of the selected
  clients (eqs 5–6), runs its block once on A and updates w_s on the logit-adjusted loss
  CE(s(x) + log P_s(y), y), P_s the label distribution of Y (eqs 7, 14);
- each client k gets G_k = ∇_{A_k} CE(s(x) + log P_k(y), y) with P_k its own label
  distribution (eqs 8, 15), taken from the SAME forward pass and the server weights that
  produced it (eq 9 differentiates at w_s^t, the weights before the update of eq 7).

Conventions shared by every step function here (where the paper leaves a choice open):

- G_k is the gradient of client k's own *mean* loss over its B_k samples, as eq 8 writes
  it (``l(w_s^t; A_k, Y_k)``, the empirical loss of client k, eq 2). It is NOT the slice of
  the gradient of the mean over the concatenated batch, which would be smaller by B_k / B
  (that is what `server.split_step` returns for plain PSL).
- P_k is client k's LOCAL label distribution (eq. 15, "the label distribution of client
  k"): the methods pass it as ``client_priors``, from the histogram each agent registers
  (`prior_from_counts`). Without ``client_priors`` the functions fall back to the labels
  client k sent this iteration (Y_k).
- Activations are detached and made leaves: nothing here reaches back into a client graph.
- The caller chooses train/eval mode of the server block; these functions do not touch it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

#: Floor for a class absent from the batch, added to P(y) before the log. This is what the
#: reference implementation of logit adjustment (Menon et al., ICLR 2021,
#: google-research/logit_adjustment: ``np.log(label_freq ** tau + 1e-12)``) and most of its
#: ports use. log(1e-12) ≈ −27.6, so an absent class keeps a softmax weight of about 1e-12
#: relative to a present one: numerically the same as P(y) = 0 (the class is left out of
#: the adjusted softmax, so a client is not pushed away from classes it never sees, which
#: is the point of eq 15), but finite, so no −inf and no inf − inf = NaN anywhere.
PRIOR_EPS = 1e-12


def label_prior(labels: torch.Tensor, num_classes: int, eps: float = PRIOR_EPS, *,
                dtype: torch.dtype = torch.float32, checked: bool = False) -> torch.Tensor:
    """Empirical label distribution P(y) of a batch (SCALA eqs 14–15), floored by `eps`.

    P(y) = (n_y / n + eps) / (1 + C·eps): every entry is > 0 so log P is finite, and the
    vector still sums to 1. Computed in float64, returned as `dtype` on `labels`' device.
    `checked`: the caller already range-checked these labels (the trainer does, on the host,
    for every forward reply), so their range is not read back from the device again.
    """
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {tuple(labels.shape)}")
    if labels.numel() == 0:
        raise ValueError("labels is empty: a label distribution needs at least one label")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 so that log P(y) is finite, got {eps}")
    labels = labels.long()
    if not checked:  # on CUDA a host read: skipped where the caller checked on the host
        lo, hi = torch.stack((labels.min(), labels.max())).tolist()  # one read, not two
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes - 1}], got [{lo}, {hi}]")
    # Counted by index_add_, not bincount: on CUDA bincount reads min and max to the host
    # again to size its output. Whole numbers in float64: the same counts, bit for bit.
    counts = torch.zeros(num_classes, dtype=torch.float64, device=labels.device).index_add_(
        0, labels, torch.ones(labels.shape, dtype=torch.float64, device=labels.device))
    prior = (counts / labels.numel() + eps) / (1.0 + num_classes * eps)
    return prior.to(dtype)


def prior_from_counts(counts: Sequence[int], num_classes: int, eps: float = PRIOR_EPS, *,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """P(y) from per-class counts (a client's registered label histogram), floored exactly
    as `label_prior`. Raises ValueError unless there are `num_classes` counts, all >= 0,
    with a positive total."""
    if len(counts) != num_classes:
        raise ValueError(f"{len(counts)} class counts for {num_classes} classes")
    c = torch.tensor([float(v) for v in counts], dtype=torch.float64)
    if not bool(torch.isfinite(c).all()) or bool((c < 0).any()) or float(c.sum()) <= 0:
        raise ValueError("class counts must be finite, >= 0 and not all zero")
    return ((c / c.sum() + eps) / (1.0 + num_classes * eps)).to(dtype)


def logit_adjusted_ce(logits: torch.Tensor, labels: torch.Tensor, prior: torch.Tensor,
                      tau: float = 1.0) -> torch.Tensor:
    """Mean CE(logits + τ·log P, labels): SCALA eqs 14/15 (τ = 1), Menon et al.'s loss.

    The log is taken in at least float32 (1e-12 underflows in half precision) and then cast
    to the logits' dtype.
    """
    if prior.ndim != 1 or prior.shape[0] != logits.shape[-1]:
        raise ValueError(f"prior has shape {tuple(prior.shape)}, logits have "
                         f"{logits.shape[-1]} classes")
    log_prior = torch.log(prior.to(torch.promote_types(prior.dtype, torch.float32)))
    shift = (tau * log_prior).to(device=logits.device, dtype=logits.dtype)
    return F.cross_entropy(logits + shift, labels)


def _leaves(activations: Sequence[torch.Tensor],
            labels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Check one label vector per activation batch, and detach the activations as leaves."""
    if len(activations) != len(labels):
        raise ValueError(f"{len(activations)} activation batches but {len(labels)} label sets")
    if not activations:
        raise ValueError("no clients: activations is empty")
    for k, (a, y) in enumerate(zip(activations, labels, strict=True)):
        if a.shape[0] == 0:
            raise ValueError(f"client {k} sent an empty batch")
        if y.ndim != 1 or y.shape[0] != a.shape[0]:
            raise ValueError(f"client {k}: {a.shape[0]} activations but labels of shape "
                             f"{tuple(y.shape)}")
    return [a.detach().requires_grad_(True) for a in activations]


def _prior_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _client_priors(labels: Sequence[torch.Tensor], num_classes: int, logits: torch.Tensor,
                   given: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if given is None:
        return [label_prior(y, num_classes, dtype=_prior_dtype(logits)) for y in labels]
    if len(given) != len(labels):
        raise ValueError(f"{len(given)} client priors for {len(labels)} clients")
    return list(given)


def server_params(server: nn.Module) -> list[nn.Parameter]:
    return [p for p in server.parameters() if p.requires_grad]


def _finish(server: nn.Module, optimizer: torch.optim.Optimizer, server_loss: torch.Tensor,
            client_losses: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Client gradients first (w_s^t, eq 9), then the server update from `server_loss`.
    The loss comes back as a 0-dim tensor: read it when the step's gradients are read."""
    grads = [g.detach() for g in torch.autograd.grad(
        torch.stack(list(client_losses)).sum(), list(leaves), retain_graph=True)]
    loss = server_loss.detach()
    optimizer.zero_grad(set_to_none=True)
    params = server_params(server)
    if params:
        torch.autograd.backward(server_loss, inputs=params)
    optimizer.step()
    return loss, grads


def _read(loss: torch.Tensor, grads: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """A whole step's (loss as a float, client gradients), as the step functions return."""
    return float(loss), grads


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (scores, targets) → mean loss


def slice_losses(loss_fn: Loss, scores: torch.Tensor, targets: torch.Tensor,
                 sizes: list[int]) -> list[float]:
    """Each slice's mean loss, measured without a graph, in one host read: what the loss
    bound is shown (server/defences/step_bounds.LossBound)."""
    with torch.no_grad():
        seen = [loss_fn(s, t) for s, t in zip(scores.detach().split(sizes),
                                              targets.split(sizes), strict=True)]
    return torch.stack(seen).tolist()


def slice_terms(loss_fn: Loss, scores: torch.Tensor, targets: torch.Tensor, sizes: list[int],
                weights: Sequence[float] | None) -> list[torch.Tensor]:
    """Each slice's weighted mean loss w_k·L_k (w_k = 1 without weights), with its graph:
    the terms whose gradients are each device's share of the server gradient
    (step_bounds.share_norms), per sample, since a slice's batch share already follows its
    capped size."""
    return [w * loss_fn(s, t) for w, s, t in zip(
        weights or [1.0] * len(sizes), scores.split(sizes), targets.split(sizes), strict=True)]


def weighted_loss(loss_fn: Loss, scores: torch.Tensor, targets: torch.Tensor,
                  sizes: list[int], weights: Sequence[float] | None,
                  clipped: Sequence[float] | None = None,
                  terms: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
    """A concatenated batch's loss with each device's slice weighted: Σ_k w_k·B_k·L_k / B
    (the plain mean loss when every w_k = 1); with the gradient bound's `clipped` c_k,
    measured on the `terms` w_k·L_k (`slice_terms`), Σ_k c_k·B_k·(w_k·L_k) / B (so too
    wherever `terms` were measured). None when neither weighs anybody: the caller keeps
    its unweighted loss, bit for bit. The one weighted concatenated loss: SCALA's family
    and SHeRL-FL's cloud head step on it."""
    if clipped is None and weights is None:
        return None
    if terms is None and clipped is not None:
        terms = slice_terms(loss_fn, scores, targets, sizes, weights)
    if terms is None:
        slices = zip(weights or (), sizes, scores.split(sizes), targets.split(sizes),
                     strict=True)
        return sum(w * n * loss_fn(s, t) for w, n, s, t in slices) / sum(sizes)
    return sum(c * n * m for c, n, m in zip(clipped or [1.0] * len(sizes), sizes, terms,
                                             strict=True)) / sum(sizes)


@dataclass
class ConcatenatedForward:
    """One forward of the server block on the concatenation (eqs 5–6): the per-slice
    client losses (eqs 8, 15), the server loss (eqs 7, 14) and what a bound is shown."""

    leaves: list[torch.Tensor]
    sizes: list[int]
    logits: torch.Tensor
    labels: torch.Tensor
    server_ce: Loss  # the server's loss on any slice (adjusted by P_s, or plain CE)
    server_loss: torch.Tensor
    client_losses: list[torch.Tensor]

    def slice_losses(self) -> list[float]:
        """Each device's server loss on its slice, L^s_k (the loss bound's input)."""
        return slice_losses(self.server_ce, self.logits, self.labels, self.sizes)

    def terms(self, weights: Sequence[float] | None) -> list[torch.Tensor]:
        """w_k·L^s_k with its graph (the gradient bound measures each one's share)."""
        return slice_terms(self.server_ce, self.logits, self.labels, self.sizes, weights)


def concatenated_forward(server: nn.Module, activations: Sequence[torch.Tensor],
                         labels: Sequence[torch.Tensor], num_classes: int, *, adjust: bool,
                         tau: float = 1.0,
                         client_priors: Sequence[torch.Tensor] | None = None,
                         labels_checked: bool = False) -> ConcatenatedForward:
    """The forward of SCALA's step (CA-SFL's with `adjust` False: plain CE in both places).

    L_k, client k's mean loss on its slice of the logits, under P_k (`client_priors`, else
    the labels it sent); the server loss under P_s, the concatenation's label distribution.
    `labels_checked`: every label is known to lie in [0, num_classes) (see `label_prior`).
    """
    leaves = _leaves(activations, labels)
    sizes = [a.shape[0] for a in leaves]
    y = torch.cat([t.to(leaves[0].device) for t in labels])
    logits = server(torch.cat(leaves))
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise ValueError(f"server output has shape {tuple(logits.shape)}, expected "
                         f"(batch, {num_classes})")
    prior = label_prior(y, num_classes, dtype=_prior_dtype(logits),
                        checked=labels_checked) if adjust else None

    def server_ce(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(scores, targets) if prior is None else \
            logit_adjusted_ce(scores, targets, prior, tau)

    server_loss = server_ce(logits, y)
    if adjust:
        priors = _client_priors([t.to(y.device) for t in labels], num_classes, logits,
                                client_priors)
        client_losses = [logit_adjusted_ce(s, t, p, tau) for s, t, p in
                         zip(logits.split(sizes), y.split(sizes), priors, strict=True)]
    else:
        client_losses = [F.cross_entropy(s, t) for s, t in
                         zip(logits.split(sizes), y.split(sizes), strict=True)]
    return ConcatenatedForward(leaves, sizes, logits, y, server_ce, server_loss, client_losses)


def concatenated_update(server: nn.Module, optimizer: torch.optim.Optimizer,
                        forward: ConcatenatedForward, weights: Sequence[float] | None = None,
                        clipped: Sequence[float] | None = None,
                        terms: Sequence[torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The two backward passes of the step `forward` began, and the server update; the
    server loss as a 0-dim tensor (on CUDA, reading it is a wait for the card).

    Backward 1 (client part, retain_graph): ∇_{A_k} Σ_j L_j. Without batch-coupling layers
    L_j depends on A_k only for j = k, so this is exactly ∇_{A_k} L_k (eq 8); with
    BatchNorm in train mode it also carries the cross-client terms through the batch
    statistics, as a backward through any concatenated loss does. Backward 2 (server
    part): ∇_{w_s} of the server loss. Both are taken at the forward's weights; only then
    does the optimizer step (eq 7).

    `weights` (the loss bound's w_k, given the slices' losses) and `clipped` (the
    gradient bound's c_k, given the norms of the `terms` w_k·L^s_k) make the server loss
    `weighted_loss`: a down-weighted client steers w_s less. Both None: the unweighted
    loss, bit for bit. The clients' own gradients G_k are not weighted.
    """
    f = forward
    weighted = weighted_loss(f.server_ce, f.logits, f.labels, f.sizes, weights, clipped, terms)
    server_loss = f.server_loss if weighted is None else weighted  # rare: over a bound
    return _finish(server, optimizer, server_loss, f.client_losses, f.leaves)


def scala_server_step(server: nn.Module, activations: list[torch.Tensor],
                      labels: list[torch.Tensor], num_classes: int,
                      optimizer: torch.optim.Optimizer, *, tau: float = 1.0,
                      client_priors: Sequence[torch.Tensor] | None = None,
                      ) -> tuple[float, list[torch.Tensor]]:
    """SCALA's server iteration (Algorithm 2, lines 14–16; eqs 5–8, 14, 15), unweighted.

    Concatenate, forward once, update w_s on CE(s + τ·log P_s, Y) (eq 14, P_s from the
    concatenated labels) and return, per client in input order, G_k = ∇_{A_k} of client
    k's mean CE(s_k + τ·log P_k, Y_k) (eq 15, P_k from Y_k unless `client_priors` is given),
    computed at the pre-update weights. Returns (server loss, [G_k]).
    """
    forward = concatenated_forward(server, activations, labels, num_classes, adjust=True,
                                   tau=tau, client_priors=client_priors)
    return _read(*concatenated_update(server, optimizer, forward))


def ca_sfl_server_step(server: nn.Module, activations: list[torch.Tensor],
                       labels: list[torch.Tensor], num_classes: int,
                       optimizer: torch.optim.Optimizer) -> tuple[float, list[torch.Tensor]]:
    """CA-SFL ablation (journal §5.2, "SFL enabled only with Concatenated Activations").

    Same as `scala_server_step` with plain CE in both places: w_s is updated on the mean CE
    over the concatenation, and G_k = ∇_{A_k} of client k's mean plain CE (eq 8 scaling,
    i.e. B / B_k times the slice of the concatenated-mean gradient).
    """
    forward = concatenated_forward(server, activations, labels, num_classes, adjust=False,
                                   tau=0.0)
    return _read(*concatenated_update(server, optimizer, forward))


def lla_sfl_server_step(server: nn.Module, activations: list[torch.Tensor],
                        labels: list[torch.Tensor], num_classes: int,
                        optimizer: torch.optim.Optimizer, *, tau: float = 1.0,
                        client_priors: Sequence[torch.Tensor] | None = None,
                        ) -> tuple[float, list[torch.Tensor]]:
    """LLA-SFL ablation (journal §5.2, "SFL with only Local Logit Adjustments").

    The journal builds it on SplitFedV1 (no concatenation: each client's activations meet
    the server block on their own) and applies only the local adjustment of eq 15 ("clients
    in LLA-SFL lack access to the global label distribution"), so there is no P_s loss:

    - one forward of the server block per client, on A_k alone (so BatchNorm statistics
      are per client, as in SplitFedV1's per-client server copies);
    - L_k = CE(s(A_k) + τ·log P_k, Y_k), mean over client k's batch; G_k = ∇_{A_k} L_k;
    - w_s takes ONE step on Σ_k (B_k / B)·L_k. With plain SGD this equals FedAvg
      (weights |D_k| ∝ B_k, eq 3/10) of per-client server copies that each took one step
      on their own L_k — SplitFedV1 aggregated every iteration. The paper does not say how
      a single shared block is updated; for SplitFedV1's exact schedule (copies averaged
      every T iterations) call this once per client with that client's copy and optimizer
      (with one client the weight is 1).

    Both gradients are taken at the pre-update weights. Returns (Σ_k (B_k/B)·L_k, [G_k]).
    """
    leaves = _leaves(activations, labels)
    total = sum(a.shape[0] for a in leaves)
    logits = [server(a) for a in leaves]
    for s in logits:
        if s.ndim != 2 or s.shape[1] != num_classes:
            raise ValueError(f"server output has shape {tuple(s.shape)}, expected "
                             f"(batch, {num_classes})")
    ys = [t.to(s.device) for t, s in zip(labels, logits, strict=True)]
    priors = _client_priors(ys, num_classes, logits[0], client_priors)
    losses = [logit_adjusted_ce(s, t, p, tau) for s, t, p in
              zip(logits, ys, priors, strict=True)]
    server_loss = torch.stack([loss * (a.shape[0] / total)
                               for loss, a in zip(losses, leaves, strict=True)]).sum()
    return _read(*_finish(server, optimizer, server_loss, losses, leaves))

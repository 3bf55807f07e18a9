"""The server-side math of GAPSL (Lin et al., the GAPSL paper §III, eqs 1–8, Algorithms
1–2), on flattened per-client server-block gradients, with no I/O.

Per iteration, with g_i the gradient of client i's loss L_i w.r.t. the server block
(one row of a (S, P) tensor):

- Leader gradient identification (LGI, Algorithm 1): consistency score θ_i = mean angle to
  the other clients (eq 1); ν = std(θ) and its running min/max; selection ratio K^t (eq 2);
  leaders = the ⌈K^t·S⌉ lowest θ (eq 3); g_lead = their mean (eq 4).
- Gradient direction alignment (GDA, Algorithm 2): θ_lead,i = angle(g_i, g_lead) (eq 5);
  θ_th = clip(μ − η·σ, 0, π/2) over all S values of θ_lead (eq 6); selected = {i :
  θ_lead,i ≤ θ_th}; L_g = Σ_selected L_i + λ(1 − cos θ_lead,i) (eqs 7–8).

Choices where the paper is silent, and why:

- Std is the population std (divide by S). The scores are the whole set of participating
  clients this round, not a sample, and it is defined for S = 1 (the sample std of one
  value is NaN and would poison K^t). `torch.std` defaults to the sample std, so this is
  explicit.
- A zero gradient has no direction: its cosine with anything is taken as 0 (θ = π/2,
  "unrelated"), never NaN. Cosines are clamped into [−1, 1] before arccos (float rounding
  makes cos(g, 3g) = 1 + 1.2e-7 in float32).
- Angles are computed from the (S, S) Gram matrix in the gradients' dtype (half types are
  promoted to float32), then in float64. arccos is steep near ±1, so two float32
  gradients that are parallel to 1e-7 can read as ~5e-4 rad apart.
- Ties in θ are broken by client index (stable sort); index tensors are returned sorted by
  client index.
- With a single client θ = 0 (there is no other gradient to disagree with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: ⌈K·S⌉ is taken as ⌈K·S − 1e-9⌉ so that float products like 0.3·10 = 3.0000000000000004
#: do not add a leader.
_CEIL_SLACK = 1e-9
#: θ_lead,i ≤ θ_th is tested with this slack (radians) so that a client exactly at the
#: threshold (e.g. all θ_lead equal, σ = 0) is not lost to float rounding in μ.
_THRESHOLD_SLACK = 1e-12


def _gram_dtype(grads: torch.Tensor) -> torch.dtype:
    return torch.promote_types(grads.dtype, torch.float32)


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos between every row of `a` (n, P) and of `b` (m, P), float64, in [−1, 1]; 0 where
    either row is the zero vector."""
    dtype = _gram_dtype(a)
    a, b = a.to(dtype), b.to(dtype)
    dots = (a @ b.T).to(torch.float64)
    na = torch.linalg.vector_norm(a, dim=1).to(torch.float64)
    nb = torch.linalg.vector_norm(b, dim=1).to(torch.float64)
    denom = na[:, None] * nb[None, :]
    ok = denom > 0
    cos = torch.where(ok, dots / torch.where(ok, denom, torch.ones_like(denom)),
                      torch.zeros_like(dots))
    return cos.clamp(-1.0, 1.0)


def _check_grads(grads: torch.Tensor) -> None:
    if grads.ndim != 2 or grads.shape[0] == 0:
        raise ValueError(f"grads must be (S, P) with S >= 1, got {tuple(grads.shape)}")


def consistency_scores(grads: torch.Tensor) -> torch.Tensor:
    """θ_i = 1/(S−1) Σ_{j≠i} arccos cos(g_i, g_j): eq 1 / Algorithm 1 line 4.

    The mean runs over the S − 1 OTHER clients, as eq 1 writes it (the self-angle 0 is not
    averaged in). Lower θ_i = more consistent with the rest. Returns (S,) float64.
    """
    _check_grads(grads)
    s = grads.shape[0]
    if s == 1:
        return torch.zeros(1, dtype=torch.float64, device=grads.device)
    angles = torch.arccos(_cosines(grads, grads))
    angles.fill_diagonal_(0.0)
    return angles.sum(dim=1) / (s - 1)


def dispersion(scores: torch.Tensor) -> float:
    """ν(θ) = population std of the consistency scores (Algorithm 1 line 11)."""
    return float(scores.to(torch.float64).std(correction=0))


@dataclass
class NuTracker:
    """Running ν_min^t / ν_max^t over iterations (Algorithm 1 lines 12–13)."""

    nu_min: float = math.inf
    nu_max: float = -math.inf

    def update(self, nu: float) -> None:
        """Fold this iteration's ν in (before K^t is computed, as Algorithm 1 orders it)."""
        if not math.isfinite(nu):
            raise ValueError(f"nu must be finite, got {nu}")
        self.nu_min = min(self.nu_min, nu)
        self.nu_max = max(self.nu_max, nu)


def leader_fraction(t: int, total: int, nu: float, nu_min: float, nu_max: float,
                    k_min: float = 0.2, k_max: float = 0.8) -> float:
    """K^t = K_min + (t/T)·(ν_max − ν)/(ν_max − ν_min)·(K_max − K_min): eq 2.

    This is exactly the paper's form, T being the scheduled total number of training
    rounds (iterations), t the current one (1-based in the paper). The stability ratio is
    1 when ν_max = ν_min (our choice: the paper leaves 0/0 undefined). t/T and the ratio
    are clamped into [0, 1] (the paper: the ratio "maps ... into a normalized range
    [0, 1]"), so K^t always lies in [K_min, K_max].
    """
    if total <= 0:
        raise ValueError(f"total must be > 0, got {total}")
    if not 0.0 <= k_min <= k_max <= 1.0:
        raise ValueError(f"need 0 <= k_min <= k_max <= 1, got {k_min}, {k_max}")
    span = nu_max - nu_min
    ratio = (nu_max - nu) / span if math.isfinite(span) and span > 0 else 1.0
    ratio = min(max(ratio, 0.0), 1.0)
    progress = min(max(t / total, 0.0), 1.0)
    return k_min + progress * ratio * (k_max - k_min)


def leader_set(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices of the ⌈fraction·S⌉ lowest-θ clients, at least 1 and at most S (eq 3).

    Ties go to the lower client index; returned sorted by client index (int64).
    """
    if scores.ndim != 1 or scores.shape[0] == 0:
        raise ValueError(f"scores must be a non-empty 1-D tensor, got {tuple(scores.shape)}")
    s = scores.shape[0]
    count = min(max(math.ceil(fraction * s - _CEIL_SLACK), 1), s)
    order = torch.sort(scores, stable=True).indices[:count]
    return torch.sort(order).values


def leader_gradient(grads: torch.Tensor, leaders: torch.Tensor) -> torch.Tensor:
    """g_lead = mean of the leaders' gradients (eq 4)."""
    _check_grads(grads)
    if leaders.numel() == 0:
        raise ValueError("the leader set is empty")
    return grads[leaders.to(device=grads.device, dtype=torch.long)].mean(dim=0)


def threshold(theta_lead: torch.Tensor, eta: float) -> float:
    """θ_th = max(min(μ − η·σ, π/2), 0) over θ_lead of ALL S clients (eq 6).

    σ is the population std (see the module docstring).
    """
    if theta_lead.ndim != 1 or theta_lead.shape[0] == 0:
        raise ValueError(f"theta_lead must be a non-empty 1-D tensor, got "
                         f"{tuple(theta_lead.shape)}")
    x = theta_lead.to(torch.float64)
    value = float(x.mean()) - eta * float(x.std(correction=0))
    return max(min(value, math.pi / 2), 0.0)


def passing(theta_lead: torch.Tensor, theta_th: float) -> torch.Tensor:
    """Ŝ^t = {i : θ_lead,i ≤ θ_th} (Algorithm 2 line 16), int64 indices sorted.

    Compared with a 1e-12 rad slack: when every θ_lead,i is the same angle, μ − η·σ can
    land an ulp or two below it through rounding in μ and σ, and nobody would pass.
    """
    return torch.nonzero(theta_lead <= theta_th + _THRESHOLD_SLACK).flatten()


@dataclass
class GapslSelection:
    """Everything one GAPSL selection decided (float64 tensors unless said otherwise)."""

    scores: torch.Tensor  # θ_i, (S,)
    nu: float  # ν = std(θ)
    k_t: float  # selection ratio K^t
    leaders: torch.Tensor  # int64 indices, sorted
    g_lead: torch.Tensor  # (P,), the gradients' dtype
    theta_lead: torch.Tensor  # θ_lead,i for all S clients, (S,)
    theta_th: float
    selected: torch.Tensor  # int64 indices, sorted; the leaders if nobody passed
    alignment_penalty: torch.Tensor  # 1 − cos θ_lead,i for `selected`, same order
    fallback: bool  # True when nobody passed θ_th and the leader set was used


def select_clients(grads: torch.Tensor, t: int, total: int, tracker: NuTracker,
                   k_min: float = 0.2, k_max: float = 0.8, eta: float = 0.0,
                   ) -> GapslSelection:
    """Algorithms 1 and 2 up to the loss: scores, ν (folded into `tracker`), K^t, leaders,
    g_lead, θ_lead, θ_th and the selected clients with their alignment penalties.

    `eta` has no value in the paper; the default 0 puts θ_th at the mean angle (set it from
    the run's config). If no client passes θ_th, the leader set is used (our choice; the
    paper does not say what happens then).
    """
    _check_grads(grads)
    scores = consistency_scores(grads)
    nu = dispersion(scores)
    tracker.update(nu)
    k_t = leader_fraction(t, total, nu, tracker.nu_min, tracker.nu_max, k_min, k_max)
    leaders = leader_set(scores, k_t)
    g_lead = leader_gradient(grads, leaders)
    cos_lead = _cosines(grads, g_lead[None, :])[:, 0]
    theta_lead = torch.arccos(cos_lead)
    theta_th = threshold(theta_lead, eta)
    passed = passing(theta_lead, theta_th)
    fallback = passed.numel() == 0
    selected = leaders.to(passed.device) if fallback else passed
    return GapslSelection(scores=scores, nu=nu, k_t=k_t, leaders=leaders, g_lead=g_lead,
                          theta_lead=theta_lead, theta_th=theta_th, selected=selected,
                          alignment_penalty=1.0 - cos_lead[selected], fallback=fallback)


def gapsl_server_loss(losses: list[torch.Tensor], selection: GapslSelection,
                      lam: float = 5e-4) -> torch.Tensor:
    """L_g = Σ_{i ∈ selected} L_i + λ(1 − cos θ_lead,i) (eqs 7–8; a sum, not a mean).

    `losses` holds every client's L_i in the same order as the rows of the gradients. The
    cosines are constants (the paper's first-order implementation, footnote 6, and
    docs/methods.md), so the penalty changes the VALUE of L_g but adds nothing to its gradient:
    ∇L_g = Σ_selected ∇L_i. The exact double-backprop variant is not implemented here.
    """
    s = selection.scores.shape[0]
    if len(losses) != s:
        raise ValueError(f"{len(losses)} losses for {s} clients")
    chosen = [losses[int(i)] for i in selection.selected]
    total = torch.stack(chosen).sum()
    penalty = lam * float(selection.alignment_penalty.sum())
    return total + torch.as_tensor(penalty, dtype=total.dtype, device=total.device)

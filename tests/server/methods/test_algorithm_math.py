"""SCALA and GAPSL server math pinned against hand computation: closed forms written out
here (softmax − one-hot for CE gradients, plane angles via atan2 for GAPSL), never the
functions under test."""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from jetsplit.server.methods.gapsl_math import (
    GapslSelection,
    NuTracker,
    consistency_scores,
    gapsl_server_loss,
    leader_fraction,
    leader_gradient,
    leader_set,
    passing,
    select_clients,
    threshold,
)
from jetsplit.server.methods.scala_math import (
    PRIOR_EPS,
    ca_sfl_server_step,
    label_prior,
    lla_sfl_server_step,
    logit_adjusted_ce,
    prior_from_counts,
    scala_server_step,
)

pytestmark = pytest.mark.fast  # pure tensor math: part of the fast tier

D = torch.float64
PI = math.pi

# ---------------------------------------------------------------- SCALA: priors and loss


def test_label_prior_tiny_batch() -> None:
    p = label_prior(torch.tensor([0, 0, 2, 1]), 4)
    assert p.dtype == torch.float32
    assert p[:3].tolist() == pytest.approx([0.5, 0.25, 0.25], abs=1e-9)
    assert 0 < p[3].item() < 1e-11  # the absent class is floored, not zero
    assert math.isfinite(torch.log(p[3]).item())
    assert torch.log(p[3]).item() == pytest.approx(math.log(PRIOR_EPS), rel=1e-3)
    assert float(p.double().sum()) == pytest.approx(1.0, abs=1e-7)


def test_label_prior_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        label_prior(torch.tensor([], dtype=torch.long), 3)
    with pytest.raises(ValueError, match="lie in"):
        label_prior(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="eps"):
        label_prior(torch.tensor([0]), 3, eps=0.0)


def _adjusted_ce_by_hand(logits: list[list[float]], labels: list[int],
                         prior: list[float], tau: float = 1.0) -> float:
    """mean −log( P(y)^τ e^{s_y} / Σ_c P(c)^τ e^{s_c} ): eqs 14/15 written out."""
    total = 0.0
    for row, y in zip(logits, labels, strict=True):
        w = [(p ** tau) * math.exp(s) if p > 0 else 0.0 for s, p in zip(row, prior,
                                                                         strict=True)]
        total += -math.log(w[y] / sum(w))
    return total / len(labels)


def test_logit_adjusted_ce_is_ce_of_shifted_logits() -> None:
    logits = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]]
    prior = [0.5, 0.25, 0.25]
    got = logit_adjusted_ce(torch.tensor(logits, dtype=D), torch.tensor([0, 2]),
                            torch.tensor(prior, dtype=D))
    assert got.item() == pytest.approx(_adjusted_ce_by_hand(logits, [0, 2], prior), rel=1e-12)
    # τ scales log P (Menon et al.): τ = 2 squares the prior, τ = 0 is plain CE
    got2 = logit_adjusted_ce(torch.tensor(logits, dtype=D), torch.tensor([0, 2]),
                             torch.tensor(prior, dtype=D), tau=2.0)
    assert got2.item() == pytest.approx(_adjusted_ce_by_hand(logits, [0, 2], prior, 2.0),
                                        rel=1e-12)
    got0 = logit_adjusted_ce(torch.tensor(logits, dtype=D), torch.tensor([0, 2]),
                             torch.tensor(prior, dtype=D), tau=0.0)
    assert got0.item() == pytest.approx(
        _adjusted_ce_by_hand(logits, [0, 2], [1.0, 1.0, 1.0]), rel=1e-12)
    assert got.item() != pytest.approx(got0.item(), rel=1e-3)


def test_floored_prior_acts_like_an_excluded_class() -> None:
    # class 2 absent: with the 1e-12 floor the loss equals the one with P(2) = 0 exactly
    logits = [[1.0, 2.0, 5.0]]
    p = label_prior(torch.tensor([0, 1, 1]), 3, dtype=D)
    got = logit_adjusted_ce(torch.tensor(logits, dtype=D), torch.tensor([0]), p).item()
    assert got == pytest.approx(_adjusted_ce_by_hand(logits, [0], [1 / 3, 2 / 3, 0.0]),
                                rel=1e-9)


# ---------------------------------------------------------------- SCALA: server steps

W0 = [[0.5, -1.0], [1.5, 0.25], [-0.5, 1.0]]
B0 = [0.1, -0.2, 0.3]
# client 0 has classes {0, 1}, client 1 has {1, 2}: P_0, P_1 and P_s all differ
A_LIST = [[[1.0, 2.0], [0.5, -1.0], [-1.5, 0.5]], [[2.0, 0.0], [-0.5, -0.5]]]
Y_LIST = [[0, 1, 0], [2, 1]]
P_CLIENT = [[2 / 3, 1 / 3, 0.0], [0.0, 0.5, 0.5]]
P_SERVER = [2 / 5, 2 / 5, 1 / 5]


def _linear() -> nn.Linear:
    lin = nn.Linear(2, 3).to(D)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(W0, dtype=D))
        lin.bias.copy_(torch.tensor(B0, dtype=D))
    return lin


def _inputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.tensor(a, dtype=D) for a in A_LIST], [torch.tensor(y) for y in Y_LIST])


def _logits_by_hand(a: list[float]) -> list[float]:
    return [sum(w * x for w, x in zip(row, a, strict=True)) + b
            for row, b in zip(W0, B0, strict=True)]


def _residual(a: list[float], y: int, prior: list[float] | None) -> list[float]:
    """softmax(s + log P) − onehot(y): the gradient of adjusted CE w.r.t. the logits."""
    s = _logits_by_hand(a)
    w = [math.exp(v) * (1.0 if prior is None else p) for v, p in
         zip(s, prior or [1.0] * 3, strict=True)]
    z = sum(w)
    return [wc / z - (1.0 if c == y else 0.0) for c, wc in enumerate(w)]


def _grad_a_by_hand(k: int, prior: list[float] | None) -> list[list[float]]:
    """∇_{A_k} of client k's mean loss: (1/B_k)·(softmax(s + log P) − onehot) · W."""
    out = []
    for a, y in zip(A_LIST[k], Y_LIST[k], strict=True):
        r = _residual(a, y, prior)
        out.append([sum(r[c] * W0[c][j] for c in range(3)) / len(A_LIST[k])
                    for j in range(2)])
    return out


def _sgd_by_hand(lr: float, prior_of: list[list[float] | None],
                 weight_of: list[float]) -> tuple[list[list[float]], list[float]]:
    """One SGD step on Σ_k weight_k · mean_k CE(s + log P_k): the closed-form
    ∇_W = Σ_i weight · (q_i − e_{y_i}) a_i^T / B_k, ∇_b = Σ_i weight · (q_i − e_{y_i}) / B_k."""
    gw = [[0.0, 0.0] for _ in range(3)]
    gb = [0.0, 0.0, 0.0]
    for k in range(2):
        for a, y in zip(A_LIST[k], Y_LIST[k], strict=True):
            r = _residual(a, y, prior_of[k])
            scale = weight_of[k] / len(A_LIST[k])
            for c in range(3):
                gb[c] += scale * r[c]
                for j in range(2):
                    gw[c][j] += scale * r[c] * a[j]
    return ([[W0[c][j] - lr * gw[c][j] for j in range(2)] for c in range(3)],
            [B0[c] - lr * gb[c] for c in range(3)])


def _flat_loss_by_hand(prior: list[float] | None) -> float:
    rows = [_logits_by_hand(a) for k in range(2) for a in A_LIST[k]]
    labels = [y for k in range(2) for y in Y_LIST[k]]
    return _adjusted_ce_by_hand(rows, labels, prior or [1.0, 1.0, 1.0])


def test_scala_server_loss_uses_the_concatenated_prior() -> None:
    server = _linear()
    acts, labels = _inputs()
    loss, _ = scala_server_step(server, acts, labels, 3, torch.optim.SGD(server.parameters(),
                                                                         lr=0.0))
    assert loss == pytest.approx(_flat_loss_by_hand(P_SERVER), rel=1e-9)
    assert loss != pytest.approx(_flat_loss_by_hand(None), rel=1e-3)


def test_scala_client_gradients_use_each_clients_own_prior() -> None:
    server = _linear()
    acts, labels = _inputs()
    # lr = 1 moves the weights a lot: the gradients must still be the pre-step ones
    _, grads = scala_server_step(server, acts, labels, 3,
                                 torch.optim.SGD(server.parameters(), lr=1.0))
    assert [tuple(g.shape) for g in grads] == [(3, 2), (2, 2)]
    for k in range(2):
        expected = torch.tensor(_grad_a_by_hand(k, P_CLIENT[k]), dtype=D)
        torch.testing.assert_close(grads[k], expected, rtol=1e-9, atol=1e-11)
        # and NOT the gradient that the concatenated prior P_s would give
        with_ps = torch.tensor(_grad_a_by_hand(k, P_SERVER), dtype=D)
        assert (grads[k] - with_ps).abs().max() > 1e-3
    # the same via autograd on hand-built per-client losses at the original weights
    for k in range(2):
        a = acts[k].clone().requires_grad_(True)
        s = a @ torch.tensor(W0, dtype=D).T + torch.tensor(B0, dtype=D)
        shifted = s + torch.log(torch.tensor(P_CLIENT[k], dtype=D) + 1e-300)
        (ref,) = torch.autograd.grad(F.cross_entropy(shifted, labels[k]), a)
        torch.testing.assert_close(grads[k], ref, rtol=1e-9, atol=1e-11)


def test_scala_updates_the_server_on_the_concatenated_prior_loss() -> None:
    server = _linear()
    acts, labels = _inputs()
    scala_server_step(server, acts, labels, 3, torch.optim.SGD(server.parameters(), lr=0.5))
    # mean over all 5 samples = Σ_k (B_k / B) · mean_k, all with P_s
    w, b = _sgd_by_hand(0.5, [P_SERVER, P_SERVER], [3 / 5, 2 / 5])
    torch.testing.assert_close(server.weight.detach(), torch.tensor(w, dtype=D),
                               rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(server.bias.detach(), torch.tensor(b, dtype=D),
                               rtol=1e-9, atol=1e-11)
    # a step on the per-client priors would land elsewhere
    w_k, _ = _sgd_by_hand(0.5, [P_CLIENT[0], P_CLIENT[1]], [3 / 5, 2 / 5])
    assert (server.weight.detach() - torch.tensor(w_k, dtype=D)).abs().max() > 1e-3


def test_scala_does_not_reach_into_the_client_graph() -> None:
    server = _linear()
    wc = torch.eye(2, dtype=D, requires_grad=True)
    acts = [torch.tensor(a, dtype=D) @ wc for a in A_LIST]
    _, grads = scala_server_step(server, acts, _inputs()[1], 3,
                                 torch.optim.SGD(server.parameters(), lr=0.1))
    assert wc.grad is None  # G_k is returned, the client applies it
    torch.testing.assert_close(grads[1], torch.tensor(_grad_a_by_hand(1, P_CLIENT[1]),
                                                      dtype=D), rtol=1e-9, atol=1e-11)


def test_scala_client_priors_override() -> None:
    server = _linear()
    acts, labels = _inputs()
    uniform = [torch.full((3,), 1 / 3, dtype=D)] * 2
    _, grads = scala_server_step(server, acts, labels, 3,
                                 torch.optim.SGD(server.parameters(), lr=0.0),
                                 client_priors=uniform)
    for k in range(2):  # a uniform prior is a constant shift: plain CE gradients
        torch.testing.assert_close(grads[k], torch.tensor(_grad_a_by_hand(k, None), dtype=D),
                                   rtol=1e-9, atol=1e-11)


def test_ca_sfl_is_plain_ce_everywhere() -> None:
    server = _linear()
    acts, labels = _inputs()
    loss, grads = ca_sfl_server_step(server, acts, labels, 3,
                                     torch.optim.SGD(server.parameters(), lr=0.5))
    assert loss == pytest.approx(_flat_loss_by_hand(None), rel=1e-9)
    for k in range(2):
        torch.testing.assert_close(grads[k], torch.tensor(_grad_a_by_hand(k, None), dtype=D),
                                   rtol=1e-9, atol=1e-11)
    w, b = _sgd_by_hand(0.5, [None, None], [3 / 5, 2 / 5])
    torch.testing.assert_close(server.weight.detach(), torch.tensor(w, dtype=D),
                               rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(server.bias.detach(), torch.tensor(b, dtype=D),
                               rtol=1e-9, atol=1e-11)


def test_lla_sfl_local_adjustment_and_weighted_server_step() -> None:
    server = _linear()
    acts, labels = _inputs()
    loss, grads = lla_sfl_server_step(server, acts, labels, 3,
                                      torch.optim.SGD(server.parameters(), lr=0.5))
    for k in range(2):
        torch.testing.assert_close(grads[k], torch.tensor(_grad_a_by_hand(k, P_CLIENT[k]),
                                                          dtype=D), rtol=1e-9, atol=1e-11)
    per_client = [_adjusted_ce_by_hand([_logits_by_hand(a) for a in A_LIST[k]], Y_LIST[k],
                                       P_CLIENT[k]) for k in range(2)]
    assert loss == pytest.approx(3 / 5 * per_client[0] + 2 / 5 * per_client[1], rel=1e-9)
    # no P_s anywhere: the server steps on Σ_k (B_k/B) · L_k with each client's own P_k
    w, b = _sgd_by_hand(0.5, [P_CLIENT[0], P_CLIENT[1]], [3 / 5, 2 / 5])
    torch.testing.assert_close(server.weight.detach(), torch.tensor(w, dtype=D),
                               rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(server.bias.detach(), torch.tensor(b, dtype=D),
                               rtol=1e-9, atol=1e-11)


def test_lla_sfl_runs_each_client_alone_through_the_server() -> None:
    # BatchNorm makes concatenation visible: LLA-SFL must normalise each client on its own
    torch.manual_seed(0)
    server = nn.Sequential(nn.BatchNorm1d(2), _linear()).to(D)
    reference = copy.deepcopy(server)
    acts, labels = _inputs()
    _, grads = lla_sfl_server_step(server, acts, labels, 3,
                                   torch.optim.SGD(server.parameters(), lr=0.0))
    for k in range(2):
        a = acts[k].clone().requires_grad_(True)
        prior = torch.tensor(P_CLIENT[k], dtype=D) + 1e-300
        loss = F.cross_entropy(reference(a) + torch.log(prior), labels[k])
        (ref,) = torch.autograd.grad(loss, a)
        torch.testing.assert_close(grads[k], ref, rtol=1e-7, atol=1e-9)
    # whereas the concatenated SCALA step normalises over both clients: different G_0
    scala_grads = scala_server_step(copy.deepcopy(reference), acts, labels, 3,
                                    torch.optim.SGD(server.parameters(), lr=0.0))[1]
    assert (scala_grads[0] - grads[0]).abs().max() > 1e-4


# ---------------------------------------------------------------- GAPSL


def _vec(deg: float, r: float = 1.0) -> list[float]:
    return [r * math.cos(math.radians(deg)), r * math.sin(math.radians(deg))]


def _angle(u: list[float], v: list[float]) -> float:
    """Plane angle in [0, π] via atan2 (no cosine, no arccos)."""
    d = abs(math.atan2(u[1], u[0]) - math.atan2(v[1], v[0])) % (2 * PI)
    return min(d, 2 * PI - d)


def test_consistency_scores_on_orthogonal_and_opposite_vectors() -> None:
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]], dtype=D)
    # angles: (0,1) π/2, (0,2) π, (1,2) π/2; mean over the S−1 = 2 others
    expected = [(PI / 2 + PI) / 2, (PI / 2 + PI / 2) / 2, (PI + PI / 2) / 2]
    assert consistency_scores(g).tolist() == pytest.approx(expected, abs=1e-12)


def test_consistency_scores_parallel_zero_and_single() -> None:
    par = torch.tensor([[1.0, 0.0], [5.0, 0.0]], dtype=D)
    assert consistency_scores(par).tolist() == pytest.approx([0.0, 0.0], abs=1e-12)
    # a zero gradient is "unrelated" (θ = π/2) to everything, never NaN
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=D)
    assert consistency_scores(z).tolist() == pytest.approx(
        [PI / 2, (PI / 2 + PI / 2) / 2, (PI / 2 + PI / 2) / 2], abs=1e-12)
    assert consistency_scores(torch.tensor([[3.0, 4.0]])).tolist() == [0.0]


def test_consistency_scores_clamp_rounding_above_one() -> None:
    x = torch.tensor([0.1, 0.7, 0.3])  # float32: cos(x, 3x) rounds to 1 + 1.2e-7
    theta = consistency_scores(torch.stack([x, 3 * x, 7 * x]))
    assert not torch.isnan(theta).any()
    assert theta.abs().max().item() < 1e-3


def test_nu_tracker() -> None:
    tr = NuTracker()
    for nu in (0.3, 0.1, 0.5, 0.2):
        tr.update(nu)
    assert (tr.nu_min, tr.nu_max) == (0.1, 0.5)
    with pytest.raises(ValueError):
        tr.update(float("nan"))


def test_leader_fraction_by_hand() -> None:
    # 0.2 + (5/10)·((0.5 − 0.3)/(0.5 − 0.1))·0.6 = 0.2 + 0.5·0.5·0.6
    assert leader_fraction(5, 10, 0.3, 0.1, 0.5) == pytest.approx(0.35, abs=1e-12)
    assert leader_fraction(0, 10, 0.3, 0.1, 0.5) == pytest.approx(0.2, abs=1e-12)
    assert leader_fraction(10, 10, 0.1, 0.1, 0.5) == pytest.approx(0.8, abs=1e-12)
    assert leader_fraction(10, 10, 0.5, 0.1, 0.5) == pytest.approx(0.2, abs=1e-12)
    # ν_max = ν_min: the ratio is 1 (our choice, docs/methods.md)
    assert leader_fraction(5, 10, 0.4, 0.4, 0.4) == pytest.approx(0.5, abs=1e-12)
    assert leader_fraction(3, 4, 0.4, 0.4, 0.4, 0.1, 0.5) == pytest.approx(0.4, abs=1e-12)
    with pytest.raises(ValueError):
        leader_fraction(1, 0, 0.1, 0.1, 0.1)


def test_leader_set_and_gradient() -> None:
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3], dtype=D)
    assert leader_set(scores, 0.5).tolist() == [1, 3]
    assert leader_set(scores, 0.26).tolist() == [1, 3]  # ⌈1.04⌉ = 2
    assert leader_set(scores, 0.01).tolist() == [1]  # at least one
    assert leader_set(scores, 0.0).tolist() == [1]
    assert leader_set(scores, 1.0).tolist() == [0, 1, 2, 3]
    ten = torch.arange(10, dtype=D)
    k = 0.2 + 0.1  # 0.30000000000000004: k·10 has a plain ceil of 4
    assert math.ceil(k * 10) == 4
    assert leader_set(ten, k).tolist() == [0, 1, 2]
    g = torch.tensor([[1.0, 2.0], [3.0, -4.0], [0.0, 0.0], [5.0, 6.0]], dtype=D)
    assert leader_gradient(g, torch.tensor([1, 3])).tolist() == [4.0, 1.0]


def test_threshold_population_std_and_clipping() -> None:
    # μ = π/4, population σ = π/4: π/4 − 0.5·π/4 = π/8 (the sample std would give less)
    assert threshold(torch.tensor([0.0, PI / 2], dtype=D), 0.5) == pytest.approx(PI / 8,
                                                                                  abs=1e-12)
    assert threshold(torch.tensor([0.0, PI / 2], dtype=D), 2.0) == 0.0  # clipped at 0
    assert threshold(torch.tensor([3.0, 3.1], dtype=D), 0.0) == pytest.approx(PI / 2)
    assert threshold(torch.tensor([PI, PI], dtype=D), 1.0) == pytest.approx(PI / 2)


# four clients at 0°, 20°, 50° and 170°, with different lengths
DEGS = [0.0, 20.0, 50.0, 170.0]
LENS = [1.0, 2.0, 0.5, 3.0]


def _grads() -> torch.Tensor:
    return torch.tensor([_vec(d, r) for d, r in zip(DEGS, LENS, strict=True)], dtype=D)


def test_select_clients_by_hand() -> None:
    vecs = [_vec(d, r) for d, r in zip(DEGS, LENS, strict=True)]
    theta = [sum(_angle(vecs[i], vecs[j]) for j in range(4) if j != i) / 3 for i in range(4)]
    nu = statistics.pstdev(theta)
    # fresh tracker: ν_min = ν_max = ν → ratio 1 → K = 0.2 + (5/10)·0.6 = 0.5 → 2 leaders
    tracker = NuTracker()
    sel = select_clients(_grads(), 5, 10, tracker, 0.2, 0.8, eta=0.0)
    assert sel.scores.tolist() == pytest.approx(theta, abs=1e-9)
    assert sel.nu == pytest.approx(nu, abs=1e-9)
    assert (tracker.nu_min, tracker.nu_max) == (pytest.approx(nu), pytest.approx(nu))
    assert sel.k_t == pytest.approx(0.5, abs=1e-12)
    leaders = sorted(sorted(range(4), key=lambda i: theta[i])[:2])
    assert leaders == [1, 2]  # 20° and 50° sit in the middle of the pack
    assert sel.leaders.tolist() == leaders
    lead = [(vecs[1][c] + vecs[2][c]) / 2 for c in range(2)]
    torch.testing.assert_close(sel.g_lead, torch.tensor(lead, dtype=D))
    theta_lead = [_angle(v, lead) for v in vecs]
    assert sel.theta_lead.tolist() == pytest.approx(theta_lead, abs=1e-9)
    th = min(max(statistics.mean(theta_lead), 0.0), PI / 2)  # η = 0
    assert sel.theta_th == pytest.approx(th, abs=1e-9)
    chosen = [i for i in range(4) if theta_lead[i] <= th]
    assert chosen == [0, 1, 2]  # 170° is out
    assert sel.selected.tolist() == chosen and not sel.fallback
    assert sel.alignment_penalty.tolist() == pytest.approx(
        [1 - math.cos(theta_lead[i]) for i in chosen], abs=1e-9)


def test_select_clients_strict_eta_and_running_nu() -> None:
    vecs = [_vec(d, r) for d, r in zip(DEGS, LENS, strict=True)]
    tracker = NuTracker(nu_min=0.1, nu_max=2.0)
    sel = select_clients(_grads(), 10, 10, tracker, 0.2, 0.8, eta=0.5)
    theta = [sum(_angle(vecs[i], vecs[j]) for j in range(4) if j != i) / 3 for i in range(4)]
    nu = statistics.pstdev(theta)
    assert sel.k_t == pytest.approx(0.2 + (2.0 - nu) / (2.0 - 0.1) * 0.6, abs=1e-9)
    lead_idx = sorted(sorted(range(4), key=lambda i: theta[i])[:math.ceil(sel.k_t * 4)])
    assert sel.leaders.tolist() == lead_idx
    lead = [sum(vecs[i][c] for i in lead_idx) / len(lead_idx) for c in range(2)]
    theta_lead = [_angle(v, lead) for v in vecs]
    th = min(max(statistics.mean(theta_lead) - 0.5 * statistics.pstdev(theta_lead), 0.0),
             PI / 2)
    assert sel.theta_th == pytest.approx(th, abs=1e-9)
    assert sel.selected.tolist() == [i for i in range(4) if theta_lead[i] <= th]


def test_select_clients_falls_back_to_the_leaders() -> None:
    # θ ≈ 83°, 83°, 117°, 123°: the leaders are the clients at ±30°, g_lead is their
    # bisector and nobody lies on it; a huge η clips θ_th to 0, nobody passes, the leader
    # set is used
    g = torch.tensor([_vec(30.0), _vec(-30.0), _vec(90.0), _vec(-100.0)], dtype=D)
    sel = select_clients(g, 1, 100, NuTracker(), 0.5, 0.5, eta=100.0)
    assert sel.theta_th == 0.0
    assert sel.leaders.tolist() == [0, 1]
    assert sel.fallback and sel.selected.tolist() == [0, 1]
    assert sel.alignment_penalty.tolist() == pytest.approx([1 - math.cos(PI / 6)] * 2,
                                                           abs=1e-9)


def test_passing_keeps_clients_exactly_at_the_threshold() -> None:
    theta_lead = torch.tensor([0.2, 0.6, 0.4, 1.0], dtype=D)
    assert passing(theta_lead, 0.4).tolist() == [0, 2]
    assert passing(theta_lead, 0.0).tolist() == []
    # three equal angles as float64 computes them for three gradients 45° off g_lead:
    # μ − 3σ lands a few ulps below them, yet all three sit "at" the threshold
    same = torch.tensor([0.7853981633974481, 0.785398163397448, 0.7853981633974481], dtype=D)
    th = threshold(same, 3.0)
    assert th < same.min().item()
    assert passing(same, th).tolist() == [0, 1, 2]


def test_all_equal_angles_all_pass() -> None:
    # θ_lead identical for everyone (σ = 0): θ_th = μ, and every client must pass
    g = torch.tensor([_vec(10.0), _vec(-10.0)], dtype=D)
    sel = select_clients(g, 1, 1, NuTracker(), 1.0, 1.0, eta=3.0)
    assert sel.selected.tolist() == [0, 1] and not sel.fallback


def test_gapsl_server_loss_value_and_first_order_gradient() -> None:
    w = torch.tensor([1.0, -2.0], dtype=D, requires_grad=True)
    cs = [torch.tensor(c, dtype=D) for c in ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0])]
    losses = [(w @ c) ** 2 for c in cs]  # 1, 4, 1
    sel = GapslSelection(
        scores=torch.zeros(3, dtype=D), nu=0.0, k_t=0.5, leaders=torch.tensor([0]),
        g_lead=torch.zeros(2, dtype=D), theta_lead=torch.tensor([0.0, 1.0, 0.5], dtype=D),
        theta_th=0.6, selected=torch.tensor([0, 2]),
        alignment_penalty=torch.tensor([0.0, 1 - math.cos(0.5)], dtype=D), fallback=False)
    lg = gapsl_server_loss(losses, sel, lam=0.1)
    assert lg.item() == pytest.approx(1.0 + 1.0 + 0.1 * (1 - math.cos(0.5)), abs=1e-12)
    lg.backward()
    # ∇ of (w·c0)² + (w·c2)² = 2(w·c0)c0 + 2(w·c2)c2 = 2·1·(1,0) + 2·(−1)·(1,1) = (0, −2);
    # client 1 is not selected and the detached penalty adds nothing
    assert w.grad is not None
    assert w.grad.tolist() == pytest.approx([0.0, -2.0], abs=1e-12)
    with pytest.raises(ValueError):
        gapsl_server_loss(losses[:2], sel)


# ---------------------------------------------------------------- edges and rejections


def test_prior_floor_formula_with_a_visible_eps() -> None:
    # P(y) = (n_y/n + ε)/(1 + C·ε), written out with an ε large enough to see in float64
    got = label_prior(torch.tensor([0, 0, 2, 1, 0]), 4, eps=0.1, dtype=D).tolist()
    want = [(n / 5 + 0.1) / 1.4 for n in (3, 1, 1, 0)]
    assert got == pytest.approx(want, rel=1e-15)
    got = prior_from_counts([3, 1, 1, 0], 4, eps=0.1, dtype=D).tolist()
    assert got == pytest.approx(want, rel=1e-15)
    # the default floor is 1e-12, visible in float64 against 0.5 and exact at an absent class
    p = label_prior(torch.tensor([0, 1]), 3, dtype=D).tolist()
    assert p == pytest.approx([(0.5 + 1e-12) / (1 + 3e-12)] * 2 + [1e-12 / (1 + 3e-12)],
                              rel=1e-15)
    assert p[0] != 0.5
    assert prior_from_counts([2, 2, 0], 3, dtype=D).tolist() == pytest.approx(p, rel=1e-15)
    assert PRIOR_EPS == 1e-12
    # one class is a valid (if trivial) distribution; labels at both ends of the range
    assert label_prior(torch.tensor([0, 0]), 1, dtype=D).tolist() == [1.0]
    assert label_prior(torch.tensor([0, 2]), 3, dtype=D)[2].item() == pytest.approx(0.5)
    assert label_prior(torch.tensor([1]), 2, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize(("labels", "classes", "eps", "match"), [
    ([[0, 1]], 2, 1e-12, "1-D"),
    ([], 2, 1e-12, "empty"),
    ([0], 0, 1e-12, "num_classes must be >= 1, got 0"),
    ([0], 2, -1e-12, "eps must be > 0"),
    ([0], 2, float("nan"), "eps must be > 0"),
    ([-1, 0], 2, 1e-12, r"lie in \[0, 1\], got \[-1, 0\]"),
    ([0, 2], 2, 1e-12, r"lie in \[0, 1\], got \[0, 2\]"),
])
def test_label_prior_rejects(labels: list, classes: int, eps: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        label_prior(torch.tensor(labels, dtype=torch.long), classes, eps)


@pytest.mark.parametrize(("counts", "match"), [
    ([1, 2], "2 class counts for 3 classes"),
    ([1, -1, 2], "finite"),
    ([0, 0, 0], "finite"),
    ([1, float("inf"), 0], "finite"),
    ([1, float("nan"), 0], "finite"),
])
def test_prior_from_counts_rejects(counts: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prior_from_counts(counts, 3)


def test_logit_adjusted_ce_checks_the_prior_and_keeps_half_precision_finite() -> None:
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"prior has shape \(2,\), logits have 3 classes"):
        logit_adjusted_ce(logits, torch.tensor([0, 1]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="prior has shape"):
        logit_adjusted_ce(logits, torch.tensor([0, 1]), torch.full((1, 3), 1 / 3))
    # a half prior holding the 1e-12 floor would log to −inf; it is logged in float32
    half = torch.tensor([0.5, 0.5, 1e-12], dtype=torch.float64).to(torch.float32)
    got = logit_adjusted_ce(torch.zeros(1, 3, dtype=torch.bfloat16), torch.tensor([0]),
                            half.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and math.isfinite(got.item())
    assert got.item() == pytest.approx(math.log(2), rel=1e-2)


def test_steps_reject_every_malformed_input() -> None:
    server = _linear()
    opt = torch.optim.SGD(server.parameters(), lr=0.1)
    acts, labels = _inputs()
    with pytest.raises(ValueError, match="2 activation batches but 1 label sets"):
        scala_server_step(server, acts, labels[:1], 3, opt)
    with pytest.raises(ValueError, match="no clients"):
        lla_sfl_server_step(server, [], [], 3, opt)
    with pytest.raises(ValueError, match="client 1 sent an empty batch"):
        scala_server_step(server, [acts[0], acts[1][:0]], [labels[0], labels[1][:0]], 3, opt)
    with pytest.raises(ValueError, match=r"client 0: 3 activations but labels of shape "
                                         r"\(3, 1\)"):
        scala_server_step(server, acts, [labels[0][:, None], labels[1]], 3, opt)
    with pytest.raises(ValueError, match="1 client priors for 2 clients"):
        scala_server_step(server, acts, labels, 3, opt, client_priors=[torch.ones(3) / 3])
    with pytest.raises(ValueError, match="3 client priors for 2 clients"):
        scala_server_step(server, acts, labels, 3, opt, client_priors=[torch.ones(3) / 3] * 3)
    with pytest.raises(ValueError, match="1 client priors for 2 clients"):
        lla_sfl_server_step(server, acts, labels, 3, opt, client_priors=[torch.ones(3) / 3])
    with pytest.raises(ValueError, match=r"server output has shape \(5, 3\), expected "
                                         r"\(batch, 4\)"):
        ca_sfl_server_step(server, acts, labels, 4, opt)
    with pytest.raises(ValueError, match=r"server output has shape \(3, 3\), expected "
                                         r"\(batch, 4\)"):
        lla_sfl_server_step(server, acts, labels, 4, opt)
    flat = nn.Sequential(_linear(), nn.Flatten(0))
    with pytest.raises(ValueError, match="server output has shape"):
        scala_server_step(flat, acts, labels, 3, torch.optim.SGD(flat.parameters(), lr=0.1))


def test_gapsl_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match=r"grads must be \(S, P\) with S >= 1, got \(0, 2\)"):
        consistency_scores(torch.zeros(0, 2))
    with pytest.raises(ValueError, match="grads must be"):
        leader_gradient(torch.zeros(3), torch.tensor([0]))
    with pytest.raises(ValueError, match="leader set is empty"):
        leader_gradient(torch.ones(2, 2), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="total must be > 0, got 0"):
        leader_fraction(1, 0, 0.1, 0.1, 0.1)
    assert leader_fraction(1, 1, 0.1, 0.1, 0.1) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="need 0 <= k_min <= k_max <= 1, got 0.5, 0.4"):
        leader_fraction(1, 2, 0.1, 0.1, 0.1, 0.5, 0.4)
    with pytest.raises(ValueError, match="k_min"):
        leader_fraction(1, 2, 0.1, 0.1, 0.1, -0.1, 0.4)
    with pytest.raises(ValueError, match="k_min"):
        leader_fraction(1, 2, 0.1, 0.1, 0.1, 0.1, 1.1)
    assert leader_fraction(1, 2, 0.1, 0.1, 0.1, 0.0, 1.0) == pytest.approx(0.5)
    assert leader_fraction(1, 2, 0.1, 0.1, 0.1, 0.4, 0.4) == pytest.approx(0.4)
    # t beyond T and ν outside [ν_min, ν_max] are clamped: K stays in [K_min, K_max]
    assert leader_fraction(20, 10, 0.0, 0.1, 0.5) == pytest.approx(0.8)
    assert leader_fraction(-5, 10, 0.3, 0.1, 0.5) == pytest.approx(0.2)
    assert leader_fraction(5, 10, 0.9, 0.1, 0.5) == pytest.approx(0.2)
    assert leader_fraction(5, 10, 0.3, 0.1, math.inf) == pytest.approx(0.5)
    for bad in ([], [[0.1, 0.2]]):
        with pytest.raises(ValueError, match="scores must be a non-empty 1-D tensor"):
            leader_set(torch.tensor(bad, dtype=D), 0.5)
        with pytest.raises(ValueError, match="theta_lead must be a non-empty 1-D tensor"):
            threshold(torch.tensor(bad, dtype=D), 0.5)
    sel = select_clients(_grads(), 1, 4, NuTracker())
    with pytest.raises(ValueError, match="3 losses for 4 clients"):
        gapsl_server_loss([torch.tensor(1.0)] * 3, sel)
    tracker = NuTracker()
    with pytest.raises(ValueError, match="nu must be finite, got inf"):
        tracker.update(math.inf)
    assert (tracker.nu_min, tracker.nu_max) == (math.inf, -math.inf)


def test_rejections_at_the_other_side_of_each_check() -> None:
    """The shapes just past each check's other edge: 3-D gradients, 0-d scores and priors,
    a label far past the range, a server wider than the classes, 300 clients (past
    CPython's small-int cache, where `is` and `==` part ways)."""
    with pytest.raises(ValueError, match="grads must be"):
        consistency_scores(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="scores must be a non-empty 1-D tensor"):
        leader_set(torch.tensor(0.5, dtype=D), 0.5)
    with pytest.raises(ValueError, match="theta_lead must be a non-empty 1-D tensor"):
        threshold(torch.tensor(0.5, dtype=D), 0.5)
    with pytest.raises(ValueError, match=r"lie in \[0, 1\], got \[0, 5\]"):
        label_prior(torch.tensor([0, 5]), 2)
    with pytest.raises(ValueError, match=r"prior has shape \(\)"):
        logit_adjusted_ce(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor(1.0))
    server = _linear()  # 3 outputs
    opt = torch.optim.SGD(server.parameters(), lr=0.1)
    acts = [torch.ones(2, 2, dtype=D), torch.ones(1, 2, dtype=D)]
    labels = [torch.tensor([0, 1]), torch.tensor([1])]
    for step in (scala_server_step, ca_sfl_server_step, lla_sfl_server_step):
        with pytest.raises(ValueError, match=r"server output has shape \(\d, 3\), expected "
                                             r"\(batch, 2\)"):
            step(server, acts, labels, 2, opt)
    many = torch.tensor([_vec(float(d)) for d in range(300)], dtype=D)
    sel = select_clients(many, 1, 4, NuTracker())
    loss = gapsl_server_loss([torch.tensor(float(i), dtype=D) for i in range(300)], sel)
    assert loss.item() == pytest.approx(sum(float(i) for i in sel.selected)
                                        + 5e-4 * float(sel.alignment_penalty.sum()))


def test_more_rejections_and_a_nan_gradient_is_unrelated() -> None:
    """A negative T, more losses than clients, the range message for 5 classes, a 0-d
    label tensor; a
    gradient row holding NaN has no direction, like a zero row: θ = π/2 to the others and
    finite scores, so one broken client cannot turn the whole selection into NaN."""
    with pytest.raises(ValueError, match="total must be > 0, got -1"):
        leader_fraction(1, -1, 0.1, 0.1, 0.1)
    sel = select_clients(_grads(), 1, 4, NuTracker())
    with pytest.raises(ValueError, match="5 losses for 4 clients"):
        gapsl_server_loss([torch.tensor(1.0)] * 5, sel)
    with pytest.raises(ValueError, match=r"lie in \[0, 4\], got \[0, 7\]"):
        label_prior(torch.tensor([0, 7]), 5)
    with pytest.raises(ValueError, match="labels must be 1-D, got shape"):
        label_prior(torch.tensor(1), 3)
    g = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [0.0, 1.0]], dtype=D)
    scores = consistency_scores(g)
    assert scores.tolist() == pytest.approx([(PI / 2 + PI / 2) / 2] * 3, abs=1e-12)



def test_the_last_edges_of_each_check() -> None:
    """Inputs on the far side of each remaining check, each refused in its own words:
    too many counts (and 300 classes, past the small-int cache), a total of exactly 1
    accepted, a square or a too-long prior, fewer activation batches than label sets,
    a 0-d or a too-short label vector, 3-D and 1-D server outputs in both step kinds."""
    assert prior_from_counts([1, 0, 0], 3, dtype=D).tolist()[0] == pytest.approx(1.0)
    assert prior_from_counts([1] * 300, 300, dtype=D).tolist()[0] == pytest.approx(1 / 300)
    with pytest.raises(ValueError, match="4 class counts for 3 classes"):
        prior_from_counts([1, 2, 3, 4], 3)
    logits = torch.zeros(2, 3)
    for prior in (torch.full((3, 3), 1 / 3), torch.full((4,), 0.25)):
        with pytest.raises(ValueError, match="prior has shape"):
            logit_adjusted_ce(logits, torch.tensor([0, 1]), prior)
    server = _linear()
    opt = torch.optim.SGD(server.parameters(), lr=0.1)
    acts, labels = _inputs()
    with pytest.raises(ValueError, match="1 activation batches but 2 label sets"):
        scala_server_step(server, acts[:1], labels, 3, opt)
    with pytest.raises(ValueError, match=r"client 0: 3 activations but labels of shape \(\)"):
        scala_server_step(server, acts, [labels[0][0], labels[1]], 3, opt)
    with pytest.raises(ValueError, match=r"client 0: 3 activations but labels of shape \(2,\)"):
        lla_sfl_server_step(server, acts, [labels[0][:2], labels[1]], 3, opt)
    cube = nn.Sequential(_linear(), nn.Unflatten(1, (3, 1)))
    flat = nn.Sequential(_linear(), nn.Flatten(0))
    for odd in (cube, flat):
        for step in (scala_server_step, lla_sfl_server_step):
            with pytest.raises(ValueError, match="server output has shape"):
                step(odd, acts, labels, 3, torch.optim.SGD(odd.parameters(), lr=0.1))


def test_gapsl_defaults_penalty_and_an_inverted_span() -> None:
    """η defaults to 0 (θ_th at the mean angle to the leader); the alignment penalty is
    1 − cos θ_lead also for a selected client more than 60° from the leader (where
    1 % cos would differ); ν_min > ν_max reads as no spread (ratio 1)."""
    sel = select_clients(_grads(), 1, 4, NuTracker())
    assert sel.theta_th == pytest.approx(float(sel.theta_lead.mean()), abs=1e-12)
    wide = torch.tensor([_vec(0.0), _vec(10.0), _vec(80.0)], dtype=D)
    sel = select_clients(wide, 4, 4, NuTracker(), k_min=0.3, k_max=0.3, eta=-10.0)
    assert sel.theta_th == pytest.approx(PI / 2)
    assert sel.selected.tolist() == [0, 1, 2]
    assert sel.leaders.tolist() == [1]  # ⌈0.3·3⌉ = 1 leader: 10°, the closest to both
    angles = [_angle(_vec(d), _vec(10.0)) for d in (0.0, 10.0, 80.0)]
    assert angles[2] > PI / 3
    assert sel.alignment_penalty.tolist() == pytest.approx(
        [1 - math.cos(a) for a in angles], abs=1e-9)
    assert leader_fraction(5, 10, 0.3, 0.5, 0.1) == pytest.approx(0.2 + 0.5 * 0.6)


def test_three_hundred_classes_clients_and_samples_pass_every_check() -> None:
    """Counts past CPython's small-int cache (−5…256), where `is not` and `!=` part: 300
    classes, 300 clients, a client of 300 samples all pass every shape check."""
    torch.manual_seed(0)
    server = nn.Linear(2, 300).double()
    acts = [torch.randn(300, 2, dtype=D)] + [torch.randn(1, 2, dtype=D) for _ in range(299)]
    labels = [torch.arange(300)] + [torch.tensor([k]) for k in range(299)]
    priors = [prior_from_counts([1] * 300, 300, dtype=D)] * 300
    for step in (scala_server_step, lla_sfl_server_step):
        loss, grads = step(server, acts, labels, 300, torch.optim.SGD(server.parameters(),
                                                                      lr=0.0),
                           client_priors=priors)
        assert math.isfinite(loss) and len(grads) == 300
    logits = torch.zeros(2, 300, dtype=D)
    got = logit_adjusted_ce(logits, torch.tensor([0, 299]), priors[0])
    assert got.item() == pytest.approx(math.log(300))

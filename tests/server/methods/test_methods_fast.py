"""Fast tier (`-m fast`): the numbers the methods' papers and docs/methods.md fix, pinned on
tiny models and data with values worked out by hand, in fixtures where a wrong weight, a
skipped reset or the wrong loss gives different numbers: unequal |D_k|, several devices at
one cut, unequal edges, two rounds, batches of unequal size, priors unlike the batch's."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from toy_server import toy_step  # testing/, on the path in tests

from jetsplit.data import load_dataset_split
from jetsplit.data.partition import partition
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.server.defences import aggregators
from jetsplit.server.defences.aggregators import fedavg
from jetsplit.server.defences.step_bounds import share_norms
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.methods import build_method, gapsl_math, sherl
from jetsplit.server.methods.ampere import Ampere
from jetsplit.server.methods.gapsl import GAPSL
from jetsplit.server.methods.psl import PSL
from jetsplit.server.methods.scala import SCALA
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

Arrays = dict[str, np.ndarray]
SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
CUT = 3


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


# ---------------------------------------------------------------- in-process rounds


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, CUT, tmp_path_factory.mktemp("fast") / "k", seed=3, tar=True,
                          aux_ratio=None)
    assert report.tar_path is not None
    return report.tar_path


def _trainer(archive: Path, algorithm: str, sizes: list[int], **settings: Any) -> Trainer:
    """Agents a0… on disjoint digits shards of the given (unequal) sizes, all at one cut."""
    train, test = load_dataset_split("digits", 0.2, 0)
    order = np.random.default_rng(0).permutation(len(train))
    starts = np.cumsum([0, *sizes])
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(order[starts[i]:starts[i + 1]]),
                                    seed=i) for i in range(len(sizes))}
    torch.manual_seed(0)
    base: dict[str, Any] = dict(algorithm=algorithm, rounds=2, local_steps=1, batch=24,
                                lr=0.05, seed=0)
    return Trainer(InProcessEngine(workers), archive, Settings(**{**base, **settings}), test)


def _mean_by_hand(states: dict[str, Arrays], sizes: dict[str, int]) -> Arrays:
    total = sum(sizes.values())
    return {name: sum(states[a][name].astype(np.float64) * (sizes[a] / total) for a in states)
            for name in next(iter(states.values()))
            if states[next(iter(states))][name].dtype.kind == "f"}


def _assert_close(got: Arrays, want: Arrays, ulps: int = 1) -> int:
    """fedavg sums in float64 and casts back: each cast to float32 is within an ulp."""
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=ulps * 1.2e-7, atol=1e-12,
                                   err_msg=name)
    return len(want)


def test_splitfed_v1_two_rounds_averages_by_size_and_resets_copies_and_optimisers(
        archive: Path) -> None:
    """Three devices at one cut with |D_k| = 40, 70, 130, SGD momentum 0.9, two rounds:
    each round starts every server copy from the averaged server block with a fresh
    optimiser (no momentum carried over), every agent from the averaged client block with
    no optimiser state; each round ends with the server copies and client blocks averaged
    with weights |D_k| / 240."""
    sizes = {"a0": 40, "a1": 70, "a2": 130}
    t = _trainer(archive, "splitfed-v1", list(sizes.values()), optimizer="sgd", momentum=0.9)
    method = build_method("splitfed-v1", t)
    seen = {"begin": 0, "end": 0, "clients": 0, "pushed": 0}
    begin, end, pull, completions = (method.begin_round, method.end_round, t.pull,
                                     t.completions.begin_round)

    def spy_begin(selected: list[str]) -> None:
        begin(selected)
        server = to_arrays(t.server, "server")
        for agent in selected:
            copy_ = to_arrays(method.copies[agent], "server")
            assert all(np.array_equal(copy_[k], server[k]) for k in server), agent
            assert method.optimizers[agent].state_dict()["state"] == {}, agent
        seen["begin"] += 1

    def spy_end(participants: list[str]) -> None:
        copies = {a: to_arrays(method.copies[a], "server") for a in participants}
        # the copies really differ (each trained on its own data), so a wrong weight shows
        assert sum(not np.array_equal(v, copies["a2"][k]) for k, v in copies["a0"].items()) > 5
        end(participants)
        seen["end"] += _assert_close(to_arrays(t.server, "server"), _mean_by_hand(copies, sizes))

    def spy_pull(agents: list[str], blocks: tuple[str, ...] = ("client",)) -> dict:
        states = pull(agents, blocks)
        if len(agents) == 3:
            pulled.update(states)
        return states

    def spy_completions(selected: list[str], global_client: Arrays, *, fresh: bool) -> None:
        if t.round > 0:  # after the push: every agent holds the average, no optimiser state
            for agent, worker in t.engine.workers.items():
                assert worker._optimizers == {}, agent
                state = pull([agent])[agent]
                assert all(np.array_equal(state[k], t.global_client[k]) for k in state)
            seen["pushed"] += 1
        completions(selected, global_client, fresh=fresh)

    method.begin_round, method.end_round = spy_begin, spy_end  # type: ignore[method-assign]
    t.pull = spy_pull  # type: ignore[method-assign]
    t.completions.begin_round = spy_completions  # type: ignore[method-assign]
    for round_ in range(2):
        pulled: dict[str, Arrays] = {}
        t.round = round_
        method.run_round(sorted(sizes))
        seen["clients"] += _assert_close(t.global_client, _mean_by_hand(pulled, sizes))
    assert seen["begin"] == 2 and seen["pushed"] == 1
    assert seen["end"] > 20 and seen["clients"] > 20


def _sherl_fedavg_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict, Arrays]]:
    calls: list[tuple[dict, dict, Arrays]] = []

    def recording(states: dict, weights: dict) -> Arrays:
        out = fedavg(states, weights)
        calls.append((dict(states), dict(weights), out))
        return out

    monkeypatch.setattr(sherl, "fedavg", recording)  # the cloud's average of edge averages
    monkeypatch.setattr(aggregators, "fedavg", recording)  # device uploads, [train] aggregator
    return calls


def test_sherl_cloud_average_weights_each_edge_by_the_data_behind_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Edges of unequal size (e0 serves a0 and a2, e1 serves a1 alone): τ1 averages each
    edge's clients with |D_k|, τ2 averages the edges' client blocks with Σ|D_k| behind each
    edge, so the global client block is the flat |D_k|-weighted mean of all three clients
    (an edge weighted 1:1 would count a1 twice as much as each of a0 and a2)."""
    calls = _sherl_fedavg_calls(monkeypatch)
    settings = Settings(algorithm="sherl", rounds=1, local_steps=1, batch=24, lr=0.05,
                        edges={"e0": ["a0", "a2"], "e1": ["a1"]})
    simulate(settings, model="mobilenetv3-small", split=2, dataset="digits", clients=3,
             partition_scheme="dirichlet:0.5", out_dir=tmp_path / "run")
    by_keys = {tuple(sorted(states)): (states, weights, out) for states, weights, out in calls}
    client_states, client_sizes = {}, {}
    for agents in (("a0", "a2"), ("a1",)):
        states, weights, _ = by_keys[agents]
        client_states.update(states)
        client_sizes.update(weights)
    assert len(set(client_sizes.values())) == 3  # dirichlet: three different |D_k|
    edges_states, edge_weights, merged = next(
        (s, w, o) for s, w, o in calls if set(s) == {"e0", "e1"} and any(
            k.startswith("client/") for k in o))
    assert edge_weights == {"e0": client_sizes["a0"] + client_sizes["a2"],
                            "e1": client_sizes["a1"]}
    # two averages, two casts to float32: within 2 ulps of the flat float64 mean
    assert _assert_close(merged, _mean_by_hand(client_states, client_sizes), ulps=2) > 10
    cloud_edge = [w for s, w, o in calls if set(s) == {"e0", "e1"} and any(
        k.startswith("edge/") for k in o)]
    assert cloud_edge == [edge_weights]  # the edge blocks: the same Σ|D_k| weights


# ---------------------------------------------------------------- Ampere at two cuts


@pytest.fixture(scope="module")
def aux_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ampere's bundle: split 2 with an aux head (devices at cut 1 get their own head)."""
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("amp") / "k", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


def _ampere_trainer(aux_archive: Path, tmp_path: Path, sizes: list[int],
                    cuts: dict[str, int]) -> Trainer:
    t = _trainer(aux_archive, "ampere", sizes, rounds=5, device_epochs=3, batch=48, lr=0.1,
                 activation_dir=str(tmp_path / "work"))
    return Trainer(t.engine, aux_archive, t.settings, t.test, cuts=cuts)


def _layer(name: str) -> str:
    return name.split("/", 1)[1].split(".", 1)[0]


def test_ampere_per_cut_heads_average_among_their_cut_by_size_over_two_epochs(
        aux_archive: Path, tmp_path: Path) -> None:
    """a0, a1 at cut 1 (|D_k| = 40, 100), a2, a3 at cut 2 (60, 120), two device epochs.
    Each device trains client[:p_k] with the aux head built for p_k (its shapes are its
    cut's); each epoch ends with layer 1 averaged over all four (weights |D_k| / 320),
    layer 2 over a2, a3 only (/ 180), the cut-1 head over a0, a1 only (/ 140), the cut-2
    head over a2, a3 (/ 180); the next epoch starts every device from the averaged layers
    it holds and its own cut's averaged head."""
    sizes = {"a0": 40, "a1": 100, "a2": 60, "a3": 120}
    cuts = {"a0": 1, "a1": 1, "a2": 2, "a3": 2}
    t = _ampere_trainer(aux_archive, tmp_path, list(sizes.values()), cuts)
    method = build_method("ampere", t)
    assert isinstance(method, Ampere) and set(method.aux) == {1, 2}
    shapes = {c: {n: v.shape for n, v in method.aux[c].items()} for c in (1, 2)}
    assert shapes[1] != shapes[2]
    pull, push = t.pull, t.push_client
    seen = {"epochs": 0, "pushed": 0, "checked": 0}

    def spy_pull(agents: list[str], blocks: tuple[str, ...] = ("client",)) -> dict:
        states = pull(agents, blocks)
        if blocks == ("client", "aux"):
            pulled.update(states)
        return states

    def spy_push(agents: list[str], arrays: Arrays, per_cut: Any = None) -> list[str]:
        done = push(agents, arrays, per_cut)
        for agent, state in pull(sorted(done), ("client", "aux")).items():
            cut = cuts[agent]
            assert {_layer(n) for n in state if n.startswith("client/")} == \
                set(["stem", "bneck0"][:cut])
            want = {**{n: v for n, v in t.global_client.items() if n in state},
                    **method.aux[cut]}
            assert state.keys() == want.keys(), agent
            assert all(np.array_equal(state[n], want[n]) for n in want), agent
            seen["pushed"] += 1
        return done

    t.pull, t.push_client = spy_pull, spy_push  # type: ignore[method-assign]
    for round_ in range(2):
        pulled: dict[str, Arrays] = {}
        t.round, t.missed = round_, {}
        method.run_round(sorted(sizes))
        assert set(pulled) == set(sizes)
        for agent, state in pulled.items():  # each device trained its own cut's head
            assert {n: v.shape for n, v in state.items() if n.startswith("aux/")} == \
                shapes[cuts[agent]], agent
        heads = {c: {a: {n: v for n, v in pulled[a].items() if n.startswith("aux/")}
                     for a in sizes if cuts[a] == c} for c in (1, 2)}
        for cut in (1, 2):
            group = heads[cut]
            assert sum(not np.array_equal(*(g[n] for g in group.values()))
                       for n in next(iter(group.values()))) > 2  # the copies differ
            seen["checked"] += _assert_close(method.aux[cut], _mean_by_hand(
                group, {a: sizes[a] for a in group}))
        stem = {a: {n: v for n, v in pulled[a].items() if _layer(n) == "stem"} for a in sizes}
        deep = {a: {n: v for n, v in pulled[a].items() if _layer(n) == "bneck0"}
                for a in ("a2", "a3")}
        assert not any(_layer(n) == "bneck0" for a in ("a0", "a1") for n in pulled[a])
        seen["checked"] += _assert_close(t.global_client, _mean_by_hand(stem, sizes))
        seen["checked"] += _assert_close(t.global_client, _mean_by_hand(
            deep, {"a2": 60, "a3": 120}))
        seen["epochs"] += 1
    assert method.epoch == 2 and method.phase == 1  # N_d = 3: no best-epoch rollback yet
    assert seen["pushed"] == 4 and seen["checked"] > 30


def test_ampere_carries_a_shallow_upload_through_the_global_layers(
        aux_archive: Path, tmp_path: Path) -> None:
    """After a device epoch, a cut-1 device's one-shot upload is checked at its cut and
    carried to p* = 2 through the *aggregated* global layer 2 in eval mode (the running
    statistics, not the batch's), so it is exactly what the global client block would give
    for the same images; a cut-2 upload is stored as it came, and a cut-1 upload of the
    wrong shape is refused."""
    from jetsplit.models.split import eval_mode
    from jetsplit.models.weights import from_arrays, load_strict
    from jetsplit.server.methods.activation_store import StoreError

    t = _ampere_trainer(aux_archive, tmp_path, [50, 70], {"a0": 1})
    method = build_method("ampere", t)
    assert isinstance(method, Ampere)
    initial = dict(t.global_client)
    t.round, t.missed = 0, {}
    method.run_round(["a0", "a1"])
    assert any(not np.array_equal(initial[n], t.global_client[n]) for n in initial
               if _layer(n) == "bneck0")
    x = t.engine.workers["a0"].data.x[:7]
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    client.train()  # carry must switch to eval itself
    with torch.no_grad(), eval_mode(client):
        at1 = client[0](torch.from_numpy(x)).numpy()
        want = client(torch.from_numpy(x)).numpy()
    labels = t.engine.workers["a0"].data.y[:7]
    got = method._carried("a0", at1, labels, 10)
    assert got.shape == want.shape == (7, 16, 4, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    at2 = np.zeros((3, 16, 4, 4), np.float32)
    assert method._carried("a1", at2, labels[:3], 10) is at2
    with pytest.raises(StoreError, match="upload from a0 refused"):
        method._carried("a0", at2, labels[:3], 10)


# ---------------------------------------------------------------- server losses by hand


def _by_hand(server: nn.Linear, acts: list[torch.Tensor], labels: list[torch.Tensor],
             server_loss: Any, client_loss: Any, lr: float
             ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Plain SGD on `server_loss(logits per client)`; client i's gradient of
    `client_loss(i, its logits)` at the pre-update weights."""
    ref = copy.deepcopy(server)
    leaves = [a.clone().requires_grad_(True) for a in acts]
    logits = [ref(x) for x in leaves]
    grads = [torch.autograd.grad(client_loss(i, lg), leaf, retain_graph=True)[0]
             for i, (lg, leaf) in enumerate(zip(logits, leaves, strict=True))]
    params = list(ref.parameters())
    step = torch.autograd.grad(server_loss(logits), params)
    after = {n: (p - lr * g).detach() for (n, p), g in zip(ref.named_parameters(), step,
                                                             strict=True)}
    return after, grads


def _psl_like(cls: type, server: nn.Module, lr: float, reduction: str, *,
              loss_weights: Any = None, share_weights: Any = None,
              measures_shares: bool = False) -> Any:
    """A PSL-like method over a fake trainer whose defences answer as the test says: the
    loss bound off unless `loss_weights` (agents, losses → weights), the gradient bound off
    unless `share_weights` (agents, norms → weights), shares measured ("all") only with
    `measures_shares`."""
    method = cls.__new__(cls)
    defences = SimpleNamespace(
        weighs_losses=loss_weights is not None, loss_weights=loss_weights,
        measures_shares=measures_shares,
        share_weights=share_weights or (lambda agents, norms: None))
    method.trainer = SimpleNamespace(
        server=server, optimizer=torch.optim.SGD(server.parameters(), lr=lr), round=0,
        device=torch.device("cpu"), defences=defences,
        settings=SimpleNamespace(psl_reduction=reduction, local_steps=1, rounds=1,
                                 k_min=0.2, k_max=0.8, eta=1.0, lam=5e-4))
    return method


def _check(server: nn.Module, after: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
           want: dict[str, torch.Tensor]) -> None:
    for name, p in server.named_parameters():
        torch.testing.assert_close(p.detach(), after[name], rtol=0, atol=1e-6)
    assert list(got) == list(want)
    for agent, g in want.items():
        torch.testing.assert_close(got[agent], g, rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_psl_server_steps_on_the_sum_of_each_clients_mean_loss(reduction: str) -> None:
    """L = Σ_i L_i, L_i client i's mean CE (the GAPSL paper eq. 8; `mean` divides by 3). Batches
    of 2, 3 and 4 rows: the mean over the 9 concatenated rows would weigh them otherwise.
    Client i gets ∂L_i/∂A_i; the reported loss is the mean of the L_i."""
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    div = 3 if reduction == "mean" else 1
    after, grads = _by_hand(
        server, acts, labels,
        lambda lg: sum(ce(x, y) for x, y in zip(lg, labels, strict=True)) / div,
        lambda i, lg: ce(lg, labels[i]), lr=0.1)
    with torch.no_grad():
        losses = [float(ce(server(x), y)) for x, y in zip(acts, labels, strict=True)]
    method = _psl_like(PSL, server, 0.1, reduction)
    loss, got = method.server_update(["a0", "a1", "a2"], acts, labels)
    assert loss == pytest.approx(sum(losses) / 3, abs=1e-6)
    _check(server, after, got, dict(zip(["a0", "a1", "a2"], grads, strict=True)))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_psl_server_step_down_weights_a_client_by_the_loss_bound(reduction: str) -> None:
    """Bounded influence: the loss bound's weights (here 1, 0.25, 1) scale each client's
    term of the server loss (L_0 + 0.25·L_1 + L_2, divided by 3 for `mean`, not by the
    weights' sum); the bound sees the clients' unweighted losses, and every client still
    gets ∂L_i/∂A_i of its own unweighted loss."""
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    div = 3 if reduction == "mean" else 1
    weights = [1.0, 0.25, 1.0]
    after, grads = _by_hand(
        server, acts, labels,
        lambda lg: sum(w * ce(x, y) for w, x, y in zip(weights, lg, labels, strict=True)) / div,
        lambda i, lg: ce(lg, labels[i]), lr=0.1)
    with torch.no_grad():
        losses = [float(ce(server(x), y)) for x, y in zip(acts, labels, strict=True)]
    seen: list[list[float]] = []

    def weigh(agents: list[str], got: list[float]) -> Any:
        assert agents == ["a0", "a1", "a2"]
        return seen.append(got) or weights

    method = _psl_like(PSL, server, 0.1, reduction, loss_weights=weigh)
    loss, got = method.server_update(["a0", "a1", "a2"], acts, labels)
    assert seen[0] == pytest.approx(losses, abs=1e-6)
    assert loss == pytest.approx(sum(losses) / 3, abs=1e-6)  # the report is unweighted
    _check(server, after, got, dict(zip(["a0", "a1", "a2"], grads, strict=True)))


def test_scala_concatenated_step_down_weights_a_slice_by_the_loss_bound() -> None:
    """SCALA's server loss under weights (1, 0.5, 1): Σ_k w_k·B_k·L^s_k / B, L^s_k slice
    k's logit-adjusted CE under the concatenation's prior P_s; the bound sees the three
    slices' L^s_k; the clients' gradients are those of the unweighted step."""
    from jetsplit.server.methods import scala_math

    server, acts, labels = toy_step()
    y = torch.cat(labels)
    prior = scala_math.label_prior(y, 3)
    weights = [1.0, 0.5, 1.0]
    sizes = [len(a) for a in acts]

    def server_loss(logits: list[torch.Tensor]) -> torch.Tensor:
        return sum(w * n * scala_math.logit_adjusted_ce(lg, t, prior, 1.0) for w, n, lg, t in
                   zip(weights, sizes, logits, labels, strict=True)) / sum(sizes)

    plain = copy.deepcopy(server)
    _, want_grads = scala_math.scala_server_step(
        plain, acts, labels, 3, torch.optim.SGD(plain.parameters(), lr=0.1))
    after, _ = _by_hand(server, acts, labels, server_loss, lambda i, lg: lg.sum(), lr=0.1)
    with torch.no_grad():
        slices = [float(scala_math.logit_adjusted_ce(server(x), t, prior, 1.0))
                  for x, t in zip(acts, labels, strict=True)]
    step = scala_math.concatenated_forward(server, acts, labels, 3, adjust=True)
    seen: list[list[float]] = [step.slice_losses()]
    _, grads = scala_math.concatenated_update(
        server, torch.optim.SGD(server.parameters(), lr=0.1), step, weights)
    assert seen[0] == pytest.approx(slices, abs=1e-6)
    _check(server, after, dict(enumerate(grads)), dict(enumerate(want_grads)))


def test_the_loss_bound_weighs_a_device_far_above_the_fleet_as_if_at_the_bound() -> None:
    """Factor 3: losses (0.5, 0.6, 0.4, 6.0): reference 0.55 (their median), bound 1.65,
    a3 weighs 1.65 / 6 = 0.275 and is noted; the history keeps 6.0 clipped to 1.65, so a
    second step's reference is the median of eight values, not moved by a3. A step where
    nobody is over the bound returns None (the unweighted path); factor 0 never weighs."""
    from jetsplit.server.defences.step_bounds import LossBound

    bound, notes, steps = LossBound(3.0, window=8), {}, {}
    agents = ["a0", "a1", "a2", "a3"]
    got = bound.weights(agents, [0.5, 0.6, 0.4, 6.0], notes, steps)
    assert got == pytest.approx([1.0, 1.0, 1.0, 1.65 / 6.0])
    assert list(bound.history) == pytest.approx([0.5, 0.6, 0.4, 1.65])
    assert list(notes) == ["a3"] and notes["a3"].startswith("1 steps down-weighted, last: ")
    assert "weight 0.275" in notes["a3"]
    got = bound.weights(agents, [0.5, 0.5, 0.5, 3.0], notes, steps)
    reference = float(np.median([0.5, 0.6, 0.4, 1.65, 0.5, 0.5, 0.5, 3.0]))
    assert got == pytest.approx([1.0, 1.0, 1.0, 3 * reference / 3.0])
    assert notes["a3"].startswith("2 steps down-weighted")
    assert bound.weights(agents, [0.5, 0.6, 0.4, 0.7], {}, {}) is None
    assert bound.weights(["a0"], [float("nan")], {}, {}) is None
    assert LossBound(0.0).weights(agents, [0.5, 0.6, 0.4, 60.0], {}, {}) is None


def test_the_loss_bound_never_down_weights_a_loss_under_its_floor() -> None:
    """Late in a clean run the fleet's median loss is 0.05: 3× it is 0.15, and an honest hard
    batch at 0.7 would be down-weighted; so would a SplitFed V2 device's 1.78 after the
    server block fitted the device before (median 0.56). With the floor at chance level,
    ln(10) ≈ 2.303 (the trainer's), neither is; a label flipper's 4.6 is, to the floor
    (weight 2.303/4.6), and the note says the floor bound it. Where 3× the median is over
    the floor, the floor changes nothing."""
    from jetsplit.server.defences.step_bounds import LOSS_FLOOR, LossBound

    floor = LOSS_FLOOR * math.log(10)
    agents = ["a0", "a1", "a2", "a3"]
    assert LossBound(3.0, floor=0.0).weights(agents, [0.05, 0.05, 0.05, 0.7], {}, {}) is not None
    assert LossBound(3.0, floor=floor).weights(agents, [0.05, 0.05, 0.05, 0.7], {}, {}) is None
    assert LossBound(3.0, floor=floor).weights(agents, [0.56, 0.55, 0.57, 1.78], {}, {}) is None
    notes: dict[str, str] = {}
    got = LossBound(3.0, floor=floor).weights(agents, [0.05, 0.05, 0.05, 4.6], notes, {})
    assert got == pytest.approx([1.0, 1.0, 1.0, floor / 4.6])
    assert "over the floor 2.303 (the fleet's 0.05)" in notes["a3"]
    assert LossBound(3.0, floor=floor).weights(agents, [1.0, 1.2, 0.8, 12.0], {}, {}) == \
        pytest.approx([1.0, 1.0, 1.0, 3.3 / 12.0])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gapsl_server_steps_only_on_the_selected_clients(
        monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    """With Ŝ = {0, 2}: the server steps on L_0 + L_2 (divided by |Ŝ| = 2 for `mean`, not by
    3), the λ term adds nothing to the gradient, and only a0 and a2 get a gradient."""
    selection = SimpleNamespace(selected=torch.tensor([0, 2]), scores=torch.zeros(3),
                                alignment_penalty=torch.tensor([0.3, 0.7]))
    monkeypatch.setattr(gapsl_math, "select_clients", lambda *a, **k: selection)
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    div = 2 if reduction == "mean" else 1
    after, grads = _by_hand(server, acts, labels,
                            lambda lg: (ce(lg[0], labels[0]) + ce(lg[2], labels[2])) / div,
                            lambda i, lg: ce(lg, labels[i]), lr=0.1)
    method = _psl_like(GAPSL, server, 0.1, reduction)
    method.tracker, method.step = gapsl_math.NuTracker(), 0
    _, got = method.server_update(["a0", "a1", "a2"], acts, labels)
    _check(server, after, got, {"a0": grads[0], "a2": grads[2]})


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gapsl_clips_each_clients_share_of_the_server_gradient(
        monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    """The gradient bound sees each client's own server-gradient norm ‖∂L_i/∂θ‖ (worked out
    here by hand) and its weights (1, 0.25, 1) scale the selected clients' terms:
    L_0 + 0.25·L_1 + L_2 (÷ 3 for `mean`); every client still gets ∂L_i/∂A_i unweighted."""
    selection = SimpleNamespace(selected=torch.tensor([0, 1, 2]), scores=torch.zeros(3),
                                alignment_penalty=torch.tensor([0.3, 0.7, 0.1]))
    monkeypatch.setattr(gapsl_math, "select_clients", lambda *a, **k: selection)
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    div = 3 if reduction == "mean" else 1
    weights = [1.0, 0.25, 1.0]
    params = list(server.parameters())
    norms = []
    for x, y in zip(acts, labels, strict=True):
        g = torch.autograd.grad(ce(server(x), y), params)
        norms.append(float(torch.cat([t.reshape(-1) for t in g]).norm()))
    after, grads = _by_hand(
        server, acts, labels,
        lambda lg: sum(w * ce(x, y) for w, x, y in zip(weights, lg, labels, strict=True)) / div,
        lambda i, lg: ce(lg, labels[i]), lr=0.1)
    seen: list[list[float]] = []

    def gradient_weights(agents: list[str], got: torch.Tensor) -> list[float]:
        assert agents == ["a0", "a1", "a2"]
        seen.append(got.tolist())
        return weights

    method = _psl_like(GAPSL, server, 0.1, reduction, share_weights=gradient_weights)
    method.tracker, method.step = gapsl_math.NuTracker(), 0
    _, got = method.server_update(["a0", "a1", "a2"], acts, labels)
    assert seen[0] == pytest.approx(norms, rel=1e-5)
    _check(server, after, got, dict(zip(["a0", "a1", "a2"], grads, strict=True)))


def _share_norms(server: nn.Module, terms: Any) -> list[float]:
    """By hand: ‖∂ term_i / ∂θ‖ for each client i, each term from its own forward."""
    params = list(server.parameters())
    return [float(torch.cat([g.reshape(-1) for g in torch.autograd.grad(term(), params)]
                            ).norm()) for term in terms]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_psl_under_all_shares_clips_each_clients_share_after_the_loss_bound(reduction: str) -> None:
    """`gradient_shares = "all"`: PSL measures each client's share of the server
    gradient, ‖∂(w_i·L_i)/∂θ‖ with w the loss bound's weights (1, 0.5, 1) (worked out here
    by hand, so a share measured before the loss bound, or on the mean loss, fails), and
    the gradient bound's weights (1, 1, 0.2) scale those terms: L_0 + 0.5·L_1 + 0.2·L_2
    (÷ 3 for `mean`); every client still gets ∂L_i/∂A_i unweighted."""
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    div = 3 if reduction == "mean" else 1
    loss_w, clip_w = [1.0, 0.5, 1.0], [1.0, 1.0, 0.2]
    norms = _share_norms(server, [lambda x=x, y=y, w=w: w * ce(server(x), y)
                                  for x, y, w in zip(acts, labels, loss_w, strict=True)])
    after, grads = _by_hand(
        server, acts, labels,
        lambda lg: sum(a * b * ce(x, y) for a, b, x, y in
                       zip(loss_w, clip_w, lg, labels, strict=True)) / div,
        lambda i, lg: ce(lg, labels[i]), lr=0.1)
    seen: list[list[float]] = []

    def measured(agents: list[str], got: list[float]) -> Any:
        assert agents == ["a0", "a1", "a2"]
        return seen.append(got) or clip_w

    method = _psl_like(PSL, server, 0.1, reduction, loss_weights=lambda agents, _: loss_w,
                       share_weights=measured, measures_shares=True)
    _, got = method.server_update(["a0", "a1", "a2"], acts, labels)
    assert seen[0] == pytest.approx(norms, rel=1e-5)
    _check(server, after, got, dict(zip(["a0", "a1", "a2"], grads, strict=True)))


def test_scala_under_all_shares_clips_a_slices_share_of_the_server_gradient() -> None:
    """SCALA's concatenated step with `shares`: it is shown ‖∂L^s_k/∂θ‖ per slice, the
    slice's MEAN loss (so a slice is not judged by its batch share; L^s_k under the
    concatenation's prior P_s, by hand from each slice's own forward; the Linear block has
    no batch coupling) and steps on Σ_k c_k·B_k·L^s_k/B with the weights c = (1, 0.3, 1)
    it returns; the clients' gradients are the unweighted step's. A `shares` that clips
    nobody gives the unweighted step, bit for bit."""
    from jetsplit.server.methods import scala_math

    server, acts, labels = toy_step()
    y = torch.cat(labels)
    prior = scala_math.label_prior(y, 3)
    sizes = [len(a) for a in acts]
    clip = [1.0, 0.3, 1.0]

    def term(k: int, logits: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return weight * sizes[k] * scala_math.logit_adjusted_ce(
            logits, labels[k], prior, 1.0) / sum(sizes)

    norms = _share_norms(server, [lambda k=k: scala_math.logit_adjusted_ce(
        server(acts[k]), labels[k], prior, 1.0) for k in range(3)])
    plain = copy.deepcopy(server)
    _, want_grads = scala_math.scala_server_step(
        plain, acts, labels, 3, torch.optim.SGD(plain.parameters(), lr=0.1))
    unclipped = copy.deepcopy(server)
    step = scala_math.concatenated_forward(unclipped, acts, labels, 3, adjust=True)
    scala_math.concatenated_update(unclipped, torch.optim.SGD(unclipped.parameters(), lr=0.1),
                                   step, None, None, step.terms(None))  # nobody clipped
    for p, q in zip(plain.parameters(), unclipped.parameters(), strict=True):
        assert torch.equal(p, q)
    after, _ = _by_hand(server, acts, labels,
                        lambda lg: sum(term(k, lg[k], clip[k]) for k in range(3)),
                        lambda i, lg: lg.sum(), lr=0.1)
    step = scala_math.concatenated_forward(server, acts, labels, 3, adjust=True)
    terms = step.terms(None)
    seen: list[list[float]] = [share_norms(terms, list(server.parameters()))]
    _, grads = scala_math.concatenated_update(
        server, torch.optim.SGD(server.parameters(), lr=0.1), step, None, clip, terms)
    assert seen[0] == pytest.approx(norms, rel=1e-5)
    _check(server, after, dict(enumerate(grads)), dict(enumerate(want_grads)))


def test_splitfed_v2_bounds_a_steps_gradient_against_the_recent_steps() -> None:
    """SplitFed V2 under `gradient_shares = "all"` serves one client per step, so its share
    of the server gradient is the step's gradient: three honest steps (a0, a1, a2), then a3
    with activations × 50. a3's step gradient norm is over 5× the median of the four norms
    (worked out by hand), so the server steps on its gradient scaled to that bound, the
    books say so, and a3 still gets its unweighted ∂L/∂A; the honest steps are plain SGD.
    Under the default `free` nothing is bounded."""
    from jetsplit.server.defences.defences import Defences
    from jetsplit.server.defences.step_bounds import StepGradientBound
    from jetsplit.server.methods.splitfed import SplitFedV2
    from jetsplit.server.training.settings import Settings

    server, acts, labels = toy_step((4, 4, 4, 4))
    acts[3] = acts[3] * 50
    ce = nn.functional.cross_entropy
    books = SimpleNamespace(gradient_clipped={}, gradient_clipped_steps={})
    defences = Defences(Settings(loss_bound=0.0), 3, None, books)  # type: ignore[arg-type]
    defences.step_gradient_bound = StepGradientBound(5.0, window=8)
    defences.settings = SimpleNamespace(gradient_shares="all")  # type: ignore[assignment]
    trainer = SimpleNamespace(server=server, optimizer=torch.optim.SGD(server.parameters(), lr=0.1),
                              defences=defences, books=books, settings=defences.settings,
                              step_gradient_weight=defences.step_gradient_weight)
    method = SplitFedV2.__new__(SplitFedV2)
    method.trainer = trainer
    ref = copy.deepcopy(server)
    norms = []
    for k in range(4):
        leaf = acts[k].clone().requires_grad_(True)
        grads = torch.autograd.grad(ce(ref(leaf), labels[k]), [*ref.parameters(), leaf])
        norm = float(torch.cat([g.reshape(-1) for g in grads[:-1]]).norm())
        norms.append(norm)
        bound = 5.0 * float(np.median(norms))
        weight = bound / norm if norm > bound else 1.0
        assert (weight < 1.0) == (k == 3)
        _, got = method.server_update([f"a{k}"], [acts[k]], [labels[k]])
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads[:-1], strict=True):
                p.sub_(0.1 * weight * g)
        for p, q in zip(server.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[f"a{k}"], grads[-1], rtol=0, atol=1e-6)
    assert books.gradient_clipped_steps == {"a3": 1}
    assert books.gradient_clipped["a3"].startswith(
        "1 steps with its server-gradient share clipped, last: gradient norm ")
    trainer.settings.gradient_shares = "free"  # the default: SplitFed V2 is not bounded
    huge = [torch.full((3, 3), 1e6), torch.full((3,), 1e6)]
    assert trainer.step_gradient_weight("a3", huge) is None
    trainer.settings.gradient_shares = "all"
    assert trainer.step_gradient_weight("a3", huge) is not None


def test_scala_server_uses_the_batch_prior_and_each_client_its_registered_prior() -> None:
    """Server: CE(s + log P_s, Y), P_s the concatenated batch's label shares (4/9, 3/9, 2/9
    here), mean over all rows. Client k: its own mean CE(s_k + log P_k, Y_k)
    with P_k the prior it registered — chosen unlike its batch's labels and unlike the
    other clients', so using the batch's prior, P_s, or another agent's prior all fail."""
    server, acts, labels = toy_step()
    priors = {"a0": torch.tensor([0.7, 0.2, 0.1]), "a1": torch.tensor([0.1, 0.1, 0.8]),
              "a2": torch.tensor([0.3, 0.6, 0.1])}
    y = torch.cat(labels)
    p_s = torch.bincount(y, minlength=3).double() / len(y)
    ce = nn.functional.cross_entropy
    agents = ["a0", "a1", "a2"]
    after, grads = _by_hand(
        server, acts, labels,
        lambda lg: ce(torch.cat(lg) + torch.log(p_s).float(), y),
        lambda i, lg: ce(lg + torch.log(priors[agents[i]]), labels[i]), lr=0.1)
    method = _psl_like(SCALA, server, 0.1, "sum")
    method.label_prior = priors.__getitem__
    method.num_classes = 3
    _, got = method.server_update(agents, acts, labels)
    _check(server, after, got, dict(zip(agents, grads, strict=True)))


# ---------------------------------------------------------------- partitioners' shapes


LABELS = np.repeat(np.arange(5), 6)  # 5 classes × 6 samples


def test_iid_and_ampere_quotas_are_array_split_sizes() -> None:
    """30 samples over 4 clients: 8, 8, 7, 7 each, every sample once; Ampere's quotas are
    the same N/K split whatever the class vectors."""
    for scheme in ("iid", "ampere:0.33", "ampere:0.05"):
        parts = partition(LABELS, 4, scheme, seed=1)
        assert [p.size for p in parts] == [8, 8, 7, 7], scheme
        assert sorted(np.concatenate(parts).tolist()) == list(range(30)), scheme


def test_quantity_gives_each_client_alpha_classes_split_evenly_among_holders() -> None:
    """#C=2 over 5 clients: client i holds class i and one more; each class's 6 samples are
    split into equal parts (array_split) among the clients holding it."""
    parts = partition(LABELS, 5, "quantity:2", seed=2)
    held = [sorted(set(LABELS[p].tolist())) for p in parts]
    assert all(len(h) == 2 and i in h for i, h in enumerate(held))
    for c in range(5):
        holders = [i for i, h in enumerate(held) if c in h]
        shares = [int(np.sum(LABELS[parts[i]] == c)) for i in holders]
        want = [len(s) for s in np.array_split(np.arange(6), len(holders))]
        assert shares == want, c
    assert sum(p.size for p in parts) == 30  # every class has a holder (client c holds c)


def test_dirichlet_covers_everything_with_at_least_two_each() -> None:
    parts = partition(LABELS, 6, "dirichlet:0.05", seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(30))
    assert min(p.size for p in parts) >= 2 and len({p.size for p in parts}) > 1

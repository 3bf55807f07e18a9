"""Fast tier: what each round STARTS from, for every method in the catalog, over three
rounds at mixed cuts (1, 3, 1, 3 on a tiny model; FedAvg and SHeRL-FL, common-cut methods,
at one cut; Ampere at 1, 2, 1, 2), with SGD momentum so that optimiser state exists.

Each method's pieces are pinned elsewhere one at a time; these tests pin the wiring between a
method and the pieces it drives over several rounds. The expected start of round r is worked
out here with plain NumPy/torch from what round r-1 ended with (every float tensor, within
an ulp of the float64 mean): the global client block, each device's block, each shallow
device's completion copy and its optimiser, the server block (or, for SplitFed V1 and
LLA-SFL, each device's server copy, recomputed step by step from the activations it got),
the server's optimiser state, aux heads. A method that forgets a reset (stale copies, a
carried momentum) fails, and so does one that resets what it must keep (PSL's and GAPSL's own
blocks and their optimisers, the shared server block and its momentum).

Observed through the trainer's and engine's calls (`forward`, `pull`, `send_and_receive`)
and the `Completions` interface, never through a method's own attributes."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit import catalog
from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.server.engines.seam import Command, InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

Arrays = dict[str, np.ndarray]
SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SERVER_CUT = 3
ROUNDS = 3
LR, MOMENTUM = 0.05, 0.9
SIZES = {"a0": 40, "a1": 70, "a2": 90, "a3": 60}  # |D_k|, all unequal
MIXED = {"a0": 1, "a1": 3, "a2": 1, "a3": 3}
#: Ampere's two variants train client + aux head on the devices (their own test below).
AVERAGING = [n for n, e in catalog.METHODS.items() if e.splits and e.aggregates_clients
             and not e.common_cut and not e.implementation.startswith("ampere:")]
OWN_BLOCKS = [n for n, e in catalog.METHODS.items() if e.splits and not e.aggregates_clients]
SERVER_COPIES = {"splitfed-v1", "lla-sfl"}  # a server-block copy per device per round


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, SERVER_CUT, tmp_path_factory.mktemp("wiring") / "k", seed=3,
                          tar=True, aux_ratio=None)
    assert report.tar_path is not None
    return report.tar_path


@pytest.fixture(scope="module")
def aux_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("wiring-aux") / "k", seed=3,
                          tar=True)
    assert report.tar_path is not None
    return report.tar_path


@functools.cache
def _digits() -> tuple[Any, Any]:
    """The digits split, loaded once per module (read-only: shards are subsets); the
    held-out part cut to 64 samples, as evaluation is not what these tests pin."""
    train, test = load_dataset_split("digits", 0.2, 0)
    return train, test.subset(np.arange(64))


def _workers() -> dict[str, AgentWorker]:
    train, _ = _digits()
    order = np.random.default_rng(0).permutation(len(train))
    workers, start = {}, 0
    for i, (agent, size) in enumerate(SIZES.items()):
        workers[agent] = AgentWorker(agent, train.subset(order[start:start + size]), seed=i)
        start += size
    return workers


def _trainer(archive: Path, algorithm: str, cuts: dict[str, int] | None,
             **settings: Any) -> Trainer:
    _, test = _digits()
    torch.manual_seed(0)
    base: dict[str, Any] = dict(algorithm=algorithm, rounds=ROUNDS, local_steps=2, batch=32,
                                lr=LR, optimizer="sgd", momentum=MOMENTUM, seed=0)
    return Trainer(InProcessEngine(_workers()), archive, Settings(**{**base, **settings}),
                   test, cuts=cuts)


# ---------------------------------------------------------------- by hand


def _floats(arrays: Arrays) -> Arrays:
    return {k: v for k, v in arrays.items() if v.dtype.kind == "f"}


def _mean(states: dict[str, Arrays], weights: dict[str, int]) -> Arrays:
    """Σ_k w_k·state_k / Σ_k w_k in float64, over every float tensor any of them holds
    (a tensor held by some devices only is averaged over those)."""
    names = sorted({n for s in states.values() for n in _floats(s)})
    out = {}
    for name in names:
        holders = [a for a in states if name in states[a]]
        total = sum(weights[a] for a in holders)
        out[name] = sum(states[a][name].astype(np.float64) * (weights[a] / total)
                        for a in holders)
    return out


def _close(got: Arrays, want: Arrays, what: str, ulps: int = 2) -> None:
    """float64 means cast to float32: within an ulp or two of the hand value."""
    assert want, what
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: missing {missing[:3]}"
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=ulps * 1.2e-7, atol=1e-12,
                                   err_msg=f"{what}: {name}")


def _equal(got: Arrays, want: Arrays, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{what}: {name}"


def _layers_after(arrays: Arrays, names: list[str]) -> Arrays:
    return {n: arrays[n] for n in names if n in arrays}


def _names_by_cut(global_client: Arrays) -> dict[int, list[str]]:
    """Client tensor names of layers 1..k, by k (layers in the block's order)."""
    layers: list[str] = []
    for name in global_client:
        layer = name.split("/", 1)[1].split(".", 1)[0]
        if layer not in layers:
            layers.append(layer)
    return {k: [n for n in global_client if n.split("/", 1)[1].split(".", 1)[0]
                in layers[:k]] for k in range(1, len(layers) + 1)}


def _optimiser_state(optimizer: torch.optim.Optimizer) -> list[np.ndarray]:
    """Every state tensor (momentum buffers), in parameter order."""
    state = optimizer.state_dict()["state"]
    return [v.detach().cpu().numpy().copy() for i in sorted(state)
            for _, v in sorted(state[i].items()) if torch.is_tensor(v)]


def _log_prior(worker: AgentWorker) -> torch.Tensor:
    """log P_k from the device's own labels (SCALA eq. 15, floored at 1e-12)."""
    counts = np.bincount(worker.data.y, minlength=SPEC.num_classes).astype(np.float64)
    p = (counts / counts.sum() + 1e-12) / (1.0 + SPEC.num_classes * 1e-12)
    return torch.log(torch.tensor(p, dtype=torch.float32))


# ---------------------------------------------------------------- observing a run


class Recorder:
    """Snapshots at the first device exchange of each round (`start`) and just before the
    round's end hook (`end`), and the server updates (SplitFed V1's copies, by hand)."""

    def __init__(self, t: Trainer, method: Any, blocks: tuple[str, ...] = ("client",),
                 first: str = "forward") -> None:
        self.t, self.method, self.blocks = t, method, blocks
        self.start: dict[int, dict[str, Any]] = {}
        self.end: dict[int, dict[str, Any]] = {}
        self.updates: dict[int, list[tuple]] = {}
        if first == "forward":
            self._wrap(t, "forward", lambda *a, **k: self._first())
        else:
            engine = t.engine

            def on_send(commands: dict, **kwargs: Any) -> None:
                if any(c.kind == "train" for c in commands.values()):
                    self._first()
            self._wrap(engine, "send_and_receive", on_send)
        if hasattr(method, "end_round"):
            self._wrap(method, "end_round", lambda *a, **k: self._snap(self.end))
        if hasattr(method, "server_update"):
            original = method.server_update

            def server_update(agents, acts, labels):  # noqa: ANN001, ANN202
                loss, grads = original(agents, acts, labels)
                self.updates.setdefault(t.round, []).append(
                    (list(agents), [x.detach().clone() for x in acts],
                     [y.clone() for y in labels],
                     {a: g.detach().clone() for a, g in grads.items()}))
                return loss, grads
            method.server_update = server_update

    @staticmethod
    def _wrap(obj: Any, name: str, before: Callable[..., None]) -> None:
        original = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before(*args, **kwargs)
            return original(*args, **kwargs)
        setattr(obj, name, wrapped)

    def _first(self) -> None:
        if self.t.round not in self.start:
            self._snap(self.start)

    def _snap(self, into: dict[int, dict[str, Any]]) -> None:
        t = self.t
        agents = sorted(SIZES)
        into[t.round] = {
            "global": {k: v.copy() for k, v in t.global_client.items()},
            "devices": t.pull(agents, self.blocks),
            "completions": {a: t.completions.state(a) for a in agents},
            "completion_optimisers": {a: _optimiser_state(t.completions.optimizers[a])
                                      for a in agents if a in t.completions.optimizers},
            "device_optimisers": {a: bool(w._optimizers) for a, w in t.engine.workers.items()},
            "server": to_arrays(t.server, "server"),
            "server_module": copy.deepcopy(t.server),
            "server_optimiser": _optimiser_state(t.optimizer),
        }


def _run(t: Trainer, method: Any, rounds: int = ROUNDS) -> list[int]:
    """The round loop's calls: train the round, then evaluate; returns the bytes of weights
    pushed to the devices (`set_weights`) in each round."""
    pushed = []
    for r in range(rounds):
        t.round = r
        before = t.engine.counters.by_kind()["down"].get("set_weights", 0)
        method.run_round(sorted(SIZES))
        pushed.append(t.engine.counters.by_kind()["down"].get("set_weights", 0) - before)
        method.evaluate()
    return pushed


def _server_copies_by_hand(start: dict[str, Any], updates: list[tuple],
                           loss: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
                           ) -> Arrays:
    """SplitFed V1's round on the server, by hand: each device's copy starts from the
    round's server block with a fresh SGD(momentum) and steps on its own activations; each
    step's activation gradient must be what the device got; returns the |D_k| mean."""
    copies: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for agents, acts, labels, grads in updates:
        for agent, x, y in zip(agents, acts, labels, strict=True):
            if agent not in copies:
                module = copy.deepcopy(start["server_module"])
                copies[agent] = (module, torch.optim.SGD(module.parameters(), lr=LR,
                                                         momentum=MOMENTUM))
            module, optimizer = copies[agent]
            leaf = x.clone().requires_grad_(True)
            module.train()
            optimizer.zero_grad(set_to_none=True)
            loss(agent, module(leaf), y).backward()
            optimizer.step()
            np.testing.assert_allclose(grads[agent].numpy(), leaf.grad.numpy(), rtol=1e-4,
                                       atol=1e-7, err_msg=f"{agent}'s activation gradient")
    assert sorted(copies) == sorted(SIZES)
    return _mean({a: to_arrays(m, "server") for a, (m, _) in copies.items()}, SIZES)


# ---------------------------------------------------------------- split methods, mixed cuts


@pytest.mark.parametrize("algorithm", AVERAGING)
def test_an_averaging_method_starts_every_round_from_the_global_block(
        archive: Path, algorithm: str) -> None:
    """Every round starts each device from the |D_k|-weighted mean of last round's whole
    blocks (device layers ∪ completion copy) and no optimiser state, each shallow device's
    completion copy from the same mean's layers c_k+1..c* with a fresh optimiser; the
    server block (and its momentum) carries over, or, with server copies, is the |D_k|
    mean of copies that each started from it with a fresh optimiser."""
    t = _trainer(archive, algorithm, MIXED)
    method = build_method(algorithm, t)
    initial = {k: v.copy() for k, v in t.global_client.items()}
    names = _names_by_cut(initial)
    rec = Recorder(t, method)
    pushed = _run(t, method)
    assert sorted(rec.start) == sorted(rec.end) == list(range(ROUNDS))
    # round 0 starts from the bundle's block, which the devices already hold: no push
    assert pushed[0] == 0 and all(p > 0 for p in pushed[1:]), pushed
    want_server: Arrays | None = None
    prior = {a: _log_prior(w) for a, w in t.engine.workers.items()}

    def loss(agent: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The copy's loss: CE, on logits + log P_k for LLA-SFL (its registered prior)."""
        adjusted = logits + prior[agent] if algorithm == "lla-sfl" else logits
        return nn.functional.cross_entropy(adjusted, y)

    for r in range(ROUNDS + 1):
        if r == 0:
            want = _floats(initial)
        else:
            end = rec.end[r - 1]
            whole = {a: {**end["devices"][a], **end["completions"][a]} for a in SIZES}
            assert all(sorted(w) == sorted(initial) for w in whole.values())
            want = _mean(whole, SIZES)
        if r == ROUNDS:  # after the last round: the global block only
            _close(t.global_client, want, f"global block after round {r - 1}")
            break
        start = rec.start[r]
        _close(start["global"], want, f"round {r}: global block")
        for agent, cut in MIXED.items():
            device = start["devices"][agent]
            assert sorted(device) == sorted(names[cut]), agent
            _close(device, _layers_after(want, names[cut]), f"round {r}: {agent}'s block")
            tail = [n for n in initial if n not in names[cut]]
            if tail:
                _close(start["completions"][agent], _layers_after(want, tail),
                       f"round {r}: {agent}'s completion copy")
                assert start["completion_optimisers"][agent] == [], (r, agent)
            else:
                assert start["completions"][agent] == {}, agent
            assert not start["device_optimisers"][agent], (r, agent)
        if algorithm in SERVER_COPIES:
            if r == 0:
                _equal(start["server"], rec.start[0]["server"], "server block")
            else:
                assert want_server is not None
                _close(start["server"], want_server, f"round {r}: server block", ulps=40)
            assert start["server_optimiser"] == []  # the shared block never steps
            want_server = _server_copies_by_hand(start, rec.updates[r], loss)
        elif r > 0:  # one shared server block: kept, momentum and all
            _equal(start["server"], rec.end[r - 1]["server"], f"round {r}: server block")
            kept = rec.end[r - 1]["server_optimiser"]
            assert kept and all(np.array_equal(a, b) for a, b in zip(
                start["server_optimiser"], kept, strict=True)), f"round {r}: server momentum"
    if algorithm in SERVER_COPIES:
        assert want_server is not None
        _close(to_arrays(t.server, "server"), want_server, "server after the last round",
               ulps=40)


@pytest.mark.parametrize("algorithm", OWN_BLOCKS)
def test_a_method_without_client_averaging_keeps_every_devices_own_block(
        archive: Path, algorithm: str) -> None:
    """PSL/GAPSL: the global client block never moves; each round starts each device
    from its own block as last round left it (device layers and completion copy, bit for
    bit) with its optimiser state kept on both sides; the server block and its momentum
    carry over. Round 0 starts everyone from the bundle's block."""
    t = _trainer(archive, algorithm, MIXED)
    method = build_method(algorithm, t)
    initial = {k: v.copy() for k, v in t.global_client.items()}
    names = _names_by_cut(initial)
    rec = Recorder(t, method)
    _run(t, method)
    assert sorted(rec.start) == sorted(rec.end) == list(range(ROUNDS))
    moved = kept_optimisers = kept_momenta = 0
    for r in range(ROUNDS):
        start = rec.start[r]
        _equal(start["global"], initial, f"round {r}: global block")
        for agent, cut in MIXED.items():
            tail = [n for n in initial if n not in names[cut]]
            if r == 0:
                _equal(start["devices"][agent], _layers_after(initial, names[cut]), agent)
                _equal(start["completions"][agent], _layers_after(initial, tail) if tail
                       else {}, agent)
                assert not start["device_optimisers"][agent]
                continue
            end = rec.end[r - 1]
            _equal(start["devices"][agent], end["devices"][agent], f"round {r}: {agent}")
            _equal(start["completions"][agent], end["completions"][agent],
                   f"round {r}: {agent}'s completion copy")
            moved += not np.array_equal(start["devices"][agent][names[1][0]],
                                        initial[names[1][0]])
            # an optimiser a device built stays (GAPSL: one never chosen has none yet)
            assert start["device_optimisers"][agent] == end["device_optimisers"][agent], (
                f"round {r}: {agent}'s optimiser")
            kept_optimisers += end["device_optimisers"][agent]
            if tail:
                kept = end["completion_optimisers"][agent]
                got = start["completion_optimisers"][agent]
                assert len(got) == len(kept) and all(
                    np.array_equal(a, b) for a, b in zip(got, kept, strict=True)), (r, agent)
                kept_momenta += bool(kept)
        if r > 0:
            _equal(start["server"], rec.end[r - 1]["server"], f"round {r}: server block")
            kept = rec.end[r - 1]["server_optimiser"]
            assert kept and all(np.array_equal(a, b) for a, b in zip(
                start["server_optimiser"], kept, strict=True)), f"round {r}: server momentum"
    # the blocks really trained and really differ, so a reset to the global block shows
    assert moved >= 4 and kept_optimisers >= 4 and kept_momenta >= 1
    ends = rec.end[ROUNDS - 1]["devices"]
    assert not np.array_equal(ends["a0"][names[1][0]], ends["a2"][names[1][0]])


# ---------------------------------------------------------------- methods training on devices


class TrainRecorder:
    """For methods whose devices train on their own (`train` commands): what every device
    holds at the round's first `train`, and the states the method pulls after it."""

    def __init__(self, t: Trainer, blocks: tuple[str, ...]) -> None:
        self.t, self.blocks = t, blocks
        self.start: dict[int, dict[str, Any]] = {}
        self.end: dict[int, dict[str, Arrays]] = {}
        send, pull = t.engine.send_and_receive, t.pull

        def send_and_receive(commands: dict, **kwargs: Any) -> Any:
            if t.round not in self.start and any(c.kind == "train" for c in commands.values()):
                self.start[t.round] = {
                    "devices": pull(sorted(SIZES), blocks),
                    "device_optimisers": {a: bool(w._optimizers)
                                          for a, w in t.engine.workers.items()},
                    "global": {k: v.copy() for k, v in t.global_client.items()},
                    "server": to_arrays(t.server, "server")}
            return send(commands, **kwargs)

        def spy_pull(agents: list[str], blocks: tuple[str, ...] = ("client",), *,
                     release: bool = False) -> dict:
            states = pull(agents, blocks, release=release)
            if t.round in self.start and t.round not in self.end and blocks == self.blocks:
                self.end[t.round] = {a: {k: v.copy() for k, v in s.items()}
                                     for a, s in states.items()}
            return states

        t.engine.send_and_receive, t.pull = send_and_receive, spy_pull  # type: ignore


def test_fedavg_starts_every_round_from_the_average_of_the_whole_models(archive: Path) -> None:
    """FedAvg (one common cut: the whole model trains on each device): every round starts
    each device from the |D_k|-weighted mean of last round's client AND server parts, with
    no optimiser state; the coordinator's global client block and server block are that
    mean too."""
    t = _trainer(archive, "fedavg", None)
    method = build_method("fedavg", t)
    initial = {**t.global_client, **to_arrays(t.server, "server")}
    rec = TrainRecorder(t, ("client", "server"))
    _run(t, method)
    assert sorted(rec.start) == sorted(rec.end) == list(range(ROUNDS))
    for r in range(ROUNDS + 1):
        want = _floats(initial) if r == 0 else _mean(rec.end[r - 1], SIZES)
        if r > 0:  # the devices really trained apart, so a wrong or missing average shows
            ends = rec.end[r - 1]
            assert sum(not np.array_equal(v, ends["a2"][k]) for k, v in ends["a0"].items()
                       if v.dtype.kind == "f") > 20
        if r == ROUNDS:
            _close({**t.global_client, **to_arrays(t.server, "server")}, want,
                   "after the last round")
            break
        start = rec.start[r]
        _close({**start["global"], **start["server"]}, want, f"round {r}: coordinator")
        for agent in SIZES:
            assert sorted(start["devices"][agent]) == sorted(initial), agent
            _close(start["devices"][agent], want, f"round {r}: {agent}")
            assert not start["device_optimisers"][agent], (r, agent)


AMPERE = [n for n, e in catalog.METHODS.items() if e.implementation.startswith("ampere:")]
AMPERE_CUTS = {"a0": 1, "a1": 2, "a2": 1, "a3": 2}


@pytest.mark.parametrize("algorithm", AMPERE)
def test_ampere_starts_every_device_epoch_from_the_layerwise_average_and_its_cuts_head(
        aux_archive: Path, tmp_path: Path, algorithm: str) -> None:
    """Ampere's phase 1 at cuts 1, 2, 1, 2, three device epochs: each epoch starts every
    device from layer l averaged over the devices holding it (|D_k| weights), its own
    cut's aux head averaged over the devices at that cut, and no optimiser state; epoch 0
    from the bundle's block, the devices at one cut from one head."""
    t = _trainer(aux_archive, algorithm, AMPERE_CUTS, rounds=6, device_epochs=4, patience=9,
                 activation_dir=str(tmp_path / "work"))
    method = build_method(algorithm, t)
    initial = {k: v.copy() for k, v in t.global_client.items()}
    names = _names_by_cut(initial)
    rec = TrainRecorder(t, ("client", "aux"))
    _run(t, method)
    assert sorted(rec.start) == sorted(rec.end) == list(range(ROUNDS))
    groups = {c: [a for a, k in AMPERE_CUTS.items() if k == c] for c in (1, 2)}
    for r in range(ROUNDS):
        start = rec.start[r]
        if r == 0:
            client = _floats(initial)
            heads = {c: {k: v for k, v in start["devices"][group[0]].items()
                         if k.startswith("aux/")} for c, group in groups.items()}
            assert {k: v.shape for k, v in heads[1].items()} != {
                k: v.shape for k, v in heads[2].items()}
        else:
            end = rec.end[r - 1]
            client = _mean({a: {k: v for k, v in s.items() if k.startswith("client/")}
                            for a, s in end.items()}, SIZES)
            heads = {c: _mean({a: {k: v for k, v in end[a].items() if k.startswith("aux/")}
                               for a in group}, SIZES) for c, group in groups.items()}
            # the heads and layer 1 really differ between devices, so a wrong group shows
            assert not np.array_equal(end["a0"][names[1][0]], end["a2"][names[1][0]])
        _close(start["global"], client, f"round {r}: global block")
        for agent, cut in AMPERE_CUTS.items():
            device = start["devices"][agent]
            assert sorted(k for k in device if k.startswith("client/")) == sorted(names[cut])
            _close(device, _layers_after(client, names[cut]), f"round {r}: {agent}'s block")
            _close(device, _floats(heads[cut]), f"round {r}: {agent}'s head")
            assert not start["device_optimisers"][agent], (r, agent)


def test_sherl_starts_every_round_from_the_cloud_average_of_both_tiers(archive: Path) -> None:
    """SHeRL-FL (one common cut; edges e0 serving a0, a2 and e1 serving a1, a3; τ1 = 1,
    τ2 = T = 2): every round starts each client from the flat |D_k| mean of last round's
    client blocks with no optimiser state, each edge from the Σ|D_k|-weighted mean of last
    round's edge blocks, and the cloud head (and its momentum) where it was."""
    from jetsplit.edge_agent.edge import no_data

    edges = {"e0": ["a0", "a2"], "e1": ["a1", "a3"]}
    t = _trainer(archive, "sherl", None, edges=edges, edge_split=4, tau1=1, tau2=2)
    for i, edge in enumerate(edges):
        t.engine.workers[edge] = AgentWorker(edge, no_data(), role="edge", seed=10 + i)
    t.engine = InProcessEngine(t.engine.workers)
    t = Trainer(t.engine, archive, t.settings, t.test)
    method = build_method("sherl", t)
    initial = {k: v.copy() for k, v in t.global_client.items()}
    start: dict[int, dict[str, Any]] = {}
    end: dict[int, dict[str, Any]] = {}
    send, broadcast = t.engine.send_and_receive, t.engine.broadcast

    def weights(agents: list[str], block: str) -> dict[str, Arrays]:
        command = Command("get_weights", {"blocks": [block]})
        return {a: r.tensors for a, r in broadcast(command, agents, round=t.round).replies.items()}

    def spy_send(commands: dict, **kwargs: Any) -> Any:
        if t.round not in start and any(c.kind == "forward" for c in commands.values()):
            start[t.round] = {
                "clients": weights(sorted(SIZES), "client"), "edges": weights(
                    sorted(edges), "edge"),
                "device_optimisers": {a: bool(t.engine.workers[a]._optimizers) for a in SIZES},
                "global": {k: v.copy() for k, v in t.global_client.items()},
                "server": to_arrays(t.server, "server"),
                "server_optimiser": _optimiser_state(t.optimizer)}
        return send(commands, **kwargs)

    def spy_broadcast(command: Command, agents: list[str], **kwargs: Any) -> Any:
        out = broadcast(command, agents, **kwargs)
        if command.kind == "get_weights" and t.round in start:  # the last ones of the round
            block = command.meta["blocks"][0]
            end.setdefault(t.round, {})[block] = {a: {k: v.copy() for k, v in r.tensors.items()}
                                                  for a, r in out.replies.items()}
        return out

    evaluate = method.evaluate

    def spy_evaluate() -> dict[str, Any]:  # the round loop's next call after the round
        end[t.round].update(server=to_arrays(t.server, "server"),
                            server_optimiser=_optimiser_state(t.optimizer))
        return evaluate()

    t.engine.send_and_receive, t.engine.broadcast = spy_send, spy_broadcast  # type: ignore
    method.evaluate = spy_evaluate
    _run(t, method)
    assert sorted(start) == sorted(end) == list(range(ROUNDS))
    behind = {e: sum(SIZES[c] for c in cs) for e, cs in edges.items()}
    for r in range(ROUNDS + 1):
        if r == 0:
            clients, edge_block = _floats(initial), None
        else:
            last = end[r - 1]
            assert sorted(last["client"]) == sorted(SIZES) and sorted(last["edge"]) == ["e0",
                                                                                        "e1"]
            clients = _mean(last["client"], SIZES)
            edge_block = _mean(last["edge"], behind)
            # the two edges really trained apart, so a wrong weight shows
            assert sum(not np.array_equal(v, last["edge"]["e1"][n])
                       for n, v in last["edge"]["e0"].items()) > 5
        if r == ROUNDS:
            _close(t.global_client, clients, "global block after the last round")
            break
        now = start[r]
        _close(now["global"], clients, f"round {r}: global block")
        for agent in SIZES:
            _close(now["clients"][agent], clients, f"round {r}: {agent}")
            assert not now["device_optimisers"][agent], (r, agent)
        if edge_block is None:
            _equal(now["edges"]["e0"], now["edges"]["e1"], "round 0: edges")
        else:
            for edge in edges:
                _close(now["edges"][edge], edge_block, f"round {r}: {edge}'s block", ulps=2)
            _equal(now["server"], end[r - 1]["server"], f"round {r}: cloud head")
            kept = end[r - 1]["server_optimiser"]
            assert kept and all(np.array_equal(a, b) for a, b in zip(
                now["server_optimiser"], kept, strict=True)), f"round {r}: cloud momentum"


def test_sherl_averages_mid_round_on_its_tau_schedule(archive: Path) -> None:
    """SHeRL-FL with T = 12 local steps, τ1 = 3, τ2 = 6 (values at which a schedule off by
    two steps shows; τ2 = 2 = T hides it): the edges average and push after steps 3, 6 and
    9, the cloud after step 6; step 12 ends the round, which aggregates both without
    pushing."""
    from jetsplit.edge_agent.edge import no_data
    from jetsplit.server.methods.sherl import SHeRL

    edges = {"e0": ["a0", "a2"], "e1": ["a1", "a3"]}
    t = _trainer(archive, "sherl", None, edges=edges, edge_split=4, tau1=3, tau2=6,
                 local_steps=12, rounds=1)
    for i, edge in enumerate(edges):
        t.engine.workers[edge] = AgentWorker(edge, no_data(), role="edge", seed=10 + i)
    t = Trainer(InProcessEngine(t.engine.workers), archive, t.settings, t.test)
    method = build_method("sherl", t)
    assert isinstance(method, SHeRL)
    seen: list[tuple[int, str, bool]] = []
    for tier in ("edge", "cloud"):
        original = getattr(method, f"_{tier}_aggregate")

        def spy(period: Any, *, push: bool, tier: str = tier, original: Any = original) -> None:
            seen.append((method.steps_done, tier, push))
            original(period, push=push)
        setattr(method, f"_{tier}_aggregate", spy)
    method.run_round(sorted(SIZES))
    assert seen == [(3, "edge", True), (6, "edge", True), (6, "cloud", True),
                    (9, "edge", True), (12, "edge", False), (12, "cloud", False)]
    assert method.aggregations == {"edge": 4, "cloud": 2}

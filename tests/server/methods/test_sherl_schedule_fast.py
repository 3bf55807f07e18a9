"""SHeRL-FL's coordinator (server/methods/sherl.py) pinned in seconds, against scripted agents.

The agents here are a fake engine: clients and edges that answer every command SHeRL-FL
sends with values chosen so that the expected ones can be worked out by hand or by the
plain reference loops below (each client block moves w ← λ_k·w + δ_k per backward, each edge
block v ← μ_e·v + ε_e per step, with λ and μ different per agent, so that an average taken at
the wrong step, with the wrong weights or pushed to the wrong agents gives other numbers).
The model is a tiny user network (testing/usernets.py token_net, clients [:2], edges
[2:5], cloud head [5:]) whose cloud head trains with Adam on the edges' embeddings exactly as
a plain PyTorch loop in the test does.

Pinned: the tier topology (who gets which command, in which exchange, in which order of
phases); the τ1 / τ2 schedules at T = 12, τ1 = 3, τ2 = 6 (where (step + 1) % τ and
(step - 1) % τ disagree) and at τ1 = 1, with the pushes mid-round and none after the last
step; the weights of both averages (|D_k| of the clients each edge trained, Σ|D_k| of the
clients each edge served); what every round starts from; the cloud head's step (one edge, two,
and under the loss bound); bytes booked per tier; the planner's inputs for the default
edge split and the profiles it gets; every check on an untrusted reply and its one-line
message; the periods' and the cut's errors; checkpoint save and restore. Each test fails
for a plausible one-token change of the module (docs/testing.md, mutation testing)."""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scripted_agents import Sent, Tamper  # testing/, on the path in tests
from torch import nn

from jetsplit.bundle import Bundle, load_bundle
from jetsplit.errors import ConfigError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ZOO_VERSION, ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.server.engines.seam import Command, Engine, Outcome, Reply
from jetsplit.server.methods.sherl import SHeRL, _count, periods, tier_bytes
from jetsplit.server.training.checkpoints import CheckpointError
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

Arrays = dict[str, np.ndarray]
SPEC = ModelSpec("usernets:token_net", (3, 16, 16), 10)
K1 = 2  # clients: embed, flatten
K2 = 5  # edges: transpose, mix, relu (k2 - k1 = 3; k2 % k1, k2 // k1, k2 ^ k1 all differ)
EMBEDDING = (16, 8)  # the edge block's output per sample
CLASSES = 10
DEADLINE_S = 45.0  # odd, so that deadline / 2 and deadline // 2 differ
SIZES = {"a0": 10, "a1": 50, "a2": 20, "a3": 40}  # |D_k|, all unequal
EDGES = {"e0": ["a2", "a0"], "e1": ["a1"]}  # a3 registered but in no edge's group
LAMBDA = {"a0": 0.5, "a1": 0.75, "a2": 1.25, "a3": 0.9}  # client k: w ← λ_k·w + δ_k
DELTA = {"a0": 6.0, "a1": 2.0, "a2": 3.0, "a3": 5.0}
MU = {"e0": 0.5, "e1": 0.25, "e2": 0.75}  # edge e: v ← μ_e·v + ε_e
EPSILON = {"e0": 1.0, "e1": -2.0, "e2": 0.5}
STEP_KINDS = ("forward", "edge_step", "backward")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, K1, tmp_path_factory.mktemp("sherl-fast") / "k", seed=3,
                          tar=True, aux_ratio=None)
    assert report.tar_path is not None
    return report.tar_path


# ---------------------------------------------------------------- scripted agents

def _affine(arrays: Arrays, scale: float, shift: float) -> Arrays:
    return {k: (scale * v + shift).astype(v.dtype) if v.dtype.kind == "f" else v.copy()
            for k, v in arrays.items()}


class Fleet(Engine):
    """Clients (role `client`, registered |D_k|) and edges (role `edge`) that answer every
    command in agent-id order and log it. A client's forward sends `batch` samples to its
    edge; an edge's step answers with seeded embeddings, the labels of what its clients
    sent, a loss of its own and its samples; a client's backward needs its edge's gradient of
    this step. `tamper[(kind, agent)]` may change a reply, or return why it is missed."""

    def __init__(self, sizes: dict[str, int], edges: list[str],
                 profiles: dict[str, Any] | None = None) -> None:
        super().__init__("scripted")
        for agent, size in sizes.items():
            self.registry.register(agent, {"agent": agent, "role": "client",
                                           "zoo_version": ZOO_VERSION,
                                           "dataset": {"size": size},
                                           "profile": (profiles or {}).get(agent)})
        for edge in edges:
            self.registry.register(edge, {"agent": edge, "role": "edge",
                                          "zoo_version": ZOO_VERSION,
                                          "profile": (profiles or {}).get(edge)})
        self.sent: list[Sent] = []
        self.exchanges: list[tuple[str, int, list[str]]] = []  # (kind, step, agents)
        self.held: dict[str, Arrays] = {}  # each agent's block
        self.smashed: dict[str, tuple[str, int, np.ndarray]] = {}  # client → edge, n, labels
        self.gradient: dict[str, tuple[str, int, int]] = {}  # client → edge, round, step
        self.uploads: list[list[tuple[str, np.ndarray, np.ndarray]]] = []  # per edge step
        self.tamper: dict[tuple[str, str], Tamper] = {}
        self.scale: dict[str, float] = {}  # edge → its embeddings' scale (default 1)

    def send_and_receive(self, commands: Any, *, round: int = 0, step: int = 0,
                         deadline_s: float = 60.0) -> Outcome:
        replies: dict[str, Reply] = {}
        missed: dict[str, str] = {}
        kind = next(iter(commands.values())).kind if commands else ""
        self.exchanges.append((kind, step, sorted(commands)))
        if kind == "edge_step":
            self.uploads.append([])
        for agent in sorted(commands):
            command: Command = commands[agent]
            self.sent.append(Sent(command.kind, agent, round, step, copy.deepcopy(command.meta),
                                  {k: v.copy() for k, v in command.tensors.items()},
                                  command.work, deadline_s))
            self.counters.add(agent, command.kind, "down", 1)
            meta, tensors, why = self._answer(agent, command, round, step)
            tamper = self.tamper.get((command.kind, agent))
            if why is None and tamper is not None:
                why = tamper(meta, tensors, round, step)
            if why is not None:
                missed[agent] = why
                continue
            self.counters.add(agent, command.kind, "up", 2)
            replies[agent] = Reply(agent, command.kind, meta, tensors)
            if kind == "edge_step":
                self.uploads[-1].append((agent, tensors["embeddings"], tensors["labels"]))
        return self._finish(replies, missed, kind, round, step)

    def _answer(self, agent: str, command: Command, round: int, step: int
                ) -> tuple[dict[str, Any], Arrays, str | None]:
        kind, meta = command.kind, command.meta
        if kind in ("set_weights", "edge_load"):
            self.held[agent] = {k: v.copy() for k, v in command.tensors.items()}
        elif kind == "get_weights":
            return {}, {k: v.copy() for k, v in self.held[agent].items()}, None
        elif kind == "forward":
            n = int(meta["batch"])
            labels = (np.arange(n) * 3 + 7 * round + step + int(agent[1:])) % CLASSES
            self.smashed[agent] = (meta["edge"], n, labels.astype(np.int64))
            self.counters.add(agent, "smashed", "up", 100 * n)
            return {"samples": n}, {}, None
        elif kind == "edge_step":
            return self._edge_step(agent, meta["clients"], round, step)
        elif kind == "backward":
            if self.gradient.get(agent) != (self.smashed[agent][0], round, step):
                return {}, {}, "error: backward: no gradient from its edge for this step"
            self.held[agent] = _affine(self.held[agent], LAMBDA[agent], DELTA[agent])
        return {}, {}, None

    def _edge_step(self, edge: str, clients: list[str], round: int, step: int
                   ) -> tuple[dict[str, Any], Arrays, str | None]:
        sizes = [self.smashed[c][1] for c in clients]
        n = sum(sizes)
        labels = np.concatenate([self.smashed[c][2] for c in clients])
        rng = np.random.default_rng([int(edge[1:]), round, step])
        embeddings = (rng.standard_normal((n, *EMBEDDING)) * self.scale.get(edge, 1.0)
                      ).astype(np.float32)
        self.held[edge] = _affine(self.held[edge], MU[edge], EPSILON[edge])
        for client in clients:
            self.gradient[client] = (edge, round, step)
        self.counters.add(edge, "gradient", "up", 10 * n)
        loss = 0.5 + int(edge[1:]) + 0.125 * step
        return ({"clients": list(clients), "sizes": sizes, "loss": loss, "samples": n},
                {"embeddings": embeddings, "labels": labels}, None)

    # ---------------------------------------------------------------- reading the log

    def trace(self) -> list[str]:
        """Each exchange as `kind@step:agents` (step kinds) or `kind:agents`."""
        return [f"{k}@{s}:{','.join(a)}" if k in STEP_KINDS else f"{k}:{','.join(a)}"
                for k, s, a in self.exchanges]

    def of(self, kind: str, agent: str | None = None) -> list[Sent]:
        return [s for s in self.sent if s.kind == kind and agent in (None, s.agent)]


def _settings(**overrides: Any) -> Settings:
    """Plain FedAvg weights: the defences that would reweigh an upload or a step are off,
    so every number below is the method's own (tests switch one back on where it matters)."""
    base: dict[str, Any] = dict(
        algorithm="sherl", rounds=2, local_steps=2, tau1=1, tau2=2, batch=24, lr=0.1,
        cloud_lr=0.05, seed=0, edges=EDGES, edge_split=K2, deadline_s=DEADLINE_S,
        direction_check="off", label_check="off", size_cap=0, outlier_bound=0,
        activation_bound=0, loss_bound=0)
    return Settings(**{**base, **overrides})


@functools.cache
def _bundle(archive: Path) -> Bundle:
    """One loaded bundle for the module: it keeps the blocks asked for twice as templates
    and hands out copies, so no test rebuilds the user network."""
    return load_bundle(archive)


def _method(archive: Path, fleet: Fleet, **overrides: Any) -> SHeRL:
    """SHeRL-FL on the scripted fleet; every client starts from a zero client block (the
    trainer's global block too), every edge from nothing until its first edge_load."""
    t = Trainer(fleet, archive, _settings(**overrides), None,  # type: ignore[arg-type]
                bundle=_bundle(archive))
    t.shipper.ensure = lambda agents, round=0, cuts=None: list(agents)  # type: ignore
    t.global_client = {k: np.zeros_like(v) for k, v in t.global_client.items()}
    for agent in fleet.registry.registered():
        if fleet.registry.registration(agent)["role"] == "client":
            fleet.held[agent] = {k: v.copy() for k, v in t.global_client.items()}
    return SHeRL(t)


def _play(method: SHeRL, round_: int, selected: list[str] | None = None) -> float | None:
    t = method.trainer
    t.round = round_
    t.books.reset()
    return method.run_round(sorted(SIZES) if selected is None else selected)


def _fleet(edges: tuple[str, ...] = ("e0", "e1"), sizes: dict[str, int] | None = None,
           profiles: dict[str, Any] | None = None) -> Fleet:
    return Fleet(dict(SIZES if sizes is None else sizes), list(edges), profiles)


def _floats(arrays: Arrays) -> Arrays:
    return {k: v for k, v in arrays.items() if v.dtype.kind == "f"}


def _close(got: Arrays, want: dict[str, Any], what: str, rtol: float = 2e-6) -> None:
    assert sorted(_floats(got)) == sorted(want), what
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-6,
                                   err_msg=f"{what}: {name}")


def _mean(states: list[tuple[Arrays, float]]) -> Arrays:
    """Σ w·state / Σ w in float64."""
    total = sum(w for _, w in states)
    return {name: sum(s[name].astype(np.float64) * (w / total) for s, w in states)
            for name in _floats(states[0][0])}


def _edge_block(method: SHeRL) -> Arrays:
    return to_arrays(method.edge_view, "edge")


# ---------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(("steps", "tau1", "tau2", "want"), [
    (4, None, None, (4, 4)), (4, None, 2, (2, 2)), (4, 2, None, (2, 4)), (4, 2, 4, (2, 4)),
    (12, 2, 6, (2, 6)), (12, 3, 6, (3, 6)), (12, 1, 12, (1, 12)), (6, 3, 3, (3, 3)),
])
def test_periods_default_and_nest(steps: int, tau1: int | None, tau2: int | None,
                                  want: tuple[int, int]) -> None:
    assert periods(Settings(local_steps=steps, tau1=tau1, tau2=tau2)) == want


@pytest.mark.parametrize(("steps", "tau1", "tau2", "message"), [
    (4, 3, 4, "train.tau2 (4) must be a multiple of train.tau1 (3): the cloud aggregates "
              "what the edges have just aggregated"),
    (12, 4, 6, "train.tau2 (6) must be a multiple of train.tau1 (4): the cloud aggregates "
               "what the edges have just aggregated"),
    (4, None, 3, "train.local_steps (4) must be a multiple of train.tau2 (3): every round "
                 "ends with a cloud aggregation"),
    (12, 2, 8, "train.local_steps (12) must be a multiple of train.tau2 (8): every round "
               "ends with a cloud aggregation"),
    (6, 1, 4, "train.local_steps (6) must be a multiple of train.tau2 (4): every round "
              "ends with a cloud aggregation"),
])
def test_periods_that_do_not_nest_are_one_line_errors(steps: int, tau1: int | None,
                                                      tau2: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        periods(Settings(local_steps=steps, tau1=tau1, tau2=tau2))
    assert str(info.value) == message


@pytest.mark.parametrize(("value", "most", "ok"), [
    (1, 3, True), (2, 3, True), (3, 3, True), (0, 3, False), (-1, 3, False), (4, 3, False),
    (True, 3, False), (2.0, 3, False), ("2", 3, False), (None, 3, False), (1, 1, True),
])
def test_a_reply_sample_count_is_an_int_in_one_to_the_batch(value: object, most: int,
                                                            ok: bool) -> None:
    assert _count(value, most) is ok


def test_tier_bytes_books_each_message_once_by_role_direction_and_kind() -> None:
    """Every (role, direction, kind) of the tier table, a kind booked before the window
    (only the difference counts), a kind new in the window (counted whole), bundle
    installs left out, and everything else control traffic."""
    before = {"a0": {"up": {"smashed": 1000, "get_weights": 7}, "down": {"forward": 5}},
              "e0": {"up": {"gradient": 50}, "down": {}}}
    after = {
        "a0": {"up": {"smashed": 1300, "get_weights": 19, "forward": 4, "bundle": 900},
               "down": {"set_weights": 40, "forward": 8, "bundle_part": 5000}},
        "a1": {"up": {"smashed": 200, "gradient": 1}, "down": {"edge_load": 3}},
        "e0": {"up": {"gradient": 80, "edge_step": 60, "get_weights": 11, "status": 2},
               "down": {"edge_load": 30, "set_weights": 6, "edge_step": 1, "bundle": 77}},
    }
    assert tier_bytes(before, after, {"e0"}) == {
        "client_to_edge": 300 + 200, "edge_to_client": 30, "edge_to_cloud": 60,
        "model_client_edge": 12 + 40, "model_edge_cloud": 11 + 30,
        "control": 4 + 3 + 1 + 3 + 2 + 6 + 1}
    # nothing moved: every tier present, at zero
    assert tier_bytes(after, after, {"e0"}) == {
        "client_to_edge": 0, "edge_to_client": 0, "edge_to_cloud": 0, "model_client_edge": 0,
        "model_edge_cloud": 0, "control": 0}
    # an agent new since `before` (nothing for it there): counted from zero
    assert tier_bytes({}, {"e1": {"up": {"edge_step": 9}, "down": {}}}, {"e1"}) == {
        "client_to_edge": 0, "edge_to_client": 0, "edge_to_cloud": 9, "model_client_edge": 0,
        "model_edge_cloud": 0, "control": 0}


@pytest.mark.parametrize(("clients", "want"), [
    (1, {"e0": ["a0"]}),
    (2, {"e0": ["a0", "a1"]}),  # √2 rounds to 1
    (3, {"e0": ["a0", "a2"], "e1": ["a1"]}),  # √3 to 2
    (4, {"e0": ["a0", "a2"], "e1": ["a1", "a3"]}),
    (7, {"e0": ["a0", "a3", "a6"], "e1": ["a1", "a4"], "e2": ["a2", "a5"]}),  # √7 to 3
    (10, {"e0": ["a0", "a3", "a6", "a9"], "e1": ["a1", "a4", "a7"], "e2": ["a2", "a5", "a8"]}),
])
def test_simulations_run_the_square_root_of_the_fleet_in_edges(
        clients: int, want: dict[str, list[str]]) -> None:
    from jetsplit.server.run.simulate import sherl_topology

    assert sherl_topology("sherl", None, clients) == want


# ---------------------------------------------------------------- reply checks by hand


@pytest.fixture(scope="module")
def checker(archive: Path) -> SHeRL:
    """One method for the checks of untrusted replies (they read its edge block's names,
    shapes and dtypes, the embedding shape and the class count only)."""
    return _method(archive, _fleet())


def _reply(meta: dict[str, Any], tensors: Arrays | None = None) -> Reply:
    return Reply("e0", "edge_step", meta, tensors or {})


def _good(n: int) -> Arrays:
    return {"embeddings": np.zeros((n, *EMBEDDING), np.float32),
            "labels": np.arange(n, dtype=np.int64) % CLASSES}


SAMPLES = {"a0": 3, "a2": 4, "a5": 2}


@pytest.mark.parametrize(("served", "clients", "problem"), [
    (["a0", "a2"], ["a0", "a2"], None),
    (["a2"], ["a0", "a2"], None),
    (["a0"], ["a0", "a2"], None),
    (("a0", "a2"), ["a0", "a2"], "served clients ('a0', 'a2') are not a subsequence of "
                                 "['a0', 'a2']"),
    ([], ["a0", "a2"], "served clients [] are not a subsequence of ['a0', 'a2']"),
    (None, ["a0"], "served clients None are not a subsequence of ['a0']"),
    (["a2", "a0"], ["a0", "a2"], "served clients ['a2', 'a0'] are not a subsequence of "
                                 "['a0', 'a2']"),
    (["a0", "a2"], ["a2", "a0"], "served clients ['a0', 'a2'] are not a subsequence of "
                                 "['a2', 'a0']"),
    (["a0", "a0"], ["a0", "a2"], "served clients ['a0', 'a0'] are not a subsequence of "
                                 "['a0', 'a2']"),
    (["a0", "a5"], ["a0", "a2"], "served clients ['a0', 'a5'] are not a subsequence of "
                                 "['a0', 'a2']"),
])
def test_an_edge_must_name_a_subsequence_of_the_clients_asked(
        checker: SHeRL, served: Any, clients: list[str], problem: str | None) -> None:
    method = checker
    sizes = [SAMPLES[c] for c in served] if isinstance(served, list | tuple) else [1]
    reply = _reply({"clients": served, "sizes": sizes, "loss": 0.5}, _good(sum(sizes)))
    assert method._step_problem(reply, clients, SAMPLES) == problem


@pytest.mark.parametrize(("sizes", "loss", "problem"), [
    ([3, 4], 0.5, None), ([3, 4], 0.0, None),
    ([3, 5], 0.5, "sizes [3, 5] differ from what the clients sent"),
    ([3, 3], 0.5, "sizes [3, 3] differ from what the clients sent"),
    ([3], 0.5, "sizes [3] differ from what the clients sent"),
    ((3, 4), 0.5, "sizes (3, 4) differ from what the clients sent"),
    ([3, 4], 1, "loss 1"), ([3, 4], "0.5", "loss '0.5'"), ([3, 4], None, "loss None"),
    ([3, 4], math.nan, "loss nan"), ([3, 4], math.inf, "loss inf"),
])
def test_an_edge_must_report_the_sizes_sent_and_a_finite_float_loss(
        checker: SHeRL, sizes: Any, loss: Any, problem: str | None) -> None:
    method = checker
    reply = _reply({"clients": ["a0", "a2"], "sizes": sizes, "loss": loss}, _good(7))
    assert method._step_problem(reply, ["a0", "a2"], SAMPLES) == problem


def test_a_step_reply_is_checked_for_the_samples_it_served(checker: SHeRL) -> None:
    method = checker
    reply = _reply({"clients": ["a2"], "sizes": [4], "loss": 0.5}, _good(7))
    assert method._step_problem(reply, ["a0", "a2"], SAMPLES) == \
        "embeddings are float32 [7, 16, 8], expected float32 [4, 16, 8]"


def _emb(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(shape, dtype)


@pytest.mark.parametrize(("embeddings", "labels", "problem"), [
    (_emb((5, 16, 8)), np.array([0, 1, 2, 3, 9]), None),
    (_emb((5, 16, 8)), np.array([4, 4, 5, 6, 7], np.uint8), None),
    (_emb((5, 16, 8)), np.array([0, 0, 0, 0, 0], np.int32), None),
    (None, np.arange(5), "embeddings are None, expected float32 [5, 16, 8]"),
    (_emb((5, 16, 8), np.float64), np.arange(5),
     "embeddings are float64 [5, 16, 8], expected float32 [5, 16, 8]"),
    (_emb((5, 16, 8), np.float16), np.arange(5),
     "embeddings are float16 [5, 16, 8], expected float32 [5, 16, 8]"),
    (_emb((4, 16, 8)), np.arange(5), "embeddings are float32 [4, 16, 8], expected float32 "
                                      "[5, 16, 8]"),
    (_emb((6, 16, 8)), np.arange(5), "embeddings are float32 [6, 16, 8], expected float32 "
                                      "[5, 16, 8]"),
    (_emb((5, 16, 9)), np.arange(5), "embeddings are float32 [5, 16, 9], expected float32 "
                                      "[5, 16, 8]"),
    (np.full((5, 16, 8), np.inf, np.float32), np.arange(5),
     "embeddings contain NaN or infinity"),
    (_emb((5, 16, 8)), None, "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.arange(4), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.arange(6), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.zeros((5, 1), np.int64), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.zeros(5, np.float32), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.array([0, 1, 2, 3, 10]), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.array([0, 1, 2, 3, 11]), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.array([-1, 1, 2, 3, 4]), "labels must be 5 integers in 0..9"),
    (_emb((5, 16, 8)), np.array([-2, 1, 2, 3, 4]), "labels must be 5 integers in 0..9"),
])
def test_the_cloud_takes_finite_float32_embeddings_and_labels_in_range(
        checker: SHeRL, embeddings: np.ndarray | None, labels: np.ndarray | None,
        problem: str | None) -> None:
    method = checker
    tensors = {k: v for k, v in (("embeddings", embeddings), ("labels", labels))
               if v is not None}
    assert method._embeddings_problem(_reply({}, tensors), 5) == problem


def test_no_samples_need_no_labels_checked(checker: SHeRL) -> None:
    method = checker
    tensors = {"embeddings": _emb((0, 16, 8)), "labels": np.zeros(0, np.int64)}
    assert method._embeddings_problem(_reply({}, tensors), 0) is None


def test_an_edge_block_upload_must_match_the_edge_block(checker: SHeRL) -> None:
    method = checker
    good = _edge_block(method)
    assert method._edge_weights_problem(good) is None
    first, last = sorted(good)[0], sorted(good)[-1]
    missing = {k: v for k, v in good.items() if k != last}
    extra = {**good, "edge/zz.weight": good[last]}
    early = {**missing, "edge/aa.weight": good[last]}
    for tensors in (missing, extra, early, {k: v for k, v in good.items() if k != first}):
        assert method._edge_weights_problem(tensors) == \
            "edge weights do not match the edge block's tensors"
    for bad, say in [(good[first].astype(np.float64), "float64"),
                     (good[first].astype(np.float16), "float16"),
                     (good[first].astype(np.int32), "int32")]:
        assert method._edge_weights_problem({**good, first: bad}) == \
            f"tensor {first} is {say} {list(good[first].shape)}"
    for shape in [(good[first].size + 1,), (1, *good[first].shape), (max(0, good[first].size
                                                                           - 1),)]:
        bad = np.zeros(shape, np.float32)
        assert method._edge_weights_problem({**good, first: bad}) == \
            f"tensor {first} is float32 {list(shape)}"
    nan = good[last].copy()
    nan.flat[0] = np.nan
    assert method._edge_weights_problem({**good, last: nan}) == \
        f"tensor {last} contains NaN or infinity"


# ---------------------------------------------------------------- construction


def test_tiers_are_carved_at_the_configured_edge_split(archive: Path) -> None:
    method = _method(archive, _fleet())
    t = method.trainer
    assert method.edge_split == K2 and t.shipper.edge_layers == K2 - K1 == 3
    assert len(method.edge_view) == 3 and len(method.head) == 4
    assert [n for n, _ in method.edge_view.named_children()] == ["transpose", "mix", "relu"]
    assert method.embedding_shape == EMBEDDING
    assert method.edge_names == sorted(_edge_block(method))
    assert method.steps_done == 0 and method.aggregations == {"edge": 0, "cloud": 0}
    assert method.topology.edges == {"e0": ("a0", "a2"), "e1": ("a1",)}
    assert method.edges == {"e0", "e1"} and (method.tau1, method.tau2) == (1, 2)
    # the cloud head trains with Adam at the cloud's rate
    assert isinstance(t.optimizer, torch.optim.Adam)
    assert t.optimizer.param_groups[0]["lr"] == 0.05
    head = {id(p) for p in method.head.parameters()}
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == head


@pytest.mark.parametrize("k2", [2, 9, 12])
def test_an_edge_split_outside_the_server_block_is_a_one_line_error(archive: Path,
                                                                     k2: int) -> None:
    with pytest.raises(ConfigError) as info:
        _method(archive, _fleet(), edge_split=k2)
    assert str(info.value) == (f"edge_split {k2} must lie in 3..8 for usernets:token_net "
                               f"split at 2")


@pytest.mark.parametrize("k2", [3, 8])
def test_every_edge_split_in_range_is_taken(archive: Path, k2: int) -> None:
    method = _method(archive, _fleet(), edge_split=k2)
    assert method.edge_split == k2 and method.trainer.shipper.edge_layers == k2 - K1
    assert len(method.edge_view) == k2 - K1 and len(method.head) == 7 - (k2 - K1)


class _Planned:
    """The planner's entry points replaced: records what SHeRL-FL asks, answers (k1, k2)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, answer: tuple[int, int]) -> None:
        from jetsplit.export import planner

        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.answer = answer
        monkeypatch.setattr(planner, "plan_three_tier", self._plan)
        monkeypatch.setattr(planner, "check_three_tier", lambda plan: self.answer)

    def _plan(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        return "plan"


def _profile(name: str) -> dict[str, Any]:
    from jetsplit.profiles import resolve_profile

    return resolve_profile(name).model_dump(mode="python")


def test_the_planner_chooses_the_edge_split_from_the_fleet(
        archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `edge_split`: the three-tier planner gets the model's costs, the distinct
    profiles of the topology's clients and of the edges (a missing or malformed one planned
    as the fallback), the per-client batch B / K (at least 1), T, the codec, the largest
    group and k1, τ1, τ2; its k2 is taken."""
    from jetsplit.export.cost_model import get_costs

    planned = _Planned(monkeypatch, (K1 + 1, 6))
    profiles = {"a0": _profile("orin-nx-16gb"), "a1": _profile("orin-nx-16gb"),
                "a2": {"device": "not a profile"}, "e0": _profile("jetson-nano-4gb")}
    fleet = _fleet(("e0", "e1"), profiles=profiles)
    method = _method(fleet=fleet, archive=archive, edge_split=None, batch=64, local_steps=6,
                     tau1=3, tau2=6, codec="fp16",
                     edges={"e0": ["a0", "a1", "a2"], "e1": ["a3"]})
    assert method.edge_split == 6 and method.trainer.shipper.edge_layers == 4
    [(args, kwargs)] = planned.calls
    costs, clients, edges, plan = args
    assert costs == get_costs(SPEC.name, SPEC.input_shape, SPEC.num_classes)
    assert [p.name for p in clients] == ["orin-nx-16gb", "x86-cpu"]
    assert [p.name for p in edges] == ["jetson-nano-4gb", "x86-cpu"]
    assert (plan.batch, plan.local_steps, plan.codec) == (16, 6, "fp16")  # round(64 / 4)
    assert kwargs == {"clients_per_edge": 3, "k1": K1, "tau1": 3, "tau2": 6}


@pytest.mark.parametrize(("batch", "edges", "want"), [
    (64, {"e0": ["a0"]}, 64), (1, {"e0": ["a0", "a1"], "e1": ["a2", "a3"]}, 1),
    (50, {"e0": ["a0", "a1", "a2"]}, 17), (62, {"e0": ["a0", "a1"], "e1": ["a2", "a3"]}, 16),
])
def test_the_planner_batch_is_the_per_client_share(
        archive: Path, monkeypatch: pytest.MonkeyPatch, batch: int,
        edges: dict[str, list[str]], want: int) -> None:
    planned = _Planned(monkeypatch, (K1, K2))
    _method(archive, _fleet(), edge_split=None, batch=batch, edges=edges)
    [(args, kwargs)] = planned.calls
    assert args[3].batch == want
    assert kwargs["clients_per_edge"] == max(len(cs) for cs in edges.values())


def test_a_planned_edge_split_out_of_range_says_it_was_planned(
        archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _Planned(monkeypatch, (K1, 9))
    with pytest.raises(ConfigError) as info:
        _method(archive, _fleet(), edge_split=None)
    assert str(info.value) == ("the planned edge split 9 must lie in 3..8 for "
                               "usernets:token_net split at 2")


def test_without_a_topology_clients_are_dealt_round_robin_to_the_registered_edges(
        archive: Path) -> None:
    method = _method(archive, _fleet(("e0", "e1")), edges={})
    assert method.topology.edges == {"e0": ("a0", "a2"), "e1": ("a1", "a3")}
    with pytest.raises(ConfigError, match='sherl needs at least one agent with role = "edge"'):
        _method(archive, _fleet(()), edges={})


# ---------------------------------------------------------------- one round by hand


def test_one_round_by_hand(archive: Path) -> None:
    """T = 1: edge e0 serves a0 (|D| 10) and a2 (20), e1 serves a1 (50); a3 (40) is in no
    group and sits out. From zero client blocks one backward gives δ = 6, 3, 2; e0's
    average (10·6 + 20·3) / 30 = 4, e1's 2; the cloud's (30·4 + 50·2) / 80 = 2.75. The
    edge blocks: each edge_load gets the cloud's block, each step moves it v ← μ·v + ε,
    and the cloud averages them 30 : 50."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None)
    t = method.trainer
    start = _edge_block(method)
    loss = _play(method, 0)
    assert fleet.trace() == [
        "edge_load:e0,e1", "forward@0:a0,a1,a2", "edge_step@0:e0,e1", "backward@0:a0,a1,a2",
        "get_weights:a0,a1,a2", "get_weights:e0,e1", "release:a0,a1,a2"]
    _close(t.global_client, {k: np.full(v.shape, 2.75) for k, v in _floats(
        t.global_client).items()}, "global client block")
    e0, e1 = (_affine(start, MU[e], EPSILON[e]) for e in ("e0", "e1"))
    _close(_edge_block(method), _mean([(e0, 30), (e1, 50)]), "global edge block")
    assert method.steps_done == 1 and method.aggregations == {"edge": 1, "cloud": 1}
    assert loss is not None and method.extra_metrics["edge_loss"] == (0.5 + 1.5) / 2
    # B_k = B·|D_k| / Σ over the clients that train (a3, in no group, does not)
    assert {s.agent: s.meta["batch"] for s in fleet.of("forward")} == {
        "a0": 3, "a1": 15, "a2": 6}


def test_the_edge_average_weighs_clients_by_size_and_the_cloud_edges_by_their_clients(
        archive: Path) -> None:
    """The same round with a0 (10) and a2 (20) under e0 and a1 (50), a3 (40) under e1:
    e0's client average (10·6 + 20·3) / 30 = 4, e1's (50·2 + 40·5) / 90 = 10/3; the cloud
    weighs them 30 : 90 (not 1 : 1, not by client count): (30·4 + 90·10/3) / 120 = 3.5."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None,
                     edges={"e0": ["a0", "a2"], "e1": ["a1", "a3"]})
    start = _edge_block(method)
    _play(method, 0)
    want = 3.5
    _close(method.trainer.global_client, {k: np.full(v.shape, want) for k, v in _floats(
        method.trainer.global_client).items()}, "global client block")
    e0, e1 = (_affine(start, MU[e], EPSILON[e]) for e in ("e0", "e1"))
    _close(_edge_block(method), _mean([(e0, 30), (e1, 90)]), "global edge block")


# ---------------------------------------------------------------- the schedule


def _steps(first: int, last: int, clients: str = "a0,a1,a2", edges: str = "e0,e1"
           ) -> list[str]:
    out = []
    for s in range(first, last + 1):
        out += [f"forward@{s}:{clients}", f"edge_step@{s}:{edges}", f"backward@{s}:{clients}"]
    return out


EDGE_PUSH = ["get_weights:a0,a1,a2", "set_weights:a0,a2", "set_weights:a1"]
CLOUD_PUSH = ["get_weights:e0,e1", "edge_load:e0,e1", "set_weights:a0,a1,a2"]
ROUND_END = ["get_weights:a0,a1,a2", "get_weights:e0,e1", "release:a0,a1,a2"]


def _reference(method: SHeRL, rounds: int, groups: dict[str, list[str]]
               ) -> list[tuple[Arrays, Arrays, list[tuple[str, Arrays]]]]:
    """The schedule as the paper and docs/methods.md state it, in float64: per step each
    client w ← λw + δ and each edge v ← μv + ε; after every τ1-th step each edge's clients
    averaged (|D_k|) and, steps following, installed on them; after every τ2-th the cloud
    averages the edges' client averages and edge blocks (Σ|D_k| behind each) and, steps
    following, installs both on everyone; each round starts from the cloud's two blocks.
    Per round: the global client and edge blocks it ends with, and its pushes in order."""
    s = method.trainer.settings
    steps, tau1, tau2 = s.local_steps, s.tau1 or s.tau2 or s.local_steps, \
        s.tau2 or s.local_steps
    names = _floats(method.trainer.global_client)
    g_client: Arrays = {k: np.zeros(v.shape) for k, v in names.items()}
    g_edge = {k: v.astype(np.float64) for k, v in _floats(_edge_block(method)).items()}
    weight = {e: sum(SIZES[c] for c in cs) for e, cs in groups.items()}
    out: list[tuple[Arrays, Arrays, list[tuple[str, Arrays]]]] = []
    for _ in range(rounds):
        w = {c: dict(g_client) for cs in groups.values() for c in cs}
        v = {e: dict(g_edge) for e in groups}
        log: list[tuple[str, Arrays]] = []
        m: dict[str, Arrays] = {}
        for step in range(steps):
            for c in w:
                w[c] = {k: LAMBDA[c] * x + DELTA[c] for k, x in w[c].items()}
            for e in v:
                v[e] = {k: MU[e] * x + EPSILON[e] for k, x in v[e].items()}
            more = step < steps - 1
            if (step + 1) % tau1 == 0:
                for e, cs in groups.items():
                    m[e] = _mean([(w[c], SIZES[c]) for c in cs])
                    if more:
                        log.append((f"edge {e}", m[e]))
                        for c in cs:
                            w[c] = dict(m[e])
            if (step + 1) % tau2 == 0:
                g_client = _mean([(m[e], weight[e]) for e in groups])
                g_edge = _mean([(v[e], weight[e]) for e in groups])
                if more:
                    log.append(("cloud", g_client))
                    w = {c: dict(g_client) for c in w}
                    v = {e: dict(g_edge) for e in v}
        out.append((g_client, g_edge, log))
    return out


@pytest.mark.parametrize(("steps", "tau1", "tau2", "expected"), [
    (12, 3, 6, _steps(0, 2) + EDGE_PUSH + _steps(3, 5) + EDGE_PUSH + CLOUD_PUSH
     + _steps(6, 8) + EDGE_PUSH + _steps(9, 11) + ROUND_END),
    (4, 1, 2, _steps(0, 0) + EDGE_PUSH + _steps(1, 1) + EDGE_PUSH + CLOUD_PUSH
     + _steps(2, 2) + EDGE_PUSH + _steps(3, 3) + ROUND_END),
    (6, 3, 3, _steps(0, 2) + EDGE_PUSH + CLOUD_PUSH + _steps(3, 5) + ROUND_END),
    (6, 1, 2, _steps(0, 0) + EDGE_PUSH + _steps(1, 1) + EDGE_PUSH + CLOUD_PUSH
     + _steps(2, 2) + EDGE_PUSH + _steps(3, 3) + EDGE_PUSH + CLOUD_PUSH + _steps(4, 4)
     + EDGE_PUSH + _steps(5, 5) + ROUND_END),  # three cloud periods: (s + 1) ^ τ2 shows
    (3, 1, 3, _steps(0, 0) + EDGE_PUSH + _steps(1, 1) + EDGE_PUSH + _steps(2, 2)
     + ROUND_END),
])
def test_each_tier_averages_and_pushes_on_its_schedule(
        archive: Path, steps: int, tau1: int, tau2: int, expected: list[str]) -> None:
    """Round 0 of T steps: after every τ1-th step the edges' clients are pulled and each
    edge's average installed on its own clients; after every τ2-th the edges are pulled,
    get the cloud's edge block back (edge_load) and every client the cloud's client block;
    after the last step both tiers are averaged and nothing is pushed. The values pushed
    and the blocks the round ends with are the reference loop's."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=steps, tau1=tau1, tau2=tau2)
    [(want_client, want_edge, pushes)] = _reference(method, 1, {"e0": ["a0", "a2"],
                                                                "e1": ["a1"]})
    _play(method, 0)
    assert fleet.trace() == ["edge_load:e0,e1", *expected]
    t = method.trainer
    _close(t.global_client, want_client, "global client block", rtol=1e-5)
    _close(_edge_block(method), want_edge, "global edge block", rtol=1e-5)
    assert method.steps_done == steps
    assert method.aggregations == {"edge": steps // tau1, "cloud": steps // tau2}
    got = [(s.agent, s.tensors) for s in fleet.of("set_weights")]
    want: list[tuple[str, Arrays]] = []
    for who, arrays in pushes:
        group = {"edge e0": ["a0", "a2"], "edge e1": ["a1"]}.get(who, ["a0", "a1", "a2"])
        want += [(c, arrays) for c in group]
    assert [a for a, _ in got] == [a for a, _ in want]
    for (agent, arrays), (_, expected_arrays) in zip(got, want, strict=True):
        _close(arrays, expected_arrays, f"pushed to {agent}", rtol=1e-5)
    assert len(fleet.of("edge_load")) == 2 * (steps // tau2)  # round start, each τ2 but the last


def test_rounds_start_from_the_cloud_blocks_of_the_round_before(archive: Path) -> None:
    """Three rounds of T = 6, τ1 = 3, τ2 = 3: round 0 installs nothing on the clients
    before its first forward (they hold their own block), rounds 1 and 2 install the
    cloud's client block first; every round loads the edges with the cloud's edge block
    and its clients; the books and counters follow the rounds."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=6, tau1=3, tau2=3, rounds=3)
    groups = {"e0": ["a0", "a2"], "e1": ["a1"]}
    t = method.trainer
    reference = _reference(method, 3, groups)
    for r in range(3):
        want_client, want_edge, _ = reference[r]
        before = len(fleet.exchanges)
        loss = _play(method, r)
        trace = fleet.trace()[before:]
        assert trace[:2] == (["edge_load:e0,e1", "forward@0:a0,a1,a2"] if r == 0 else
                             ["edge_load:e0,e1", "set_weights:a0,a1,a2"])
        assert trace[-3:] == ROUND_END
        _close(t.global_client, want_client, f"round {r}: global client block", rtol=1e-5)
        _close(_edge_block(method), want_edge, f"round {r}: global edge block", rtol=1e-5)
        assert method.steps_done == 6 * (r + 1)
        assert method.aggregations == {"edge": 2 * (r + 1), "cloud": 2 * (r + 1)}
        assert loss is not None
        # the books: B_k per forward, six forwards; each edge's samples this round only
        assert dict(t.books.fwd_samples) == {"a0": 6 * 3, "a1": 6 * 15, "a2": 6 * 6}
        assert dict(t.books.bwd_samples) == dict(t.books.fwd_samples)
        flops = method.edge_flops
        assert method.extra_metrics["edge_gflops"] == {"e0": 54 * flops / 1e9,
                                                       "e1": 90 * flops / 1e9}
    first_push = [s for s in fleet.of("set_weights") if s.round == 1][0]
    assert first_push.agent == "a0"
    edge_loads = [s for s in fleet.of("edge_load") if s.round == 2]
    assert [(s.agent, s.meta["clients"], s.meta["layers"]) for s in edge_loads[:2]] == [
        ("e0", ["a0", "a2"], 3), ("e1", ["a1"], 3)]
    assert edge_loads[0].meta["optimizer"] == {"name": "adam", "lr": 1e-3, "momentum": 0.0,
                                               "weight_decay": 0.0}


def test_the_cloud_head_steps_on_every_edges_embeddings_like_a_plain_adam_loop(
        archive: Path) -> None:
    """T = 3 with two edges: each step the head takes one Adam step on the cross-entropy of
    the edges' embeddings concatenated in edge-id order; the round's loss is the mean of
    the steps' losses before each step; the edge loss the mean of what the edges reported."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=3, tau1=3, tau2=3)
    head = copy.deepcopy(method.head)
    loss = _play(method, 0)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    losses = []
    assert [[e for e, _, _ in step] for step in fleet.uploads] == [["e0", "e1"]] * 3
    for step in fleet.uploads:
        x = torch.from_numpy(np.concatenate([emb for _, emb, _ in step]))
        y = torch.from_numpy(np.concatenate([lab for _, _, lab in step]))
        optimizer.zero_grad()
        ce = nn.functional.cross_entropy(head(x), y)
        ce.backward()
        optimizer.step()
        losses.append(float(ce.detach()))
    _close(to_arrays(method.head, "head"), _floats(to_arrays(head, "head")), "cloud head",
           rtol=1e-5)
    assert loss == pytest.approx(float(np.mean(losses)), rel=1e-6)
    assert method.extra_metrics["edge_loss"] == pytest.approx(
        np.mean([0.5, 1.5, 0.625, 1.625, 0.75, 1.75]))
    assert method.extra_metrics["edge_split"] == K2
    assert method.extra_metrics["aggregations"] == {"edge": 1, "cloud": 1}


def test_one_edge_alone_trains_the_head_on_its_embeddings(archive: Path) -> None:
    fleet = _fleet(("e0",))
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None,
                     edges={"e0": ["a0", "a1"]})
    head = copy.deepcopy(method.head)
    loss = _play(method, 0)
    [[(edge, emb, labels)]] = fleet.uploads
    assert edge == "e0" and emb.shape == (4 + 20, *EMBEDDING)  # B_k of a0, a1
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    ce = nn.functional.cross_entropy(head(torch.from_numpy(emb)), torch.from_numpy(labels))
    ce.backward()
    optimizer.step()
    _close(to_arrays(method.head, "head"), _floats(to_arrays(head, "head")), "cloud head",
           rtol=1e-5)
    assert loss == pytest.approx(float(ce.detach()), rel=1e-6)


def test_under_the_loss_bound_an_edge_far_above_the_others_is_down_weighted(
        archive: Path) -> None:
    """Three edges, e2's embeddings 10⁵× the others' (so its loss is far over 3× the median
    and over chance): its slice weighs bound / L_2 in the head's step, Σ w_k·n_k·L_k / Σ n_k;
    the loss reported stays the plain mean."""
    fleet = _fleet(("e0", "e1", "e2"))
    fleet.scale = {"e0": 0.01, "e1": 0.01, "e2": 1000.0}
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None, loss_bound=3.0,
                     edges={"e0": ["a0"], "e1": ["a1"], "e2": ["a2", "a3"]})
    head = copy.deepcopy(method.head)
    loss = _play(method, 0)
    [step] = fleet.uploads
    assert [e for e, _, _ in step] == ["e0", "e1", "e2"]
    logits = head(torch.from_numpy(np.concatenate([emb for _, emb, _ in step])))
    y = torch.from_numpy(np.concatenate([lab for _, _, lab in step]))
    sizes = [len(lab) for _, _, lab in step]
    parts = [nn.functional.cross_entropy(s, t) for s, t in zip(
        logits.split(sizes), y.split(sizes), strict=True)]
    values = [float(p.detach()) for p in parts]
    bound = max(3.0 * float(np.median(values)), math.log(CLASSES))
    weights = [bound / v if v > bound else 1.0 for v in values]
    assert weights[0] == weights[1] == 1.0 and weights[2] < 0.5
    weighted = sum(w * n * p for w, n, p in zip(weights, sizes, parts, strict=True)) / sum(sizes)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    weighted.backward()
    optimizer.step()
    _close(to_arrays(method.head, "head"), _floats(to_arrays(head, "head")), "cloud head",
           rtol=1e-5)
    assert loss == pytest.approx(float(nn.functional.cross_entropy(logits, y).detach()),
                                 rel=1e-6)
    assert "e2" in method.trainer.books.down_weighted


# ---------------------------------------------------------------- commands and books


def test_the_commands_carry_what_each_tier_needs(archive: Path) -> None:
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None, margin=0.75,
                     codec="fp16", compression="lz4")
    _play(method, 0)
    forward = {s.agent: s for s in fleet.of("forward")}
    assert {a: s.meta for a, s in forward.items()} == {
        a: {"batch": b, "codec": "fp16", "compression": "lz4", "edge": e}
        for a, b, e in (("a0", 3, "e0"), ("a1", 15, "e1"), ("a2", 6, "e0"))}
    assert all(s.deadline_s == DEADLINE_S and s.step == 0 for s in forward.values())
    step = {s.agent: s for s in fleet.of("edge_step")}
    assert {e: s.meta for e, s in step.items()} == {
        "e0": {"clients": ["a0", "a2"], "margin": 0.75, "codec": "fp16", "compression": "lz4",
               "wait_s": 22.5},
        "e1": {"clients": ["a1"], "margin": 0.75, "codec": "fp16", "compression": "lz4",
               "wait_s": 22.5}}
    assert {e: s.work for e, s in step.items()} == {"e0": 9, "e1": 15}
    assert all(s.deadline_s == DEADLINE_S for s in step.values())
    backward = fleet.of("backward")
    assert [s.meta for s in backward] == [{"direct": True, "wait_s": 22.5}] * 3
    assert [s.agent for s in backward] == ["a0", "a1", "a2"]
    [load_e0, load_e1] = fleet.of("edge_load")
    assert load_e0.meta["clients"] == ["a0", "a2"] and load_e1.meta["clients"] == ["a1"]
    assert load_e0.meta["layers"] == 3
    assert sorted(load_e0.tensors) == method.edge_names
    pulls = [s.meta for s in fleet.of("get_weights")]
    assert pulls[-2:] == [{"blocks": ["edge"]}] * 2


def test_bytes_are_booked_per_tier_for_the_round_only(archive: Path) -> None:
    """Every message booked 1 byte down and 2 up (its reply) by the scripted engine, the
    smashed data 100 bytes a sample and gradients 10; what was booked before the round
    (a bundle, an earlier exchange) is not the round's."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None)
    fleet.counters.add("a0", "bundle", "down", 5000)
    fleet.counters.add("a0", "smashed", "up", 777)
    fleet.counters.add("e0", "edge_step", "up", 99)
    _play(method, 0)
    samples = 3 + 15 + 6
    assert method.extra_metrics["tier_bytes"] == {
        "client_to_edge": 100 * samples,
        "edge_to_client": 10 * samples,
        "edge_to_cloud": 2 * 2,  # the edge_step replies
        "model_client_edge": 2 * 3,  # the clients' get_weights replies
        "model_edge_cloud": 2 * 1 + 2 * 2,  # edge_load down, the edges' get_weights up
        # edge_load replies 2·2, forwards 3·3, edge_step commands 2, backwards 3·3,
        # get_weights commands 5, releases 3·3
        "control": 4 + 9 + 2 + 9 + 5 + 9}


# ---------------------------------------------------------------- untrusted replies


def _bad_samples(value: object) -> Tamper:
    def tamper(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        meta["samples"] = value
    return tamper


@pytest.mark.parametrize("value", [0, 7, True, 2.0, None])
def test_a_forward_reply_with_a_bad_sample_count_sits_that_step_out(archive: Path,
                                                                     value: object) -> None:
    """a2 (B_k 6) answers step 0's forward with `value` samples: dropped with the reason,
    not sent to its edge, given no backward; it trains again at step 1."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=2, tau1=2, tau2=2)
    calls = []

    def once(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        calls.append(step)
        if step == 0:
            meta["samples"] = value
    fleet.tamper[("forward", "a2")] = once
    _play(method, 0)
    assert fleet.trace()[1:4] == ["forward@0:a0,a1,a2", "edge_step@0:e0,e1",
                                  "backward@0:a0,a1"]
    assert fleet.of("edge_step", "e0")[0].meta["clients"] == ["a0"]
    assert fleet.of("edge_step", "e0")[1].meta["clients"] == ["a0", "a2"]
    assert method.trainer.books.missed["a2"] == (f"error: bad reply: samples {value!r}, "
                                                 f"expected 1..6")
    assert method.trainer.books.fwd_samples["a2"] == 6
    assert method.trainer.books.bwd_samples["a2"] == 6


def test_a_failed_edge_sits_out_the_rest_of_the_round_with_its_clients(archive: Path
                                                                       ) -> None:
    """e1's step-0 reply carries NaN embeddings: dropped with the reason; its client a1
    gets no backward and no more forwards this round; the cloud averages e0 alone and
    trains the head on e0's embeddings only."""
    fleet = _fleet()

    def poison(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        tensors["embeddings"][0, 0, 0] = np.nan
    fleet.tamper[("edge_step", "e1")] = poison
    method = _method(archive, fleet, local_steps=3, tau1=3, tau2=3)
    head = copy.deepcopy(method.head)
    start = _edge_block(method)
    _play(method, 0)
    assert fleet.trace() == [
        "edge_load:e0,e1", "forward@0:a0,a1,a2", "edge_step@0:e0,e1", "backward@0:a0,a2",
        *_steps(1, 2, "a0,a2", "e0"), "get_weights:a0,a2", "get_weights:e0",
        "release:a0,a1,a2"]
    assert method.trainer.books.missed["e1"] == \
        "error: bad reply: embeddings contain NaN or infinity"
    assert method.ready == {"e0"}
    # a0: 0 → 6 → 9 → 10.5; a2: 0 → 3 → 6.75 → 11.4375; e0's average by 10 : 20
    want = (10 * 10.5 + 20 * 11.4375) / 30
    _close(method.trainer.global_client, {k: np.full(v.shape, want) for k, v in _floats(
        method.trainer.global_client).items()}, "global client block")
    e0 = start
    for _ in range(3):
        e0 = _affine(e0, MU["e0"], EPSILON["e0"])
    _close(_edge_block(method), _floats(e0), "global edge block", rtol=1e-5)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    for step in fleet.uploads:
        [(edge, emb, labels)] = [u for u in step if u[0] == "e0"]
        optimizer.zero_grad()
        nn.functional.cross_entropy(head(torch.from_numpy(emb)),
                                    torch.from_numpy(labels)).backward()
        optimizer.step()
    _close(to_arrays(method.head, "head"), _floats(to_arrays(head, "head")), "cloud head",
           rtol=1e-5)
    # from step 1 the batch is shared by e0's clients alone: B_k = 24·10/30, 24·20/30
    assert [(s.agent, s.meta["batch"]) for s in fleet.of("forward")] == [
        ("a0", 3), ("a1", 15), ("a2", 6), ("a0", 8), ("a2", 16), ("a0", 8), ("a2", 16)]
    assert method.extra_metrics["edge_gflops"] == {"e0": 57 * method.edge_flops / 1e9}


def test_a_client_whose_backward_fails_counts_for_its_edge_but_not_in_its_average(
        archive: Path) -> None:
    """T = 1: a2's backward misses. e0's client average is a0's alone (weight 10), but e0
    served a2's data, so the cloud weighs e0's edge block by 10 + 20 against e1's 50; the
    cloud's client average weighs e0's by 10 (the clients it trained) against 50."""
    fleet = _fleet()
    fleet.tamper[("backward", "a2")] = lambda meta, tensors, r, s: "error: backward: boom"
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None)
    start = _edge_block(method)
    _play(method, 0)
    want = (10 * 6.0 + 50 * 2.0) / 60
    _close(method.trainer.global_client, {k: np.full(v.shape, want) for k, v in _floats(
        method.trainer.global_client).items()}, "global client block")
    e0, e1 = (_affine(start, MU[e], EPSILON[e]) for e in ("e0", "e1"))
    _close(_edge_block(method), _mean([(e0, 30), (e1, 50)]), "global edge block")
    assert fleet.trace()[-3:] == ["get_weights:a0,a1", "get_weights:e0,e1",
                                  "release:a0,a1,a2"]
    assert dict(method.trainer.books.bwd_samples) == {"a0": 3, "a1": 15}


def _bad_weights(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].astype(np.float64)


def test_an_edge_whose_clients_all_fail_their_upload_leaves_the_others_averaged(
        archive: Path) -> None:
    """T = 1: both of e0's clients upload float64 blocks (refused): e0 has no client
    average, e1's (a1's 2) is the cloud's client block; the edge blocks are still averaged
    30 : 50."""
    fleet = _fleet()
    fleet.tamper[("get_weights", "a0")] = _bad_weights
    fleet.tamper[("get_weights", "a2")] = _bad_weights
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None)
    start = _edge_block(method)
    _play(method, 0)
    _close(method.trainer.global_client, {k: np.full(v.shape, 2.0) for k, v in _floats(
        method.trainer.global_client).items()}, "global client block")
    e0, e1 = (_affine(start, MU[e], EPSILON[e]) for e in ("e0", "e1"))
    _close(_edge_block(method), _mean([(e0, 30), (e1, 50)]), "global edge block")
    assert method.aggregations == {"edge": 1, "cloud": 1}


def test_edges_whose_uploads_all_fail_leave_the_edge_model_and_average_the_clients(
        archive: Path) -> None:
    fleet = _fleet()
    fleet.tamper[("get_weights", "e0")] = _bad_weights
    fleet.tamper[("get_weights", "e1")] = _bad_weights
    method = _method(archive, fleet, local_steps=1, tau1=None, tau2=None)
    start = _edge_block(method)
    _play(method, 0)
    _close(_edge_block(method), _floats(start), "edge block unchanged", rtol=0)
    _close(method.trainer.global_client, {k: np.full(v.shape, 2.75) for k, v in _floats(
        method.trainer.global_client).items()}, "global client block")
    first = sorted(start)[0]
    assert method.trainer.books.missed["e0"] == \
        f"error: bad reply: tensor {first} is float64 {list(start[first].shape)}"


def test_no_live_edge_means_no_iteration(archive: Path) -> None:
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=2)
    for edge in ("e0", "e1"):
        fleet.registry.set_state(edge, "offline")
    assert _play(method, 0) is None
    assert fleet.trace() == ["release:a0,a1,a2"]
    assert method.steps_done == 0 and method.aggregations == {"edge": 0, "cloud": 0}
    assert method.extra_metrics["edge_loss"] is None
    assert method.extra_metrics["edge_gflops"] == {}


def test_every_client_gone_ends_the_iterations_even_if_one_comes_back(archive: Path
                                                                      ) -> None:
    """All clients drop out after step 0's backward and are back one live-check later:
    the round stops at step 1 (it does not wait for them in steps 2 and 3)."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=4, tau1=4, tau2=4)
    t = method.trainer
    ensure = t.shipper.ensure
    gone: set[str] = set()

    def drop(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        if step == 0:
            gone.update(("a0", "a1", "a2"))
            for agent in gone:
                fleet.registry.set_state(agent, "offline")

    def back(agents: list[str], round: int = 0, cuts: Any = None) -> list[str]:
        out = ensure(agents, round, cuts)
        for agent in sorted(gone):
            fleet.registry.set_state(agent, "online")
        gone.clear()
        return out
    fleet.tamper[("backward", "a2")] = drop
    t.shipper.ensure = back  # type: ignore[method-assign]
    _play(method, 0)
    assert [k for k, _, _ in fleet.exchanges].count("forward") == 1
    assert method.steps_done == 1


# ---------------------------------------------------------------- checkpoints


def test_a_checkpoint_carries_the_cut_and_the_counters_and_restores_them(archive: Path
                                                                         ) -> None:
    """After a round at k2 = 5: the checkpoint's meta holds the cut, the steps and the
    aggregations beside the base state; a method started at k2 = 4 takes the checkpoint's
    cut (edge layers, head, optimizer over the new head) before loading the weights and the
    head's Adam state."""
    fleet = _fleet()
    method = _method(archive, fleet, local_steps=2)
    _play(method, 0)
    arrays, meta = method.checkpoint()
    assert meta["sherl"] == {"edge_split": K2, "steps": 2,
                             "aggregations": {"edge": 2, "cloud": 1}}
    assert "optimizer" in meta and any(k.startswith("optimizer/") for k in arrays)
    other = _method(archive, _fleet(), local_steps=2, edge_split=4)
    assert other.trainer.shipper.edge_layers == 2
    other.restore(arrays, meta)
    assert other.edge_split == K2 and other.trainer.shipper.edge_layers == 3
    assert len(other.edge_view) == 3 and len(other.head) == 4
    assert other.embedding_shape == EMBEDDING
    assert other.steps_done == 2 and other.aggregations == {"edge": 2, "cloud": 1}
    _close(to_arrays(other.trainer.server, "server"),
           _floats(to_arrays(method.trainer.server, "server")), "server block", rtol=0)
    head = {id(p) for p in other.head.parameters()}
    assert {id(p) for g in other.trainer.optimizer.param_groups for p in g["params"]} == head
    restored = other.trainer.optimizer.state_dict()["state"]
    original = method.trainer.optimizer.state_dict()["state"]
    assert sorted(restored) == sorted(original) and restored
    for index, buffers in original.items():
        for key, value in buffers.items():
            assert torch.equal(torch.as_tensor(restored[index][key]), torch.as_tensor(value))
    # the same cut restores in place
    same = _method(archive, _fleet(), local_steps=2)
    same.restore(arrays, {**meta, "sherl": {**meta["sherl"], "steps": 7}})
    assert same.edge_split == K2 and same.steps_done == 7


@pytest.mark.parametrize("k2", [K1 + 1, 8])
def test_a_checkpoint_cut_either_side_is_taken(archive: Path, k2: int) -> None:
    method = _method(archive, _fleet(), local_steps=2, edge_split=k2)
    arrays, meta = method.checkpoint()
    other = _method(archive, _fleet(), local_steps=2)
    other.restore(arrays, meta)
    assert other.edge_split == k2 and other.trainer.shipper.edge_layers == k2 - K1


@pytest.mark.parametrize("state", [
    None, {"edge_split": K2, "steps": 1}, {"edge_split": K2, "aggregations": {}},
    {"edge_split": "five", "steps": 1, "aggregations": {"edge": 1, "cloud": 1}},
    {"edge_split": K2, "steps": 1, "aggregations": {"edge": 1}},
    {"edge_split": K2, "steps": 1, "aggregations": None},
    {"edge_split": K2, "steps": [1], "aggregations": {"edge": 1, "cloud": 1}},
])
def test_a_checkpoint_without_the_tier_state_is_refused(archive: Path, state: Any) -> None:
    method = _method(archive, _fleet())
    arrays, meta = method.checkpoint()
    with pytest.raises(CheckpointError) as info:
        method.restore(arrays, {**meta, "sherl": state})
    assert str(info.value) == "checkpoint lacks SHeRL-FL's tier state"


def test_a_checkpoint_cut_outside_the_model_is_refused(archive: Path) -> None:
    method = _method(archive, _fleet())
    arrays, meta = method.checkpoint()
    with pytest.raises(CheckpointError) as info:
        method.restore(arrays, {**meta, "sherl": {**meta["sherl"], "edge_split": 9}})
    assert str(info.value) == ("checkpoint edge_split 9 must lie in 3..8 for "
                               "usernets:token_net split at 2")


# ---------------------------------------------------------------- the edge tier's shape


@pytest.mark.parametrize(("edges", "message"), [
    ({"e0": ["a0"], "e9": ["a1"]},
     "topology: edge e9 is not a registered agent (registered: a0, a1, a2, a3, e0, e1)"),
    ({"e0": ["a7"]},
     "topology: client a7 is not a registered agent (registered: a0, a1, a2, a3, e0, e1)"),
    ({"a0": ["a1"]}, "topology: a0 is listed as an edge but registered with role client"),
    ({"e0": ["e1"]}, "topology: e1 is listed as a client but registered with role edge"),
    ({"e0": []}, "topology: edge e0 has no clients"),
    ({"e0": ["a0", "a0"]}, "topology: client a0 is listed twice under edge e0"),
    ({"e0": ["a0"], "e1": ["a0"]}, "topology: client a0 is listed under two edges (e0 and e1)"),
])
def test_a_bad_edges_setting_is_a_one_line_error(archive: Path, edges: dict[str, list[str]],
                                                 message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _method(archive, _fleet(), edges=edges)
    assert str(info.value) == message


def test_the_cut_error_names_the_range_of_each_model(tmp_path: Path) -> None:
    """Another network and client cut (plain_net split at 3: five server layers, an odd k1
    and an even k1 + layers): the range is k1 + 1 .. k1 + layers - 1."""
    report = write_bundle(ModelSpec("usernets:plain_net", (3, 8, 8), 10), 3, tmp_path / "k",
                          seed=3, tar=True, aux_ratio=None)
    assert report.tar_path is not None
    for k2 in (3, 8):
        with pytest.raises(ConfigError) as info:
            _method(report.tar_path, _fleet(), edge_split=k2)
        assert str(info.value) == (f"edge_split {k2} must lie in 4..7 for usernets:plain_net "
                                   f"split at 3")


def test_a_fleet_of_edges_without_clients_is_a_one_line_error(
        archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _Planned(monkeypatch, (K1, K2))
    with pytest.raises(ConfigError, match='at least one agent with role = "client"; none'):
        _method(archive, _fleet(("e0",), sizes={}), edges={}, edge_split=None)

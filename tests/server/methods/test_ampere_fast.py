"""Ampere's coordinator (server/methods/ampere.py, ampere_uploads.py, activation_store.py)
pinned in seconds, against scripted agents.

The agents here are a fake engine: devices that answer every command Ampere sends with
values chosen so that the expected ones can be worked out by hand or by the plain reference
loops below (a device's `train` moves every tensor it holds w ← λ_k·w + δ_k, with λ and δ
different per device, so that an average with the wrong weights, of the wrong devices or
pushed to the wrong ones gives other numbers; a `generate` answers rows of seeded
activations). The model is a tiny user network (testing/usernets.py token_net, the server
cut p* = 4: embed, flatten, transpose, mix on the devices; a shallow device at cut 2 holds
no `mix` layer and an aux head of another shape), whose server block trains with SGD and
momentum exactly as a plain PyTorch loop in the test does.

Pinned: carving the validation part; the constructor's checks and state; who gets which
command in which order in both phases (train's batch, steps, rate and work; pushes from the
second epoch on; pulls, releases; phase 2's waves of `generate` and their offsets, limits,
work and steps); the weights of the averages (|D_k|, layer by layer over the devices that
hold a layer, each cut's head over its cut); the sample-weighted loss and the checks on
the reported loss and samples; early stopping (patience, N_d, the last round, the best
epoch kept); the validation accuracy per cut against plain PyTorch; the trained bundle's
weights, the shipper and the store it opens; the server's shuffled epoch as uploads arrive
and the ablation's per-device copies, against plain loops; every check on an untrusted
upload and its one-line message; the upload bound's reference; the activation store's
names, bounds, restart, torn appends and every refusal; save, checkpoint and restore with
every error path. Each test fails for a plausible one-token change of the modules
(docs/testing.md, mutation testing)."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from scripted_agents import Sent, Tamper  # testing/, on the path in tests
from torch import nn

from jetsplit.bundle import Bundle, load_bundle
from jetsplit.data import ArrayDataset
from jetsplit.errors import ConfigError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ZOO_VERSION, ModelSpec
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.seam import Command, Engine, Outcome, Reply
from jetsplit.server.methods.activation_store import (
    INDEX,
    MAX_INDEX_BYTES,
    ActivationStore,
    StoreError,
)
from jetsplit.server.methods.ampere import Ampere, AmpereNoConsolidation, carve_validation
from jetsplit.server.training.checkpoints import CheckpointError
from jetsplit.server.training.evaluation import evaluate
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

pytestmark = pytest.mark.fast

Arrays = dict[str, np.ndarray]
SPEC = ModelSpec("usernets:token_net", (3, 16, 16), 10)
SPLIT = 4  # p*: embed, flatten, transpose, mix on the devices
SHALLOW = 2  # embed, flatten: no `mix` layer, a head for (8, 16)
SHAPE = (16, 8)  # activations at p*
SHALLOW_SHAPE = (8, 16)  # at cut 2
CLASSES = 10
DEADLINE_S = 45.0
SIZES = {"a0": 10, "a1": 50, "a2": 20, "a3": 40}  # |D_k|, all unequal
LAMBDA = {"a0": 0.5, "a1": 0.75, "a2": 1.25, "a3": 0.9}  # train: w ← λ_k·w + δ_k
DELTA = {"a0": 6.0, "a1": 2.0, "a2": 3.0, "a3": 5.0}
LOSS = {"a0": 1.5, "a1": 0.5, "a2": 2.0, "a3": 1.0}
CLIENT_LR, SERVER_LR, MOMENTUM = 0.03, 0.2, 0.5


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Agents and server share this process: one torch thread each (conftest)."""


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, SPLIT, tmp_path_factory.mktemp("ampere-fast") / "k", seed=3,
                          tar=True)
    assert report.tar_path is not None
    return report.tar_path


@pytest.fixture(autouse=True)
def _shipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shipper (the trainer's and phase 2's) installs at once and logs who it was
    asked for, with which kind of bundle, in which round, at which cuts."""
    def ensure(self: BundleShipper, agents: list[str], round: int = 0,
               cuts: Any = None) -> list[str]:
        log = getattr(self.engine, "ensured", None)
        if log is not None:
            log.append((self.kind, list(agents), round, dict(cuts or {})))
        return list(agents)
    monkeypatch.setattr(BundleShipper, "ensure", ensure)


# ---------------------------------------------------------------- scripted agents

def _affine(arrays: Arrays, scale: float, shift: float) -> Arrays:
    return {k: (scale * v + shift).astype(v.dtype) for k, v in arrays.items()}


def _rows(agent: str, shape: tuple[int, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """An agent's one-shot activations (seeded by its id) and labels."""
    index = int(agent[1:])
    rng = np.random.default_rng([index, 7])
    acts = rng.standard_normal((n, *shape)).astype(np.float32)
    return acts, ((np.arange(n) * 3 + index) % CLASSES).astype(np.int64)


class Fleet(Engine):
    """Devices (registered |D_k|, cut `cuts[a]`, default p*) that answer every command in
    agent-id order and log it. `train` moves every tensor held w ← λ_k·w + δ_k and reports
    |D_k| samples and LOSS[k]; `generate` answers rows offset..offset+limit of the device's
    seeded activations at its cut. `tamper[(kind, agent)]` may change a reply, or return
    why it is missed. `send_and_stream` answers each device only when asked for it."""

    def __init__(self, sizes: dict[str, int] | None = None,
                 cuts: dict[str, int] | None = None) -> None:
        super().__init__("scripted")
        self.sizes = dict(SIZES if sizes is None else sizes)
        self.cuts = dict(cuts or {})
        for agent, size in self.sizes.items():
            self.registry.register(agent, {"agent": agent, "role": "client",
                                           "zoo_version": ZOO_VERSION,
                                           "dataset": {"size": size}})
        self.data = {a: _rows(a, SHAPE if self.cuts.get(a, SPLIT) == SPLIT else SHALLOW_SHAPE,
                              n) for a, n in self.sizes.items()}
        self.sent: list[Sent] = []
        self.exchanges: list[tuple[str, int, list[str]]] = []  # (kind, step, agents)
        self.events: list[str] = []  # answers given and server steps, in order
        self.held: dict[str, Arrays] = {}
        self.tamper: dict[tuple[str, str], Tamper] = {}
        self.ensured: list[tuple[str, list[str], int, dict[str, int]]] = []

    def send_and_receive(self, commands: Any, *, round: int = 0, step: int = 0,
                         deadline_s: float = 60.0) -> Outcome:
        kind = next(iter(commands.values())).kind if commands else ""
        self.exchanges.append((kind, step, sorted(commands)))
        replies: dict[str, Reply] = {}
        missed: dict[str, str] = {}
        for agent in sorted(commands):
            reply, why = self._one(agent, commands[agent], round, step, deadline_s)
            if reply is None:
                missed[agent] = why
            else:
                replies[agent] = reply
        return self._finish(replies, missed, kind, round, step)

    def send_and_stream(self, commands: Any, *, round: int = 0, step: int = 0,
                        deadline_s: float = 60.0) -> Iterator[Outcome]:
        kind = next(iter(commands.values())).kind if commands else ""
        self.exchanges.append((kind, step, sorted(commands)))
        if step > 100:  # no upload here takes that many waves: a collection that never ends
            raise AssertionError(f"wave {step}: the uploads never end")
        return _Stream(self._stream(commands, kind, round, step, deadline_s))

    def _stream(self, commands: Any, kind: str, round: int, step: int, deadline_s: float
                ) -> Iterator[Outcome]:
        for agent in sorted(commands):
            reply, why = self._one(agent, commands[agent], round, step, deadline_s)
            replies = {} if reply is None else {agent: reply}
            yield self._finish(replies, {} if reply is not None else {agent: why}, kind,
                               round, step)

    def _one(self, agent: str, command: Command, round: int, step: int, deadline_s: float
             ) -> tuple[Reply | None, str]:
        self.sent.append(Sent(command.kind, agent, round, step, copy.deepcopy(command.meta),
                              {k: v.copy() for k, v in command.tensors.items()},
                              command.work, deadline_s))
        meta, tensors = self._answer(agent, command)
        tamper = self.tamper.get((command.kind, agent))
        why = None if tamper is None else tamper(meta, tensors, round, step)
        if why is not None:
            return None, why
        self.events.append(f"{command.kind}:{agent}")
        return Reply(agent, command.kind, meta, tensors), ""

    def _answer(self, agent: str, command: Command) -> tuple[dict[str, Any], Arrays]:
        kind, meta = command.kind, command.meta
        if kind == "set_weights":
            self.held[agent] = {k: v.copy() for k, v in command.tensors.items()}
        elif kind == "get_weights":
            return {}, {k: v.copy() for k, v in self.held[agent].items()}
        elif kind == "train":
            self.held[agent] = _affine(self.held[agent], LAMBDA[agent], DELTA[agent])
            return {"samples": self.sizes[agent], "loss": LOSS[agent]}, {}
        elif kind == "generate":
            start, limit = int(meta["offset"]), int(meta["limit"])
            acts, labels = self.data[agent]
            part = slice(start, start + limit)
            return ({"offset": start, "samples": len(labels[part]),  # decoded: new ints
                     "total": int(str(self.sizes[agent]))},
                    {"activations": acts[part].copy(), "labels": labels[part].copy()})
        return {}, {}

    # ---------------------------------------------------------------- reading the log

    def trace(self) -> list[str]:
        """Each exchange as `kind@step:agents` (generate) or `kind:agents`."""
        return [f"{k}@{s}:{','.join(a)}" if k == "generate" else f"{k}:{','.join(a)}"
                for k, s, a in self.exchanges]

    def of(self, kind: str, agent: str | None = None) -> list[Sent]:
        return [s for s in self.sent if s.kind == kind and agent in (None, s.agent)]


class _Stream:
    """A stream that refuses to be read twice past its end (a reader that never stops)."""

    def __init__(self, results: Iterator[Outcome]) -> None:
        self.results, self.past_end = results, 0

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Outcome:
        try:
            return next(self.results)
        except StopIteration:
            self.past_end += 1
            if self.past_end > 1:
                raise AssertionError("the stream was read past its end again") from None
            raise


def _held_out(n: int = 25) -> ArrayDataset:
    rng = np.random.default_rng(11)
    return ArrayDataset(rng.standard_normal((n, 3, 16, 16)).astype(np.float32),
                        (np.arange(n) * 7 % CLASSES).astype(np.int64), "scripted", CLASSES)


def _settings(**overrides: Any) -> Settings:
    """Plain FedAvg weights: the defences that would reweigh an upload are off, so every
    number below is the method's own (tests switch one back on where it matters)."""
    base: dict[str, Any] = dict(
        algorithm="ampere", rounds=6, batch=32, lr=0.1, client_lr=CLIENT_LR,
        server_lr=SERVER_LR, momentum=MOMENTUM, seed=5, deadline_s=DEADLINE_S,
        bundle_deadline_s=77.0, direction_check="off", label_check="off", size_cap=0,
        outlier_bound=0, activation_bound=0, loss_bound=0, patience=50, device_epochs=4,
        upload_mb=1.0)
    return Settings(**{**base, **overrides})


@functools.cache
def _bundle(archive: Path) -> Bundle:
    """One loaded bundle for the module (it hands out copies of its blocks)."""
    return load_bundle(archive)


def _method(archive: Path, fleet: Fleet, *, zero: bool = True, ablation: bool = False,
            test: ArrayDataset | None = None, **overrides: Any) -> Ampere:
    """Ampere on the scripted fleet (its cuts). With `zero`, the global client block and
    every head start at zero (so does each device: what it holds is what the trainer
    would have installed), so that an epoch's averages are hand sums of δ."""
    settings = _settings(**({"algorithm": "ampere-noconsolidation"} if ablation else {}),
                         **overrides)
    t = Trainer(fleet, archive, settings, _held_out() if test is None else test,
                bundle=_bundle(archive), cuts=fleet.cuts or None)
    method = (AmpereNoConsolidation if ablation else Ampere)(t)
    step = method._step

    def guarded(server: nn.Module, optimizer: torch.optim.Optimizer, rows: np.ndarray
                ) -> float:
        assert len(rows) > 0, "a server step on no rows"  # (a loop that would not end)
        return step(server, optimizer, rows)
    method._step = guarded  # type: ignore[method-assign]
    if zero:
        t.global_client = {k: np.zeros_like(v) for k, v in t.global_client.items()}
        method.aux = {c: {k: np.zeros_like(v) for k, v in a.items()}
                      for c, a in method.aux.items()}
        method.best = {**t.global_client, **method._flat(method.aux)}
    for agent in fleet.sizes:
        cut = t.cut(agent)
        fleet.held[agent] = {**{k: v.copy() for k, v in t.device_part(agent,
                                                                     t.global_client).items()},
                             **{k: v.copy() for k, v in method.aux[cut].items()}}
    return method


def _play(method: Ampere, round_: int, selected: list[str] | None = None) -> float | None:
    t = method.trainer
    t.round = round_
    t.books.reset()
    return method.run_round(sorted(t.engine.registry.eligible()) if selected is None
                            else selected)


def _close(got: Arrays, want: dict[str, Any], what: str, rtol: float = 2e-6) -> None:
    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-6,
                                   err_msg=f"{what}: {name}")


def _full(arrays: Arrays, value: float) -> Arrays:
    return {k: np.full(v.shape, value) for k, v in arrays.items()}


def _phase2(method: Ampere, first_round: int = 0, *, zero: bool = False) -> None:
    """Phase 1 over after one epoch (whatever the settings say), ending on the bundle's
    own blocks (small weights: ONNX Runtime matches PyTorch on them), or on zeros."""
    method._device_training_done = lambda: True  # type: ignore[method-assign]
    _play(method, first_round)
    del method._device_training_done
    assert method.phase == 2
    _reset(method, zero=zero)


def _reset(method: Ampere, *, zero: bool = False) -> None:
    t = method.trainer
    t.global_client = to_arrays(t.bundle.client_module(), "client")
    method.aux = {c: method._initial_aux(c) for c in method.aux}
    if zero:
        t.global_client = {k: np.zeros_like(v) for k, v in t.global_client.items()}
        method.aux = {c: {k: np.zeros_like(v) for k, v in a.items()}
                      for c, a in method.aux.items()}


# ---------------------------------------------------------------- the activation store


def _chunk(n: int, first: int = 0, seed: int = 0, shape: tuple[int, ...] = SHAPE
           ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, *shape)).astype(np.float32),
            (np.arange(first, first + n) % CLASSES).astype(np.int64))


ROW = 4 * 16 * 8 + 8


def _store(root: Path, max_bytes: int = 1 << 20, tag: str = "t") -> ActivationStore:
    return ActivationStore(root, SHAPE, CLASSES, max_bytes=max_bytes, tag=tag)


def test_a_new_store_commits_an_empty_index(tmp_path: Path) -> None:
    store = _store(tmp_path / "s" / "t", tag="abc")  # its folder made, parents too
    assert json.loads((tmp_path / "s" / "t" / INDEX).read_text()) == {
        "format": 1, "activation_shape": [16, 8], "num_classes": 10, "tag": "abc", "agents": {}}
    assert store.row_bytes == ROW and len(store) == 0 and store.nbytes == 0
    assert store.agents() == [] and store.completed() == [] and store.counts() == {}
    assert store.received("a0") == 0 and not store.complete("a0")
    assert len(store.rows_of("a0")) == 0
    assert not (tmp_path / "s" / "t" / f".{INDEX}.tmp").exists()
    assert MAX_INDEX_BYTES == 16 * 1024 * 1024
    # reopened: the shape and class count read back compare by value (300: no cached int)
    many = ActivationStore(tmp_path / "many", SHAPE, 300, max_bytes=1, tag="m")
    assert ActivationStore(tmp_path / "many", SHAPE, int("300"), max_bytes=1,
                           tag="m").num_classes == many.num_classes == 300


def test_the_byte_bound_and_tag_are_keywords(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        ActivationStore(tmp_path, SHAPE, CLASSES, 100)  # type: ignore[misc]
    store = ActivationStore(root=tmp_path, activation_shape=SHAPE, num_classes=CLASSES,
                            max_bytes=100, tag="k")
    assert (store.max_bytes, store.tag) == (100, "k")


def test_appends_commit_rows_in_upload_order(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a1, y1 = _chunk(6, seed=1)
    a0, y0 = _chunk(4, seed=2)
    assert store.append("a1", 0, 6, a1[:2], y1[:2]) == 2
    assert store.append("a0", 0, 5, a0, y0) == 4
    assert store.append("a1", 2, 6, a1[2:], y1[2:]) == 4
    assert store.agents() == ["a1", "a0"] and store.counts() == {"a1": 6, "a0": 4}
    assert store.completed() == ["a1"] and store.complete("a1") and not store.complete("a0")
    assert len(store) == 10 and store.nbytes == 10 * ROW
    assert list(store.rows_of("a1")) == list(range(6))
    assert list(store.rows_of("a0")) == [6, 7, 8, 9]  # a1's dataset holds rows 0..5
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["agents"] == {"a1": {"total": 6, "received": 6},
                               "a0": {"total": 5, "received": 4}}
    assert (tmp_path / "a1.act").stat().st_size == 6 * 4 * 128
    assert (tmp_path / "a1.lab").stat().st_size == 6 * 8
    acts, labels = store.take(np.array([7, 0, 9, 3]))
    assert np.array_equal(acts, np.stack([a0[1], a1[0], a0[3], a1[3]]))
    assert np.array_equal(labels, np.array([y0[1], y1[0], y0[3], y1[3]]))
    for bad in ([10], [-1], [11], [25]):
        with pytest.raises(IndexError, match="^row index outside the committed rows$"):
            store.take(np.array(bad))
    # rows of an incomplete upload's not yet sent part are not there
    store2 = _store(tmp_path / "b")
    store2.append("a0", 0, 5, a0[:2], y0[:2])
    store2.append("a1", 0, 6, a1, y1)
    assert list(store2.rows_of("a1")) == list(range(5, 11))
    for bad in ([2], [3]):  # a0's rows 2..4 are not in yet
        with pytest.raises(IndexError, match="^row index outside the committed rows$"):
            store2.take(np.array(bad))
    assert np.array_equal(store2.take(np.array([1, 5]))[0], np.stack([a0[1], a1[0]]))


def test_counts_past_the_small_int_cache_compare_by_value(tmp_path: Path) -> None:
    """600 rows in two chunks of 300, the second's offset and total decoded (new int
    objects, as from the wire): accepted, and the upload is complete."""
    store = _store(tmp_path)
    a, y = _chunk(600)
    store.append("big", 0, 600, a[:300], y[:300])
    offset, total = int("300"), int("600")
    assert store.problem("big", offset, total, a[300:], y[300:]) is None
    store.append("big", offset, total, a[300:], y[300:])
    assert store.complete("big") and store.completed() == ["big"]
    assert np.array_equal(store.take(np.array([599, 0]))[0], a[[599, 0]])


def test_memory_maps_follow_new_rows(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a, y = _chunk(6)
    store.append("a0", 0, 6, a[:3], y[:3])
    assert np.array_equal(store.take(np.arange(3))[0], a[:3])
    store.append("a0", 3, 6, a[3:], y[3:])
    assert np.array_equal(store.take(np.arange(6))[0], a)


def test_a_reopened_store_cuts_torn_appends_and_resumes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a, y = _chunk(8)
    store.append("a0", 0, 8, a[:5], y[:5])
    with open(tmp_path / "a0.act", "ab") as fh:
        fh.write(b"\0" * 700)
    with open(tmp_path / "a0.lab", "ab") as fh:
        fh.write(b"\0" * 9)
    again = _store(tmp_path)
    assert (tmp_path / "a0.act").stat().st_size == 5 * 512
    assert (tmp_path / "a0.lab").stat().st_size == 5 * 8
    assert again.received("a0") == 5 and again.counts() == {"a0": 5}
    again.append("a0", 5, 8, a[5:], y[5:])
    assert np.array_equal(again.take(again.rows_of("a0"))[0], a)
    assert np.array_equal(again.take(again.rows_of("a0"))[1], y)
    # an agent with nothing received and no files yet is fine
    index = json.loads((tmp_path / INDEX).read_text())
    index["agents"]["b1"] = {"total": 3, "received": 0}
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert _store(tmp_path).agents() == ["a0", "b1"]


def test_a_torn_first_upload_is_cut_before_the_next(tmp_path: Path) -> None:
    """A crash during an agent's first append leaves bytes the index never named: its next
    upload (from row 0) must not land behind them."""
    store = _store(tmp_path)
    a, y = _chunk(4)
    store.append("a0", 0, 4, a[:2], y[:2])
    (tmp_path / "b1.act").write_bytes(b"\1" * 700)
    (tmp_path / "b1.lab").write_bytes(b"\1" * 3)
    again = _store(tmp_path)
    assert again.agents() == ["a0"] and again.received("b1") == 0
    b, z = _chunk(3, seed=1)
    again.append("b1", 0, 3, b, z)
    assert (tmp_path / "b1.act").stat().st_size == 3 * (ROW - 8)
    assert (tmp_path / "b1.lab").stat().st_size == 3 * 8
    rows = again.rows_of("b1")
    assert np.array_equal(again.take(rows)[0], b) and np.array_equal(again.take(rows)[1], z)
    # and stray bytes after committed rows, appended to without a reopen
    with open(tmp_path / "a0.act", "ab") as fh:
        fh.write(b"\1" * 5)
    again.append("a0", 2, 4, a[2:], y[2:])
    assert np.array_equal(again.take(again.rows_of("a0"))[0], a)


@pytest.mark.parametrize(("received", "torn", "shape"), [
    (0, 1, SHAPE), (0, 8, SHAPE), (1, 1, SHAPE), (1, 1, (2, 3)), (2, 15, (2, 3))])
def test_reopening_cuts_a_torn_tail_of_any_length(tmp_path: Path, received: int, torn: int,
                                                  shape: tuple[int, ...]) -> None:
    """Rows of 16 × 8 floats are 512 bytes, of 2 × 3 floats 24 (a row's 32 less the label's
    8, which 32 ^ 8 = 40 would not give)."""
    store = ActivationStore(tmp_path, shape, CLASSES, max_bytes=1 << 20, tag="t")
    a, y = _chunk(2, shape=shape)
    if received:
        store.append("a0", 0, 2, a[:received], y[:received])
    index = json.loads((tmp_path / INDEX).read_text())
    index["agents"]["a0"] = {"total": 2, "received": received}
    (tmp_path / INDEX).write_text(json.dumps(index))
    for suffix in (".act", ".lab"):
        with open(tmp_path / f"a0{suffix}", "ab") as fh:
            fh.write(b"\1" * torn)
    ActivationStore(tmp_path, shape, CLASSES, max_bytes=1 << 20, tag="t")
    assert (tmp_path / "a0.act").stat().st_size == received * 4 * math.prod(shape)
    assert (tmp_path / "a0.lab").stat().st_size == received * 8


def test_rows_of_any_shape_are_bounded_by_their_bytes(tmp_path: Path) -> None:
    """A row is 4 bytes per activation and 8 for its label: (2, 3) makes 32, where a row
    size computed with a bitwise or (24 | 8 = 24) would let a fourth row into 96 bytes."""
    store = ActivationStore(tmp_path, (2, 3), CLASSES, max_bytes=3 * 32)
    a, y = _chunk(4, shape=(2, 3))
    store.append("a0", 0, 4, a[:3], y[:3])
    assert store.nbytes == 96
    assert store.problem("a0", 3, 4, a[3:], y[3:]) == "store would exceed its 0.00 GiB bound"
    assert np.array_equal(store.take(store.rows_of("a0"))[0], a[:3])


def _write_index(root: Path, **changes: Any) -> None:
    index = json.loads((root / INDEX).read_text())
    index.update(changes)
    (root / INDEX).write_text(json.dumps(index))


def test_a_store_of_another_shape_classes_format_or_model_is_refused(tmp_path: Path) -> None:
    _store(tmp_path, tag="1234567890abcdef")
    with pytest.raises(StoreError) as info:
        ActivationStore(tmp_path, (8, 16), CLASSES, max_bytes=1, tag="1234567890abcdef")
    assert str(info.value) == (f"activation store {tmp_path} holds activations [16, 8] for 10 "
                               f"classes, this run needs [8, 16] for 10")
    with pytest.raises(StoreError) as info:
        ActivationStore(tmp_path, SHAPE, 9, max_bytes=1, tag="1234567890abcdef")
    assert str(info.value) == (f"activation store {tmp_path} holds activations [16, 8] for 10 "
                               f"classes, this run needs [16, 8] for 9")
    with pytest.raises(StoreError) as info:
        _store(tmp_path, tag="0ther")  # sorts before the stored tag
    assert str(info.value) == (f"activation store {tmp_path} holds activations of another "
                               f"model (1234567890ab); remove it or use another folder")
    _write_index(tmp_path, tag="")
    with pytest.raises(StoreError, match=r"another model \(untagged\)"):
        _store(tmp_path, tag="x")
    for format_ in (2, 0):
        _write_index(tmp_path, tag="x", format=format_)
        with pytest.raises(StoreError, match="this run needs"):
            _store(tmp_path, tag="x")
    _write_index(tmp_path, format=1)
    for shape, classes in (((16, 9), CLASSES), ((16, 7), CLASSES), (SHAPE, 11), (SHAPE, 9)):
        with pytest.raises(StoreError, match="this run needs"):
            ActivationStore(tmp_path, shape, classes, max_bytes=1, tag="x")
    assert ActivationStore(tmp_path, SHAPE, CLASSES, max_bytes=1, tag="x").tag == "x"


@pytest.mark.parametrize(("field", "value"), [
    ("format", True), ("format", 1.0), ("num_classes", "10"), ("activation_shape", [16.0, 8]),
    ("total", True), ("received", 1.0), ("received", "1")])
def test_an_index_count_is_a_json_integer(tmp_path: Path, field: str, value: Any) -> None:
    """A bool, float or string count in the index (disk is untrusted) is damage, not the
    integer int() would make of it."""
    store = _store(tmp_path)
    a, y = _chunk(2)
    store.append("a0", 0, 2, a[:1], y[:1])
    index = json.loads((tmp_path / INDEX).read_text())
    if field in ("total", "received"):
        index["agents"]["a0"][field] = value
    else:
        index[field] = value
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == (f"activation store {tmp_path}: {INDEX} is damaged "
                               f"({value if not isinstance(value, list) else value[0]!r} "
                               "is not an integer)")


@pytest.mark.parametrize(("text", "why"), [
    ("{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("[]", "list indices must be integers or slices, not str"),
    ('{"format": 1}', "'activation_shape'"),
    ('{"format": 1, "activation_shape": [16, 8], "num_classes": 10, "agents": {}}', "'tag'"),
    ('{"activation_shape": [16, 8], "num_classes": 10, "tag": "t", "agents": {}}', "'format'"),
    ('{"format": 1, "activation_shape": 5, "num_classes": 10, "tag": "t", "agents": {}}',
     "'int' object is not iterable"),
    ('{"format": 1, "activation_shape": [16, 8], "num_classes": "x", "tag": "t", '
     '"agents": {}}', "'x' is not an integer"),
    ('{"format": 1, "activation_shape": [16, 8], "num_classes": 10, "tag": "t", '
     '"agents": []}', "'list' object has no attribute 'items'"),
    ('{"format": 1, "activation_shape": [16, 8], "num_classes": 10, "tag": "t", '
     '"agents": {"a0": {"total": 3}}}', "'received'"),
])
def test_a_damaged_index_is_one_line(tmp_path: Path, text: str, why: str) -> None:
    _store(tmp_path)
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == f"activation store {tmp_path}: {INDEX} is damaged ({why})"


def test_an_unreadable_index_is_one_line(tmp_path: Path) -> None:
    (tmp_path / INDEX).mkdir()
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == (f"activation store {tmp_path}: {INDEX} is damaged ([Errno 21] "
                               f"Is a directory: '{tmp_path / INDEX}')")


def test_an_oversized_index_is_refused_unread(tmp_path: Path) -> None:
    _store(tmp_path)
    with open(tmp_path / INDEX, "ab") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == f"activation store {tmp_path}: {INDEX} is too large"
    with open(tmp_path / INDEX, "r+b") as fh:
        fh.truncate(MAX_INDEX_BYTES)
    with pytest.raises(StoreError, match="is damaged"):  # read: JSON with trailing zeros
        _store(tmp_path)


@pytest.mark.parametrize(("name", "entry", "message"), [
    ("../a0", {"total": 3, "received": 0}, "bad entry for '../a0'"),
    ("a0", {"total": 3, "received": 4}, "bad entry for 'a0'"),
    ("a0", {"total": 3, "received": -1}, "bad entry for 'a0'"),
    ("a0", {"total": 3, "received": 2}, "a0.act is shorter than its 2 committed rows"),
])
def test_a_bad_index_entry_is_refused(tmp_path: Path, name: str, entry: dict[str, int],
                                      message: str) -> None:
    _store(tmp_path)
    _write_index(tmp_path, agents={name: entry})
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == f"activation store {tmp_path}: {message}"


def test_a_short_label_file_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a, y = _chunk(3)
    store.append("a0", 0, 3, a, y)
    with open(tmp_path / "a0.lab", "r+b") as fh:
        fh.truncate(3 * 8 - 1)
    with pytest.raises(StoreError) as info:
        _store(tmp_path)
    assert str(info.value) == (f"activation store {tmp_path}: a0.lab is shorter than its 3 "
                               f"committed rows")
    # exactly full files are kept as they are
    with open(tmp_path / "a0.lab", "r+b") as fh:
        fh.truncate(3 * 8)
    assert _store(tmp_path).received("a0") == 3


@pytest.mark.parametrize(("agent", "offset", "total", "chunk", "problem"), [
    ("a0", 0, 8, _chunk(8), None),
    ("a.b_c-9", 0, 8, _chunk(3), None),
    ("A" * 64, 0, 8, _chunk(3), None),
    ("A" * 65, 0, 8, _chunk(3), f"agent name {'A' * 65!r} is not allowed"),
    ("-a0", 0, 8, _chunk(3), "agent name '-a0' is not allowed"),
    ("a0\n", 0, 8, _chunk(3), "agent name 'a0\\n' is not allowed"),
    ("", 0, 8, _chunk(3), "agent name '' is not allowed"),
    ("a0", 0, 1, _chunk(1), None),
    ("a0", 0, 0, _chunk(3), "dataset size 0 is not positive"),
    ("a0", 0, -2, _chunk(3), "dataset size -2 is not positive"),
    ("a0", 1, 8, _chunk(3), "chunk starts at row 1, the store expects row 0"),
    ("a0", 0, 2, _chunk(3), "labels must be 1..2 integers in one dimension"),
    ("a0", 0, 8, (np.zeros((0, *SHAPE), np.float32), np.zeros(0, np.int64)),
     "labels must be 1..8 integers in one dimension"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.zeros((3, 1), np.int64)),
     "labels must be 1..8 integers in one dimension"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.zeros(3, np.int32)),
     "labels are int32, expected int64"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.zeros(3, np.float32)),
     "labels are float32, expected int64"),
    ("a0", 0, 8, (np.zeros((1, *SHAPE), np.float32), np.array(3)),
     "labels must be 1..8 integers in one dimension"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.array([0, 10, 1])),
     "labels out of range 0..9"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.array([0, -1, 1])),
     "labels out of range 0..9"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float32), np.array([0, 9, 1])), None),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float64), np.arange(3)),
     "activations float64 [3, 16, 8], expected float32 [3, 16, 8]"),
    ("a0", 0, 8, (np.zeros((3, *SHAPE), np.float16), np.arange(3)),
     "activations float16 [3, 16, 8], expected float32 [3, 16, 8]"),
    ("a0", 0, 8, (np.zeros((3, 16, 9), np.float32), np.arange(3)),
     "activations float32 [3, 16, 9], expected float32 [3, 16, 8]"),
    ("a0", 0, 8, (np.zeros((2, *SHAPE), np.float32), np.arange(3)),
     "activations float32 [2, 16, 8], expected float32 [3, 16, 8]"),
    ("a0", 0, 8, (np.zeros((3, 8, 16), np.float32), np.arange(3)),
     "activations float32 [3, 8, 16], expected float32 [3, 16, 8]"),
    ("a0", 0, 8, (np.full((3, *SHAPE), np.nan, np.float32), np.arange(3)),
     "activations contain NaN or infinity"),
])
def test_an_upload_chunk_is_checked(tmp_path: Path, agent: str, offset: int, total: int,
                                    chunk: tuple[np.ndarray, np.ndarray],
                                    problem: str | None) -> None:
    store = _store(tmp_path)
    assert store.problem(agent, offset, total, *chunk) == problem
    if problem is None:
        return
    with pytest.raises(StoreError) as info:
        store.append(agent, offset, total, *chunk)
    assert str(info.value) == f"upload from {agent} refused: {problem}"
    assert len(store) == 0 and not (tmp_path / f"{agent}.act").exists()


def test_a_later_chunk_must_match_what_is_stored(tmp_path: Path) -> None:
    store = _store(tmp_path)
    a, y = _chunk(8)
    store.append("a0", 0, 8, a[:5], y[:5])
    assert store.problem("a0", 5, 9, a[5:], y[5:]) == "dataset size 9 differs from the 8 stored"
    assert store.problem("a0", 5, 7, a[5:], y[5:]) == "dataset size 7 differs from the 8 stored"
    assert store.problem("a0", 6, 8, a[6:], y[6:]) == \
        "chunk starts at row 6, the store expects row 5"
    assert store.problem("a0", 4, 8, a[5:], y[5:]) == \
        "chunk starts at row 4, the store expects row 5"
    assert store.problem("a0", 5, 8, a[4:], y[4:]) == \
        "labels must be 1..3 integers in one dimension"
    assert store.problem("a0", 5, 8, a[5:], y[5:]) is None
    store.append("a0", 5, 8, a[5:], y[5:])
    assert store.problem("a0", 8, 8, a[:1], y[:1]) == \
        "labels must be 1..0 integers in one dimension"


def test_the_store_is_bounded_in_bytes(tmp_path: Path) -> None:
    store = _store(tmp_path, max_bytes=10 * ROW)
    a, y = _chunk(12)
    store.append("a0", 0, 12, a[:6], y[:6])
    assert store.problem("a0", 6, 12, a[6:10], y[6:10]) is None  # exactly at the bound
    assert store.problem("a0", 6, 12, a[6:11], y[6:11]) == \
        "store would exceed its 0.00 GiB bound"
    big = _store(tmp_path / "big", max_bytes=3 * 2**30)
    assert big.max_bytes == 3 * 2**30
    big.nbytes  # noqa: B018 - a property
    assert _store(tmp_path / "b2", max_bytes=int(1.5 * 2**30)).problem(
        "a0", 0, 12, a, y) is None
    small = ActivationStore(tmp_path / "b3", SHAPE, CLASSES, max_bytes=2**29 + 5)
    assert small.max_bytes == 2**29 + 5 and small.tag == ""
    tiny = _store(tmp_path / "b4", max_bytes=ROW)
    assert tiny.problem("a0", 0, 12, a[:2], y[:2]) == "store would exceed its 0.00 GiB bound"
    half = ActivationStore(tmp_path / "b5", SHAPE, CLASSES, max_bytes=ROW + 2**29)
    half.append("a0", 0, 12, a[:1], y[:1])
    assert half.problem("a0", 1, 12, a[1:2], y[1:2]) is None


def test_the_gib_bound_is_said_with_two_decimals(tmp_path: Path) -> None:
    """1.25 GiB hold 2 581 110 rows of 520 bytes (the rows held are set, not written)."""
    store = _store(tmp_path, max_bytes=int(1.25 * 2**30))
    a, y = _chunk(1)
    store._totals["a9"] = store._received["a9"] = 2_581_109
    assert store.problem("a0", 0, 12, a, y) is None
    store._received["a9"] += 1
    assert store.problem("a0", 0, 12, a, y) == "store would exceed its 1.25 GiB bound"


def test_the_index_replace_is_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk files and the index are fsync-ed, the index replaced atomically, the folder
    fsync-ed after the rename (a folder that cannot be opened is no error)."""
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    store = _store(tmp_path)
    assert len(synced) == 2  # the index, the folder
    a, y = _chunk(2)
    store.append("a0", 0, 2, a, y)
    assert len(synced) == 2 + 4
    from jetsplit.server.methods import activation_store

    def refuse(path: Any, flags: int) -> int:
        raise OSError("no")
    monkeypatch.setattr(os, "open", refuse)
    activation_store._fsync_dir(tmp_path)  # nothing raised

    def broken(fd: int) -> None:
        raise OSError("no")
    monkeypatch.undo()
    monkeypatch.setattr(os, "fsync", broken)
    closed: list[int] = []
    close = os.close
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), close(fd))[1])
    activation_store._fsync_dir(tmp_path)
    assert len(closed) == 1


# ---------------------------------------------------------------- the validation part


def test_carving_takes_a_seeded_sorted_fraction_for_validation() -> None:
    held = _held_out(20)
    order = np.random.default_rng([9, 0xA3]).permutation(20)
    for fraction, count in ((0.2, 4), (0.01, 1), (0.99, 19), (0.125, 2), (0.5, 10)):
        validation, test = carve_validation(held, fraction, 9)
        assert validation is not None
        want = np.sort(order[:count])
        assert np.array_equal(validation.x, held.x[want]), fraction
        assert np.array_equal(test.x, held.x[np.sort(order[count:])]), fraction
        assert len(validation) + len(test) == 20
    for fraction in (0.0, -0.5):
        validation, test = carve_validation(held, fraction, 9)
        assert validation is None and test is held
    # one sample: nothing can be spared for validation
    single = _held_out(1)
    validation, test = carve_validation(single, 0.5, 9)
    assert validation is None and test is single
    # no samples at all: no validation part either
    empty = _held_out(0)
    validation, test = carve_validation(empty, 0.5, 9)
    assert validation is None and test is empty
    # two samples: one each way
    pair = _held_out(2)
    validation, test = carve_validation(pair, 0.9, 9)
    assert validation is not None and len(validation) == len(test) == 1


# ---------------------------------------------------------------- construction


def test_construction_keeps_a_head_per_cut_and_the_starting_state(archive: Path) -> None:
    fleet = Fleet(cuts={"a0": SHALLOW})
    method = _method(archive, fleet, zero=False)
    t = method.trainer
    assert list(method.aux) == [SPLIT, SHALLOW]  # deepest first
    bundle = _bundle(archive)
    head = to_arrays(bundle.aux_module(), "aux")
    assert all(np.array_equal(method.aux[SPLIT][k], v) for k, v in head.items())
    assert sorted(method.aux[SPLIT]) == sorted(head)
    shallow = load_bundle(t.shipper.bundles.get("client", SHALLOW, aux=True).root)
    own = to_arrays(shallow.aux_module(), "aux")
    assert {k: v.shape for k, v in method.aux[SHALLOW].items()} == {
        k: v.shape for k, v in own.items()}
    assert method.aux[SHALLOW]["aux/hidden.fc.weight"].shape == (16, 16)
    assert method.aux[SPLIT]["aux/hidden.fc.weight"].shape == (16, 8)
    # replies are checked against each cut's own head
    assert {k: v.shape for k, v in t.weight_template.items() if k.startswith("aux/")} == {
        k: v.shape for k, v in head.items()}
    assert sorted(t.cut_templates) == [SHALLOW]
    assert t.weights_problem({**t.device_part("a0", t.global_client),
                              **method.aux[SHALLOW]}, ("client", "aux"), "a0") is None
    # the validation part is the held-out split's seeded fifth
    assert method.validation is not None and method.test is not None
    assert (len(method.validation), len(method.test)) == (5, 20)
    want, _ = carve_validation(_held_out(), 0.2, 5)
    assert want is not None and np.array_equal(method.validation.x, want.x)
    assert method.phase == method.round_phase == 1
    assert method.epoch == method.stale == method.server_epochs == 0
    assert method.best_accuracy is None and method.last_validation is None
    assert method.workdir is None and method.own_workdir is False
    assert method.bundle_sha is None and method.store is None and method.shipper is None
    assert method.upload_bound is None
    assert sorted(method.best) == sorted({**t.global_client, **method._flat(method.aux)})
    assert method.loss_tier == "device" and method.switches_cuts


def test_a_bundle_without_an_aux_head_is_a_one_line_error(tmp_path: Path) -> None:
    report = write_bundle(SPEC, SPLIT, tmp_path / "k", seed=3, tar=True, aux_ratio=None)
    assert report.tar_path is not None
    t = Trainer(Fleet(), report.tar_path, _settings(), _held_out())
    with pytest.raises(ConfigError) as info:
        Ampere(t)
    assert str(info.value) == "ampere needs a bundle with an auxiliary head (set model.aux_ratio)"


def test_one_round_is_too_few(archive: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _method(archive, Fleet(), rounds=1)
    assert str(info.value) == ("ampere needs at least 2 rounds (device epochs, then server "
                               "training), got rounds = 1")
    assert _method(archive, Fleet(), rounds=2).device_epochs == 4


@pytest.mark.parametrize(("rounds", "given", "want"), [
    (2, None, 1), (3, None, 1), (5, None, 2), (8, None, 4), (9, None, 4), (5, 7, 7), (5, 1, 1),
])
def test_device_epochs_default_to_half_the_rounds(archive: Path, rounds: int,
                                                  given: int | None, want: int) -> None:
    assert _method(archive, Fleet(), rounds=rounds, device_epochs=given).device_epochs == want


# ---------------------------------------------------------------- phase 1 by hand


def test_one_device_epoch_by_hand(archive: Path) -> None:
    """Epoch 0: no push (the devices hold the bundle's blocks), a `train` of target aux to
    each live device (B_k = 32·|D_k| / 120 rounded: 3, 13, 5, 11; ⌈|D_k| / B_k⌉ = 4 steps
    each, where ⌊⌋ gives 3, 3, 4, 3), the pull of client + aux from those that trained,
    their release. From zero, one step gives δ: (10·6 + 50·2 + 20·3 + 40·5) / 120 = 3.5
    for every client and aux tensor. The loss is Σ n_k·L_k / Σ n_k."""
    fleet = Fleet()
    method = _method(archive, fleet)
    t = method.trainer
    loss = _play(method, 0)
    assert fleet.trace() == ["train:a0,a1,a2,a3", "get_weights:a0,a1,a2,a3",
                             "release:a0,a1,a2,a3"]
    assert fleet.ensured == [("bundle", ["a0", "a1", "a2", "a3"], 0, {})]
    batches = {"a0": 3, "a1": 13, "a2": 5, "a3": 11}
    for sent in fleet.of("train"):
        b = batches[sent.agent]
        assert sent.meta == {"target": "aux", "batch": b, "lr": CLIENT_LR, "steps": 4}
        assert sent.work == 4 * b and sent.round == 0 and sent.deadline_s == DEADLINE_S
    assert fleet.of("get_weights")[0].meta["blocks"] == ["client", "aux"]
    _close(t.global_client, _full(t.global_client, 3.5), "global client block")
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], 3.5), "aux head")
    assert loss == pytest.approx((10 * 1.5 + 50 * 0.5 + 20 * 2.0 + 40 * 1.0) / 120)
    assert dict(t.books.fwd_samples) == SIZES and dict(t.books.bwd_samples) == SIZES
    assert method.epoch == 1 and method.phase == 1 and method.round_phase == 1
    assert method.last_validation is not None and method.best_accuracy is not None


def test_later_epochs_start_from_the_average(archive: Path) -> None:
    """Epoch 1 pushes the average (3.5 everywhere) first; from there λ·3.5 + δ gives 7.75,
    4.625, 7.375, 8.15, averaged 10 : 50 : 20 : 40."""
    fleet = Fleet()
    method = _method(archive, fleet)
    t = method.trainer
    _play(method, 0)
    _play(method, 1, ["a0", "a1", "a2", "a3"])
    assert fleet.trace()[3:] == ["set_weights:a0,a1,a2,a3", "train:a0,a1,a2,a3",
                                 "get_weights:a0,a1,a2,a3", "release:a0,a1,a2,a3"]
    for sent in fleet.of("set_weights"):
        assert sent.round == 1
        _close(sent.tensors, _full({**t.global_client, **method.aux[SPLIT]}, 3.5) | {
            k: np.full(v.shape, 3.5) for k, v in sent.tensors.items()}, "pushed")
        assert sorted(sent.tensors) == sorted({**t.global_client, **method.aux[SPLIT]})
    want = (10 * 7.75 + 50 * 4.625 + 20 * 7.375 + 40 * 8.15) / 120
    _close(t.global_client, _full(t.global_client, want), "global client block")
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], want), "aux head")
    assert method.epoch == 2


def test_only_the_selected_live_devices_train(archive: Path) -> None:
    """a3 is offline, a1 not selected: a0 and a2 train, B_k shared between them."""
    fleet = Fleet()
    method = _method(archive, fleet)
    fleet.registry.set_state("a3", "offline")
    loss = _play(method, 0, ["a0", "a2", "a3"])
    assert fleet.trace() == ["train:a0,a2", "get_weights:a0,a2", "release:a0,a2"]
    assert {s.agent: s.meta["batch"] for s in fleet.of("train")} == {"a0": 11, "a2": 21}
    assert {s.agent: s.meta["steps"] for s in fleet.of("train")} == {"a0": 1, "a2": 1}
    _close(method.trainer.global_client, _full(method.trainer.global_client, 4.0), "client")
    assert loss == pytest.approx((10 * 1.5 + 20 * 2.0) / 30)


def test_a_fixed_client_batch_sets_the_steps(archive: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, client_batch=7)
    _play(method, 0)
    assert {s.agent: (s.meta["batch"], s.meta["steps"], s.work) for s in fleet.of("train")} == {
        "a0": (7, 2, 14), "a1": (7, 8, 56), "a2": (7, 3, 21), "a3": (7, 6, 42)}


def test_per_cut_layers_and_heads_average_over_their_holders(archive: Path) -> None:
    """a0, a2 at cut 2 (no `mix` layer), a1, a3 at p*: `embed` is averaged over all four
    (3.5), `mix` over a1, a3 ((50·2 + 40·5) / 90), the cut-2 head over a0, a2 ((10·6 +
    20·3) / 30 = 4), the p* head over a1, a3. Epoch 1 pushes each device its cut's layers
    and head, per cut (deepest first)."""
    fleet = Fleet(cuts={"a0": SHALLOW, "a2": SHALLOW})
    method = _method(archive, fleet)
    t = method.trainer
    _play(method, 0)
    assert fleet.ensured[0] == ("bundle", ["a0", "a1", "a2", "a3"], 0,
                                {"a0": SHALLOW, "a2": SHALLOW})
    deep = (50 * 2 + 40 * 5) / 90
    want = {k: np.full(v.shape, 3.5 if "embed" in k else deep)
            for k, v in t.global_client.items()}
    _close(t.global_client, want, "global client block")
    _close(method.aux[SHALLOW], _full(method.aux[SHALLOW], 4.0), "cut-2 head")
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], deep), "p* head")
    for sent in fleet.of("get_weights"):
        assert sorted(fleet.held[sent.agent]) == sorted(
            {**t.device_part(sent.agent, t.global_client), **method.aux[t.cut(sent.agent)]})
    _play(method, 1)
    assert fleet.trace()[3:5] == ["set_weights:a1,a3", "set_weights:a0,a2"]
    for sent in fleet.of("set_weights"):
        cut = t.cut(sent.agent)
        assert sorted(sent.tensors) == sorted(
            {**t.device_part(sent.agent, t.global_client), **method.aux[cut]})
        assert all(np.all(v == (4.0 if cut == SHALLOW and k.startswith("aux/") else
                                np.float32(3.5) if "embed" in k else np.float32(deep)))
                   for k, v in sent.tensors.items()), sent.agent


def test_a_layer_nobody_held_keeps_its_weights(archive: Path) -> None:
    """Every device at cut 2: `mix` stays as it was (1.25 here); the p* head too."""
    fleet = Fleet(cuts={a: SHALLOW for a in SIZES})
    method = _method(archive, fleet)
    t = method.trainer
    t.global_client = {k: np.full_like(v, 1.25) for k, v in t.global_client.items()}
    method.aux[SPLIT] = {k: np.full_like(v, -2.0) for k, v in method.aux[SPLIT].items()}
    for agent in SIZES:
        fleet.held[agent] = {**{k: np.zeros_like(v) for k, v in t.device_part(
            agent, t.global_client).items()}, **method.aux[SHALLOW]}
    _play(method, 0)
    want = {k: np.full(v.shape, 3.5 if "embed" in k else 1.25)
            for k, v in t.global_client.items()}
    _close(t.global_client, want, "global client block")
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], -2.0), "untouched head")
    _close(method.aux[SHALLOW], _full(method.aux[SHALLOW], 3.5), "cut-2 head")


# ---------------------------------------------------------------- reported losses


def _loss_of(meta: dict[str, Any]) -> Tamper:
    def tamper(m: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        m.update(meta)
    return tamper


@pytest.mark.parametrize(("meta", "counted"), [
    ({"samples": 12}, True),  # = steps·batch, a0's limit
    ({"samples": 1}, True),
    ({"samples": 13}, False), ({"samples": 0}, False), ({"samples": -1}, False),
    ({"samples": 4.0}, False), ({"samples": "4"}, False), ({"samples": None}, False),
    ({"loss": 2}, False), ({"loss": math.nan}, False), ({"loss": math.inf}, False),
    ({"loss": -math.inf}, False), ({"loss": "1.5"}, False), ({"loss": None}, False),
    ({"loss": 0.0}, True), ({"loss": -1.0}, True),
])
def test_a_train_reply_counts_for_the_loss_only_when_plausible(
        archive: Path, meta: dict[str, Any], counted: bool) -> None:
    """a0 (B_k 3, 4 steps: at most 12 samples) reports `meta`: counted in the loss and
    the books, or left out of both; its weights are averaged either way."""
    fleet = Fleet()
    fleet.tamper[("train", "a0")] = _loss_of(meta)
    method = _method(archive, fleet)
    loss = _play(method, 0)
    t = method.trainer
    n0, l0 = meta.get("samples", 10), meta.get("loss", 1.5)
    rest = 50 * 0.5 + 20 * 2.0 + 40 * 1.0
    want = (n0 * l0 + rest) / (n0 + 110) if counted else rest / 110
    assert loss == pytest.approx(want)
    if counted:
        assert t.books.fwd_samples["a0"] == t.books.bwd_samples["a0"] == n0
    else:  # not in the books at all (no device GFLOPs for it)
        assert "a0" not in t.books.fwd_samples and "a0" not in t.books.bwd_samples
    _close(t.global_client, _full(t.global_client, 3.5), "global client block")


def test_a_bool_sample_count_is_not_counted(archive: Path) -> None:
    fleet = Fleet()
    fleet.tamper[("train", "a0")] = _loss_of({"samples": True})
    method = _method(archive, fleet)
    _play(method, 0)
    assert "a0" not in method.trainer.books.fwd_samples


def test_no_plausible_loss_is_no_loss(archive: Path) -> None:
    fleet = Fleet()
    for agent in SIZES:
        fleet.tamper[("train", agent)] = _loss_of({"loss": math.nan})
    method = _method(archive, fleet)
    assert _play(method, 0) is None
    assert method.epoch == 1


def test_an_epoch_without_uploads_changes_nothing(archive: Path) -> None:
    """Every train reply missed: nobody is pulled, no epoch counted, no validation."""
    fleet = Fleet()
    for agent in SIZES:
        fleet.tamper[("train", agent)] = lambda m, x, r, s: "error: train: boom"
    method = _method(archive, fleet)
    method._validation_accuracy = lambda: pytest.fail("validated")  # type: ignore
    assert _play(method, 0) is None
    assert fleet.trace() == ["train:a0,a1,a2,a3"]
    assert method.epoch == 0 and method.phase == 1 and method.last_validation is None


def test_a_refused_upload_is_left_out_of_the_average(archive: Path) -> None:
    """a1's pulled head is float64 (refused): the average is a0, a2, a3's only."""
    fleet = Fleet()

    def bad(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        tensors["aux/classifier.bias"] = tensors["aux/classifier.bias"].astype(np.float64)
    fleet.tamper[("get_weights", "a1")] = bad
    method = _method(archive, fleet)
    _play(method, 0)
    want = (10 * 6 + 20 * 3 + 40 * 5) / 70
    _close(method.trainer.global_client, _full(method.trainer.global_client, want), "client")
    assert method.trainer.books.missed["a1"] == \
        "error: bad reply: tensor aux/classifier.bias is float64 [10]"


# ---------------------------------------------------------------- early stopping


def _scripted(method: Ampere, accuracies: list[float]) -> None:
    values = iter(accuracies)
    method._validation_accuracy = lambda: next(values)  # type: ignore[method-assign]


def test_the_best_epoch_is_kept_and_patience_ends_phase_one(archive: Path) -> None:
    """Accuracies 0.5, 0.7, 0.7 (not better), 0.6: patience 2 ends phase 1 after epoch 3
    and the blocks go back to epoch 1's (λ·3.5 + δ averaged)."""
    fleet = Fleet()
    method = _method(archive, fleet, patience=2, rounds=20, device_epochs=10)
    _scripted(method, [0.5, 0.7, 0.7, 0.6])
    t = method.trainer
    stale, best = [], []
    for r in range(4):
        _play(method, r)
        stale.append(method.stale)
        best.append(method.best_accuracy)
        assert method.round_phase == 1
        if r == 1:
            epoch1 = dict(t.global_client)
    assert stale == [0, 0, 1, 2] and best == [0.5, 0.7, 0.7, 0.7]
    assert method.last_validation == 0.6 and method.phase == 2 and method.epoch == 4
    _close(t.global_client, epoch1, "the best epoch's client block", rtol=0)
    want = (10 * 7.75 + 50 * 4.625 + 20 * 7.375 + 40 * 8.15) / 120
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], want), "the best epoch's head")
    assert method.evaluate()["phase"] == 1 and method.evaluate()["validation_accuracy"] == 0.6
    assert method.loss_tier == "device"


@pytest.mark.parametrize(("rounds", "device_epochs", "patience", "epochs"), [
    (20, 3, 50, 3),  # N_d
    (5, 50, 50, 4),  # rounds 0..3: round 3 + 2 = 5 leaves one round for phase 2
    (4, 50, 50, 3),
    (6, 50, 50, 5),  # round 4: 4 + 2 = 6 (2·4 or 4² would end it at round 3)
    (20, 50, 1, 2),  # accuracies fall from the first: one stale epoch
])
def test_phase_one_ends_at_n_d_patience_or_the_last_round(
        archive: Path, rounds: int, device_epochs: int, patience: int, epochs: int) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, rounds=rounds, device_epochs=device_epochs,
                     patience=patience)
    _scripted(method, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    phases = []
    for r in range(epochs):
        _play(method, r)
        phases.append(method.phase)
    assert phases == [1] * (epochs - 1) + [2]
    assert method.epoch == epochs


def test_a_run_past_its_limits_ends_phase_one_at_its_next_epoch(archive: Path) -> None:
    """A resumed run whose state is already past a limit (a smaller patience, N_d or
    round budget than it was started with) ends phase 1 after its next epoch."""
    for limits, state in (({"patience": 2}, {"stale": 5}), ({"device_epochs": 3},
                                                            {"epoch": 7})):
        method = _method(archive, Fleet(), rounds=40, **{"patience": 50, "device_epochs": 50,
                                                         **limits})
        _scripted(method, [0.5])
        method.best_accuracy = 0.9
        for name, value in state.items():
            setattr(method, name, value)
        _play(method, 10)
        assert method.phase == 2, limits
    method = _method(archive, Fleet(), rounds=5, patience=50, device_epochs=50)
    _scripted(method, [0.5])
    _play(method, 4)
    assert method.phase == 2


def test_without_a_validation_part_the_latest_epoch_is_best(archive: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, validation_fraction=0.0, device_epochs=2)
    assert method.validation is None and method.test is not None and len(method.test) == 25
    method.stale = 3
    _play(method, 0)
    assert method.stale == 0 and method.best_accuracy is None and method.last_validation is None
    _play(method, 1)
    want = (10 * 7.75 + 50 * 4.625 + 20 * 7.375 + 40 * 8.15) / 120
    _close(method.trainer.global_client, _full(method.trainer.global_client, want), "latest")
    assert method.phase == 2 and method.evaluate()["validation_accuracy"] is None


def test_a_head_first_held_after_the_best_epoch_keeps_its_latest_weights(
        archive: Path) -> None:
    """Epoch 0 is best; a0 moves to cut 2 and trains a fresh head there in epoch 1 (not
    better): phase 1 ends on epoch 0's blocks, with the cut-2 head as epoch 1 left it."""
    fleet = Fleet()
    method = _method(archive, fleet, patience=1, rounds=20, device_epochs=10)
    _scripted(method, [0.9, 0.1])
    t = method.trainer
    _play(method, 0)
    epoch0 = dict(t.global_client)
    assert method.switch_cuts({"a0": SHALLOW, "a1": SPLIT}) == ["a0"]
    assert t.cut("a0") == SHALLOW and sorted(method.aux) == [SHALLOW, SPLIT]
    assert SHALLOW in t.cut_templates
    fleet.held["a0"] = {}
    _play(method, 1)
    assert method.phase == 2
    _close(t.global_client, epoch0, "epoch 0's client block", rtol=0)
    _close(method.aux[SPLIT], _full(method.aux[SPLIT], 3.5), "epoch 0's p* head")
    fresh = to_arrays(load_bundle(t.shipper.bundles.get("client", SHALLOW, aux=True).root
                                  ).aux_module(), "aux")
    _close(method.aux[SHALLOW], _affine(fresh, LAMBDA["a0"], DELTA["a0"]), "a0's head",
           rtol=1e-6)
    assert method.switch_cuts({"a0": SPLIT}) == [] and t.cut("a0") == SHALLOW
    assert not method.switches_cuts


def test_a_switch_back_to_a_cut_held_before_keeps_its_head(archive: Path) -> None:
    fleet = Fleet(cuts={"a0": SHALLOW})
    method = _method(archive, fleet)
    t = method.trainer
    method.aux[SHALLOW] = {k: np.full_like(v, 9.0) for k, v in method.aux[SHALLOW].items()}
    template = t.cut_templates[SHALLOW]
    assert method.switch_cuts({"a0": SPLIT}) == ["a0"]
    assert method.switch_cuts({"a0": SHALLOW, "a1": 1}) == ["a0", "a1"]
    _close(method.aux[SHALLOW], _full(method.aux[SHALLOW], 9.0), "kept head", rtol=0)
    assert t.cut_templates[SHALLOW] is template
    assert sorted(method.aux) == [1, SHALLOW, SPLIT] and sorted(t.cut_templates) == [1, 2]
    assert method.switch_cuts({"a1": SPLIT}) == ["a1"] and SPLIT not in t.cut_templates


# ---------------------------------------------------------------- validation accuracy


def _device_accuracy(method: Ampere, cut: int) -> float:
    """client[:cut]∘aux_cut in plain PyTorch on the validation part."""
    t = method.trainer
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    head = (t.bundle.aux_module() if cut == SPLIT else load_bundle(
        t.shipper.bundles.get("client", cut, aux=True).root).aux_module())
    load_strict(head, from_arrays(method.aux[cut], "aux"), "aux")
    model = nn.Sequential(*list(client.children())[:cut], head)
    assert method.validation is not None
    with torch.no_grad(), eval_mode(model):
        guess = model(torch.from_numpy(method.validation.x)).argmax(1).numpy()
    return float(np.mean(guess == method.validation.y))


def _random_weights(method: Ampere, seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = method.trainer
    t.global_client = {k: (0.3 * rng.standard_normal(v.shape)).astype(v.dtype)
                       for k, v in t.global_client.items()}
    method.aux = {c: {k: (0.3 * rng.standard_normal(v.shape)).astype(v.dtype)
                      for k, v in a.items()}
                  for c, a in method.aux.items()}


def test_validation_accuracy_is_the_devices_models_weighted_by_their_data(
        archive: Path) -> None:
    """a0 (10) and a2 (6) at cut 2, a1 (50) at p*, a3 (no size: 0, left out):
    (16·acc_2 + 50·acc_4) / 66, each device model client[:cut]∘aux_cut (sizes whose bits
    overlap: 10 | 6 = 14 and 10 ^ 6 = 12 are not their sum)."""
    held = _held_out(60)
    fleet = Fleet(sizes={"a0": 10, "a1": 50, "a2": 6}, cuts={"a0": SHALLOW, "a2": SHALLOW})
    fleet.registry.register("a3", {"agent": "a3", "role": "client",
                                   "zoo_version": ZOO_VERSION, "dataset": {}})
    method = _method(archive, fleet, test=held, validation_fraction=0.5)
    for seed in range(40):
        _random_weights(method, seed)
        deep, shallow = _device_accuracy(method, SPLIT), _device_accuracy(method, SHALLOW)
        if deep != shallow and min(deep, shallow) > 0:
            break
    assert deep != shallow
    assert method._validation_accuracy() == pytest.approx((16 * shallow + 50 * deep) / 66)
    # one cut in the fleet: that cut's model
    fleet2 = Fleet(sizes={"a0": 10, "a2": 20}, cuts={"a0": SHALLOW, "a2": SHALLOW})
    method2 = _method(archive, fleet2, test=held, validation_fraction=0.5)
    method2.trainer.global_client, method2.aux = method.trainer.global_client, method.aux
    assert method2._validation_accuracy() == shallow
    fleet3 = Fleet(sizes={"a1": 50})
    method3 = _method(archive, fleet3, test=held, validation_fraction=0.5)
    method3.trainer.global_client = method.trainer.global_client
    method3.aux = {SPLIT: method.aux[SPLIT]}
    assert method3._validation_accuracy() == deep
    # nobody registered a size (a5, at cut 2, claims none): the server cut's model
    fleet4 = Fleet(sizes={})
    fleet4.registry.register("a5", {"agent": "a5", "role": "client",
                                    "zoo_version": ZOO_VERSION, "dataset": {}})
    fleet4.cuts = {"a5": SHALLOW}
    method4 = _method(archive, fleet4, test=held, validation_fraction=0.5)
    method4.trainer.global_client = method.trainer.global_client
    method4.aux = {SPLIT: method.aux[SPLIT]}
    assert method4._validation_accuracy() == deep


# ---------------------------------------------------------------- phase 2 setup


def test_phase_two_writes_a_trained_bundle_and_opens_the_store(archive: Path,
                                                               tmp_path: Path) -> None:
    """The trained bundle: the final client block and p* head, a zero server block, at p*
    with the run's aux ratio; shipped as training traffic with the client's optimiser, the
    bundle deadline, the seed and every other cut's head. The store is tied to its sha256,
    bounded by activation_gb."""
    fleet = Fleet(cuts={"a0": SHALLOW})
    method = _method(archive, fleet, zero=False, device_epochs=1,
                     activation_dir=str(tmp_path / "work"), activation_gb=0.25)
    _random_weights(method, 3)
    method.phase = 2
    method._prepare_phase2()
    t = method.trainer
    assert method.workdir == tmp_path / "work" and method.own_workdir is False
    trained = load_bundle(tmp_path / "work" / "bundle")
    assert trained.split == SPLIT and trained.has_aux
    assert trained.manifest.aux_ratio == t.bundle.manifest.aux_ratio
    _close(to_arrays(trained.client_module(), "client"), t.global_client, "client", rtol=0)
    _close(to_arrays(trained.aux_module(), "aux"), method.aux[SPLIT], "aux", rtol=0)
    server = to_arrays(trained.server_module(), "server")
    assert server and all(not v.any() for v in server.values())
    shipper = method.shipper
    assert shipper is not None and shipper.kind == "trained_bundle"
    assert shipper.part_kind == "trained_bundle_part" and shipper.content == "aux"
    assert shipper.lr == CLIENT_LR and shipper.deadline_s == 77.0
    assert shipper.optimizer == {"name": "sgd", "lr": CLIENT_LR, "momentum": MOMENTUM,
                                 "weight_decay": 0.0}
    assert shipper.bundles.seed == 5
    assert sorted(shipper.bundles.aux_weights) == [SHALLOW]
    _close({f"aux/{k}": v.numpy() for k, v in shipper.bundles.aux_weights[SHALLOW].items()},
           method.aux[SHALLOW], "cut-2 head", rtol=0)
    archive_sha = shipper.sha256
    assert method.bundle_sha == archive_sha
    store = method.store
    assert store is not None and store.root == tmp_path / "work" / "store"
    assert store.activation_shape == SHAPE and store.num_classes == CLASSES
    assert store.max_bytes == 2**28 and store.tag == archive_sha
    # once: a second call keeps the same shipper and store
    shipper_before, store_before = method.shipper, method.store
    method._prepare_phase2()
    assert method.shipper is shipper_before and method.store is store_before


def test_phase_two_reuses_only_the_archive_this_run_wrote(archive: Path,
                                                          tmp_path: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, activation_dir=str(tmp_path / "w"))
    method.phase = 2
    method._prepare_phase2()
    sha = method.bundle_sha
    written: list[int] = []
    write = method._write_trained_bundle

    def counting() -> None:
        written.append(1)
        write()
    method._write_trained_bundle = counting  # type: ignore[method-assign]
    method.shipper = method.store = None
    method._prepare_phase2()  # a resume: the archive matches
    assert written == [] and method.bundle_sha == sha
    method.shipper = method.store = None
    method.bundle_sha = "0" * 64  # another run's archive in the folder
    method._prepare_phase2()
    assert written == [1] and method.bundle_sha == sha
    method.shipper = method.store = None
    method.bundle_sha = "f" * 64
    method._prepare_phase2()
    assert written == [1, 1] and method.bundle_sha == sha


def test_without_an_activation_dir_a_temp_folder_is_made_and_removed(archive: Path,
                                                                      tmp_path: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, rounds=2)
    _phase2(method)
    _play(method, 1)
    workdir = method.workdir
    assert workdir is not None and method.own_workdir is True
    assert workdir.parent == Path(tempfile.gettempdir())
    assert workdir.name.startswith("jetsplit-ampere-scripted-")
    assert (workdir / "store" / INDEX).exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out2").mkdir()
    method.save(tmp_path / "out")
    assert not workdir.exists()
    method.save(tmp_path / "out")  # gone already: no error
    given = _method(archive, Fleet(), rounds=2, activation_dir=str(tmp_path / "mine"))
    _phase2(given)
    _play(given, 1)
    given.save(tmp_path / "out2")
    assert (tmp_path / "mine" / "store" / INDEX).exists()


# ---------------------------------------------------------------- phase 2 uploads


def test_phase_two_asks_every_eligible_device_in_waves_of_upload_mb(archive: Path,
                                                                    tmp_path: Path) -> None:
    """upload_mb = 0.005 MiB: ⌊5242 / 512⌋ = 10 rows (16×8 floats) per reply. Wave 0 asks
    all four (rows 0..10), wave 1 a1, a2, a3 (10..20), wave 2 a1, a3, … until each sent
    |D_k|; the phase-2 shipper is asked for every eligible device, the round's selection
    notwithstanding, and `work` is the rows still owed up to the limit."""
    fleet = Fleet()
    method = _method(archive, fleet, rounds=2, upload_mb=0.005,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    assert method._rows_per_reply("a0") == 10
    trained: list[np.ndarray] = []
    _spy_steps(method, fleet, trained)
    loss = _play(method, 1, ["a1"])
    assert loss is not None and method.round_phase == 2 and method.loss_tier == "server"
    assert fleet.trace()[3:] == ["generate@0:a0,a1,a2,a3", "generate@1:a1,a2,a3",
                                 "generate@2:a1,a3", "generate@3:a1,a3", "generate@4:a1"]
    assert fleet.ensured[-1] == ("trained_bundle", ["a0", "a1", "a2", "a3"], 1, {})
    got = [(s.agent, s.step, s.meta["offset"], s.work) for s in fleet.of("generate")]
    assert got[:4] == [("a0", 0, 0, 10), ("a1", 0, 0, 10), ("a2", 0, 0, 10), ("a3", 0, 0, 10)]
    assert [(a, o) for a, _, o, _ in got if a == "a1"] == [("a1", o) for o in (0, 10, 20, 30,
                                                                              40)]
    for sent in fleet.of("generate"):
        assert sent.meta == {"offset": sent.meta["offset"], "limit": 10, "codec": "fp32",
                             "compression": "none"}
        assert sent.round == 1 and sent.deadline_s == DEADLINE_S
    store = method._store()
    assert store.completed() == ["a0", "a1", "a2", "a3"] and len(store) == 120
    for agent in SIZES:
        acts, labels = store.take(store.rows_of(agent))
        assert np.array_equal(acts, fleet.data[agent][0]), agent
        assert np.array_equal(labels, fleet.data[agent][1]), agent
    assert dict(method.trainer.books.fwd_samples) == SIZES
    assert method.server_epochs == 1
    # every wave's rows (offsets 10, 20, …: not the offset's bits or'ed with the count)
    # train the server once in its first epoch
    assert np.array_equal(np.sort(np.concatenate(trained)), np.arange(120))


def test_uploads_carry_the_codec_and_the_work_still_owed(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 25})
    method = _method(archive, fleet, rounds=2, upload_mb=0.005, codec="fp16",
                     compression="zstd", activation_dir=str(tmp_path / "w"))
    _phase2(method)
    _play(method, 1)
    assert [(s.meta["offset"], s.meta["codec"], s.meta["compression"], s.work)
            for s in fleet.of("generate")] == [(0, "fp16", "zstd", 10), (10, "fp16", "zstd", 10),
                                               (20, "fp16", "zstd", 5)]


def test_a_tiny_upload_budget_still_sends_a_row(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 3})
    method = _method(archive, fleet, rounds=2, upload_mb=0.0001,
                     activation_dir=str(tmp_path / "w"))
    assert method._rows_per_reply("a0") == 1
    _phase2(method)
    _play(method, 1)
    assert fleet.trace()[3:] == ["generate@0:a0", "generate@1:a0", "generate@2:a0"]


def test_a_large_dataset_uploads_in_one_reply_and_is_stored(archive: Path,
                                                          tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 300})
    method = _method(archive, fleet, rounds=2, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    assert method._rows_per_reply("a0") == 2048
    assert _play(method, 1) is not None
    assert fleet.trace()[-1] == "generate@0:a0" and method._store().completed() == ["a0"]


def test_an_incomplete_upload_is_asked_again_next_round_from_its_offset(
        archive: Path, tmp_path: Path) -> None:
    """a2 misses wave 1: it is not asked again this round; next round only a2 is asked,
    from row 10; once all are in, later rounds ask nobody and ship nothing."""
    fleet = Fleet()
    calls: list[int] = []

    def away(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> str | None:
        calls.append(step)
        return "offline" if round == 1 and step == 1 else None
    fleet.tamper[("generate", "a2")] = away
    method = _method(archive, fleet, rounds=4, upload_mb=0.005,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    _play(method, 1)
    store = method._store()
    assert store.received("a2") == 10 and store.completed() == ["a0", "a1", "a3"]
    assert method.trainer.books.missed["a2"] == "offline"
    assert [s for s in fleet.trace() if "a2" in s][-1] == "generate@1:a1,a2,a3"
    before = len(fleet.exchanges)
    _play(method, 2)
    assert fleet.trace()[before:] == ["generate@0:a2"]
    assert [s.meta["offset"] for s in fleet.of("generate", "a2")] == [0, 10, 10]
    assert fleet.ensured[-1] == ("trained_bundle", ["a2"], 2, {})
    assert store.completed() == ["a0", "a1", "a2", "a3"]
    before, ensured = len(fleet.exchanges), len(fleet.ensured)
    assert _play(method, 3) is not None
    assert len(fleet.exchanges) == before and len(fleet.ensured) == ensured
    assert method.server_epochs == 3


def test_n_s_server_epochs_then_rounds_only_evaluate(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, rounds=6, server_epochs=2,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    server = to_arrays(method.trainer.server, "server")
    assert _play(method, 1) is not None and _play(method, 2) is not None
    after = to_arrays(method.trainer.server, "server")
    assert any(not np.array_equal(server[k], after[k]) for k in server)
    before = len(fleet.exchanges)
    assert _play(method, 3) is None and _play(method, 4) is None
    assert len(fleet.exchanges) == before and method.server_epochs == 2
    _close(to_arrays(method.trainer.server, "server"), after, "server block", rtol=0)
    assert method.round_phase == 2
    method.server_epochs = 3  # restored from a run given more server epochs
    assert _play(method, 5) is None and len(fleet.exchanges) == before


def test_an_ineligible_device_is_not_asked(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, rounds=3, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    fleet.registry.register("old", {"agent": "old", "role": "client", "zoo_version": -1,
                                    "dataset": {"size": 5}})
    fleet.registry.set_state("a3", "offline")
    _play(method, 1, ["a0"])
    assert fleet.trace()[-1] == "generate@0:a0,a1,a2"


# ---------------------------------------------------------------- untrusted uploads


def _tamper_generate(change: Callable[[dict[str, Any], Arrays], None]) -> Tamper:
    def tamper(meta: dict[str, Any], tensors: Arrays, round: int, step: int) -> None:
        change(meta, tensors)
    return tamper


LACKS = ("reply lacks activations or labels, or its dataset size differs from the "
         "registered one")


@pytest.mark.parametrize(("change", "reason"), [
    (lambda m, x: x.pop("activations"), LACKS),
    (lambda m, x: x.pop("labels"), LACKS),
    (lambda m, x: m.update(total=51), LACKS),
    (lambda m, x: m.update(total=49), LACKS),
    (lambda m, x: m.pop("total"), LACKS),
    (lambda m, x: x.update(activations=x["activations"].astype(np.float64)),
     "activations float64 [50, 16, 8], expected float32 [50, 16, 8]"),
    (lambda m, x: x.update(labels=x["labels"] + 10), "labels out of range 0..9"),
    (lambda m, x: x["activations"].__setitem__((0, 0, 0), np.inf),
     "activations contain NaN or infinity"),
])
def test_a_bad_upload_is_a_recorded_miss_and_the_store_is_unchanged(
        archive: Path, tmp_path: Path, change: Callable[[dict[str, Any], Arrays], None],
        reason: str) -> None:
    fleet = Fleet()
    fleet.tamper[("generate", "a1")] = _tamper_generate(change)
    method = _method(archive, fleet, rounds=3, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    assert _play(method, 1) is not None
    t = method.trainer
    assert t.books.missed["a1"] == f"error: bad reply: upload from a1 refused: {reason}"
    store = method._store()
    assert store.agents() == ["a0", "a2", "a3"] and store.received("a1") == 0
    assert "a1" not in t.books.fwd_samples
    assert fleet.trace()[-1] == "generate@0:a0,a1,a2,a3"  # not asked again this round


def test_a_shallow_upload_is_checked_at_its_cut_then_carried(archive: Path,
                                                             tmp_path: Path) -> None:
    """a0 at cut 2 uploads (8, 16) rows: carried through transpose and mix with the global
    block; a p*-shaped upload from it is refused at its cut."""
    fleet = Fleet(sizes={"a0": 12, "a1": 9}, cuts={"a0": SHALLOW})
    method = _method(archive, fleet, zero=False, rounds=3, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    _play(method, 1)
    t = method.trainer
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    with torch.no_grad(), eval_mode(client):
        want = nn.Sequential(*list(client.children())[SHALLOW:])(
            torch.from_numpy(fleet.data["a0"][0])).numpy()
    store = method._store()
    acts, labels = store.take(store.rows_of("a0"))
    np.testing.assert_allclose(acts, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(labels, fleet.data["a0"][1])
    assert np.array_equal(store.take(store.rows_of("a1"))[0], fleet.data["a1"][0])
    bad = np.zeros((3, *SHAPE), np.float32)
    with pytest.raises(StoreError) as info:
        method._carried("a0", bad, labels[:3], 10)
    assert str(info.value) == ("upload from a0 refused: activations float32 [3, 16, 8], "
                               "expected float32 [3, 8, 16]")
    ok = np.zeros((3, *SHALLOW_SHAPE), np.float32)
    with pytest.raises(StoreError) as info:
        method._carried("a0", ok, labels[:3], 2)
    assert str(info.value) == "upload from a0 refused: labels must be 1..2 integers"
    assert method._carried("a0", ok, labels[:3], 3).shape == (3, *SHAPE)
    assert method._carried("a1", bad, labels[:3], 1) is bad


def test_uploads_are_bounded_against_the_coordinators_own_norm(archive: Path,
                                                               tmp_path: Path) -> None:
    """activation_bound 5: the reference is the median per-sample norm of the global
    client block on the validation inputs; a0, the first to upload, sends rows ×1000 and
    is brought within 5× it and noted; a1's clean rows are stored bit for bit."""
    fleet = Fleet(sizes={"a0": 12, "a1": 9})
    fleet.data["a0"] = (fleet.data["a0"][0] * 1000, fleet.data["a0"][1])
    method = _method(archive, fleet, zero=False, rounds=3, activation_bound=5.0,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    t = method.trainer
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    assert method.validation is not None
    with torch.no_grad(), eval_mode(client):
        reference = float(client(torch.from_numpy(method.validation.x)).flatten(1).norm(
            dim=1).median())
    assert method._reference_norm() == pytest.approx(reference, rel=1e-6)
    clean = np.linalg.norm(fleet.data["a1"][0].reshape(9, -1), axis=1)
    assert clean.max() < 5 * reference < 100 * clean.min()  # the clean rows pass
    _play(method, 1)
    store = method._store()
    a0 = store.take(store.rows_of("a0"))[0]
    assert np.linalg.norm(a0.reshape(12, -1), axis=1).max() <= 5 * reference * (1 + 1e-5)
    assert np.array_equal(store.take(store.rows_of("a1"))[0], fleet.data["a1"][0])
    assert list(t.books.bounded) == ["a0"]
    assert method.upload_bound is not None and method.upload_bound.factor == 5.0


def test_a_clean_slice_is_returned_as_it_came(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet()
    method = _method(archive, fleet, zero=False, activation_bound=5.0)
    acts = fleet.data["a0"][0]
    acts.flags.writeable = False  # as decoded: torch warns on a read-only array
    empty = np.zeros((0, *SHAPE), np.float32)
    assert method._bounded("a0", empty) is empty and method.upload_bound is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert method._bounded("a0", acts) is acts
    assert method.upload_bound is not None
    off = _method(archive, Fleet(), zero=False, activation_bound=0.0)
    assert off._bounded("a0", acts) is acts and off.upload_bound is None
    half = _method(archive, Fleet(), zero=False, activation_bound=0.5)
    half._bounded("a0", acts)
    assert half.upload_bound is not None and half.upload_bound.factor == 0.5


def test_a_zero_reference_leaves_the_bound_to_the_uploads(archive: Path,
                                                          tmp_path: Path) -> None:
    """A zero client block gives a zero reference: no history is made up, and the first
    upload is its own reference (stored as it came)."""
    fleet = Fleet(sizes={"a0": 12})
    method = _method(archive, fleet, rounds=3, activation_bound=5.0,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method, zero=True)
    assert method._reference_norm() == 0.0
    _play(method, 1)
    store = method._store()
    assert np.array_equal(store.take(store.rows_of("a0"))[0], fleet.data["a0"][0])
    assert method.trainer.books.bounded == {}


def test_a_reference_under_one_still_bounds(archive: Path, tmp_path: Path) -> None:
    """A client block that maps every input to 0.01 everywhere: the reference is
    0.01·√128 ≈ 0.11, so a0's rows (norms about 11) are all brought to 5× that."""
    fleet = Fleet(sizes={"a0": 12})
    method = _method(archive, fleet, rounds=3, activation_bound=5.0,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method, zero=True)
    t = method.trainer
    t.global_client["client/mix.mix.bias"] = np.full(8, 0.01, np.float32)
    assert method._reference_norm() == pytest.approx(0.01 * math.sqrt(128), rel=1e-5)
    _play(method, 1)
    store = method._store()
    norms = np.linalg.norm(store.take(store.rows_of("a0"))[0].reshape(12, -1), axis=1)
    assert norms.max() <= 5 * 0.01 * math.sqrt(128) * (1 + 1e-5)
    assert list(t.books.bounded) == ["a0"]


def test_the_reference_uses_the_test_part_without_a_validation_part(archive: Path) -> None:
    method = _method(archive, Fleet(), zero=False, validation_fraction=0.0)
    t = method.trainer
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    with torch.no_grad(), eval_mode(client):
        want = float(client(torch.from_numpy(_held_out().x)).flatten(1).norm(dim=1).median())
    assert method._reference_norm() == pytest.approx(want, rel=1e-6)
    method.test = None
    assert method._reference_norm() == 0.0
    method.test = _held_out(2).subset(np.arange(0))
    assert method._reference_norm() == 0.0
    method.validation = _held_out(3)
    with torch.no_grad(), eval_mode(client):
        want = float(client(torch.from_numpy(_held_out(3).x)).flatten(1).norm(dim=1).median())
    assert method._reference_norm() == pytest.approx(want, rel=1e-6)


def test_the_reference_takes_at_most_512_inputs(archive: Path) -> None:
    big = _held_out(600)
    method = _method(archive, Fleet(), zero=False, validation_fraction=0.0, test=big)
    t = method.trainer
    client = t.bundle.client_module()
    load_strict(client, from_arrays(t.global_client, "client"), "client")
    with torch.no_grad(), eval_mode(client):
        norms = client(torch.from_numpy(big.x)).flatten(1).norm(dim=1)
    assert float(norms[:512].median()) != float(norms.median())
    assert float(norms[:512].median()) != float(norms[:513].median())
    assert float(norms[:512].median()) != float(norms[:511].median())
    assert method._reference_norm() == pytest.approx(float(norms[:512].median()), rel=1e-6)


# ---------------------------------------------------------------- the server's epochs


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: np.ndarray,
              y: np.ndarray) -> float:
    """One plain cross-entropy SGD step on (x, y); its loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _reference_epoch(server: nn.Module, optimizer: torch.optim.Optimizer,
                     data: tuple[np.ndarray, np.ndarray], pool: np.ndarray,
                     arrivals: list[np.ndarray], seed: int, round_: int, batch: int
                     ) -> tuple[list[float], list[int]]:
    """Eqs 11–12 as docs state them: the stored rows shuffled, every full batch trained;
    each arrival joins the rest, reshuffled, full batches trained; the last rows (≥ 2) one
    batch. Plain SGD steps on the rows in index order. Returns the losses and batch sizes."""
    acts, labels = data
    rng = np.random.default_rng([seed, round_])
    pool = pool.copy()
    rng.shuffle(pool)
    losses: list[float] = []
    sizes: list[int] = []

    def train(rest: np.ndarray, least: int) -> np.ndarray:
        while len(rest) >= least:
            rows = np.sort(rest[:batch])
            server.train()
            losses.append(_sgd_step(server, optimizer, acts[rows], labels[rows]))
            sizes.append(len(rows))
            rest = rest[batch:]
        return rest

    pool = train(pool, batch)
    for rows in arrivals:
        pool = np.concatenate([pool, rows])
        rng.shuffle(pool)
        pool = train(pool, batch)
    train(pool, 2)
    return losses, sizes


def _all_rows(fleet: Fleet, agents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate([fleet.data[a][0] for a in agents]),
            np.concatenate([fleet.data[a][1] for a in agents]))


def _spy_steps(method: Ampere, fleet: Fleet, trained: list[np.ndarray] | None = None
               ) -> list[int]:
    """The size of every server step's batch (its rows too, into `trained`)."""
    sizes: list[int] = []
    step = method._step

    def spy(server: nn.Module, optimizer: torch.optim.Optimizer, rows: np.ndarray) -> float:
        sizes.append(len(rows))
        if trained is not None:
            trained.append(np.array(rows))
        fleet.events.append(f"step:{len(rows)}")
        return step(server, optimizer, rows)
    method._step = spy  # type: ignore[method-assign]
    return sizes


def test_the_server_trains_on_each_upload_as_it_lands_like_a_plain_sgd_loop(
        archive: Path, tmp_path: Path) -> None:
    """B(s) = 32 over arrivals of 10, 50, 20, 40 rows: nothing after a0's, one batch after
    a1's (28 left), one after a2's (16), one after a3's (24), then the last 24: the steps
    come between the uploads, and the weights, momentum and loss are a plain loop's."""
    fleet = Fleet()
    method = _method(archive, fleet, rounds=3, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    t = method.trainer
    server = copy.deepcopy(t.server)
    optimizer = torch.optim.SGD(server.parameters(), lr=SERVER_LR, momentum=MOMENTUM)
    sizes = _spy_steps(method, fleet)
    fleet.events.clear()
    loss = _play(method, 1)
    assert fleet.events == ["generate:a0", "generate:a1", "step:32", "generate:a2", "step:32",
                            "generate:a3", "step:32", "step:24"]
    arrivals = [np.arange(0, 10), np.arange(10, 60), np.arange(60, 80), np.arange(80, 120)]
    losses, want_sizes = _reference_epoch(server, optimizer, _all_rows(fleet, sorted(SIZES)),
                                          np.arange(0), arrivals, 5, 1, 32)
    assert sizes == want_sizes == [32, 32, 32, 24]
    _close(to_arrays(t.server, "server"), to_arrays(server, "server"), "server block",
           rtol=1e-6)
    assert loss == pytest.approx(float(np.mean(losses)), rel=1e-6)
    # the next epoch: everything stored, shuffled with the round's seed, nothing uploaded
    sizes.clear()
    loss = _play(method, 2)
    losses, want_sizes = _reference_epoch(server, optimizer, _all_rows(fleet, sorted(SIZES)),
                                          np.arange(120), [], 5, 2, 32)
    assert sizes == want_sizes == [32, 32, 32, 24]
    _close(to_arrays(t.server, "server"), to_arrays(server, "server"), "server block",
           rtol=1e-5)
    assert loss == pytest.approx(float(np.mean(losses)), rel=1e-5)


def test_the_server_batch_option_and_a_last_single_row(archive: Path, tmp_path: Path) -> None:
    """B(s) = 7 over 10 + 12 rows: 7 after a0 (3 left), 7 + 7 after a1 (1 left): one row
    cannot train batch norm, so it waits for the next epoch."""
    fleet = Fleet(sizes={"a0": 10, "a1": 12})
    method = _method(archive, fleet, rounds=3, server_batch=7,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    sizes = _spy_steps(method, fleet)
    _play(method, 1)
    assert sizes == [7, 7, 7]
    sizes.clear()
    _play(method, 2)
    assert sizes == [7, 7, 7]


def test_two_rows_left_make_a_last_batch(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 9})
    method = _method(archive, fleet, rounds=3, server_batch=7,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    sizes = _spy_steps(method, fleet)
    _play(method, 1)
    assert sizes == [7, 2]


def test_a_server_epoch_without_rows_has_no_loss(archive: Path, tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 9})
    fleet.tamper[("generate", "a0")] = lambda m, x, r, s: "offline"
    method = _method(archive, fleet, rounds=3, activation_dir=str(tmp_path / "w"))
    _phase2(method)
    assert _play(method, 1) is None
    assert method.server_epochs == 1


# ---------------------------------------------------------------- the ablation


def test_the_ablation_trains_a_copy_per_device_and_averages_them(archive: Path,
                                                                 tmp_path: Path) -> None:
    """After every upload is in: one copy of the server block per device (id order) on
    its rows alone, each in batches of max(2, round(B(s)·|A_k| / Σ|A|)) = 3, 13, 5, 11 in
    a seeded order (a one-row remainder skipped), each with a fresh optimiser; the copies
    FedAvg-ed |A_k|. The round's loss is the mean over every step."""
    fleet = Fleet()
    method = _method(archive, fleet, ablation=True, rounds=3,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    t = method.trainer
    start = copy.deepcopy(t.server)
    sizes = _spy_steps(method, fleet)
    fleet.events.clear()
    loss = _play(method, 1)
    assert fleet.events[:4] == ["generate:a0", "generate:a1", "generate:a2", "generate:a3"]
    rng = np.random.default_rng([5, 1])
    states, losses, want_sizes, offset = [], [], [], 0
    for agent in sorted(SIZES):
        n = SIZES[agent]
        copy_ = copy.deepcopy(start)
        optimizer = torch.optim.SGD(copy_.parameters(), lr=SERVER_LR, momentum=MOMENTUM)
        batch = max(2, round(32 * n / 120))
        order = np.arange(offset, offset + n)[rng.permutation(n)] - offset
        acts, labels = fleet.data[agent]
        for first in range(0, n, batch):
            rows = np.sort(order[first:first + batch])
            if len(rows) < 2:
                continue
            losses.append(_sgd_step(copy_, optimizer, acts[rows], labels[rows]))
            want_sizes.append(len(rows))
        states.append((to_arrays(copy_, "server"), n))
        offset += n
    assert sizes == want_sizes
    assert want_sizes == [3, 3, 3] + [13] * 3 + [11] + [5] * 4 + [11] * 3 + [7]
    total = sum(w for _, w in states)
    want = {k: sum(s[k].astype(np.float64) * w / total for s, w in states)
            for k in states[0][0]}
    _close(to_arrays(t.server, "server"), want, "server average", rtol=1e-5)
    assert loss == pytest.approx(float(np.mean(losses)), rel=1e-6)
    # the shared block's optimiser is not the copies': it has no state
    assert not t.optimizer.state


def test_the_ablations_own_copies_are_not_judged_by_the_direction_check(
        archive: Path, tmp_path: Path) -> None:
    """The coordinator trained the copies itself: no device can have reversed them, so the
    direction check (on here, four devices: enough to judge) never sees them."""
    fleet = Fleet()
    method = _method(archive, fleet, ablation=True, rounds=3, direction_check="on",
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    assert _play(method, 1) is not None
    direction = method.trainer.defences.direction
    assert direction.enabled and any(block == "client" for block, _ in direction.sums)
    assert not [key for key in direction.sums if key[0] == "server copy"]


def test_the_ablation_without_rows_has_no_loss_and_keeps_the_block(archive: Path,
                                                                   tmp_path: Path) -> None:
    fleet = Fleet(sizes={"a0": 9})
    fleet.tamper[("generate", "a0")] = lambda m, x, r, s: "offline"
    method = _method(archive, fleet, ablation=True, rounds=3,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    before = to_arrays(method.trainer.server, "server")
    assert _play(method, 1) is None
    _close(to_arrays(method.trainer.server, "server"), before, "server block", rtol=0)


def test_the_ablation_batch_is_at_least_two(archive: Path, tmp_path: Path) -> None:
    """a0's 3 rows of 63: round(4·3 / 63) = 0 → 2 (then one row, skipped); a1's 60:
    round(3.81) = 4 each."""
    fleet = Fleet(sizes={"a0": 3, "a1": 60})
    method = _method(archive, fleet, ablation=True, rounds=3, server_batch=4,
                     activation_dir=str(tmp_path / "w"))
    _phase2(method)
    sizes = _spy_steps(method, fleet)
    _play(method, 1)
    assert sizes == [2] + [4] * 15


# ---------------------------------------------------------------- results and state


def test_evaluate_reports_the_test_part_with_the_phase(archive: Path) -> None:
    held = _held_out(40)
    method = _method(archive, Fleet(), zero=False, test=held, validation_fraction=0.5)
    t = method.trainer
    assert method.test is not None
    scores = method.evaluate()
    want = evaluate(t.composed(t.global_client), method.test).as_dict()
    assert {k: v for k, v in scores.items() if k not in ("phase", "validation_accuracy")} == want
    assert scores["phase"] == 1 and scores["validation_accuracy"] is None
    method.round_phase, method.last_validation = 2, 0.25
    assert method.evaluate()["phase"] == 2 and method.evaluate()["validation_accuracy"] == 0.25


def test_save_writes_every_cuts_head(archive: Path, tmp_path: Path) -> None:
    method = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    method.save(tmp_path)
    saved = load_file(str(tmp_path / "aux.safetensors"))
    assert sorted(saved) == sorted(method._flat(method.aux))
    assert any(k.startswith("aux-k2/") for k in saved) and any(k.startswith("aux/")
                                                               for k in saved)
    assert (tmp_path / "client.safetensors").exists() and (tmp_path / "server.safetensors").exists()


def test_flat_names_and_their_inverse(archive: Path) -> None:
    method = _method(archive, Fleet())
    one = np.ones(1, np.float32)
    flat = method._flat({SPLIT: {"aux/w": one}, 2: {"aux/w": 2 * one}, 12: {"aux/b": one}})
    assert list(flat) == ["aux/w", "aux-k2/w", "aux-k12/b"]
    back = method._unflat({**flat, "client/x": one, "aux-kx/w": one, "aux-k/w": one,
                           "auxk3/w": one, "aux-k3": one, "best/aux/w": one, "aa/w": one})
    assert sorted(back) == [2, 3, SPLIT, 12]
    assert back[2] == {"aux/w": 2 * one} and back[12] == {"aux/b": one}
    assert back[SPLIT] == {"aux/w": one} and back[3] == {"aux/": one}
    assert method._aux_prefix(SPLIT) == "aux" and method._aux_prefix(1) == "aux-k1"


def test_a_checkpoint_round_trips_the_phase_heads_and_best_epoch(archive: Path,
                                                                 tmp_path: Path) -> None:
    fleet = Fleet(cuts={"a0": SHALLOW})
    method = _method(archive, fleet, patience=1, rounds=8, device_epochs=4,
                     activation_dir=str(tmp_path / "w"))
    _scripted(method, [0.75, 0.5])
    _play(method, 0)
    _play(method, 1)
    assert method.phase == 2
    _reset(method)
    _play(method, 2)
    arrays, meta = method.checkpoint()
    json.dumps(meta)
    assert meta["ampere"] == {
        "phase": 2, "epoch": 2, "best_accuracy": 0.75, "stale": 1, "last_validation": 0.5,
        "server_epochs": 1, "workdir": str(tmp_path / "w"), "own_workdir": False,
        "bundle_sha256": method.bundle_sha}
    assert "optimizer" in meta
    for name, value in method._flat(method.aux).items():
        assert np.array_equal(arrays[name], value)
    for name, value in method.best.items():
        assert np.array_equal(arrays[f"best/{name}"], value)
    other = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    other.store = method.store
    other.restore(arrays, meta)
    assert (other.phase, other.epoch, other.stale, other.server_epochs) == (2, 2, 1, 1)
    assert other.best_accuracy == 0.75 and other.last_validation == 0.5
    assert other.workdir == tmp_path / "w" and other.own_workdir is False
    assert other.bundle_sha == method.bundle_sha
    assert other.store is None and other.shipper is None
    for cut in (SHALLOW, SPLIT):
        _close(other.aux[cut], method.aux[cut], f"head {cut}", rtol=0)
    assert sorted(other.best) == sorted(method.best)
    _close(other.best, method.best, "best", rtol=0)
    _close(other.trainer.global_client, method.trainer.global_client, "client", rtol=0)
    # the resumed run reopens the store and reuses the trained bundle
    other.trainer.round = 3
    other.trainer.books.reset()
    other._write_trained_bundle = lambda: pytest.fail("rewritten")  # type: ignore
    assert other.run_round(["a0", "a1", "a2", "a3"]) is not None
    assert other.store is not None and other.store.completed() == ["a0", "a1", "a2", "a3"]
    assert other.server_epochs == 2


def test_a_restored_checkpoint_adds_heads_for_cuts_the_devices_moved_to(
        archive: Path) -> None:
    """A checkpoint holding heads for cuts 1 and 2 restored into a run planned at p* only:
    each gets its cut's template; a head for cut 0 (no such cut) is checked against p*'s."""
    method = _method(archive, Fleet(cuts={"a0": SHALLOW, "a1": 1}), zero=False)
    arrays, meta = method.checkpoint()
    other = _method(archive, Fleet(), zero=False)
    assert other.trainer.cut_templates == {}
    other.restore(arrays, meta)
    assert sorted(other.trainer.cut_templates) == [1, SHALLOW]
    assert sorted(other.aux) == [1, SHALLOW, SPLIT]
    _close(other.aux[SHALLOW], method.aux[SHALLOW], "cut-2 head", rtol=0)
    assert any(k.startswith("aux-k2/") for k in other.best)
    # a head for a cut past p* gets no template either: checked against p*'s, and kept
    stray = {k.replace("aux/", "aux-k9/", 1): v for k, v in arrays.items()
             if k.startswith("aux/")}
    third = _method(archive, Fleet(), zero=False)
    third.restore({**arrays, **stray}, meta)
    assert sorted(third.trainer.cut_templates) == [1, SHALLOW]
    assert sorted(third.aux) == [1, SHALLOW, SPLIT, 9]
    # a head for cut 0 gets no template of its own: it is checked against p*'s
    zero = {k.replace("aux-k2/", "aux-k0/"): v for k, v in arrays.items()
            if k.startswith("aux-k2/")}
    with pytest.raises(CheckpointError) as info:
        _method(archive, Fleet(), zero=False).restore({**arrays, **zero}, meta)
    assert str(info.value) == ("checkpoint aux head: cut 0: tensor aux/hidden.fc.weight is "
                               "float32 [16, 16]")


def _damaged(arrays: Arrays, name: str, value: np.ndarray | None) -> Arrays:
    out = {k: v for k, v in arrays.items() if k != name}
    if value is not None:
        out[name] = value
    return out


def test_a_damaged_checkpoint_is_refused_in_one_line(archive: Path) -> None:
    method = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    arrays, meta = method.checkpoint()
    other = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    cases = [
        (_damaged(arrays, "aux/classifier.bias", np.zeros(3, np.float32)), meta,
         "checkpoint aux head: tensor aux/classifier.bias is float32 [3]"),
        (_damaged(arrays, "aux-k2/classifier.bias", np.zeros(3, np.float32)), meta,
         "checkpoint aux head: cut 2: tensor aux/classifier.bias is float32 [3]"),
        (_damaged(arrays, "best/client/embed.embed.bias", None), meta,
         "checkpoint best blocks: weights do not match the model's tensors"),
        (_damaged(arrays, "best/aux-k2/classifier.bias", np.full(10, np.nan, np.float32)),
         meta, "checkpoint best blocks: cut 2: tensor aux/classifier.bias contains NaN or "
               "infinity"),
        (_damaged(arrays, "best/aux/classifier.bias", np.zeros(10, np.float64)), meta,
         "checkpoint best blocks: tensor aux/classifier.bias is float64 [10]"),
        # a head for a cut past p* is named by its cut too
        (_damaged({**arrays, **{k.replace("aux/", "aux-k9/", 1): v for k, v in arrays.items()
                                if k.startswith("aux/")}},
                  "aux-k9/classifier.bias", np.zeros(3, np.float32)), meta,
         "checkpoint aux head: cut 9: tensor aux/classifier.bias is float32 [3]"),
        (arrays, {**meta, "ampere": {**meta["ampere"], "phase": 3}},
         "checkpoint Ampere phase 3 is not 1 or 2"),
        (arrays, {**meta, "ampere": {**meta["ampere"], "phase": 0}},
         "checkpoint Ampere phase 0 is not 1 or 2"),
    ]
    for bad, bad_meta, message in cases:
        with pytest.raises(CheckpointError) as info:
            other.restore(bad, bad_meta)
        assert str(info.value) == message


def test_a_checkpoint_tensor_of_another_block_is_no_head(archive: Path) -> None:
    """Only `aux/` and `aux-k<cut>/` tensors are heads: one under a name that sorts before
    "aux" (`a/`, `aa/`) neither replaces p*'s head nor is refused as one."""
    method = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    arrays, meta = method.checkpoint()
    heads = {k: v for k, v in arrays.items() if k.startswith("aux/")}
    stray = {f"{prefix}/{k[4:]}": np.full_like(v, 7.0) for k, v in heads.items()
             for prefix in ("a", "aa")}
    stray["a/classifier.bias"] = np.zeros(3, np.float32)  # not even p*'s head's shape
    other = _method(archive, Fleet(cuts={"a0": SHALLOW}), zero=False)
    other.restore({**arrays, **stray}, meta)
    assert sorted(other.aux) == [SHALLOW, SPLIT]
    _close(other.aux[SPLIT], method.aux[SPLIT], "p*'s head", rtol=0)


@pytest.mark.parametrize(("change", "says"), [
    (lambda s: s.pop("phase"), "'phase'"), (lambda s: s.pop("epoch"), "'epoch'"),
    (lambda s: s.pop("stale"), "'stale'"), (lambda s: s.pop("server_epochs"),
                                            "'server_epochs'"),
    (lambda s: s.pop("best_accuracy"), "'best_accuracy'"),
    (lambda s: s.pop("last_validation"), "'last_validation'"),
    (lambda s: s.pop("workdir"), "'workdir'"), (lambda s: s.pop("own_workdir"),
                                               "'own_workdir'"),
    (lambda s: s.pop("bundle_sha256"), "'bundle_sha256'"),
    (lambda s: s.update(phase="two"), "invalid literal for int() with base 10: 'two'"),
    (lambda s: s.update(epoch=None), "int() argument must be a string, a bytes-like object "
                                     "or a real number, not 'NoneType'"),
    (lambda s: s.update(best_accuracy="high"), "could not convert string to float: 'high'"),
    (lambda s: s.update(last_validation=[1]), "float() argument must be a string or a real "
                                              "number, not 'list'"),
    (lambda s: s.update(epoch=-1), "epoch -1 is negative"),
    (lambda s: s.update(stale=-2), "stale -2 is negative"),
    (lambda s: s.update(server_epochs=-1), "server_epochs -1 is negative"),
])
def test_a_checkpoint_with_damaged_state_is_refused(archive: Path,
                                                    change: Callable[[dict[str, Any]], Any],
                                                    says: str) -> None:
    method = _method(archive, Fleet(), zero=False)
    arrays, meta = method.checkpoint()
    state = dict(meta["ampere"])
    change(state)
    with pytest.raises(CheckpointError) as info:
        method.restore(arrays, {**meta, "ampere": state})
    assert str(info.value) == f"checkpoint Ampere state is damaged: {says}"


def test_a_checkpoint_without_ampere_state_is_refused(archive: Path) -> None:
    method = _method(archive, Fleet(), zero=False)
    arrays, meta = method.checkpoint()
    for state in (None, {}):
        with pytest.raises(CheckpointError) as info:
            method.restore(arrays, {**meta, "ampere": state})
        assert str(info.value) == "checkpoint Ampere state is damaged: 'phase'"


def test_restore_converts_the_state_it_reads(archive: Path) -> None:
    method = _method(archive, Fleet(), zero=False)
    arrays, meta = method.checkpoint()
    method.restore(arrays, {**meta, "ampere": {
        "phase": "1", "epoch": 2.0, "stale": "3", "server_epochs": 0, "best_accuracy": "0.5",
        "last_validation": 1, "workdir": 7, "own_workdir": 1, "bundle_sha256": 5}})
    assert (method.phase, method.epoch, method.stale, method.server_epochs) == (1, 2, 3, 0)
    assert method.best_accuracy == 0.5 and isinstance(method.last_validation, float)
    assert method.workdir == Path("7") and method.own_workdir is True
    assert method.bundle_sha == "5"
    method.restore(arrays, {**meta, "ampere": {
        "phase": 2, "epoch": 0, "stale": 0, "server_epochs": 0, "best_accuracy": None,
        "last_validation": None, "workdir": None, "own_workdir": 0, "bundle_sha256": None}})
    assert method.best_accuracy is None and method.last_validation is None
    assert method.workdir is None and method.own_workdir is False and method.bundle_sha is None
    # restored arrays are copies, not the checkpoint's
    name = "aux/classifier.bias"
    arrays[name][...] = 123.0
    assert not np.any(method.aux[SPLIT][name] == 123.0)
    arrays["best/" + name][...] = 123.0
    assert not np.any(method.best[name] == 123.0)

"""A resumed run judges the fleet as the run it continues would have
(server/defences/memory.py): the defences' evidence and verdicts travel in the checkpoint, are read
back as untrusted input, and a run stopped after round 0 and resumed ends with the bits of
the uninterrupted one, attacker and all."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.server.defences import memory as defence_memory
from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.label_check import DIMS
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.round_books import RoundBooks
from jetsplit.server.training.settings import Settings


def _fresh() -> Defences:
    """A run's defences as they start (bench after 3 misses, bounds 3× and 5×)."""
    settings = Settings(max_misses=3, loss_bound=3.0, gradient_bound=5.0, activation_bound=5.0)
    return Defences(settings, 3, None, RoundBooks())  # type: ignore[arg-type]


def _remembering() -> Defences:
    trainer = _fresh()
    trainer.bench.misses, trainer.bench.strikes, trainer.bench.until = (
        {"a1": 2}, {"a2": 1}, {"a2": 7})
    trainer.bench.suspect = {"a1", "a2"}  # they must answer a probe before playing again
    trainer.direction.sums = {("model", "a3"): -1.5, ("model", "a0"): 0.75}
    trainer.direction.counts = {("model", "a3"): 1.9, ("model", "a0"): 1.9}
    trainer.direction.last = {("model", "a3"): -0.8, ("model", "a0"): 0.4}
    trainer.direction.opposed = {("model", "a3"): "update opposed"}
    trainer.outliers = {"model": frozenset({"a4"}), "client": frozenset()}
    trainer.loss_bound.history.extend([2.25, 2.5])
    trainer.step_gradient_bound.history.extend([0.5])
    trainer.activation_bound.history[(4, 2)] = deque([3.0, 3.5], maxlen=32)
    trainer.consistency.inconsistent = {"a4": "labels inconsistent"}
    trainer.consistency.against = {"a4": 1}
    rng = np.random.default_rng(0)
    for agent in ("a0", "a4"):
        trainer.consistency.sums.setdefault((4, 2), {})[agent] = torch.from_numpy(
            rng.normal(size=(3, DIMS)).astype(np.float32))
        trainer.consistency.counts.setdefault((4, 2), {})[agent] = torch.tensor(
            [8.0, 0.5, 12.0])
    return trainer


def _state(trainer: Defences) -> dict[str, Any]:
    c = trainer.consistency
    return {
        "bench": (trainer.bench.misses, trainer.bench.strikes, trainer.bench.until,
                  trainer.bench.suspect),
        "direction": (trainer.direction.sums, trainer.direction.counts,
                      trainer.direction.last, trainer.direction.opposed),
        "outliers": trainer.outliers,
        "bounds": (list(trainer.loss_bound.history), list(trainer.step_gradient_bound.history)),
        "activation": {k: list(v) for k, v in trainer.activation_bound.history.items()},
        "consistency": (c.inconsistent, c.against, {
            s: {a: (v.tolist(), c.counts[s][a].tolist()) for a, v in per.items()}
            for s, per in c.sums.items()}),
    }


def _round_trip(trainer: Defences) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = defence_memory.snapshot(trainer)
    return json.loads(json.dumps(meta)), arrays  # as the checkpoint's state.json holds it


def test_every_defence_comes_back_as_it_was() -> None:
    trainer = _remembering()
    meta, arrays = _round_trip(trainer)
    back = _fresh()
    defence_memory.restore(back, meta, arrays)
    assert _state(back) == _state(trainer)
    assert back.activation_bound.history[(4, 2)].maxlen == 32
    before = _fresh()
    defence_memory.restore(before, {}, {})  # a checkpoint from before: fresh defences
    assert _state(before) == _state(_fresh())


@pytest.mark.parametrize(("path", "bad"), [
    (("bench", "until", "a2"), -1),
    (("bench", "misses", "a1"), 1.5),
    (("bench", "suspect"), "a1"),
    (("bench", "suspect", 0), 7),
    (("direction", 0, 2), float("nan")),
    (("direction", 0, 1), ""),
    (("direction", 0), ["model", "a0", 0.75]),
    (("outliers", "model"), "a4"),
    (("loss_bound", 0), -2.0),
    (("activation_bound", 0, 0), [4, 0]),
    (("consistency", "against", "a4"), True),
    (("consistency", "shapes", 0, 1), ["a0", "a4", "a9"]),  # no arrays for a9
])
def test_a_damaged_memory_is_refused(path: tuple[Any, ...], bad: Any) -> None:
    meta, arrays = _round_trip(_remembering())
    place = meta["defences"]
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = bad
    with pytest.raises((ValueError, TypeError, KeyError)):
        defence_memory.restore(_fresh(), meta, arrays)


def test_label_check_sums_of_the_wrong_shape_are_refused() -> None:
    meta, arrays = _round_trip(_remembering())
    arrays[f"{defence_memory.PREFIX}/0/1/sums"] = np.zeros((3, DIMS + 1), np.float32)
    with pytest.raises(ValueError, match="wrong shape or not finite"):
        defence_memory.restore(_fresh(), meta, arrays)


# ---------------------------------------------------------------- a resumed attacked run


def _weights(run: Path) -> dict[str, np.ndarray]:
    return {f"{p.name}:{k}": v for p in sorted(run.glob("*.safetensors"))
            for k, v in load_file(str(p)).items()}


@pytest.mark.parametrize(("algorithm", "attack", "checks"), [
    ("fedavg", "scale:1000", dict(direction_check="off")),  # the outlier bound's verdict
    ("fedavg", "signflip", {}),  # the direction check's running cosines
    ("splitfed-v1", "labelflip", {}),  # the label check's sums and verdict
])
def test_a_run_resumed_after_round_0_ends_as_the_uninterrupted_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None,
        algorithm: str, attack: str, checks: dict[str, str]) -> None:
    """a4 attacks; a run stopped after round 0's checkpoint and resumed for rounds 1–2
    leaves a4 out, and gives its batch share away, exactly as the run of 3 rounds does:
    the same rows (who was left out, each device's work, accuracy) and the same weights."""
    monkeypatch.setenv(ALLOW_ENV, "1")
    base: dict[str, Any] = dict(algorithm=algorithm, local_steps=4, batch=80, lr=0.1, seed=0,
                                threads=1, device="cpu", **checks)
    kwargs: dict[str, Any] = dict(model="vgg11", split=2, dataset="digits", clients=5,
                                  partition_scheme="iid", attacks={"a4": attack})
    simulate(Settings(rounds=3, **base), out_dir=tmp_path / "steady", **kwargs)
    simulate(Settings(rounds=1, **base), out_dir=tmp_path / "resumed", **kwargs)
    simulate(Settings(rounds=3, **base), out_dir=tmp_path / "resumed", resume=True, **kwargs)

    def rows(run: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]

    steady, resumed = rows("steady"), rows("resumed")
    assert [r["round"] for r in resumed] == [0, 1, 2]
    assert all("a4" in r["aggregation"] for r in steady[1:])  # the resumed rounds
    for a, b in zip(steady, resumed, strict=True):
        for key in ("aggregation", "excluded", "device_gflops", "accuracy", "train_loss"):
            assert a[key] == b[key], (a["round"], key)
    first, second = _weights(tmp_path / "steady"), _weights(tmp_path / "resumed")
    assert first and first.keys() == second.keys()
    for name, value in first.items():
        np.testing.assert_array_equal(value, second[name], err_msg=name)

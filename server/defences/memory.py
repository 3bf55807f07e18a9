"""What the coordinator's defences remember across rounds, kept in the run's checkpoint.

A resumed run must judge the fleet as the run it continues would have: without this, a
device left out for reversed updates, inconsistent labels or an outlier upload started
the resumed run trusted again (and took back its share of the batch), a device benched
for missed deadlines played at once, and every running bound started from nothing. So the
checkpoint keeps each defence's evidence and verdicts: the deadline bench, the direction
check's running cosines, the outlier bound's last verdicts, the loss and gradient bounds'
and the activation bound's windows, and the label check's per-class activation sums (as
arrays; its projections are seeded, so they are rebuilt).

A checkpoint is read like any input: every value is checked (names, finite numbers,
counts, shapes) and a bad one raises ValueError or TypeError, which the resume turns into
one line (`round_loop._restore`). Checkpoints written before this carry none of it and
resume with fresh defences, as they did.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jetsplit.server.defences.untrusted_numbers import finite

if TYPE_CHECKING:
    import torch

    from jetsplit.server.defences.aggregators import Arrays
    from jetsplit.server.defences.defences import Defences

PREFIX = "trainer/consistency"  # the label check's sums and counts among the arrays
MAX_NAME = 128  # characters of an agent or block name


def snapshot(defences: Defences) -> tuple[dict[str, Any], Arrays]:
    """The defences' memory as JSON-safe meta and named arrays."""
    bench, direction, consistency = defences.bench, defences.direction, defences.consistency
    meta: dict[str, Any] = {
        "bench": {"misses": dict(bench.misses), "strikes": dict(bench.strikes),
                  "until": dict(bench.until), "suspect": sorted(bench.suspect)},
        "direction": [[block, agent, direction.sums[block, agent],
                       direction.counts[block, agent], direction.last.get((block, agent)),
                       direction.opposed.get((block, agent))]
                      for block, agent in sorted(direction.sums)],
        "outliers": {block: sorted(agents) for block, agents in defences.outliers.items()},
        "loss_bound": list(defences.loss_bound.history),
        "step_gradient_bound": list(defences.step_gradient_bound.history),
        "activation_bound": [[list(shape), list(values)] for shape, values
                             in defences.activation_bound.history.items()],
        "consistency": {"inconsistent": dict(consistency.inconsistent),
                        "against": dict(consistency.against), "shapes": []},
    }
    arrays: dict[str, np.ndarray] = {}
    for i, (shape, sums) in enumerate(consistency.sums.items()):
        agents = sorted(sums)
        meta["consistency"]["shapes"].append([list(shape), agents])
        for j, agent in enumerate(agents):
            arrays[f"{PREFIX}/{i}/{j}/sums"] = sums[agent].detach().cpu().numpy()
            arrays[f"{PREFIX}/{i}/{j}/counts"] = (
                consistency.counts[shape][agent].detach().cpu().numpy())
    return {"defences": meta}, arrays


def restore(defences: Defences, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
            device: torch.device | str = "cpu") -> None:
    """Put the memory `snapshot` wrote back into fresh `defences` (nothing where the
    checkpoint has none); the label check's sums go onto `device`, the server's."""
    saved = meta.get("defences")
    if saved is None:
        return
    _mapping(saved, "defences")
    bench = _mapping(saved["bench"], "bench")
    defences.bench.misses = _counts(bench["misses"], "bench misses")
    defences.bench.strikes = _counts(bench["strikes"], "bench strikes")
    defences.bench.until = _counts(bench["until"], "bench rounds")
    defences.bench.suspect = {_name(a) for a in _list(bench.get("suspect", []), "suspects")}
    direction = defences.direction
    for entry in _list(saved["direction"], "direction"):
        block, agent, total, count, last, why = _list(entry, "direction entry", 6)
        key = (_name(block), _name(agent))
        direction.sums[key] = _number(total)
        direction.counts[key] = _number(count, low=0.0)
        if last is not None:
            direction.last[key] = _number(last)
        if why is not None:
            direction.opposed[key] = _text(why)
    defences.outliers = {_name(block): frozenset(_name(a) for a in _list(agents, "outliers"))
                        for block, agents in _mapping(saved["outliers"], "outliers").items()}
    for bound, values in ((defences.loss_bound, saved["loss_bound"]),
                          (defences.step_gradient_bound, saved["step_gradient_bound"])):
        bound.history.extend(_number(v, low=0.0) for v in _list(values, "bound window"))
    activation = defences.activation_bound
    for shape, values in _list(saved["activation_bound"], "activation windows"):
        activation.history[_shape(shape)] = deque(
            (_number(v, low=0.0) for v in _list(values, "activation window")),
            maxlen=activation.window)
    _restore_consistency(defences, _mapping(saved["consistency"], "consistency"), arrays,
                         device)


def _restore_consistency(defences: Defences, saved: Mapping[str, Any],
                         arrays: Mapping[str, np.ndarray], device: torch.device | str) -> None:
    import torch

    from jetsplit.server.defences.label_check import DIMS

    consistency = defences.consistency
    consistency.inconsistent = {_name(a): _text(why) for a, why in
                                _mapping(saved["inconsistent"], "inconsistent").items()}
    consistency.against = _counts(saved["against"], "against")
    want = (consistency.classes, DIMS)
    for i, entry in enumerate(_list(saved["shapes"], "label check shapes")):
        shape_list, agents = _list(entry, "label check shape", 2)
        shape = _shape(shape_list)
        for j, agent in enumerate(_list(agents, "label check agents")):
            sums = np.asarray(arrays[f"{PREFIX}/{i}/{j}/sums"], np.float32)
            counts = np.asarray(arrays[f"{PREFIX}/{i}/{j}/counts"], np.float32)
            if sums.shape != want or counts.shape != want[:1] or not (
                    np.isfinite(sums).all() and np.isfinite(counts).all()):
                raise ValueError(f"label check sums of {agent!r}: wrong shape or not finite")
            consistency.sums.setdefault(shape, {})[_name(agent)] = torch.from_numpy(
                sums.copy()).to(device)
            consistency.counts.setdefault(shape, {})[_name(agent)] = torch.from_numpy(
                counts.copy()).to(device)


# ------------------------------------------------------------------ checks


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what}: not a mapping")
    return value


def _list(value: Any, what: str, length: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise TypeError(f"{what}: not a list" + (f" of {length}" if length else ""))
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ValueError(f"bad name {str(value)[:40]!r}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a verdict is not text")
    return value[:1000]


def _number(value: Any, low: float = -math.inf) -> float:
    number = finite(value, low)
    if number is None:
        raise ValueError(f"bad number {str(value)[:40]!r}")
    return number


def _counts(value: Any, what: str) -> dict[str, int]:
    out = {}
    for name, count in _mapping(value, what).items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{what}: bad count {str(count)[:40]!r}")
        out[_name(name)] = count
    return out


def _shape(value: Any) -> tuple[int, ...]:
    dims = _list(value, "shape")
    if not 0 < len(dims) <= 8 or any(
            isinstance(d, bool) or not isinstance(d, int) or not 0 < d < 1 << 31 for d in dims):
        raise ValueError(f"bad shape {str(value)[:40]!r}")
    return tuple(dims)

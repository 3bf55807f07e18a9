"""Ampere's on-disk activation store (the Ampere paper §3.3, Algorithm 1 line 16: the server
stores the devices' one-shot activation uploads on disk and loads batches from there).

Layout of the store folder: per agent two append-only raw files, `<agent>.act` (float32,
C order, one activation per row) and `<agent>.lab` (int64 labels), and `index.json`, the
commit record: the activation shape, the number of classes, a tag naming what produced the
activations (Ampere: the trained bundle's sha256, so activations of another client block are
never mixed in), and per agent the size of its dataset and how many rows are committed. An
upload chunk is appended and fsync-ed, then the index is replaced atomically, so a
coordinator killed at any point reopens a consistent store: rows past the committed count
(a torn append) are cut off, agents whose uploads are complete are known, and an unfinished
upload continues from its committed offset.

Uploads come from devices and are untrusted: every chunk is checked (dtype, shape, finite
values, label range, offset and dataset size consistent with what is stored) and the store
has a byte bound; a bad chunk is refused with one line saying why, the store unchanged.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from jetsplit.errors import JetsplitError

FORMAT = 1
INDEX = "index.json"
MAX_INDEX_BYTES = 16 * 1024 * 1024
_AGENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")  # as the registry accepts them


class StoreError(JetsplitError):
    """An upload the store refuses, or a store folder it cannot use; one line."""


def _whole(value: object) -> int:
    """A count from the index: a JSON integer, not a bool, float or string that int()
    would turn into one."""
    if type(value) is not int:
        raise ValueError(f"{value!r} is not an integer")
    return value


class ActivationStore:
    """Append-only, bounded activation+label store; survives a coordinator restart."""

    def __init__(self, root: str | Path, activation_shape: tuple[int, ...], num_classes: int,
                 *, max_bytes: int, tag: str = "") -> None:
        self.root, self.tag = Path(root), tag
        self.activation_shape = tuple(int(d) for d in activation_shape)
        self.num_classes = int(num_classes)
        self.max_bytes = int(max_bytes)
        self.row_bytes = 4 * math.prod(self.activation_shape) + 8
        self._totals: dict[str, int] = {}
        self._received: dict[str, int] = {}
        self._maps: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / INDEX).exists():
            self._reopen()
        else:
            self._commit()

    # ------------------------------------------------------------------ state

    def _reopen(self) -> None:
        """Read the commit record (disk is untrusted too) and cut torn appends."""
        path = self.root / INDEX
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise StoreError(f"activation store {self.root}: {INDEX} is too large")
        try:
            index = json.loads(path.read_text())
            shape = tuple(_whole(d) for d in index["activation_shape"])
            classes = _whole(index["num_classes"])
            tag = str(index["tag"])
            agents = {str(a): (_whole(v["total"]), _whole(v["received"]))
                      for a, v in index["agents"].items()}
            ok = _whole(index["format"]) == FORMAT
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"activation store {self.root}: {INDEX} is damaged ({exc})"
                             ) from None
        if not ok or shape != self.activation_shape or classes != self.num_classes:
            raise StoreError(f"activation store {self.root} holds activations {list(shape)} "
                             f"for {classes} classes, this run needs "
                             f"{list(self.activation_shape)} for {self.num_classes}")
        if tag != self.tag:
            raise StoreError(f"activation store {self.root} holds activations of another "
                             f"model ({tag[:12] or 'untagged'}); remove it or use another folder")
        for agent, (total, received) in agents.items():
            if not _AGENT.match(agent) or not 0 <= received <= total:
                raise StoreError(f"activation store {self.root}: bad entry for {agent!r}")
            for suffix, width in ((".act", self.row_bytes - 8), (".lab", 8)):
                file = self.root / f"{agent}{suffix}"
                size = file.stat().st_size if file.exists() else 0
                if size < received * width:
                    raise StoreError(f"activation store {self.root}: {file.name} is shorter "
                                     f"than its {received} committed rows")
                if size > received * width:
                    os.truncate(file, received * width)
            self._totals[agent], self._received[agent] = total, received

    def _commit(self) -> None:
        index = {"format": FORMAT, "activation_shape": list(self.activation_shape),
                 "num_classes": self.num_classes, "tag": self.tag,
                 "agents": {a: {"total": self._totals[a], "received": self._received[a]}
                            for a in self._totals}}
        tmp = self.root / f".{INDEX}.tmp"
        with open(tmp, "w") as fh:
            json.dump(index, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / INDEX)
        _fsync_dir(self.root)

    def agents(self) -> list[str]:
        """Agents with anything stored, in the order they first uploaded."""
        return list(self._totals)

    def received(self, agent: str) -> int:
        """Committed rows of `agent` (where its next upload chunk starts)."""
        return self._received.get(agent, 0)

    def complete(self, agent: str) -> bool:
        return agent in self._totals and self._received[agent] == self._totals[agent]

    def completed(self) -> list[str]:
        return [a for a in self._totals if self.complete(a)]

    def counts(self) -> dict[str, int]:
        """Committed rows per agent, in store order."""
        return dict(self._received)

    def __len__(self) -> int:
        return sum(self._received.values())

    @property
    def nbytes(self) -> int:
        return len(self) * self.row_bytes

    # ------------------------------------------------------------------ writing

    def problem(self, agent: str, offset: int, total: int, activations: np.ndarray,
                labels: np.ndarray) -> str | None:
        """Why this upload chunk cannot be stored, or None."""
        if not _AGENT.match(agent):
            return f"agent name {agent!r} is not allowed"
        if total < 1:
            return f"dataset size {total} is not positive"
        if agent in self._totals and total != self._totals[agent]:
            return f"dataset size {total} differs from the {self._totals[agent]} stored"
        if offset != self.received(agent):
            return f"chunk starts at row {offset}, the store expects row {self.received(agent)}"
        n = len(labels) if labels.ndim == 1 else -1
        if not 0 < n <= total - offset:
            return f"labels must be 1..{total - offset} integers in one dimension"
        if labels.dtype != np.int64:
            return f"labels are {labels.dtype}, expected int64"
        if labels.min() < 0 or labels.max() >= self.num_classes:
            return f"labels out of range 0..{self.num_classes - 1}"
        if activations.dtype != np.float32 or tuple(activations.shape) != (
                n, *self.activation_shape):
            return (f"activations {activations.dtype} {list(activations.shape)}, expected "
                    f"float32 {[n, *self.activation_shape]}")
        if not np.isfinite(activations).all():
            return "activations contain NaN or infinity"
        if self.nbytes + n * self.row_bytes > self.max_bytes:
            return f"store would exceed its {self.max_bytes / 2**30:.2f} GiB bound"
        return None

    def append(self, agent: str, offset: int, total: int, activations: np.ndarray,
               labels: np.ndarray) -> int:
        """Store one upload chunk (rows offset…offset+n of the agent's data); returns n.
        Raises StoreError with the reason when the chunk is refused."""
        reason = self.problem(agent, offset, total, activations, labels)
        if reason is not None:
            raise StoreError(f"upload from {agent} refused: {reason}")
        for suffix, array, width in ((".act", activations, self.row_bytes - 8),
                                     (".lab", labels, 8)):
            path = self.root / f"{agent}{suffix}"
            with open(path, "r+b" if path.exists() else "wb") as fh:
                # bytes past the committed rows are a torn write (a crash before the index
                # named this agent leaves them, and reopening cuts only indexed agents)
                fh.truncate(offset * width)
                fh.seek(offset * width)
                fh.write(np.ascontiguousarray(array).tobytes())
                fh.flush()
                os.fsync(fh.fileno())
        self._totals.setdefault(agent, total)
        self._received[agent] = offset + len(labels)
        self._commit()
        return len(labels)

    # ------------------------------------------------------------------ reading

    def _arrays(self, agent: str) -> tuple[np.ndarray, np.ndarray]:
        """Memory maps of an agent's committed rows (rebuilt when rows were added)."""
        n = self._received[agent]
        cached = self._maps.get(agent)
        if cached is None or cached[0] != n:
            acts = np.memmap(self.root / f"{agent}.act", np.float32, "r",
                             shape=(n, *self.activation_shape))
            labs = np.memmap(self.root / f"{agent}.lab", np.int64, "r", shape=(n,))
            cached = self._maps[agent] = (n, acts, labs)
        return cached[1], cached[2]

    def _starts(self) -> np.ndarray:
        """First global index of each agent: its data set's place in store order, fixed
        once it first uploads, so indices stay valid while uploads keep arriving."""
        return np.cumsum([0] + list(self._totals.values()))

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Committed rows by global index, in the order given."""
        indices = np.asarray(indices, dtype=np.int64)
        agents, starts = list(self._totals), self._starts()
        owner = np.searchsorted(starts, indices, side="right") - 1
        acts = np.empty((len(indices), *self.activation_shape), np.float32)
        labels = np.empty(len(indices), np.int64)
        for k in np.unique(owner):
            mask = owner == k
            rows = indices[mask] - starts[k]
            if k < 0 or k >= len(agents) or rows.max() >= self._received[agents[k]]:
                raise IndexError("row index outside the committed rows")
            a, y = self._arrays(agents[k])
            acts[mask], labels[mask] = a[rows], y[rows]
        return acts, labels

    def rows_of(self, agent: str) -> np.ndarray:
        """Global indices of an agent's committed rows."""
        if agent not in self._totals:
            return np.arange(0)
        start = int(self._starts()[list(self._totals).index(agent)])
        return np.arange(start, start + self._received[agent])


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

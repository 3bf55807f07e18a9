"""Training batches for an agent: which samples (seeded, per round) and their inputs.

Arrays in memory are indexed where they are, as they always were. Image datasets are
decoded per batch, ahead of time by ``torch.utils.data.DataLoader`` worker processes when
the device has cores to spare (``workers`` > 0), or in the agent's own process (0). The
batches and their crops and flips are a function of (seed, round, draw) alone, so a run
gives the same bits with any number of workers, and a restarted agent draws what an
uninterrupted one would.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

from jetsplit.data.image_sets import ImageDataset

_PREFETCH = 2  # batches each worker decodes ahead


class BatchSampler:
    """Seeded epoch-wise shuffling, restarted each round from (seed, round): the same seed
    gives the same batches in any process, and an agent that restarts (or a coordinator that
    resumes from a checkpoint) draws exactly the batches an uninterrupted run would."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self._round: int | None = None
        self._order = np.arange(size)
        self._cursor = size

    def _start(self, round_: int) -> None:
        self._round = round_
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round_)
        self._cursor = self.size  # first draw shuffles

    def next(self, batch: int, round_: int = 0) -> np.ndarray:
        if round_ != self._round:
            self._start(round_)
        batch = min(batch, self.size)
        if self._cursor + batch > self.size:
            self._order = torch.randperm(self.size, generator=self.generator).numpy()
            self._cursor = 0
        indices = self._order[self._cursor:self._cursor + batch]
        self._cursor += batch
        return np.sort(indices)


def default_workers(cores: Optional[int] = None) -> int:
    """Decoding processes for a device: none below 4 cores (they would take the training
    step's), else half the cores, at most 4."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return 0 if cores < 4 else min(4, cores // 2)


class _Draws:
    """The batch requests of one round at one batch size, continuing after ``history``
    (the sizes already drawn this round): what the DataLoader's workers decode ahead."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.round, self.history, self.batch = 0, [], 1

    def restart(self, round_: int, history: List[int], batch: int) -> None:
        """Where the next iteration starts (the DataLoader iterates this object anew)."""
        self.round, self.history, self.batch = round_, list(history), batch

    def __iter__(self) -> Iterator[Tuple[np.ndarray, int, int]]:
        sampler = BatchSampler(self.size, self.seed)
        for size in self.history:
            sampler.next(size, self.round)
        draw = len(self.history)
        while True:
            yield sampler.next(self.batch, self.round), self.round, draw
            draw += 1


class _Decoder(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What a DataLoader worker runs: one whole batch request per item."""

    def __init__(self, data: ImageDataset) -> None:
        self.data = data

    def __getitem__(self, request: Tuple[np.ndarray, int, int]) -> Any:
        indices, round_, draw = request
        x, y, bad = self.data.decode(indices, True, (round_, draw))
        for path, reason in bad:  # this process's copy learns them too: no second try
            self.data.skips.add(path, reason)
        return x, y, bad

    def __len__(self) -> int:  # never asked for: requests come from a sampler
        return len(self.data)


def _as_is(item: Any) -> Any:
    return item


class BatchFeed:
    """``next(batch, round)``: the training batch's inputs and labels as numpy arrays."""

    def __init__(self, data: Any, seed: int, workers: int = 0) -> None:
        self.data, self.seed, self.workers = data, seed, workers
        self.sampler = BatchSampler(len(data), seed)
        self._round: Optional[int] = None
        self._history: List[int] = []  # batch sizes drawn this round
        self._loader: Any = None
        self._stream: Optional[Iterator[Any]] = None
        self._stream_key: Optional[Tuple[int, int]] = None

    def next(self, batch: int, round_: int) -> Tuple[np.ndarray, np.ndarray]:
        if not isinstance(self.data, ImageDataset):
            idx = self.sampler.next(batch, round_)
            return self.data.x[idx], self.data.y[idx]
        if round_ != self._round:
            self._round, self._history = round_, []
        if self.workers > 0:
            x, y, bad = self._prefetched(batch, round_)
            for path, reason in bad:
                self.data.skips.add(path, reason)
        else:
            idx = self.sampler.next(batch, round_)
            x, y = self.data.batch(idx, True, (round_, len(self._history)))
        self._history.append(batch)
        return x, y

    def _prefetched(self, batch: int, round_: int) -> Any:
        """The next batch from the worker processes; a new round or batch size restarts
        their stream where an in-process feed would be."""
        if self._stream is None or self._stream_key != (round_, batch):
            if self._loader is None:
                self._loader = torch.utils.data.DataLoader(
                    _Decoder(self.data), batch_size=None,
                    sampler=_Draws(len(self.data), self.seed), num_workers=self.workers,
                    collate_fn=_as_is, persistent_workers=True, prefetch_factor=_PREFETCH)
            self._loader.sampler.restart(round_, self._history, batch)
            self._stream = iter(self._loader)
            self._stream_key = (round_, batch)
        return next(self._stream)

    def close(self) -> None:
        """Stop the worker processes (they also stop with the agent)."""
        self._stream = None
        self._loader = None

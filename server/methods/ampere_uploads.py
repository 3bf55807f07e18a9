"""Ampere's phase 2 uploads: every device's one-shot activations, collected into the store.

Each eligible device runs its trained client block once over all its data and uploads
activations and labels in slices of at most `upload_mb` (several `generate` replies per
device, consumed in agent-id order). Each slice is checked (its dataset size against the
registered one), a shallow device's carried to the server cut through the aggregated global
layers, bounded against the norm the coordinator's own copy of the client block gives its
held-out inputs, and appended to the on-disk `ActivationStore` as it lands. The training on
those rows is in ampere.py.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from jetsplit.data import ArrayDataset
from jetsplit.models.split import eval_mode
from jetsplit.models.weights import from_arrays, load_strict
from jetsplit.protocol import Kind
from jetsplit.server.defences.step_bounds import WINDOW, ActivationBound
from jetsplit.server.engines.seam import Command, Outcome
from jetsplit.server.methods.activation_store import ActivationStore, StoreError
from jetsplit.server.training.trainer import Trainer

log = logging.getLogger("jetsplit.coordinator")


class PhaseTwoUploads:
    """Ampere's collection of the devices' activations (a part of `Ampere`)."""

    trainer: Trainer
    options: Any
    validation: ArrayDataset | None
    test: ArrayDataset | None
    upload_bound: ActivationBound | None  # built at the first upload (see `_bounded`)
    store: ActivationStore | None  # opened by `Ampere._prepare_phase2`

    def _store(self) -> ActivationStore:
        assert self.store is not None
        return self.store

    def _rows_per_reply(self, agent: str) -> int:
        """Rows of `agent`'s activations (at its cut) that fit in `upload_mb`."""
        t = self.trainer
        row = 4 * math.prod(t.activation_shape_at(t.cut(agent)))
        return max(1, int(self.options.upload_mb * 2**20) // row)

    def _collect(self, agents: list[str]) -> Iterator[np.ndarray]:
        """Ask `agents` for the rest of their activations, one slice per agent per wave;
        store each slice as it lands and yield the store rows it added. An agent that
        misses a wave (or sends a bad slice) is asked again next round."""
        t, s, store = self.trainer, self.trainer.settings, self._store()
        sizes = t.defences.claimed_sizes(agents)  # the rows each device holds
        active, wave = list(agents), 0
        limits = {a: self._rows_per_reply(a) for a in agents}
        while active:
            offsets = {a: store.received(a) for a in active}
            commands = {a: Command(Kind.GENERATE.value, {
                "offset": offsets[a], "limit": limits[a], "codec": s.codec,
                "compression": s.compression},  # the cutoff waits for its rows' share
                work=min(limits[a], sizes[a] - offsets[a])) for a in active}
            stream = t.engine.send_and_stream(commands, round=t.round, step=wave,
                                              deadline_s=s.deadline_s)
            while True:
                with t.books.timed("upload"):
                    out = next(stream, None)
                if out is None:
                    break
                rows = self._accept(t.books.note(out), offsets, sizes, limits)
                if rows is not None:
                    yield rows
            active = [a for a in active if a not in t.books.missed and not store.complete(a)]
            wave += 1

    def _accept(self, out: Outcome, offsets: dict[str, int], sizes: dict[str, int],
                limits: dict[str, int]) -> np.ndarray | None:
        """Store a one-agent outcome's slice (a shallow device's carried to the server
        cut first); a refused slice becomes a recorded miss."""
        t, store = self.trainer, self._store()
        for agent, reply in list(out.replies.items()):
            acts, labels = reply.tensors.get("activations"), reply.tensors.get("labels")
            try:
                if acts is None or labels is None or reply.meta.get("total") != sizes[agent]:
                    raise StoreError(f"upload from {agent} refused: reply lacks activations "
                                     "or labels, or its dataset size differs from the "
                                     "registered one")
                with t.books.timed("store"):
                    acts = self._bounded(agent, self._carried(agent, acts, labels,
                                                             limits[agent]))
                    n = store.append(agent, offsets[agent], sizes[agent], acts, labels)
            except StoreError as exc:
                log.warning("%s", exc)
                del out.replies[agent]
                out.missed[agent] = t.books.missed[agent] = f"error: bad reply: {exc}"
                continue
            t.books.fwd_samples[agent] += n  # the client block's forward pass on the device
            return store.rows_of(agent)[offsets[agent]:offsets[agent] + n]
        return None

    def _carried(self, agent: str, acts: np.ndarray, labels: np.ndarray, limit: int
                 ) -> np.ndarray:
        """A shallow device's slice, checked at its cut p_k, then carried to p* through
        the aggregated global layers p_k+1..p* (eval mode, no gradient), so the store
        holds one shape and one server block trains on all of it."""
        t = self.trainer
        cut = t.cut(agent)
        if cut >= t.bundle.split:
            return acts  # the store checks it at p*
        problem = t.activation_problem({"activations": acts, "labels": labels}, limit, agent)
        if problem is not None:
            raise StoreError(f"upload from {agent} refused: {problem}")
        return t.completions.carry(cut, t.global_client, acts)

    def _bounded(self, agent: str, acts: np.ndarray) -> np.ndarray:
        """A slice with every sample's norm at most `activation_bound` × the norm the
        coordinator's own copy of the trained client block gives its held-out inputs
        (server/defences/step_bounds.py; the median per sample). Phase 2 uploads arrive one device
        at a
        time, so a running fleet median would start at whoever uploads first: the reference
        is computed here instead, where no device can move it. A clean slice comes back as
        it was, bit for bit; a bounded device is noted in the round's books."""
        t = self.trainer
        if t.settings.activation_bound <= 0 or acts.size == 0:
            return acts
        if self.upload_bound is None:
            self.upload_bound = ActivationBound(t.settings.activation_bound)
            reference = self._reference_norm()
            if reference > 0:
                self.upload_bound.history[tuple(acts.shape[1:])] = deque(
                    [reference] * WINDOW, maxlen=WINDOW)
        view = np.ascontiguousarray(acts)  # decoded slices are read-only: torch wants to own
        tensor = torch.from_numpy(view if view.flags.writeable else view.copy())
        [out] = self.upload_bound.apply([agent], [tensor], t.books.bounded,
                                        t.books.activation_scale)
        return acts if out is tensor else out.numpy()

    def _reference_norm(self) -> float:
        """Median per-sample activation norm at p* of the global client block on (at most
        512 of) the coordinator's held-out inputs (the validation part, else the test part)."""
        t = self.trainer
        held = self.validation if self.validation is not None and len(self.validation) \
            else self.test
        if held is None or not len(held):
            return 0.0
        client = t.bundle.client_module()
        load_strict(client, from_arrays(t.global_client, "client"), "client weights")
        with torch.no_grad(), eval_mode(client):
            acts = client(torch.from_numpy(np.ascontiguousarray(held.x[:512], np.float32)))
        return float(acts.flatten(1).norm(dim=1).median())


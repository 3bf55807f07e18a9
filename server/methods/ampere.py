"""Ampere (the Ampere paper §3, Algorithm 1, eqs 5–12) and its ablation without activation
consolidation (§5.2.4), on the shared runtime.

Phase 1 (device training, eqs 7–10): each round is one epoch. Selected agents train client
block + auxiliary head on their local loss (`train target=aux`, ⌈|D_k|/B_k⌉ steps of B_k, so
every agent makes one pass), upload both, and the coordinator FedAvg-s them (weights |D_k|)
and sends the average back at the next epoch: two model exchanges per epoch, eq. 5. The
coordinator then scores the averaged client∘aux on a validation part it carves from its
held-out split; phase 1 ends after `patience` epochs without a better score, after N_d =
`device_epochs` epochs, or when only one round is left, and keeps the best epoch's blocks.

Why validate on the coordinator: the paper trains "until {θ(d), θ~(d)} converges" and does
not say where convergence is measured. The agents hold only their training data (accuracy
there measures fit, not generalisation, and would cost every device a pass over its data
plus a round trip per epoch); the coordinator already holds held-out data, so it scores the
one averaged model once per epoch at no device cost. The validation part is disjoint from
the part `evaluate` reports on, so model selection never sees the test samples.

Phase 2 (eqs 6, 11–12; the uploads in ampere_uploads.py): the coordinator writes a fresh
bundle holding the final client and aux weights (its bytes are training traffic, kind
`trained_bundle`), every eligible agent installs it and runs its client block once over all
its data in ONNX Runtime (TensorRT EP where present), uploading activations+labels in slices
of at most `upload_mb` (several `generate` replies, so a device never holds the whole
encoding twice). Each slice goes into the on-disk `ActivationStore` as it lands, and the
single server block trains on shuffled batches of everything stored so far while later
slices are still travelling (Algorithm 1's two server subprocesses). Each later round is one
more shuffled epoch over the whole store; agents whose upload is incomplete (offline,
restarted) are asked again for the rest. Phase 2 involves every eligible agent (the paper's
K devices), whatever the round's selection. Slices are consumed in agent-id order
(`Engine.send_and_stream`), so the MQTT and in-process engines still train the same model
bit for bit. Devices download only the trained client block and aux head (a role-true client
bundle, eq. 27); the coordinator's full copy holds a zero server block, which never leaves
it.

Rounds: `rounds` is the whole budget; phase 1 takes up to min(N_d, rounds − 1) of them and
every remaining round is one server epoch (N_s = rounds − phase-1 rounds). N_d defaults to
half the rounds: the paper trains each side to convergence, and with a fixed budget a phase
1 that kept improving would leave the server block, trained from scratch, one epoch, and the
model far under what half the rounds each reach (benchmarks/method_matrix.py;
docs/results.md#measurements-behind-the-defaults). `local_steps` is
not used. Rows carry `phase` and `validation_accuracy` besides the usual fields; in phase 1
`accuracy` is client∘server with the still untrained server block, which is what the
system would serve at that point.

The ablation keeps phase 1 but, once all activations are in, trains one server-block copy
per agent on that agent's activations alone and FedAvg-s the copies (weights |A_k|) every
epoch, as the SFL baselines do.

Per-device blocks (§3.2.1; the planner picks p_k per device, export/planner.py): device k
trains layers 1..p_k with an aux head built for p_k (its cut's bundle). Phase 1 averages
layer l over the devices holding it (p_k ≥ l) and each head over the devices at its cut.
Phase 2 ships each device a trained bundle at its cut; a shallow device's uploads are
carried to p* = max p_k through the aggregated global layers p_k+1..p* (eval mode, no
gradient; `Completions.carry`) before they are stored, so the store has one shape and one
server block [p*:] trains on it. Equal cuts run the one-cut code bit for bit. Live
re-planning (server/cuts/replanning.py) may move a device's cut between phase-1 epochs
(`switch_cuts`): it trains the global layers up to its new cut with that cut's head; heads
are kept for every cut a device has held, and one for a new cut starts from its bundle.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jetsplit.bundle import load_bundle, sha256_file
from jetsplit.data import ArrayDataset
from jetsplit.errors import ConfigError
from jetsplit.models import ZOO_VERSION
from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.defences.step_bounds import ActivationBound
from jetsplit.server.engines.seam import Command, Outcome
from jetsplit.server.methods.activation_store import ActivationStore
from jetsplit.server.methods.ampere_uploads import PhaseTwoUploads
from jetsplit.server.methods.base import Method
from jetsplit.server.training.checkpoints import CheckpointError, save_arrays, strip, subset
from jetsplit.server.training.evaluation import evaluate
from jetsplit.server.training.trainer import Arrays, Trainer

log = logging.getLogger("jetsplit.coordinator")


def carve_validation(held_out: ArrayDataset, fraction: float, seed: int
                     ) -> tuple[ArrayDataset | None, ArrayDataset]:
    """(validation, test): a seeded `fraction` of the held-out split for early stopping,
    the rest for reporting; no validation part when `fraction` is 0."""
    n = len(held_out)
    count = min(n - 1, max(1, round(fraction * n))) if fraction > 0 else 0
    if count <= 0:
        return None, held_out
    order = np.random.default_rng([seed, 0xA3]).permutation(n)
    return held_out.subset(np.sort(order[:count])), held_out.subset(np.sort(order[count:]))


class Ampere(PhaseTwoUploads, Method):
    """Ampere: unidirectional inter-block training with activation consolidation."""

    name = "ampere"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        t, s = trainer, trainer.settings
        if not t.bundle.has_aux:
            raise ConfigError(f"{self.name} needs a bundle with an auxiliary head "
                              "(set model.aux_ratio)")
        if s.rounds < 2:
            raise ConfigError(f"{self.name} needs at least 2 rounds (device epochs, then "
                              f"server training), got rounds = {s.rounds}")
        # One aux head per cut in the fleet (`aux/…` names; see `_flat` for checkpoints).
        self.aux: dict[int, Arrays] = {k: self._initial_aux(k) for k in sorted(
            {t.bundle.split, *t.cuts.values()}, reverse=True)}
        # Aux blocks come back from agents too: validate them like the other blocks, each
        # device's against its own cut's head.
        t.weight_template = {**t.weight_template, **self.aux[t.bundle.split]}
        t.cut_templates = {k: a for k, a in self.aux.items() if k != t.bundle.split}
        self.validation, self.test = carve_validation(
            t.test, self.options.validation_fraction, s.seed)
        self.phase = self.round_phase = 1
        self.epoch = 0  # phase-1 epochs done
        self.best: Arrays = {**t.global_client, **self._flat(self.aux)}
        self.best_accuracy: float | None = None
        self.stale = 0  # epochs since the best validation accuracy
        self.last_validation: float | None = None
        self.server_epochs = 0
        self.workdir: Path | None = None  # the store and the trained bundle
        self.own_workdir = False  # a temp folder of ours, removed when the run ends
        self.bundle_sha: str | None = None  # the trained bundle this run wrote
        self.store: ActivationStore | None = None
        self.shipper: BundleShipper | None = None
        self.upload_bound: ActivationBound | None = None  # phase 2 (see `_bounded`)

    @property
    def loss_tier(self) -> str:  # type: ignore[override]
        """Phase 1 trains client+aux on the devices, phase 2 the server block."""
        return "device" if self.round_phase == 1 else "server"

    def run_round(self, selected: list[str]) -> float | None:
        self.round_phase = self.phase  # what this round's metrics row reports
        if self.phase == 1:
            return self._device_epoch(selected)
        t = self.trainer
        limit = self.options.server_epochs
        if limit is not None and self.server_epochs >= limit:
            return None  # N_s server epochs done: later rounds only evaluate
        self._prepare_phase2()
        owing = [a for a in t.engine.registry.eligible(zoo_version=ZOO_VERSION)
                 if not self._store().complete(a)]
        assert self.shipper is not None
        ready = self.shipper.ensure(owing, t.round, t.cuts) if owing else []
        loss = self._server_epoch(ready)
        self.server_epochs += 1
        return loss

    # ------------------------------------------------------------------ phase 1

    def _device_epoch(self, selected: list[str]) -> float | None:
        """One epoch of eqs 8–10: local client+aux training, FedAvg, validation."""
        t = self.trainer
        live = t.live(selected)
        if self.epoch > 0:
            live = t.push_client(live, t.global_client, self.aux)
        d = t.defences  # an epoch of its own data: its raw claim
        batches, claims = d.batches(live), d.claimed_sizes(live)
        commands = {a: Command(Kind.TRAIN.value, {
            "target": "aux", "batch": batches[a], "lr": t.client_optimizer.lr,
            "steps": math.ceil(claims[a] / batches[a])},
            work=batches[a] * math.ceil(claims[a] / batches[a])) for a in live}  # cutoff
        with t.books.timed("local_train"):
            out = t.books.note(t.engine.send_and_receive(
                commands, round=t.round, deadline_s=t.step_deadline(Kind.TRAIN.value)))
        loss = self._train_loss(out, commands)
        states = t.pull(out.agents, ("client", "aux"))
        t.release(out.agents)
        if states:
            with t.books.timed("aggregate"):
                self._aggregate(states)
            self.epoch += 1
            with t.books.timed("validate"):
                self._validate()
        if self._device_training_done():
            self._end_phase1()
        return loss

    def _aggregate(self, states: dict[str, Arrays]) -> None:
        """FedAvg (weights |D_k|) layer by layer over the devices that hold the layer
        (p_k ≥ l; a layer nobody held this epoch keeps its weights), and each cut's aux
        head over the devices at that cut. With one cut: FedAvg of client + aux."""
        t, d = self.trainer, self.trainer.defences
        sizes = d.sizes(sorted(states))
        client = d.aggregate({a: subset(v, "client") for a, v in states.items()}, sizes,
                             reference=t.global_client)
        t.global_client = {**t.global_client, **client}
        for cut, group in t.by_cut(sorted(states)).items():
            self.aux[cut] = d.aggregate({a: subset(states[a], "aux") for a in group}, sizes,
                                        reference=self.aux.get(cut), block=f"aux head (cut {cut})")

    def _train_loss(self, out: Outcome, commands: dict[str, Command]) -> float | None:
        """Sample-weighted mean of the agents' reported losses (untrusted: checked)."""
        t = self.trainer
        total, seen = 0.0, 0
        for agent, reply in out.replies.items():
            samples, loss = reply.meta.get("samples"), reply.meta.get("loss")
            limit = commands[agent].meta["steps"] * commands[agent].meta["batch"]
            # a JSON true is an int in Python: a bool is no count
            if not (isinstance(samples, int) and not isinstance(samples, bool)
                    and 0 < samples <= limit and isinstance(loss, float)
                    and math.isfinite(loss)):
                continue
            t.books.fwd_samples[agent] += samples  # client forward and backward on device
            t.books.bwd_samples[agent] += samples
            total, seen = total + loss * samples, seen + samples
        return total / seen if seen else None

    def _device_model(self, cut: int) -> nn.Module:
        """client[:cut]∘aux_cut with the global weights (what a device at `cut` trains)."""
        t = self.trainer
        client = t.bundle.client_module()
        load_strict(client, from_arrays(t.global_client, "client"), "client weights")
        aux = t.bundle.aux_module() if cut == t.bundle.split else self._aux_module(cut)
        load_strict(aux, from_arrays(self.aux[cut], "aux"), "aux weights")
        return nn.Sequential(*list(client.children())[:cut], aux)

    def _aux_module(self, cut: int) -> nn.Module:
        """The aux head built for `cut`: from the device bundle the agents at `cut` run."""
        shipped = self.trainer.shipper.bundles.get("client", cut, aux=True)
        return load_bundle(shipped.root).aux_module()

    def _initial_aux(self, cut: int) -> Arrays:
        t = self.trainer
        head = t.bundle.aux_module() if cut == t.bundle.split else self._aux_module(cut)
        return to_arrays(head, "aux")

    def _add_head(self, cut: int) -> None:
        """A head for a cut no device held so far (a re-planned device moved there): fresh
        from that cut's bundle, and the template its uploads are checked against."""
        t = self.trainer
        if cut not in self.aux:
            self.aux[cut] = self._initial_aux(cut)
        if cut != t.bundle.split:
            t.cut_templates.setdefault(cut, self.aux[cut])

    @property
    def switches_cuts(self) -> bool:
        """Phase 1 only: in phase 2 each device's uploads are encoded at its cut and carried
        to p*, the store has one shape, and the trained bundles are per cut."""
        return self.phase == 1

    def switch_cuts(self, cuts: Mapping[str, int]) -> list[str]:
        """Phase 1 (live re-planning): the device trains the global layers up to its new
        cut and that cut's head (kept for every cut a device ever held, so a return finds
        the head the devices there trained; a new cut's starts fresh)."""
        if not self.switches_cuts:
            return []
        moved = super().switch_cuts(cuts)
        for agent in moved:
            self._add_head(self.trainer.cut(agent))
        return moved

    def _validation_accuracy(self) -> float:
        """Accuracy of the devices' client∘aux on the validation part. With several cuts,
        each device serves its own cut's model: the mean over cuts weighted by the data
        (Σ|D_k|, each claim capped as in every average) of the registered devices at each
        cut."""
        t = self.trainer
        assert self.validation is not None
        weights: dict[int, int] = {}
        for agent, size in t.defences.sizes(t.engine.registry.registered()).items():
            if size > 0:
                weights[t.cut(agent)] = weights.get(t.cut(agent), 0) + size
        if len(weights) <= 1:
            cut = next(iter(weights), t.bundle.split)
            return evaluate(self._device_model(cut), self.validation).accuracy
        total = sum(weights.values())
        return sum(n / total * evaluate(self._device_model(cut), self.validation).accuracy
                   for cut, n in sorted(weights.items()))

    def _validate(self) -> None:
        """Early-stopping bookkeeping; without a validation part the latest epoch is best."""
        current = {**self.trainer.global_client, **self._flat(self.aux)}
        if self.validation is None:
            self.best, self.stale = current, 0
            return
        accuracy = self._validation_accuracy()
        self.last_validation = accuracy
        if self.best_accuracy is None or accuracy > self.best_accuracy:
            self.best, self.best_accuracy, self.stale = current, accuracy, 0
        else:
            self.stale += 1

    def _flat(self, aux: dict[int, Arrays]) -> Arrays:
        """Every cut's aux head in one name space (checkpoints, the best epoch, aux.
        safetensors): the server cut's as `aux/…`, as in a one-cut run; another cut's as
        `aux-k<cut>/…`."""
        out: Arrays = {}
        for cut, arrays in aux.items():
            prefix = self._aux_prefix(cut)
            out.update({prefix + name[3:]: v for name, v in arrays.items()})
        return out

    def _unflat(self, arrays: Arrays) -> dict[int, Arrays]:
        """Inverse of `_flat`: every cut's head `arrays` hold (a re-planned run's heads
        include cuts its devices moved to)."""
        out: dict[int, Arrays] = {}
        split = self.trainer.bundle.split
        for name, value in arrays.items():
            head, _, rest = name.partition("/")
            if head == "aux":
                cut = split
            elif head.startswith("aux-k") and head[5:].isdigit():
                cut = int(head[5:])
            else:
                continue
            out.setdefault(cut, {})["aux/" + rest] = value
        return out

    def _aux_prefix(self, cut: int) -> str:
        return "aux" if cut == self.trainer.bundle.split else f"aux-k{cut}"

    def _device_training_done(self) -> bool:
        t, s = self.trainer, self.trainer.settings
        last_round_next = t.round + 2 >= s.rounds  # phase 2 needs at least one round
        return (self.stale >= self.options.patience or self.epoch >= self.device_epochs
                or last_round_next)

    @property
    def device_epochs(self) -> int:
        """N_d: the option, else half the rounds (the server block trains on the rest)."""
        given = self.options.device_epochs
        return given if given is not None else max(1, self.trainer.settings.rounds // 2)

    def _end_phase1(self) -> None:
        t = self.trainer
        t.global_client = subset(self.best, "client")
        # a head for a cut first held after the best epoch keeps its latest weights
        self.aux = {**self.aux, **self._unflat(self.best)}
        self.phase = 2
        log.info("%s: device training ends after %d epochs (best validation accuracy %s)",
                 self.name, self.epoch, self.best_accuracy)

    # ------------------------------------------------------------------ phase 2 setup

    def _prepare_phase2(self) -> None:
        """The work folder, the trained bundle and the store (once; again after a resume)."""
        t, s = self.trainer, self.trainer.settings
        if self.workdir is None:
            if self.options.activation_dir:
                self.workdir = Path(self.options.activation_dir)
            else:  # a fresh folder; a checkpoint records it, so a resumed run finds it
                self.workdir = Path(tempfile.mkdtemp(prefix=f"jetsplit-ampere-{t.engine.run_id}-"))
                self.own_workdir = True
        archive = self.workdir / "bundle.tar.gz"
        if self.shipper is None:
            # Reuse only the archive this run wrote (a resume); never a stale one.
            if not (archive.is_file() and sha256_file(archive) == self.bundle_sha):
                with t.books.timed("export"):
                    self._write_trained_bundle()
            self.shipper = BundleShipper(t.engine, archive, lr=t.client_optimizer.lr,
                                         optimizer=t.client_optimizer.wire(),
                                         deadline_s=s.bundle_deadline_s,
                                         kind=Kind.TRAINED_BUNDLE.value, content="aux",
                                         seed=s.seed, aux_weights={
                                             k: from_arrays(a, "aux")
                                             for k, a in self.aux.items()
                                             if k != t.bundle.split})
            self.bundle_sha = self.shipper.sha256
        if self.store is None:
            # The store is tied to the trained bundle: activations of another client block
            # (an earlier run in the same folder) are refused, never mixed in.
            self.store = ActivationStore(
                self.workdir / "store", t.activation_shape, self.num_classes,
                max_bytes=int(self.options.activation_gb * 2**30), tag=self.shipper.sha256)

    def _write_trained_bundle(self) -> None:
        """A bundle like the shipped one, with the final client and aux weights: its ONNX
        client block is what the agents run to generate activations. Devices never run the
        server block in Ampere, so its tensors here are zeros, which the archive's gzip
        shrinks to almost nothing: the download is what eq. 27 counts (client block and aux
        head), not another copy of the server block."""
        from jetsplit.export.bundle_writer import write_bundle

        t = self.trainer
        assert self.workdir is not None
        weights = {**from_arrays(t.global_client, "client"),
                   **{k: torch.zeros(v.shape, dtype=v.dtype)
                      for k, v in t.server.state_dict().items()},
                   **{f"aux.{k}": v for k, v in
                      from_arrays(self.aux[t.bundle.split], "aux").items()}}
        write_bundle(t.bundle.spec, t.bundle.split, self.workdir / "bundle",
                     aux_ratio=t.bundle.manifest.aux_ratio, seed=t.settings.seed,
                     weights=weights, tar=True)

    # ------------------------------------------------------------------ phase 2 training

    def _server_epoch(self, owing: list[str]) -> float | None:
        """One shuffled epoch over the store, started on the first slice that lands: each
        arrival joins the pool of rows not yet trained on this epoch, and the server takes
        batches from the shuffled pool whenever a full one is there (eqs 11–12)."""
        t = self.trainer
        rng = np.random.default_rng([t.settings.seed, t.round])
        pool = self._stored_rows()
        rng.shuffle(pool)
        batch, losses = self.options.server_batch or t.settings.batch, []  # B(s)

        def train_on(rest: np.ndarray, smallest: int) -> np.ndarray:
            while len(rest) >= smallest:
                losses.append(self._step(t.server, t.optimizer, rest[:batch]))
                rest = rest[batch:]
            return rest  # rows left for the next arrival

        pool = train_on(pool, batch)  # rows stored before this round (after a resume)
        for rows in self._collect(owing):
            pool = np.concatenate([pool, rows])
            rng.shuffle(pool)
            pool = train_on(pool, batch)
        train_on(pool, 2)  # the last partial batch (one row cannot train batch norm)
        return float(np.mean(losses)) if losses else None

    def _stored_rows(self) -> np.ndarray:
        store = self._store()
        parts = [store.rows_of(a) for a in store.agents()]
        return np.concatenate(parts) if parts else np.arange(0)

    def _step(self, server: nn.Module, optimizer: torch.optim.Optimizer, rows: np.ndarray
              ) -> float:
        """One SGD step of the server block on stored rows (eq. 12)."""
        with self.trainer.books.timed("load"):
            acts, labels = self._store().take(np.sort(rows))
        with self.trainer.server_compute():
            device = self.trainer.device
            server.train()
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(server(torch.from_numpy(acts).to(device)),
                                               torch.from_numpy(labels).to(device))
            loss.backward()
            optimizer.step()
        return float(loss.detach())

    # ------------------------------------------------------------------ results and state

    def evaluate(self) -> dict[str, Any]:
        """client∘server on the test part (the held-out split minus the validation part),
        plus the round's phase and the latest validation accuracy of client∘aux."""
        t = self.trainer
        scores = evaluate(t.composed(t.global_client), self.test).as_dict()
        return {**scores, "phase": self.round_phase, "validation_accuracy": self.last_validation}

    def save(self, out_dir: Path) -> None:
        """Final weights (the aux head too); a temp work folder of ours goes away."""
        super().save(out_dir)
        save_arrays(self._flat(self.aux), out_dir / "aux.safetensors")
        if self.own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        arrays, meta = super().checkpoint()
        arrays = {**arrays, **self._flat(self.aux),
                  **{f"best/{k}": v for k, v in self.best.items()}}
        return arrays, {**meta, "ampere": {
            "phase": self.phase, "epoch": self.epoch, "best_accuracy": self.best_accuracy,
            "stale": self.stale, "last_validation": self.last_validation,
            "server_epochs": self.server_epochs,
            "workdir": None if self.workdir is None else str(self.workdir),
            "own_workdir": self.own_workdir, "bundle_sha256": self.bundle_sha}}

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        super().restore(arrays, meta)
        t = self.trainer
        best = strip(arrays, "best")
        aux, best_aux = self._unflat(arrays), self._unflat(best)
        for cut in sorted(aux):  # cuts the devices were moved to hold heads too
            if 1 <= cut < t.bundle.split and cut not in t.cut_templates:
                t.cut_templates[cut] = self._initial_aux(cut)
        for what, problem in (
                ("aux head", self._aux_problem(aux)),
                ("best blocks", t.weights_problem(subset(best, "client"), ("client",))
                 or self._aux_problem(best_aux))):
            if problem is not None:
                raise CheckpointError(f"checkpoint {what}: {problem}")
        state = meta.get("ampere") or {}
        try:
            self.phase, self.epoch = int(state["phase"]), int(state["epoch"])
            self.stale, self.server_epochs = int(state["stale"]), int(state["server_epochs"])
            self.best_accuracy = _float_or_none(state["best_accuracy"])
            self.last_validation = _float_or_none(state["last_validation"])
            self.workdir = None if state["workdir"] is None else Path(str(state["workdir"]))
            self.own_workdir = bool(state["own_workdir"])
            self.bundle_sha = None if state["bundle_sha256"] is None else str(
                state["bundle_sha256"])
            for name in ("epoch", "stale", "server_epochs"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} {getattr(self, name)} is negative")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint Ampere state is damaged: {exc}") from None
        if self.phase not in (1, 2):
            raise CheckpointError(f"checkpoint Ampere phase {self.phase} is not 1 or 2")
        self.aux = {k: {n: np.array(v) for n, v in a.items()} for k, a in aux.items()}
        self.best = {k: np.array(v) for k, v in best.items()
                     if k.startswith("client/") or k.split("/", 1)[0] in
                     {self._aux_prefix(c) for c in self.aux}}
        self.store = self.shipper = None  # reopened from the work folder when needed

    def _aux_problem(self, aux: dict[int, Arrays]) -> str | None:
        """Why these aux heads (one per cut, untrusted) cannot be loaded, or None."""
        t = self.trainer
        for cut, arrays in aux.items():
            problem = t.weights_problem(arrays, ("aux",), cut=cut)
            if problem is not None:
                return problem if cut == t.bundle.split else f"cut {cut}: {problem}"
        return None


def _float_or_none(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


class AmpereNoConsolidation(Ampere):
    """§5.2.4's ablation: after all uploads are in, one server-block copy per agent trains
    on that agent's activations only; the copies are FedAvg-ed every epoch."""

    name = "ampere-noconsolidation"

    def _server_epoch(self, owing: list[str]) -> float | None:
        t, s, store = self.trainer, self.trainer.settings, self._store()
        for _ in self._collect(owing):
            pass  # the ablation trains only once the activations are collected
        counts = {a: n for a, n in store.counts().items() if n}
        if not counts:
            return None
        total = sum(counts.values())
        rng = np.random.default_rng([s.seed, t.round])
        states, losses = {}, []
        for agent in sorted(counts):
            server = copy.deepcopy(t.server)
            optimizer = t.server_optimizer.for_module(server)
            batch = max(2, round((self.options.server_batch or s.batch) * counts[agent] / total))
            order = store.rows_of(agent)[rng.permutation(counts[agent])]
            for start in range(0, len(order), batch):
                rows = order[start:start + batch]
                if len(rows) > 1:
                    losses.append(self._step(server, optimizer, rows))
            states[agent] = to_arrays(server, "server")
        with t.books.timed("aggregate"):  # under [train] aggregator, like every upload
            merged = t.defences.aggregate(states, counts, reference=to_arrays(t.server, "server"),
                                          block="server copy", uploaded=False)
        load_strict(t.server, from_arrays(merged, "server"), "server average")
        return float(np.mean(losses)) if losses else None

"""The round loop: rounds of a method over any engine, with evaluation and metrics.

Per round it selects a seeded fraction of eligible agents, makes sure they hold the bundle,
lets the method run its T local iterations, evaluates on the held-out test split (which
never leaves the coordinator) and writes one JSON line: top-1 and balanced accuracy,
per-class accuracy, loss, bytes up/down per message kind (training and evaluation apart),
device GFLOPs per agent (from the cost model and the samples each agent processed) and wall
time per phase.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetsplit.bundle import Bundle
from jetsplit.data import Dataset
from jetsplit.devices import torch_threads
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.protocol import Kind
from jetsplit.server.cuts.replanning import Replanner
from jetsplit.server.defences import memory as defence_memory
from jetsplit.server.engines.seam import Engine
from jetsplit.server.run.held_out import run_classes
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

log = logging.getLogger("jetsplit.coordinator")
Arrays = dict[str, np.ndarray]
REJOIN_GRACE_S = 3.0  # after an outage, how long to wait for the rest of the fleet


def run_training(
    engine: Engine,
    archive: Path,
    settings: Settings,
    test: Dataset,
    out_dir: Path,
    *,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    bundle: Bundle | None = None,
    checkpoint: bool = True,
    resume: bool = False,
    row_extras: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    cuts: Mapping[str, int] | None = None,
    replanner: Replanner | None = None,
    predicted_step_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Train `settings.algorithm` for `settings.rounds` rounds; returns the summary.

    With `checkpoint`, the state after every round goes to `out_dir/checkpoint`; with
    `resume`, training continues after the last checkpointed round (its bundle is shipped,
    its metrics rows are kept) and ends exactly where an uninterrupted run would.
    `row_extras(row)` may add fields to each metrics row before it is written. The
    coordinator's compute runs with `settings.threads` intra-op threads (0: as it is).
    `cuts` trains a fleet of per-device cuts (see Trainer and server/cuts/completions.py);
    `replanner` may move them between rounds (server/cuts/replanning.py), reading each row
    after `row_extras` (the fleet books' live estimates) and adding `replan` to the row of
    the round after which it switched. `predicted_step_s` (agent → the planner's seconds
    for its longest exchange) raises the step deadlines' floor."""
    with torch_threads(settings.threads):
        return _train(engine, archive, settings, test, out_dir, on_round=on_round,
                      bundle=bundle, checkpoint=checkpoint, resume=resume,
                      row_extras=row_extras, cuts=cuts, replanner=replanner,
                      predicted_step_s=predicted_step_s)


def _train(engine: Engine, archive: Path, settings: Settings, test: Dataset,
           out_dir: Path, *, on_round: Callable[[dict[str, Any]], None] | None,
           bundle: Bundle | None, checkpoint: bool, resume: bool,
           row_extras: Callable[[dict[str, Any]], dict[str, Any]] | None,
           cuts: Mapping[str, int] | None, replanner: Replanner | None,
           predicted_step_s: Mapping[str, float] | None) -> dict[str, Any]:
    from jetsplit.server.methods import build_method
    from jetsplit.server.training.checkpoints import load_checkpoint

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    saved = load_checkpoint(out_dir / "checkpoint") if resume else None
    if saved is not None:
        archive, bundle = saved.bundle, None
    trainer = Trainer(engine, archive, settings, test, bundle=bundle, cuts=cuts,
                      predicted_step_s=predicted_step_s)
    method = build_method(settings.algorithm, trainer)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    first = 0
    if saved is not None:
        _restore(saved, settings, trainer, method)
        rows = _kept_rows(out_dir / "metrics.jsonl", saved.round + 1)
        first = saved.round + 1
        log.info("resuming %s after round %d of %d from %s", settings.algorithm,
                 first, settings.rounds, out_dir / "checkpoint")
    with (out_dir / "metrics.jsonl").open("w") as metrics:
        metrics.writelines(json.dumps(r) + "\n" for r in rows)
        for round_ in range(first, settings.rounds):
            row = _round(round_, engine, settings, trainer, method)
            if row_extras is not None:  # e.g. a trial's per-agent time and telemetry
                row.update(row_extras(row))
            if replanner is not None and round_ + 1 < settings.rounds:
                switch = _replan(replanner, row, trainer, method)
                if switch is not None:
                    row["replan"] = switch
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            loss = row["train_loss"]
            log.info("round %d/%d %s: accuracy %.4f (balanced %.4f), train loss %.4f, "
                     "%d agents, up %.2f MB, down %.2f MB", round_ + 1, settings.rounds,
                     settings.algorithm, _or_nan(row["accuracy"]),
                     _or_nan(row["balanced_accuracy"]),
                     float("nan") if loss is None else loss, len(row["selected"]),
                     row["bytes_up"] / 1e6, row["bytes_down"] / 1e6)
            if checkpoint:
                with trainer.books.timed("checkpoint"):
                    _save(out_dir / "checkpoint", round_, settings, trainer, method, archive)
            if on_round is not None:
                on_round(row)
    if not rows:
        raise JetsplitError(f"nothing to train: the checkpoint already covers all "
                            f"{settings.rounds} rounds")
    summary = _summary(rows, engine, settings, trainer, time.perf_counter() - started)
    classes = run_classes(test)  # what the report names the classes by
    summary["classes"] = None if classes is None else list(classes)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    method.save(out_dir)
    return summary


def _round(round_: int, engine: Engine, settings: Settings, trainer: Trainer, method: Any
           ) -> dict[str, Any]:
    """One round: select, train, evaluate; its metrics row (before any row extras)."""
    trainer.round = trainer.defences.bench.round = round_
    trainer.books.reset()
    trainer.defences.consistency.new_round()
    trainer.defences.direction.new_round()
    round_started = time.perf_counter()
    before = engine.counters.by_kind()
    selected = trainer.select()
    loss = method.run_round(selected)
    trainer.guard.check(loss, round_, method.loss_tier)
    train_bytes = _delta(engine.counters.by_kind(), before)
    # Installing the bundle is setup, not training: reported apart.
    setup_bytes = sum(train_bytes[d].pop(kind, 0) for d in ("up", "down")
                      for kind in (Kind.BUNDLE.value, Kind.BUNDLE_PART.value))
    with trainer.books.timed("evaluate"):
        before_eval = engine.counters.by_kind()
        scores = method.evaluate()
        eval_bytes = _delta(engine.counters.by_kind(), before_eval)
    books = trainer.books
    deadlines, full_deadlines = trainer.deadlines.new_round()
    return {
        "round": round_, "algorithm": settings.algorithm, "selected": selected,
        "missed": dict(sorted(books.missed.items())),
        "benched": trainer.defences.bench.sitting_out(),
        # out for silence, not benched: a probe is pending (server/training/rejoin.py)
        "awaiting_probe": trainer.sitting_out(),
        "probes": dict(sorted(books.probes.items())),  # proof of life before selection
        # kind → the round's largest step deadline; exchanges given the whole deadline_s
        "deadlines_s": deadlines, "full_deadlines": full_deadlines,
        "aggregation": dict(sorted(books.aggregation.items())),
        "bounded": dict(sorted(books.bounded.items())),
        "down_weighted": dict(sorted(books.down_weighted.items())),
        "excluded": dict(sorted(books.excluded.items())),
        "gradient_clipped": dict(sorted(books.gradient_clipped.items())),
        "activation_scale": dict(sorted(books.activation_scale.items())),
        "influence": books.influence.result(),
        "train_loss": loss,
        **scores,
        "bytes_up": sum(train_bytes["up"].values()),
        "bytes_down": sum(train_bytes["down"].values()),
        "bytes_by_kind": train_bytes, "eval_bytes": eval_bytes,
        "bundle_bytes": setup_bytes,
        "bytes_up_total": engine.counters.total("up"),
        "bytes_down_total": engine.counters.total("down"),
        "device_gflops": trainer.device_gflops(),
        "phases_s": {k: round(v, 4) for k, v in sorted(books.phases.items())},
        "seconds": time.perf_counter() - round_started,
        "cuts": trainer.cuts_of(selected),
        **getattr(method, "extra_metrics", {}),  # a method's own (sherl: tier_bytes)
    }


def _summary(rows: list[dict[str, Any]], engine: Engine, settings: Settings,
             trainer: Trainer, seconds: float) -> dict[str, Any]:
    """summary.json: the last round's accuracy, the run's totals and the fleet's books."""
    last = rows[-1]
    gflops: dict[str, float] = defaultdict(float)
    for row in rows:
        for agent, value in row["device_gflops"].items():
            gflops[agent] += value
    return {
        "algorithm": settings.algorithm, "rounds": settings.rounds, "run": engine.run_id,
        "final_accuracy": last["accuracy"], "balanced_accuracy": last["balanced_accuracy"],
        "final_accuracy_std": last.get("accuracy_std"),
        "bytes_up": sum(r["bytes_up"] for r in rows),
        "bytes_down": sum(r["bytes_down"] for r in rows),
        "bundle_bytes": sum(r["bundle_bytes"] for r in rows),
        "device_gflops": float(sum(gflops.values())),
        "device_gflops_per_agent": dict(sorted(gflops.items())),
        "seconds": seconds,
        "bundle_sha256": trainer.shipper.sha256,
        "settings": settings.model_dump(),
        "agents": engine.registry.snapshot(),
        "missed": [m.__dict__ for m in engine.registry.missed],
        "capped_claims": dict(sorted(trainer.defences.claims.capped.items())),
        "histogram_claims": dict(sorted(trainer.defences.labels.replaced.items())),
        "benched": dict(sorted(trainer.defences.bench.strikes.items())),  # times each sat out
        "bytes": engine.counters.snapshot(),
    }


def _replan(replanner: Replanner, row: dict[str, Any], trainer: Trainer, method: Any
            ) -> dict[str, Any] | None:
    """Feed the replanner this round's row; make its switch, if any (the `replan` field)."""
    registered = sorted(trainer.engine.registry.registered())
    if not registered or not method.switches_cuts:  # e.g. Ampere after its device phase
        return None
    batches = trainer.defences.batches(registered)
    selected = max(1, round(trainer.settings.fraction * len(registered)))
    batches = {a: max(1, round(b * len(registered) / selected)) for a, b in batches.items()}
    replanner.observe(row, batches)
    switch = replanner.consider(int(row["round"]), trainer.cuts_of(registered), batches)
    if switch is None:
        return None
    moved = method.switch_cuts(switch.after)
    log.info("round %d: re-planned %s", row["round"] + 1, switch.reason)
    return {**switch.row(), "moved_agents": moved}


def _shown(value: Any) -> str:
    """A setting's value in a message: unset ones (the method's default) say so."""
    return "unset (the method's default)" if value is None else repr(value)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]
           ) -> dict[str, dict[str, int]]:
    return {d: {k: v - before[d].get(k, 0) for k, v in sorted(after[d].items())
                if v - before[d].get(k, 0)} for d in ("up", "down")}


# Settings a resumed run may change: how long to wait, how far to go and where the
# coordinator computes, not what to train.
RESUMABLE_CHANGES = {"rounds", "deadline_s", "bundle_deadline_s", "retry_s", "device", "threads",
                     "deadline_k", "deadline_window", "deadline_floor_s", "probe_deadline_s"}


def _save(directory: Path, round_: int, settings: Settings, trainer: Trainer,
          method: Any, archive: Path) -> None:
    """Round `round_`'s checkpoint: the method's state, the RNGs, the fleet's books."""
    from jetsplit.server.training.checkpoints import save_checkpoint

    arrays, method_meta = method.checkpoint()
    defences, defence_arrays = defence_memory.snapshot(trainer.defences)
    arrays = {**arrays, **defence_arrays, "trainer/torch_rng": torch.get_rng_state().numpy()}
    engine = trainer.engine
    meta = {
        "settings": settings.model_dump(), "bundle_sha256": trainer.shipper.sha256,
        "numpy_rng": trainer.rng.bit_generator.state, "last_pool": trainer.last_pool,
        "method": method_meta, "bytes": engine.counters.snapshot(),
        "missed": [m.__dict__ for m in engine.registry.missed],
        "cuts": dict(sorted(trainer.cuts.items())),  # as re-planned (server/cuts/replanning.py)
        **defences,  # who is left out, benched or bounded, and on what evidence
        "step_deadlines": trainer.deadlines.snapshot(),  # a resumed run waits as this one
    }
    save_checkpoint(directory, round_, meta, arrays, archive)


def _restore(saved: Any, settings: Settings, trainer: Trainer, method: Any) -> None:
    """Put a fresh trainer and method back into the checkpointed state."""
    from jetsplit.server.engines.registry import MissedStep
    from jetsplit.server.training.checkpoints import CheckpointError

    meta = saved.meta
    before = meta.get("settings") or {}
    defaults = {name: info.get_default(call_default_factory=True)
                for name, info in Settings.model_fields.items()}  # keys older runs lack
    changed = sorted(k for k, v in settings.model_dump().items()
                     if k not in RESUMABLE_CHANGES and before.get(k, defaults[k]) != v)
    if changed:
        name = changed[0]
        raise CheckpointError(f"cannot resume: setting {name!r} was "
                              f"{_shown(before.get(name, defaults[name]))}, now "
                              f"{_shown(getattr(settings, name))}")
    if meta.get("bundle_sha256") != trainer.shipper.sha256:
        raise CheckpointError("cannot resume: the checkpoint's bundle does not match its hash")
    try:
        trainer.rng.bit_generator.state = meta["numpy_rng"]
        torch.set_rng_state(torch.from_numpy(np.array(saved.arrays["trainer/torch_rng"])))
        trainer.last_pool = int(meta.get("last_pool", 0))
        engine = trainer.engine
        engine.counters.load(meta.get("bytes", {}))
        for miss in meta.get("missed", []):
            engine.registry.missed.append(MissedStep(**miss))
        for agent, cut in (meta.get("cuts") or {}).items():  # a re-planned run's cuts
            if trainer.cut(str(agent)) != cut:
                trainer.set_cut(str(agent), cut)
        defence_memory.restore(trainer.defences, meta, saved.arrays, trainer.device)
        trainer.deadlines.restore(meta.get("step_deadlines"))
    except (KeyError, TypeError, ValueError, RuntimeError, ConfigError) as exc:
        raise CheckpointError(f"checkpoint state is damaged: {exc}") from None
    method.restore({k: v for k, v in saved.arrays.items() if not k.startswith("trainer/")},
                   meta.get("method", {}))


def _kept_rows(path: Path, count: int) -> list[dict[str, Any]]:
    """The metrics rows of the checkpointed rounds (later ones, if any, are discarded)."""
    rows: list[dict[str, Any]] = []
    if path.is_file():
        with path.open() as fh:
            for line in fh:
                if len(rows) == count:
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a row cut short by the kill
    if len(rows) < count:
        log.warning("metrics.jsonl holds %d of the %d checkpointed rounds", len(rows), count)
    return rows

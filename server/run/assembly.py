"""One run assembly: what every launcher hands the round loop, and the one place that turns
it into rounds, a summary and a report.

`jetsplit server run` (server/run/server_run.py), `jetsplit simulate` (server/run/simulate.py),
`jetsplit trial` (server/run/trial.py) and the tests' fleet fixtures differ in where their fleet
comes from (registered agents over MQTT, in-process workers, emulated agent processes) and
how they read their options (a server.toml, flags, a trial spec). Each builds a `RunSpec`
and an engine, and calls `execute`: the bundle on resume, the per-device cuts, the
callbacks and the report are decided here once. The two that drive a fleet over MQTT
(`server run`, `trial`) run inside a `LiveFleet`, which closes the engine and wires the
fleet books, the Prometheus endpoint and the trackers into every row. Tests and
benchmarks train the same way: `execute(engine, RunSpec(settings, archive, test, out))`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetsplit.bundle import load_bundle
from jetsplit.data import Dataset
from jetsplit.models import ModelSpec
from jetsplit.server.cuts.replanning import Replanner
from jetsplit.server.engines.seam import Engine
from jetsplit.server.run.config import ServerConfig
from jetsplit.server.training.checkpoints import BUNDLE_FILE
from jetsplit.server.training.settings import Settings

if TYPE_CHECKING:
    from jetsplit.server.ops.tracking import Trackers

log = logging.getLogger("jetsplit.coordinator")

Row = dict[str, Any]
OnRound = Callable[[Row], None]
RowExtras = Callable[[Row], Row]


def folder_run_id(out_dir: Path, fallback: str, flag: str = "--out") -> str:
    """The run id every message carries: the run folder's name (`fallback` where it has
    none), refused in one line where the wire would refuse it (else every agent rejects
    the first command and the run fails in round 0 for no visible reason)."""
    import re

    from jetsplit.errors import ConfigError
    from jetsplit.wire.envelope import WIRE_NAME

    name = out_dir.name or fallback
    if not re.match(WIRE_NAME, name):
        raise ConfigError(f"{flag} {out_dir}: the folder's name is the run id, and may hold "
                          "only letters, digits and . _ : / - (at most 128)")
    return name


def checkpointed_bundle(out_dir: Path) -> Path:
    """The bundle a run's checkpoint keeps (what a resumed run ships again)."""
    return out_dir / "checkpoint" / BUNDLE_FILE


def bundle_for(out_dir: Path, resume: bool, prepare: Callable[[], Path]) -> Path:
    """The bundle to ship: the checkpoint's when resuming (the run must go on with the
    bundle it started with), else a fresh one from `prepare`."""
    return checkpointed_bundle(out_dir) if resume else prepare()


def device_cuts(cuts: Mapping[str, int] | None, server_cut: int | None
                ) -> dict[str, int] | None:
    """Per-device cuts for the trainer, or None when every device trains at the server cut
    (the common-cut code then runs exactly as without a plan)."""
    cuts = dict(cuts or {})
    return cuts if any(c != server_cut for c in cuts.values()) else None


@dataclass
class RunSpec:
    """Everything the round loop needs besides the engine."""

    settings: Settings
    archive: Path  # the whole model split at the server cut (the bundle archive)
    test: Dataset  # the held-out set the coordinator evaluates on
    out_dir: Path
    server_cut: int | None = None  # the bundle's split, c* (None: every cut given is used)
    cuts: Mapping[str, int] = field(default_factory=dict)  # agent → its cut (empty: c*)
    resume: bool = False
    checkpoint: bool = True
    on_round: list[OnRound | None] = field(default_factory=list)  # after each metrics row
    row_extras: list[RowExtras] = field(default_factory=list)  # fields added to each row
    report_title: str | None = None  # write report.md at the end (None: no report)
    replanner: Replanner | None = None  # moves cuts between rounds (server/cuts/replanning.py)
    # agent → the planner's seconds for its longest exchange: the step deadlines' floor
    # covers the slowest (server/defences/step_deadlines.py)
    predicted_step_s: Mapping[str, float] = field(default_factory=dict)


def chain_extras(extras: list[RowExtras]) -> RowExtras | None:
    """One row-extras callback from several, applied in order: each sees the row with
    what the ones before it added (a trial's predictions read the fleet books' fields)."""
    if not extras:
        return None

    def combined(row: Row) -> Row:
        added: Row = {}
        for extra in extras:
            added.update(extra({**row, **added}))
        return added

    return combined


def chain_rounds(*callbacks: OnRound | None) -> OnRound | None:
    """One per-round callback calling each given one in order (None entries skipped;
    None when none is left)."""
    live = [c for c in callbacks if c is not None]
    if not live:
        return None

    def combined(row: Row) -> None:
        for callback in live:
            callback(row)

    return combined


def execute(engine: Engine, spec: RunSpec) -> dict[str, Any]:
    """Train `spec` over `engine`: rounds, metrics, checkpoints, summary and the report."""
    from jetsplit.server.run.round_loop import run_training

    summary = run_training(engine, spec.archive, spec.settings, spec.test, spec.out_dir,
                           on_round=chain_rounds(*spec.on_round),
                           row_extras=chain_extras(spec.row_extras), resume=spec.resume,
                           checkpoint=spec.checkpoint,
                           cuts=device_cuts(spec.cuts, spec.server_cut),
                           replanner=spec.replanner,
                           predicted_step_s=spec.predicted_step_s)
    if spec.report_title is not None:
        from jetsplit.server.report.document import write_report

        summary["report"] = str(write_report(spec.out_dir, title=spec.report_title))
    return summary


class LiveFleet:
    """A run over MQTT around `execute` (`server run`, `trial`): the engine closed at the end,
    the Prometheus endpoint when a port is given, and every metrics row fed to the fleet
    books (per-agent time split and telemetry, first among the row extras), the exporter
    and the trackers (after the spec's own per-round callbacks)."""

    def __init__(self, engine: Engine, *, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", trackers: Trackers | None = None) -> None:
        from jetsplit.server.fleet.books import FleetBooks

        self.engine, self.trackers = engine, trackers
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.books = FleetBooks(engine)
        self.exporter: Any = None

    def __enter__(self) -> LiveFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.close()
        if self.exporter is not None:
            self.exporter.close()

    def serve_metrics(self) -> str | None:
        """Start the Prometheus endpoint if a port was given; its address."""
        if self.metrics_port is None:
            return None
        from jetsplit.server.ops.prometheus import MetricsExporter

        self.exporter = MetricsExporter(self.metrics_port, self.metrics_host).start()
        return f"http://{self.metrics_host}:{self.exporter.port}/metrics"

    def execute(self, spec: RunSpec) -> dict[str, Any]:
        """Train `spec` over the fleet, its rows fed to the books, exporter and trackers."""
        from jetsplit.server.ops.prometheus import round_callback

        exporter = (None if self.exporter is None
                    else round_callback(self.exporter, self.engine, self.books))
        tracker = (self.trackers.log_round if self.trackers is not None and self.trackers.active
                   else None)
        return execute(self.engine, replace(
            spec, row_extras=[self.books.collect, *spec.row_extras],
            on_round=[*spec.on_round, exporter, tracker]))


def prepare_bundle(cfg: ServerConfig, workdir: Path, classes: Sequence[str] | None = None
                   ) -> Path:
    """The full bundle archive (the coordinator's): the configured one (verified), or a
    fresh export naming the run's `classes` (agents map their own labels to them)."""
    if cfg.model.bundle:
        path = Path(cfg.model.bundle)
        load_bundle(path)  # fail here, in one line, rather than on every agent
        return path
    from jetsplit.export.bundle_writer import write_bundle

    spec = ModelSpec(cfg.model.name, tuple(cfg.model.input_shape), cfg.model.classes)
    report = write_bundle(spec, cfg.model.split, workdir / "bundle", aux_ratio=cfg.model.aux_ratio,
                          seed=cfg.seed, tar=True, initial_weights=cfg.model.weights,
                          classes=classes)
    tell_bundle_notes(report.notes)
    assert report.tar_path is not None
    return report.tar_path


def tell_bundle_notes(notes: Sequence[str]) -> None:
    """What a fresh bundle started from (the initial weights' file and hash) and which
    layers it re-initialised for a new class count: a warning, since a run that was meant
    to fine-tune must not silently train a layer from scratch."""
    for note in notes:
        (log.warning if "re-initialised" in note else log.info)("%s", note)

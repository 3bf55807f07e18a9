"""Optional experiment trackers fed from the same per-round rows as metrics.jsonl:
TensorBoard scalars (`--tensorboard DIR`) and MLflow (`--mlflow URI`). Both packages are
imported only when asked for; where one is missing the flag fails in one line before any
training starts, and a tracker that fails mid-run is logged, never allowed to stop training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from jetsplit.errors import ConfigError
from jetsplit.server.defences.untrusted_numbers import finite

log = logging.getLogger(__name__)

# row key → scalar name; byte counters become MB.
SCALARS = {"accuracy": "accuracy/top1", "balanced_accuracy": "accuracy/balanced",
           "accuracy_std": "accuracy/std_across_clients", "train_loss": "loss/train",
           "test_loss": "loss/test", "seconds": "time/round_s"}
MB_SCALARS = {"bytes_up_total": "traffic/up_total_mb", "bytes_down_total": "traffic/down_total_mb",
              "bundle_bytes": "traffic/bundle_mb"}


def scalars(row: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The numbers of one metrics row worth plotting over rounds (None values skipped)."""
    for key, name in SCALARS.items():
        value = finite(row.get(key))
        if value is not None:
            yield name, value
    for key, name in MB_SCALARS.items():
        value = finite(row.get(key))
        if value is not None:
            yield name, value / 1e6
    phases = row.get("phases_s")
    if isinstance(phases, Mapping):
        for phase, seconds in phases.items():
            value = finite(seconds)
            if value is not None:
                yield f"time/phase_{phase}_s", value


class Trackers:
    """The trackers a run asked for; `log_round(row)` feeds each, `close()` flushes."""

    def __init__(self, tensorboard: str | None = None, mlflow: str | None = None,
                 run_name: str = "jetsplit", params: Mapping[str, Any] | None = None) -> None:
        self._writer: Any = None
        self._mlflow: Any = None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard: the tensorboard package is not installed "
                                  "(pip install tensorboard)") from None
            self._writer = SummaryWriter(log_dir=tensorboard)
        if mlflow is not None:
            try:
                import mlflow as mlflow_module
            except ImportError:
                raise ConfigError("--mlflow: the mlflow package is not installed "
                                  "(pip install mlflow)") from None
            mlflow_module.set_tracking_uri(mlflow)
            mlflow_module.start_run(run_name=run_name)
            mlflow_module.log_params({k: str(v)[:250] for k, v in (params or {}).items()})
            self._mlflow = mlflow_module

    @property
    def active(self) -> bool:
        return self._writer is not None or self._mlflow is not None

    def log_round(self, row: Mapping[str, Any]) -> None:
        step = row.get("round")
        step = int(step) + 1 if isinstance(step, int) else 0
        values = dict(scalars(row))
        try:
            if self._writer is not None:
                for name, value in values.items():
                    self._writer.add_scalar(name, value, step)
                self._writer.flush()
            if self._mlflow is not None:
                self._mlflow.log_metrics({n.replace("/", "."): v for n, v in values.items()},
                                         step=step)
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
            log.warning("tracking: round %d not recorded: %s", step, exc)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._mlflow is not None:
            self._mlflow.end_run()

"""Classes agree by name: a device's own folder names its classes, the run's list is the
coordinator's, and a device's label histogram is read in the run's order.

A device may lack some of the run's classes (a camera that never saw a fox); a device with
a class the run does not know is refused at registration, in one line, before it trains a
label the run's classifier has no output for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jetsplit.data import class_mapping
from jetsplit.protocol import Registration


def agree_classes(registration: Registration, run: Sequence[str] | None) -> dict[str, Any]:
    """The registration as the coordinator books it: with a named run and a device that
    names its classes, its histogram moved to the run's order and the run's list as its
    classes; otherwise as sent. Raises ConfigError naming the unknown class."""
    record = registration.model_dump(mode="json")
    device = registration.dataset.classes
    if run is None or device is None:
        return record
    mapping = class_mapping(device, run, f"agent {registration.agent}")
    histogram = [0] * len(run)
    for own, count in zip(mapping.tolist(), registration.dataset.label_histogram,
                           strict=True):
        histogram[own] += count
    record["dataset"].update(classes=list(run), num_classes=len(run),
                             label_histogram=histogram)
    return record

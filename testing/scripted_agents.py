"""What the methods' fast tests script their agents with (test_sherl_schedule_fast.py,
test_ampere_fast.py): the record of one command as an agent received it, and the shape of a
tamper hook that changes a reply (or refuses it with a reason)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]
# (reply meta, reply tensors, round, step) → None, or a miss's reason
Tamper = Callable[[dict[str, Any], Arrays, int, int], "str | None"]


@dataclass
class Sent:
    """One command as a scripted agent received it."""

    kind: str
    agent: str
    round: int
    step: int
    meta: dict[str, Any]
    tensors: Arrays
    work: float | None
    deadline_s: float

"""Numbers read from untrusted or sparse records (agent replies, metrics rows)."""

from __future__ import annotations

import math
from typing import Any


def finite(value: Any, low: float = -math.inf, high: float = math.inf) -> float | None:
    """`value` as a float if it is a real, finite number within [low, high]; else None
    (None, NaN, strings and booleans included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None

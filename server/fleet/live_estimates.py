"""Live estimates of each device: its effective compute speed and link rates, from what the
run measures, smoothed so that one slow round does not move them.

A device in the field does not keep its datasheet speed: it throttles, changes power mode,
its link degrades and recovers. Every round the coordinator knows how many GFLOPs each
device computed (`Trainer.device_gflops`) and the device reports, cumulatively, how long it
computed and how many bytes it moved in how long each way (`edge_agent.emulation
.DeviceClock.snapshot`). One round's ratio is a measurement; the estimate is the median of
the last `window` measurements, so a single outlier (a GC pause, a retransmission) is
ignored and a lasting change is followed within `window // 2 + 1` rounds.

Device numbers are untrusted: anything not a finite, positive number in range is not a
measurement.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

WINDOW = 3  # rounds of measurements per estimate (median)
MIN_COMPUTE_S = 0.01  # a round with less compute measures timer noise
MIN_BYTES = 64 * 1024  # smaller transfers measure latency, not rate
QUANTITIES = ("gflops", "uplink_mbps", "downlink_mbps")


class LiveEstimates:
    """Per device: the last `window` measurements of each quantity and their median."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._seen: dict[str, dict[str, deque[float]]] = {}

    def measure(self, agent: str, gflops: Any, delta: dict[str, Any]) -> dict[str, float]:
        """This round's measurements of `agent`: `gflops` it computed (the coordinator's
        count), `delta` its books' growth this round (compute_s, transfer_up_s,
        transfer_down_s, bytes_up, bytes_down). Returns the updated estimates."""
        compute_s = finite(delta.get("compute_s"), 0.0, 1e9)
        work = finite(gflops, 0.0, 1e12)
        if compute_s is not None and work is not None and compute_s >= MIN_COMPUTE_S and work:
            self._add(agent, "gflops", work / compute_s)
        for way in ("up", "down"):
            seconds = finite(delta.get(f"transfer_{way}_s"), 0.0, 1e9)
            nbytes = finite(delta.get(f"bytes_{way}"), 0.0, 1e15)
            if seconds and nbytes is not None and nbytes >= MIN_BYTES:
                self._add(agent, f"{way}link_mbps", nbytes * 8 / seconds / 1e6)
        return self.estimate(agent)

    def _add(self, agent: str, quantity: str, value: float) -> None:
        per = self._seen.setdefault(agent, {})
        per.setdefault(quantity, deque(maxlen=self.window)).append(value)

    def estimate(self, agent: str) -> dict[str, float]:
        """{quantity: median of its recent measurements}; a quantity never measured is
        left out (the report and `fleet status` say `unknown`)."""
        return {q: round(statistics.median(v), 4)
                for q, v in sorted(self._seen.get(agent, {}).items()) if v}

"""Live estimates of each device's speed and links: one round's measurement is GFLOPs over
compute seconds and bytes over transfer seconds each way; the estimate is the median of the
last three, so one outlier is ignored and a lasting change is followed in two rounds.
Untrusted numbers and measurements too small to mean anything are not measurements."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jetsplit.server.fleet.live_estimates import MIN_BYTES, LiveEstimates

pytestmark = pytest.mark.fast

MB = 1_000_000


def _round(est: LiveEstimates, gflops: float, compute_s: float, up_mbps: float,
           down_bytes: int = 0, down_s: float = 0.0) -> dict[str, float]:
    up_bytes = 2 * MB
    return est.measure("a0", gflops, {"compute_s": compute_s, "bytes_up": up_bytes,
                                      "transfer_up_s": up_bytes * 8 / (up_mbps * 1e6),
                                      "bytes_down": down_bytes, "transfer_down_s": down_s})


def test_the_median_of_three_ignores_one_outlier_and_follows_a_change() -> None:
    est = LiveEstimates()
    assert _round(est, 40.0, 2.0, 50.0) == {"gflops": 20.0, "uplink_mbps": 50.0}
    assert _round(est, 40.0, 2.0, 50.0)["uplink_mbps"] == 50.0
    one_slow = _round(est, 40.0, 20.0, 0.5)  # one bad round: 2 GFLOPS, 0.5 Mbit/s
    assert one_slow == {"gflops": 20.0, "uplink_mbps": 50.0}
    assert _round(est, 40.0, 2.0, 50.0) == {"gflops": 20.0, "uplink_mbps": 50.0}
    assert _round(est, 40.0, 2.0, 50.0) == {"gflops": 20.0, "uplink_mbps": 50.0}
    # a lasting change (power mode: half the speed; uplink 50 -> 5): one round is not yet
    # enough, the second is
    assert _round(est, 40.0, 4.0, 5.0) == {"gflops": 20.0, "uplink_mbps": 50.0}
    assert _round(est, 40.0, 4.0, 5.0) == {"gflops": 10.0, "uplink_mbps": 5.0}


def test_untrusted_or_tiny_numbers_are_not_measurements() -> None:
    est = LiveEstimates()
    for junk in (math.nan, math.inf, -1.0, "40", None, 1e400, True):
        assert est.measure("a1", junk, {"compute_s": junk, "bytes_up": junk,
                                        "transfer_up_s": junk}) == {}
    # too little compute (timer noise) or too few bytes (latency) measure nothing
    assert est.measure("a1", 1.0, {"compute_s": 0.001}) == {}
    assert est.measure("a1", 0.0, {"compute_s": 5.0}) == {}
    assert est.measure("a1", None, {"bytes_down": MIN_BYTES - 1,
                                    "transfer_down_s": 0.01}) == {}
    got = est.measure("a1", None, {"bytes_down": 4 * MB, "transfer_down_s": 0.5})
    assert got == {"downlink_mbps": 64.0}
    assert est.estimate("nobody") == {}


def test_fleet_books_estimate_each_agent_from_its_clock() -> None:
    """The status poll after a round turns each agent's clock into measurements: a0 moved
    2 MB up in 0.32 s (50 Mbit/s) and computed 1.5 s for 30 GFLOPs; a1 reported nothing
    new."""
    from jetsplit.data import ArrayDataset
    from jetsplit.edge_agent.worker import AgentWorker
    from jetsplit.server.engines.seam import InProcessEngine
    from jetsplit.server.fleet.books import FleetBooks

    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    workers = {f"a{i}": AgentWorker(f"a{i}", data) for i in range(2)}
    engine = InProcessEngine(workers)
    books = FleetBooks(engine)
    clock = workers["a0"].clock
    clock.compute_s += 1.5
    clock.transfer_dir_s["up"] += 0.32
    clock.bytes_dir["up"] += 2 * MB
    row = books.collect({"round": 0, "device_gflops": {"a0": 30.0}})
    assert row["agents"]["a0"]["estimate"]["gflops"] == pytest.approx(20.0, rel=0.01)
    assert row["agents"]["a0"]["estimate"]["uplink_mbps"] == pytest.approx(50.0, rel=0.01)
    assert row["agents"]["a1"]["estimate"] == {}
    clock.transfer_dir_s["up"] += 3.2  # the next round: the same bytes at 5 Mbit/s
    clock.bytes_dir["up"] += 2 * MB
    row = books.collect({"round": 1, "device_gflops": {}})
    assert row["agents"]["a0"]["estimate"]["uplink_mbps"] == pytest.approx(27.5, rel=0.01)


def test_power_mode_comes_from_the_trace_then_nvpmodel_else_unknown() -> None:
    from jetsplit.server.fleet.books import power_mode

    assert power_mode({"power_mode": "10W"}, {"gpu": {"power_mode": "MAXN"}}) == "10W"
    assert power_mode({"power_mode": None}, {"gpu": {"power_mode": "MAXN"}}) == "MAXN"
    assert power_mode({}, {"gpu": None}) == "unknown"
    assert power_mode("junk", {"gpu": {"power_mode": 7}}) == "unknown"
    assert power_mode({"power_mode": "x" * 100}, None) == "x" * 32


def test_emulated_conditions_are_range_checked_and_absent_on_a_real_device() -> None:
    from jetsplit.server.fleet.books import emulated_conditions

    stated = {"compute": 0.5, "uplink_mbps": 5.0, "downlink_mbps": None}
    assert emulated_conditions({"emulated": stated}) == {"compute": 0.5, "uplink_mbps": 5.0}
    assert emulated_conditions({"emulated": None}) == {}
    assert emulated_conditions("junk") == {}
    hostile = {"compute": 1e400, "uplink_mbps": -1.0, "downlink_mbps": "fast"}
    assert emulated_conditions({"emulated": hostile}) == {}
    assert emulated_conditions({"emulated": {"compute": 0.0, "uplink_mbps": 2e6}}) == {}
    # exactly what a trace may state (edge_agent/traces.py): over 0, at most the limit
    edges = {"compute": 1e-9, "uplink_mbps": 1e6, "downlink_mbps": 1e6 * (1 + 1e-12)}
    assert emulated_conditions({"emulated": edges}) == {"compute": 1e-9, "uplink_mbps": 1e6}
    from jetsplit.edge_agent.traces import TraceRow

    TraceRow(round=0, compute=1e-9, uplink_mbps=1e6)  # the agent takes the same

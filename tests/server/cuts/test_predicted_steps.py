"""What the step deadlines' floor covers (server/cuts/planning.py `longest_exchange_s`,
`registered_steps`): the planner's seconds for a device's longest exchange, an iteration or
its block's weights once over its slower link, by hand and from registered profiles."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from jetsplit.config_io import tomllib
from jetsplit.profiles import bundled_profiles_dir
from jetsplit.server.cuts.planning import longest_exchange_s, registered_steps
from jetsplit.server.defences.step_deadlines import FLOOR_MARGIN, predicted_floor

pytestmark = pytest.mark.fast


def _profile_dict(name: str, mbps: float | None = None) -> dict[str, Any]:
    data = tomllib.loads((bundled_profiles_dir() / f"{name}.toml").read_text())
    if mbps is not None:
        data["network"].update(uplink_mbps=mbps, downlink_mbps=mbps)
    return data


def test_longest_exchange_by_hand() -> None:
    link = SimpleNamespace(uplink_bytes_per_s=250_000.0, downlink_bytes_per_s=500_000.0,
                           network=SimpleNamespace(rtt_ms=20.0))
    # 10 iterations of 1 kB; 1 MB of weights down and up once a round: 1 MB / 250 kB/s
    # (the slower way) + 20 ms = 4.02 s, over the 0.15 s iteration
    row = SimpleNamespace(compute_ms=120.0, transfer_ms=30.0, bytes_iter=1000.0,
                          bytes_round=10 * 1000.0 + 2 * 1e6)
    assert longest_exchange_s(row, link, 10) == pytest.approx(4.02)
    no_weights = SimpleNamespace(compute_ms=120.0, transfer_ms=30.0, bytes_iter=1000.0,
                                 bytes_round=10 * 1000.0)
    assert longest_exchange_s(no_weights, link, 10) == pytest.approx(0.15)


def test_registered_profiles_predict_each_agents_step() -> None:
    cfg = SimpleNamespace(model=SimpleNamespace(name="alexnet", input_shape=[1, 28, 28],
                                                classes=10, split=2),
                          train=SimpleNamespace(algorithm="scala"))
    registrations = {"a0": {"profile": _profile_dict("orin-nx-16gb")},
                     "a1": {"profile": _profile_dict("jetson-nano-4gb", 2.0)},
                     "a2": {"profile": _profile_dict("jetson-nano-4gb")},
                     "a3": {}, "a4": {"profile": {"device": "not a profile"}}}
    kwargs: dict[str, Any] = dict(batch=16, local_steps=10, rounds=10, codec="fp32")
    steps = registered_steps(cfg, registrations, {"a1": 1, "a2": 1}, **kwargs)
    assert set(steps) == {"a0", "a1", "a2"}  # no profile, or an invalid one: no prediction
    assert steps["a1"] > steps["a2"] > 0 and steps["a0"] > 0  # 2 Mbit/s is slower than 50
    # the floor covers the slow Nano with its margin, whatever the configured floor
    assert predicted_floor(steps, 1.0) == pytest.approx(FLOOR_MARGIN * steps["a1"])
    at_two = registered_steps(cfg, registrations, {}, **kwargs)
    assert at_two["a0"] == steps["a0"] and at_two["a1"] != steps["a1"]  # the cut counts
    fedavg = SimpleNamespace(model=cfg.model, train=SimpleNamespace(algorithm="fedavg"))
    assert registered_steps(fedavg, registrations, {}, **kwargs) == {}

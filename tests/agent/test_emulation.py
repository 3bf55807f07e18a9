"""Device emulation on the agent: the device clock stretches compute by the profile's
slowdown, times transfers at the emulated link, and books setup apart, unstretched; the
warm-up before the clock runs leaves weights, statistics and the RNG untouched."""

from __future__ import annotations

import time

import pytest

from jetsplit.edge_agent.emulation import DeviceClock, EmulationSection


def test_device_clock_books_emulated_time() -> None:
    clock = DeviceClock(EmulationSection(compute_slowdown=3.0, uplink_mbps=80.0))
    cpu = time.process_time()
    with clock.compute():
        sum(i * i for i in range(200_000))
    spent_cpu = time.process_time() - cpu
    assert clock.compute_s == pytest.approx(spent_cpu * 3.0, rel=0.2, abs=0.02)
    clock.transfer(100_000, "up")  # 0.8 Mbit at 80 Mbit/s
    assert clock.transfer_s == pytest.approx(0.01, abs=1e-6)
    clock.transfer(100_000, "down")  # downlink not limited: nothing to wait for
    assert clock.transfer_s == pytest.approx(0.01, abs=1e-6)
    books = clock.snapshot()
    assert books["compute_slowdown"] == 3.0 and books["uptime_s"] >= 0


def test_setup_inside_a_command_is_booked_apart_and_not_stretched() -> None:
    clock = DeviceClock(EmulationSection(compute_slowdown=50.0))
    with clock.compute(), clock.setup():
        sum(i * i for i in range(300_000))
    # the whole command was setup: nothing stretched by 50x, all of it booked as setup
    assert clock.compute_s < 0.5 * clock.setup_s
    assert clock.snapshot()["setup_s"] == pytest.approx(clock.setup_s, abs=1e-3)


def test_warm_up_leaves_weights_statistics_and_rng_untouched() -> None:
    import torch

    from jetsplit.edge_agent.worker import warm_up
    from jetsplit.models import ModelSpec, build_model, split
    from jetsplit.protocol import OptimizerArgs

    client, _ = split(build_model(ModelSpec("mobilenetv3-small", (3, 32, 32), 10)), 3)
    before = {k: v.clone() for k, v in client.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    warm_up(client, (4, 3, 32, 32), torch.device("cpu"), OptimizerArgs())
    assert torch.equal(torch.rand(3), expected)
    after = client.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in client.parameters())

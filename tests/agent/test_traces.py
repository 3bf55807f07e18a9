"""Traces: a device's speed, links and power mode changing during an emulated run. Parsed
with one-line errors naming the file and the row; replayed exactly by the device clock at
each command's round (or second)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.edge_agent.emulation import DeviceClock, EmulationSection
from jetsplit.edge_agent.traces import bundled_traces_dir, load_trace, parse_trace
from jetsplit.errors import ConfigError

pytestmark = pytest.mark.device_pure

ROUNDS = """
[[at]]
round = 0
uplink_mbps = 50.0
[[at]]
round = 3
compute = 0.5
power_mode = "10W"
[[at]]
round = 6
uplink_mbps = 5.0
[[at]]
round = 8
compute = 1.0
uplink_mbps = 50.0
"""


def test_rows_carry_forward_and_the_row_in_force_applies() -> None:
    trace = parse_trace(ROUNDS, "t.toml")
    states = [trace.state(r, 0.0).as_tuple() for r in range(10)]
    assert states == (
        [(1.0, 50.0, None, None)] * 3 + [(0.5, 50.0, None, "10W")] * 3
        + [(0.5, 5.0, None, "10W")] * 2 + [(1.0, 50.0, None, "10W")] * 2)
    csv = "seconds,compute,uplink_mbps\n0,1.0,\n30,0.25,\n60,,2.5\n"
    by_time = parse_trace(csv, "t.csv")
    assert [by_time.state(99, s).as_tuple()[:2] for s in (0, 29.9, 30, 61)] == [
        (1.0, None), (1.0, None), (0.25, None), (0.25, 2.5)]


def test_the_device_clock_replays_a_trace_round_by_round() -> None:
    cpu = [0.0]

    def fake_cpu() -> float:  # each command "uses" 1 ms of CPU
        cpu[0] += 0.0005
        return cpu[0]

    section = EmulationSection(compute_slowdown=2.0, uplink_mbps=80.0,
                               trace=parse_trace(ROUNDS, "t.toml"))
    clock = DeviceClock(section, cpu_clock=fake_cpu)
    booked = []
    for round_ in (0, 3, 6, 8):
        clock.enter_round(round_)
        before = clock.compute_s
        with clock.compute():
            pass
        booked.append(round(clock.compute_s - before, 6))
        before_t = clock.transfer_s
        clock.transfer(1000, "up")
        booked.append(round(clock.transfer_s - before_t, 6))
    # compute: 0.5 ms × slowdown 2, then 4 at half speed; links 50, 50, 5 and 50 Mbit/s
    assert booked == [0.001, 0.00016, 0.002, 0.00016, 0.002, 0.0016, 0.001, 0.00016]
    assert clock.snapshot()["power_mode"] == "10W"
    assert clock.snapshot()["compute_slowdown"] == 2.0
    # what a model-clock re-planner reads: the trace row in force, links as applied
    assert clock.snapshot()["emulated"] == {"compute": 1.0, "uplink_mbps": 50.0,
                                            "downlink_mbps": None}
    assert DeviceClock().snapshot()["emulated"] is None  # a real device states nothing
    clock.enter_round(4)
    assert clock.link_mbps("down") is None and clock.slowdown == 4.0
    faster = DeviceClock(EmulationSection(trace=parse_trace(
        "[[at]]\nround = 0\ncompute = 4.0\n", "fast.toml")))
    assert faster.emulating and faster.slowdown == 1.0  # never faster than this machine


def test_seconds_keyed_traces_follow_the_agents_uptime() -> None:
    clock = DeviceClock(EmulationSection(trace=parse_trace(
        "[[at]]\nseconds = 0\n[[at]]\nseconds = 100\ncompute = 0.5\n", "s.toml")))
    clock.enter_round(7)
    assert clock.slowdown == 1.0
    clock.started -= 150.0  # as if the agent had been up 150 s
    clock.enter_round(7)
    assert clock.slowdown == 2.0


@pytest.mark.parametrize(("text", "source", "message"), [
    ("[[at]]\nround = 0\ncompute = -1.0\n", "a.toml",
     "trace a.toml: row 1: compute: input should be greater than 0 (got -1.0)"),
    ("[[at]]\nround = 0\n[[at]]\nround = 2\nuplink = 5.0\n", "b.toml",
     "trace b.toml: row 2: uplink: unknown field (did you mean 'uplink_mbps'?)"),
    ("[[at]]\nround = 3\n[[at]]\nround = 1\n", "c.toml",
     "trace c.toml: row 2: round must increase (got 1 after 3)"),
    ("[[at]]\nround = 0\n[[at]]\nseconds = 5.0\n", "d.toml",
     "trace d.toml: row 2: every row is keyed by round, as the first is"),
    ("[[at]]\ncompute = 0.5\n", "e.toml",
     "trace e.toml: row 1: each row needs exactly one of 'round' and 'seconds'"),
    ("round,compute\n0,fast\n", "f.csv", "trace f.csv: row 1: compute: not a number ('fast')"),
    ("round,speed\n0,1\n", "g.csv", "trace g.csv: header row: unknown column 'speed'"),
    ("round,compute\n0,1,7\n", "h.csv", "trace h.csv: row 1: wrong number of columns"),
    ("[[at]\n", "i.toml", "trace i.toml: not valid TOML"),
    ("", "j.toml", "trace j.toml: no rows"), ("round,compute\n", "k.csv", "trace k.csv: no rows"),
])
def test_a_malformed_trace_is_one_line_naming_the_file_and_row(
        text: str, source: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_trace(text, source)
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


def test_bundled_traces_load_and_unknown_names_list_them(tmp_path: Path) -> None:
    names = sorted(p.stem for p in bundled_traces_dir().glob("*.toml"))
    assert names == ["link-drop-recover", "power-mode-drop", "thermal-throttle"]
    for name in names:
        assert load_trace(name).at
    drop = load_trace("power-mode-drop")
    assert drop.state(4, 0).compute == 1.0 and drop.state(5, 0).as_tuple()[::3] == (0.5, "10W")
    own = tmp_path / "mine.csv"
    own.write_text("round,uplink_mbps\n0,10\n")
    assert load_trace(str(own)).state(0, 0).uplink_mbps == 10.0
    with pytest.raises(ConfigError, match="no such file or bundled trace .bundled: "
                                          "link-drop-recover, power-mode-drop"):
        load_trace("nope")

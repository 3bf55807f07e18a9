"""Device emulation for field trials on one machine, and the agent's time books.

A trial runs every agent on the build machine, yet each should behave like the device its
profile describes: compute is stretched to the profile's speed relative to this machine's
measured speed (`compute_slowdown`), and every message waits for the profile's link
(`uplink_mbps` / `downlink_mbps`). Without emulation the same class just keeps the books:
seconds computing and seconds transferring, which the coordinator turns into the per-agent
compute / transfer / waiting split of its report.

Under emulation an agent's compute time is its process CPU time × slowdown (torch runs one
thread per trial agent), and it sleeps until its wall time reaches that: agents sharing a
2-core machine are not charged for waiting on each other's CPU (that shows as waiting).
Without emulation compute time is wall time, as on a real device.

A trace (`edge_agent/traces.py`) makes the device change during the run: from a given round
(or second) its speed falls to a fraction of the profile's, its links change, its power
mode is relabelled. The clock applies the row in force at each command's round.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from jetsplit.edge_agent.traces import Trace, TraceState

Direction = Literal["up", "down"]
MAX_LINK_SLEEP_S = 600.0  # one message never blocks the agent longer (watchdog headroom)


class EmulationSection(BaseModel):
    """`[emulation]` in agent.toml: only trials set it; a real device leaves it out."""

    model_config = ConfigDict(extra="forbid", strict=True)

    profile: Optional[str] = None  # what is emulated (for reports)
    compute_slowdown: Annotated[float, Field(ge=1.0, le=10_000.0)] = 1.0
    uplink_mbps: Optional[Annotated[float, Field(gt=0, le=1e6)]] = None
    downlink_mbps: Optional[Annotated[float, Field(gt=0, le=1e6)]] = None
    trace: Optional[Trace] = None  # how the device changes during the run


class DeviceClock:
    """Stretches compute and delays transfers per `EmulationSection`; counts both."""

    def __init__(self, section: EmulationSection | None = None,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        """`cpu_clock`: whose CPU time counts as this device's compute; a fleet host running
        many agents in one process passes `time.thread_time` (each agent computes on its
        own thread, torch on one thread), so agents are not charged for each other."""
        self.section = section or EmulationSection()
        self._cpu = cpu_clock
        self.compute_s = 0.0
        self.compute_wall_s = 0.0  # what compute really took here (emulation fidelity)
        self.transfer_s = 0.0
        # per direction, for the coordinator's live link estimates (server/fleet/live_estimates.py)
        self.transfer_dir_s = {"up": 0.0, "down": 0.0}
        self.bytes_dir = {"up": 0, "down": 0}
        self.setup_s = 0.0  # one-time setup inside commands, never stretched (see `setup`)
        self._setup_cpu = 0.0
        self._setup_wall = 0.0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.round = 0  # the round of the command being handled (a trace's key)
        self.conditions = TraceState()
        self._looked_up = False  # whether `conditions` holds the trace's row for `round`

    @property
    def emulating(self) -> bool:
        s = self.section
        return s.compute_slowdown > 1.0 or s.uplink_mbps is not None \
            or s.downlink_mbps is not None or s.trace is not None

    def enter_round(self, round_: int) -> None:
        """Apply the trace row in force at this round (or at this many seconds since start).
        Called for every command: a round-keyed trace is looked up once per round."""
        trace = self.section.trace
        if trace is None or (trace.by_round and round_ == self.round and self._looked_up):
            return
        self.round, self._looked_up = max(0, round_), True
        self.conditions = trace.state(self.round, time.monotonic() - self.started)

    @property
    def slowdown(self) -> float:
        """The compute stretch now: the profile's, divided by the trace's speed fraction
        (never below 1: this machine cannot run faster than it does)."""
        return max(1.0, self.section.compute_slowdown / self.conditions.compute)

    def link_mbps(self, direction: Direction) -> Optional[float]:
        """The link rate now: the trace's where it sets one, else the profile's."""
        c, s = self.conditions, self.section
        if direction == "up":
            return c.uplink_mbps if c.uplink_mbps is not None else s.uplink_mbps
        return c.downlink_mbps if c.downlink_mbps is not None else s.downlink_mbps

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Wrap one command's work; with a slowdown, wait until it took as long as the
        emulated device would have."""
        wall, cpu = time.perf_counter(), self._cpu()
        setup_cpu, setup_wall = self._setup_cpu, self._setup_wall
        try:
            yield
        finally:
            skip_cpu = self._setup_cpu - setup_cpu
            spent = time.perf_counter() - wall - (self._setup_wall - setup_wall)
            if self.emulating:  # the device's time: CPU work × slowdown
                spent, late = (self._cpu() - cpu - skip_cpu) * self.slowdown, spent
                if spent > late:
                    time.sleep(spent - late)
            with self._lock:
                self.compute_s += spent
                self.compute_wall_s += time.perf_counter() - wall

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """One-time setup inside a command (building blocks from a bundle, the runtime's first
        pass): booked as `setup_s`, not stretched. The slowdown models training throughput;
        stretching this machine's one-off start-up by it made an emulated first round many
        times slower than the device's would be."""
        wall, cpu = time.perf_counter(), self._cpu()
        try:
            yield
        finally:
            spent_wall, spent_cpu = time.perf_counter() - wall, self._cpu() - cpu
            with self._lock:
                self._setup_wall += spent_wall
                self._setup_cpu += spent_cpu
                self.setup_s += spent_wall

    def transfer(self, nbytes: int, direction: Direction, spent_s: float = 0.0) -> None:
        """Account one message; on an emulated link, wait for its bytes to pass."""
        mbps = self.link_mbps(direction)
        if mbps is not None:
            wait = min(nbytes * 8 / (mbps * 1e6), MAX_LINK_SLEEP_S) - spent_s
            if wait > 0:
                time.sleep(wait)
                spent_s += wait
        with self._lock:
            self.transfer_s += spent_s
            self.transfer_dir_s[direction] += spent_s
            self.bytes_dir[direction] += nbytes

    def snapshot(self) -> dict[str, float | str | None]:
        """Cumulative books since start; the coordinator differences them per round."""
        with self._lock:
            return {"compute_s": round(self.compute_s, 4),
                    "compute_wall_s": round(self.compute_wall_s, 4),
                    "transfer_s": round(self.transfer_s, 4),
                    "transfer_up_s": round(self.transfer_dir_s["up"], 6),
                    "transfer_down_s": round(self.transfer_dir_s["down"], 6),
                    "bytes_up": self.bytes_dir["up"], "bytes_down": self.bytes_dir["down"],
                    "setup_s": round(self.setup_s, 4),
                    "uptime_s": round(time.monotonic() - self.started, 4),
                    "profile": self.section.profile,
                    "compute_slowdown": round(self.slowdown, 4),
                    "power_mode": self.conditions.power_mode,
                    "emulated": self.emulated()}

    def emulated(self) -> dict[str, float | None] | None:
        """What this emulated device is set to be now (None on a real device): its speed as
        a fraction of its profile's and its link rates. A coordinator re-planning on its
        model clock (`[train] replan_clock = "model"`) reads these instead of measured
        times, so its decisions do not depend on how busy the emulating machine is."""
        if not self.emulating:
            return None
        return {"compute": self.conditions.compute, "uplink_mbps": self.link_mbps("up"),
                "downlink_mbps": self.link_mbps("down")}

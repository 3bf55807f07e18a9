"""Device faults over a broker, for the fault matrix (tests/integration/test_fault_matrix.py).

The attacks in `edge_agent/attacks.py` change what a device sends; these change whether and
when it sends at all, which only an engine with a clock can see (over MQTT), so `jetsplit
simulate` refuses them. Each is a real failure mode of a field device:

* `silent`: it registers and installs its bundle, then answers nothing, not even `status`,
  while its connection stays up: a process that hung.
* `every-other`: a flaky device (a marginal link, a thermal governor) that answers only
  every second command it receives; it is never `max_misses` in a row, so only an
  unanswered probe benches it, and each missed step costs the fleet a step deadline.
* `hang-upload`: a device that hangs mid-upload: its first reply that
  travels in two or more chunks (cut at the smallest chunk size the wire allows, so that even
  a tiny model's reply does) goes out half, then the process answers nothing more while its
  connection stays up. The coordinator holds the partial message until its reassembler drops
  it (jetsplit/wire/chunking.py).
* `clock-jump:S`: a device whose wall clock steps by S seconds (NTP stepping after a long
  drift, an RTC reset) when its first command of its round arrives. It steps what Python reads
  as the wall clock (`time.time`, `time.time_ns`) in the whole agent process, so everything
  the agent stamps with it moves: the envelope's `ts`, the replay guard's "now" that incoming
  commands are checked against, presence timestamps and their sequence numbers. Monotonic clocks
  (deadlines, the emulation, the reassembler's ages) do not move, as on a real device. In a
  signed fleet (a fleet key or device keys) both sides then refuse the other's messages
  beyond the replay skew; without signatures nothing reads the timestamps.

Each fault strikes from a round on: `@R` after the spec (`silent@2`, `clock-jump:3600@2`);
by default `silent` from the start (round 0: rounds count from 0, as in metrics.jsonl), the
others from round 1, mid-run. A fault that strikes once every exchange kind has been timed
costs the fleet the step deadlines that follow the measured steps; before that, the whole
`deadline_s` per exchange (server/defences/step_deadlines.py). Every fault is reached
through `Attack` (edge_agent/attacks.py), so it needs `JETSPLIT_ALLOW_ATTACKS=1` exactly as
the attacks do. Torch-free (the device floor's pure tests run it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, List, Optional, Tuple

from jetsplit.wire.chunking import CHUNK_OVERHEAD

SETUP_KINDS = ("bundle", "bundle_part")  # what a `silent` agent still answers
FAULT_ROUND = 1  # every-other, hang-upload and clock-jump strike from here without @R
HANG_CHUNK_BYTES = 4 * CHUNK_OVERHEAD  # the smallest chunk the wire allows (chunk_message)
MAX_REMEMBERED = 256  # command ids `every-other` keeps its verdicts for (retransmissions)
CommandKey = Tuple[str, int]  # (run, command id): what the daemon's reply cache keys on


def step_wall_clock(seconds: float) -> Callable[[], None]:
    """Step this process's wall clock by `seconds` as Python reads it (`time.time`,
    `time.time_ns`), the way an OS clock step moves CLOCK_REALTIME for every reader while
    CLOCK_MONOTONIC runs on; returns the undo (tests restore the clock with it)."""
    real, real_ns = time.time, time.time_ns
    offset_ns = int(round(seconds * 1e9))
    time.time = lambda: real() + seconds  # type: ignore[assignment]
    time.time_ns = lambda: real_ns() + offset_ns  # type: ignore[assignment]

    def undo() -> None:
        time.time, time.time_ns = real, real_ns  # type: ignore[assignment]
    return undo


class Fault:
    """One device's fault state (none when `kind` is None or an attack that is no fault):
    the daemon asks `takes` for each command and passes each reply's chunks through
    `chunk_bytes` and `published`."""

    def __init__(self, kind: Optional[str] = None, value: Optional[float] = None,
                 start: Optional[int] = None) -> None:
        self.kind = kind
        self.value = 0.0 if value is None else value
        # the first round it is faulty in (`@R`; else silent from the start, the rest mid-run)
        self.start = start if start is not None else 0 if kind == "silent" else FAULT_ROUND
        self.hung = False  # hang-upload: it sent half a message and stopped
        self.clock_stepped = False  # clock-jump: its wall clock has jumped
        self.undo_clock: Optional[Callable[[], None]] = None
        self._verdicts: OrderedDict[CommandKey, bool] = OrderedDict()  # every-other
        self._new_commands = 0

    def answers(self, kind: str, round_: int = 0) -> bool:
        """Whether it answers a command of `kind` in round `round_` at all: `silent` (from
        its round on) only its setup, a hung `hang-upload` nothing."""
        if self.hung:
            return False
        return self.kind != "silent" or round_ < self.start or kind in SETUP_KINDS

    def takes(self, kind: str, key: CommandKey, round_: int) -> bool:
        """Whether it runs and answers this command (`key` is its (run, id), the same for a
        retransmission); what the command does to the fault itself happens here: the clock
        jump at its round, every-other's count."""
        if not self.answers(kind, round_):
            return False
        if self.kind == "clock-jump" and round_ >= self.start and not self.clock_stepped:
            self.clock_stepped = True
            self.undo_clock = step_wall_clock(self.value)
        if self.kind != "every-other" or round_ < self.start or kind in SETUP_KINDS:
            return True
        verdict = self._verdicts.get(key)
        if verdict is None:  # a new command: it answers the 1st, 3rd, 5th …
            verdict = self._new_commands % 2 == 0
            self._new_commands += 1
            self._verdicts[key] = verdict
            while len(self._verdicts) > MAX_REMEMBERED:
                self._verdicts.popitem(last=False)
        return verdict

    def chunk_bytes(self, round_: int) -> Optional[int]:
        """The chunk size its reply goes out in (None: the endpoint's own): `hang-upload`
        cuts its replies small from its round on, so the one it hangs in is chunked."""
        if self.kind == "hang-upload" and round_ >= self.start and not self.hung:
            return HANG_CHUNK_BYTES
        return None

    def published(self, parts: List[bytes], round_: int) -> List[bytes]:
        """The chunks it actually publishes of a reply: `hang-upload` from its
        round on sends the first half of a reply of two or more chunks, then hangs."""
        if self.kind != "hang-upload" or round_ < self.start or len(parts) < 2:
            return parts
        self.hung = True
        return parts[:len(parts) // 2]

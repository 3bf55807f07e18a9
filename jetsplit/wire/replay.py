"""Sequence numbers and the replay window for signed messages.

A sender starts its sequence at the wall clock in microseconds, so a restarted agent keeps
counting upwards and its peers' replay windows accept it without coordination.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict, deque

from jetsplit.wire.errors import ReplayedMessage, StalePresence


class SequenceCounter:
    """Monotonic per-sender sequence numbers that survive a restart."""

    def __init__(self, start: int | None = None) -> None:
        self._counter = itertools.count(start if start is not None else time.time_ns() // 1000)

    def next(self) -> int:
        return next(self._counter)

    def reserve(self, count: int) -> int:
        """The first of `count` consecutive numbers (for the chunks of one message)."""
        first = next(self._counter)
        for _ in range(count - 1):
            next(self._counter)
        return first


class ReplayGuard:
    """Rejects a signed message whose (sender, seq) was already accepted, whose seq is older
    than the window, or whose timestamp is further than `max_skew_s` from now.

    `floors` carries what a previous run of this process accepted (sender → its highest
    seq, persisted by `transport.replay_state`): a message at or below it is refused, so
    a command captured before a restart cannot be replayed after it within the skew."""

    def __init__(self, window: int = 4096, max_skew_s: float = 300.0, max_senders: int = 4096,
                 floors: dict[str, int] | None = None):
        self.window, self.max_skew_s, self.max_senders = window, max_skew_s, max_senders
        self._seen: dict[str, tuple[set[int], deque[int]]] = {}
        self._highest: dict[str, int] = {}
        self._floors = dict(floors or {})

    def check(self, sender: str, seq: int, ts: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not (isinstance(ts, (int, float)) and math.isfinite(ts)):
            raise ReplayedMessage(f"{sender} seq {seq}: timestamp {ts!r} is not a finite number")
        if abs(now - ts) > self.max_skew_s:
            raise ReplayedMessage(f"{sender} seq {seq}: timestamp {now - ts:+.0f}s off now")
        if seq <= self._floors.get(sender, -1):
            raise ReplayedMessage(f"{sender} seq {seq}: not newer than what was accepted "
                                  "before this process restarted")
        seen, order = self._seen.get(sender, (set(), deque()))
        highest = self._highest.get(sender, -1)
        if seq in seen or seq <= highest - self.window:
            raise ReplayedMessage(f"{sender} seq {seq}: already seen or older than the window")
        if sender not in self._seen and len(self._seen) >= self.max_senders:
            oldest = next(iter(self._seen))
            del self._seen[oldest], self._highest[oldest]
        seen.add(seq)
        order.append(seq)
        while len(order) > self.window:
            seen.discard(order.popleft())
        self._seen[sender] = (seen, order)
        self._highest[sender] = max(highest, seq)


class PresenceGuard:
    """Retained presence is redelivered by design, so it gets its own check: a finite
    timestamp, not ahead of now by more than `max_skew_s`, no older than `max_age_s`, and
    never older than the newest presence of the same state already accepted from that
    sender. The last will (`offline`) is built when the agent connects and published by
    the broker when it dies, possibly days later and after newer `online` messages: it is
    ordered among offline messages only and may be as old as `will_max_age_s`."""

    def __init__(self, max_age_s: float = 24 * 3600.0, max_skew_s: float = 300.0,
                 will_max_age_s: float = 30 * 24 * 3600.0, max_senders: int = 4096) -> None:
        self.max_age_s, self.max_skew_s, self.max_senders = max_age_s, max_skew_s, max_senders
        self.will_max_age_s = will_max_age_s
        self._newest: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()

    def check(self, sender: str, seq: int, ts: float, state: str = "online",
              now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not (isinstance(ts, (int, float)) and math.isfinite(ts)):
            raise StalePresence(f"{sender} presence: timestamp {ts!r} is not a finite number")
        max_age = self.will_max_age_s if state == "offline" else self.max_age_s
        if ts > now + self.max_skew_s or now - ts > max_age:
            raise StalePresence(f"{sender} presence ({state}): timestamp {now - ts:+.0f}s "
                                "off now")
        key = (sender, state)
        newest = self._newest.get(key)
        if newest is not None and (ts, seq) < newest:
            raise StalePresence(f"{sender} presence ({state}): older than the last one "
                                "accepted")
        if newest is None and len(self._newest) >= self.max_senders:
            self._newest.popitem(last=False)
        self._newest[key] = (ts, seq)

"""Bytes on the wire per agent, per message kind and direction (thread-safe)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Literal

Direction = Literal["up", "down"]


class ByteCounters:
    """`up` is agent→coordinator, `down` coordinator→agent; chunk envelopes included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self._messages: dict[tuple[str, str, str], int] = defaultdict(int)
        # Sums over agents, kept as bytes are added: a round's books cost O(kinds), not
        # O(agents ever seen) (a large fleet registers hundreds that a round never touches).
        self._kinds: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, agent: str, kind: str, direction: Direction, nbytes: int) -> None:
        with self._lock:
            self._bytes[(agent, kind, direction)] += nbytes
            self._messages[(agent, kind, direction)] += 1
            self._kinds[(kind, direction)] += nbytes

    def total(self, direction: Direction | None = None, *, agent: str | None = None,
              kind: str | None = None) -> int:
        with self._lock:
            if agent is None:
                return sum(n for (k, d), n in self._kinds.items()
                           if (direction is None or d == direction)
                           and (kind is None or k == kind))
            return sum(n for (a, k, d), n in self._bytes.items()
                       if (direction is None or d == direction)
                       and (agent is None or a == agent) and (kind is None or k == kind))

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{agent: {"up": {kind: bytes}, "down": {kind: bytes}}}``, JSON-safe and sorted."""
        with self._lock:
            items = sorted(self._bytes.items())
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (agent, kind, direction), n in items:
            out.setdefault(agent, {"up": {}, "down": {}})[direction][kind] = n
        return out

    def load(self, snapshot: dict[str, dict[str, dict[str, int]]]) -> None:
        """Add a `snapshot()`'s bytes (a resumed run continues its books)."""
        with self._lock:
            for agent, directions in snapshot.items():
                for direction in ("up", "down"):
                    for kind, n in directions.get(direction, {}).items():
                        self._bytes[(str(agent), str(kind), direction)] += int(n)
                        self._kinds[(str(kind), direction)] += int(n)

    def by_kind(self) -> dict[str, dict[str, int]]:
        """``{"up": {kind: bytes}, "down": {kind: bytes}}`` summed over agents."""
        out: dict[str, dict[str, int]] = {"up": {}, "down": {}}
        with self._lock:
            for (kind, direction), n in self._kinds.items():
                out[direction][kind] = n
        return out

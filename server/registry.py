"""The coordinator's view of the fleet: who is online, busy or gone, and what each has."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

State = Literal["online", "offline", "busy"]


@dataclass
class AgentRecord:
    """One agent as last seen; `stragglers` counts steps it missed (deadline or offline)."""

    agent: str
    state: State = "online"
    last_seen: float = field(default_factory=time.time)
    registration: dict[str, Any] = field(default_factory=dict)
    stragglers: int = 0
    errors: int = 0
    offline_events: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"agent": self.agent, "state": self.state, "last_seen": self.last_seen,
                "stragglers": self.stragglers, "errors": self.errors,
                "offline_events": self.offline_events,
                "role": self.registration.get("role"),
                "dataset_size": (self.registration.get("dataset") or {}).get("size")}


@dataclass(frozen=True)
class MissedStep:
    """An agent dropped from one step, and why (`deadline`, `offline` or `error: …`)."""

    agent: str
    round: int
    step: int
    kind: str
    reason: str


class FleetRegistry:
    """Thread-safe: the MQTT engine's receive thread updates it while rounds read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, AgentRecord] = {}
        self.missed: list[MissedStep] = []
        self.changed = threading.Condition(self._lock)

    def _record(self, agent: str) -> AgentRecord:
        record = self._agents.get(agent)
        if record is None:
            record = self._agents[agent] = AgentRecord(agent)
        return record

    def register(self, agent: str, registration: dict[str, Any]) -> None:
        with self._lock:
            record = self._record(agent)
            record.registration = registration
            record.state, record.last_seen = "online", time.time()
            self.changed.notify_all()

    def seen(self, agent: str) -> None:
        with self._lock:
            if agent in self._agents:
                self._agents[agent].last_seen = time.time()

    def set_state(self, agent: str, state: State) -> None:
        with self._lock:
            record = self._record(agent)
            if state == "offline" and record.state != "offline":
                record.offline_events += 1
            record.state = state
            if state != "offline":
                record.last_seen = time.time()
            self.changed.notify_all()

    def record_missed(self, miss: MissedStep) -> None:
        with self._lock:
            record = self._record(miss.agent)
            if miss.reason.startswith("error"):
                record.errors += 1
            else:
                record.stragglers += 1
            self.missed.append(miss)

    def state(self, agent: str) -> State | None:
        with self._lock:
            record = self._agents.get(agent)
            return None if record is None else record.state

    def registered(self) -> list[str]:
        """Agents that sent a registration, online or not, sorted by id."""
        with self._lock:
            return sorted(a for a, r in self._agents.items() if r.registration)

    def _online_locked(self) -> list[str]:
        return sorted(a for a, r in self._agents.items()
                      if r.registration and r.state != "offline")

    def online(self) -> list[str]:
        """Registered agents not known to be offline, sorted by id (the selection pool)."""
        with self._lock:
            return self._online_locked()

    def eligible(self, *, role: str = "client", zoo_version: int | None = None) -> list[str]:
        """Online agents of `role` whose model zoo matches ours (else their blocks would not
        load the bundle), sorted by id."""
        with self._lock:
            return sorted(
                a for a, r in self._agents.items()
                if r.registration and r.state != "offline"
                and r.registration.get("role") == role
                and (zoo_version is None or r.registration.get("zoo_version") == zoo_version))

    def registration(self, agent: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._agents[agent].registration)

    def note_bundle(self, agent: str, sha256: str) -> None:
        """The agent acknowledged installing this bundle (until it registers again)."""
        with self._lock:
            if agent in self._agents:
                self._agents[agent].registration["bundle"] = sha256

    def wait_for(self, count: int, timeout_s: float) -> list[str]:
        """Block until `count` agents are online (or the timeout); returns who is."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                online = self._online_locked()
                remaining = deadline - time.monotonic()
                if len(online) >= count or remaining <= 0:
                    return online
                self.changed.wait(min(remaining, 0.5))

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._agents[a].as_dict() for a in sorted(self._agents)]

"""The coordinator's view of the fleet: who is online, busy or gone, and what each has.

Scale rules: every per-agent update is O(1), and what a step asks (is this agent live, does
this set cover everyone online, how many are online) costs O(selected), never O(fleet). The
sorted pools a round draws from are cached and rebuilt only when membership changes (an
agent registers, goes offline or returns), so a presence storm costs one rebuild, not one
per step. An idle agent costs its record and its registration (bounded by the wire header
limit, 64 KiB; a typical one is ~2 KB: see benchmarks/bench_scale.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from jetsplit.server.defences.size_claims import registered_size

State = Literal["online", "offline", "busy"]


@dataclass(slots=True)
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

    @property
    def available(self) -> bool:
        """In the selection pool: registered and not known to be offline."""
        return bool(self.registration) and self.state != "offline"


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
        self._online: set[str] = set()  # registered and not offline (busy included)
        self._generation = 0  # bumped whenever `_online` or a registration changes
        self._pools: dict[tuple[Any, ...], tuple[int, tuple[str, ...]]] = {}
        self._claims: tuple[int, dict[str, int]] = (-1, {})
        self.missed: list[MissedStep] = []
        self.changed = threading.Condition(self._lock)

    def _record(self, agent: str) -> AgentRecord:
        record = self._agents.get(agent)
        if record is None:
            record = self._agents[agent] = AgentRecord(agent)
        return record

    def _reindex(self, record: AgentRecord) -> None:
        """Keep `_online` in step with one record (O(1)); invalidate cached pools."""
        if record.available:
            if record.agent not in self._online:
                self._online.add(record.agent)
                self._generation += 1
        elif record.agent in self._online:
            self._online.discard(record.agent)
            self._generation += 1

    def register(self, agent: str, registration: dict[str, Any]) -> None:
        with self._lock:
            record = self._record(agent)
            if record.registration != registration:
                record.registration = registration
                self._generation += 1
            record.state, record.last_seen = "online", time.time()
            self._reindex(record)
            self.changed.notify_all()

    def same_registration(self, agent: str, registration: dict[str, Any]) -> bool:
        """Whether `agent` is on record with exactly this (already validated) registration:
        a reconnect storm then costs a comparison per agent, not a validation."""
        with self._lock:
            record = self._agents.get(agent)
            return record is not None and bool(record.registration) \
                and record.registration == registration

    def seen(self, agent: str) -> None:
        with self._lock:
            record = self._agents.get(agent)
            if record is not None:
                record.last_seen = time.time()

    def set_state(self, agent: str, state: State) -> None:
        with self._lock:
            record = self._record(agent)
            if state == "offline" and record.state != "offline":
                record.offline_events += 1
            was_online = record.state != "offline"
            record.state = state
            if state != "offline":
                record.last_seen = time.time()
            self._reindex(record)
            if was_online != (state != "offline"):  # busy<->online wakes nobody
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

    def states(self, agents: list[str]) -> dict[str, State | None]:
        """Many agents' states under one lock acquisition (a step's selected agents)."""
        with self._lock:
            get = self._agents.get
            return {a: (None if (r := get(a)) is None else r.state) for a in agents}

    def registered(self) -> list[str]:
        """Agents that sent a registration, online or not, sorted by id."""
        with self._lock:
            return sorted(a for a, r in self._agents.items() if r.registration)

    def _pool_locked(self, key: tuple[Any, ...]) -> tuple[str, ...]:
        """A sorted pool, cached until membership changes (then rebuilt once)."""
        cached = self._pools.get(key)
        if cached is not None and cached[0] == self._generation:
            return cached[1]
        if key[0] == "online":
            pool = tuple(sorted(self._online))
        else:
            _, role, zoo_version = key
            pool = tuple(sorted(
                a for a in self._online
                if (reg := self._agents[a].registration).get("role") == role
                and (zoo_version is None or reg.get("zoo_version") == zoo_version)))
        self._pools[key] = (self._generation, pool)
        return pool

    def client_claims(self) -> dict[str, int]:
        """Every registered client's |D_k| claim by id (0 where it made none), online or
        not: what the size cap is taken against (server/defences/size_claims.py). Cached until a
        registration or membership changes, so a step costs no walk over the fleet (the
        same dict each time: read it, do not change it)."""
        with self._lock:
            if self._claims[0] != self._generation:
                self._claims = (self._generation, {
                    a: registered_size(r.registration) or 0 for a, r in self._agents.items()
                    if r.registration and r.registration.get("role", "client") == "client"})
            return self._claims[1]

    def online(self) -> list[str]:
        """Registered agents not known to be offline, sorted by id (the selection pool)."""
        with self._lock:
            return list(self._pool_locked(("online",)))

    def online_count(self) -> int:
        with self._lock:
            return len(self._online)

    def covers_online(self, agents: list[str]) -> bool:
        """Whether `agents` include every online agent: O(len(agents)), as a broadcast on
        `down/all` is only worth it then."""
        with self._lock:
            return len(agents) >= len(self._online) and self._online.issubset(agents)

    def eligible(self, *, role: str = "client", zoo_version: int | None = None) -> list[str]:
        """Online agents of `role` whose model zoo matches ours (else their blocks would not
        load the bundle), sorted by id."""
        with self._lock:
            return list(self._pool_locked(("eligible", role, zoo_version)))

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
                remaining = deadline - time.monotonic()
                if len(self._online) >= count or remaining <= 0:
                    return list(self._pool_locked(("online",)))
                self.changed.wait(min(remaining, 0.5))

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._agents[a].as_dict() for a in sorted(self._agents)]

"""Per-round books of every agent: where its time went (compute / transfer / waiting), its
telemetry (memory, CPU, temperature), its power mode and the live estimates of its speed
and links (server/fleet/live_estimates.py), from one `status` poll after each round (not
of agents sitting out, benched or awaiting a probe's answer: a silent one would cost the
poll's whole deadline every round).

Agents keep cumulative books (`edge_agent.emulation.DeviceClock`); the coordinator takes
differences per round, so a missed poll only merges two rounds. Replies are untrusted:
numbers are range-checked and anything else is left out.
"""

from __future__ import annotations

from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite
from jetsplit.server.engines.seam import Command, Engine
from jetsplit.server.fleet.live_estimates import LiveEstimates

STATUS_DEADLINE_S = 15.0


class FleetBooks:
    """`collect(row)` is run_training's `row_extras`: it adds `agents` to each metrics row."""

    def __init__(self, engine: Engine, deadline_s: float = STATUS_DEADLINE_S) -> None:
        self.engine, self.deadline_s = engine, deadline_s
        self.last: dict[str, dict[str, float]] = {}
        self.walls: dict[str, float] = {}
        self.links: dict[str, dict[str, float]] = {}  # cumulative per-direction books
        self.telemetry: dict[str, dict[str, Any]] = {}
        self.estimates = LiveEstimates()

    def collect(self, row: dict[str, Any]) -> dict[str, Any]:
        registry = self.engine.registry
        sitting: set[str] = set()  # silent ones answer the round-start probe instead
        for key in ("benched", "awaiting_probe"):
            listed = row.get(key)
            if isinstance(listed, list):
                sitting.update(a for a in listed if isinstance(a, str))
        online = [a for a in registry.online() if a not in sitting]
        out = self.engine.broadcast(Command("status"), online, round=int(row["round"]),
                                    deadline_s=self.deadline_s) if online else None
        agents: dict[str, dict[str, Any]] = {}
        for agent in registry.registered():
            info: dict[str, Any] = {"state": registry.state(agent) or "unknown"}
            profile = (registry.registration(agent).get("profile") or {})
            name = (profile.get("device") or {}).get("name") if isinstance(profile, dict) else None
            if isinstance(name, str):
                info["profile"] = name[:64]
            reply = out.replies.get(agent) if out is not None else None
            if reply is not None:
                books = reply.meta.get("time")
                info.update(self._books(agent, books))
                info.update(self._memory(agent, reply.meta.get("telemetry")))
                info["power_mode"] = power_mode(books, reply.meta.get("telemetry"))
                skipped = images_skipped(reply.meta.get("data"))
                if skipped is not None:
                    info["images_skipped"] = skipped
                emulated = emulated_conditions(books)
                if emulated:
                    info["emulated"] = emulated
                delta = {**self._links(agent, books), "compute_s": info.get("compute_s")}
                gflops = (row.get("device_gflops") or {}).get(agent)
                info["estimate"] = self.estimates.measure(agent, gflops, delta)
            agents[agent] = info
        return {"agents": agents}

    def _links(self, agent: str, books: Any) -> dict[str, float]:
        """This round's growth of the per-direction transfer books (seconds and bytes)."""
        if not isinstance(books, dict):
            return {}
        keys = ("transfer_up_s", "transfer_down_s", "bytes_up", "bytes_down")
        now = {k: finite(books.get(k), 0.0, 1e15) for k in keys}
        before = self.links.get(agent, {})
        self.links[agent] = {k: v for k, v in now.items() if v is not None}
        return {k: max(0.0, v - before.get(k, 0.0)) for k, v in now.items() if v is not None}

    def _books(self, agent: str, books: Any) -> dict[str, float]:
        if not isinstance(books, dict):
            return {}
        now = {k: finite(books.get(k), 0.0, 1e12) for k in ("compute_s", "transfer_s", "uptime_s")}
        if any(v is None for v in now.values()):
            return {}
        before = self.last.get(agent, {"compute_s": 0.0, "transfer_s": 0.0, "uptime_s": 0.0})
        self.last[agent] = now  # type: ignore[assignment]
        delta = {k: max(0.0, now[k] - before[k]) for k in now}  # type: ignore[operator]
        wait = max(0.0, delta["uptime_s"] - delta["compute_s"] - delta["transfer_s"])
        out = {"compute_s": round(delta["compute_s"], 4),
               "transfer_s": round(delta["transfer_s"], 4), "wait_s": round(wait, 4)}
        wall = finite(books.get("compute_wall_s"), 0.0, 1e12)
        if wall is not None:  # emulation fidelity: what the compute really took here
            out["compute_wall_s"] = round(max(0.0, wall - self.walls.get(agent, 0.0)), 4)
            self.walls[agent] = wall
        return out

    def _memory(self, agent: str, telemetry: Any) -> dict[str, Any]:
        if not isinstance(telemetry, dict):
            return {}
        self.telemetry[agent] = telemetry
        out = {"rss_mb": finite(telemetry.get("rss_mb"), 0.0, 1e12),
               "available_mb": finite(telemetry.get("mem_available_mb"), 0.0, 1e12),
               "cpu_percent": finite(telemetry.get("cpu_process_pct"), 0, 1e5),
               "temperature_c": finite(telemetry.get("temp_c"), -100, 200)}
        return {k: v for k, v in out.items() if v is not None}


def images_skipped(data: Any) -> int | None:
    """How many of its images the agent has skipped as undecodable so far (its status'
    `data` report; cumulative), range-checked."""
    count = finite(data.get("skipped"), 0, 1e12) if isinstance(data, dict) else None
    return None if count is None else int(count)


def power_mode(books: Any, telemetry: Any) -> str:
    """The device's power mode: an emulated trace's label, else what `nvpmodel -q` said on
    the device, else `unknown` (not a Jetson, or no nvpmodel)."""
    mode = books.get("power_mode") if isinstance(books, dict) else None
    if not isinstance(mode, str) and isinstance(telemetry, dict):
        gpu = telemetry.get("gpu")
        mode = gpu.get("power_mode") if isinstance(gpu, dict) else None
    return mode[:32] if isinstance(mode, str) and mode else "unknown"


def emulated_conditions(books: Any) -> dict[str, float]:
    """An emulated device's stated conditions now (its speed as a fraction of its profile's,
    its link rates; `edge_agent.emulation.DeviceClock.emulated`), in the ranges a trace may
    set (`edge_agent.traces.LIMITS`: over 0, at most the limit); empty for a real device,
    and any value out of range is dropped."""
    from jetsplit.edge_agent.traces import LIMITS

    stated = books.get("emulated") if isinstance(books, dict) else None
    if not isinstance(stated, dict):
        return {}
    out = {k: finite(stated.get(k), 0.0, high) for k, high in LIMITS.items()}
    return {k: float(v) for k, v in out.items() if v is not None and v > 0}

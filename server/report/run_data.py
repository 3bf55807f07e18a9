"""A run folder read back for the report: metrics rows, summary, plan and configs, and
per-agent totals over the rows. Everything here is untrusted and optional: a field an
older run or another device lacks is skipped, a half-written last line is counted."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

Row = dict[str, Any]
MB = 1e6
NO_AGENT_BOOKS = "the metrics rows carry no per-agent `agents` field"


# ---------------------------------------------------------------------- loading


@dataclass
class RunData:
    """What a run folder holds, read once and leniently."""

    run_dir: Path
    rows: list[Row]
    summary: dict[str, Any]
    plan: Any
    configs: list[tuple[str, str, str]]  # (file name, fence language, text)
    skipped_lines: int = 0


def load_run(run_dir: Path) -> RunData:
    """Read DIR; a missing folder or metrics file is the user's error (exit 2)."""
    from jetsplit.errors import ConfigError

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (is it a run folder?)")
    rows, skipped = _read_jsonl(metrics)
    summary = _read_json(run_dir / "summary.json")
    return RunData(run_dir, rows, summary if isinstance(summary, dict) else {},
                   _read_json(run_dir / "plan.json"), _read_configs(run_dir), skipped)


def _read_jsonl(path: Path) -> tuple[list[Row], int]:
    """Rows as dicts; undecodable lines (a running trial's half-written last line) are
    counted, not fatal."""
    rows: list[Row] = []
    skipped = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError:
        return None


def _read_configs(run_dir: Path) -> list[tuple[str, str, str]]:
    configs = []
    toml = run_dir / "config.toml"
    if toml.is_file():
        configs.append((toml.name, "toml", toml.read_text(errors="replace").rstrip()))
    trial = _read_json(run_dir / "trial.json")
    if trial is not None:
        configs.append(("trial.json", "json", json.dumps(trial, indent=2)))
    return configs


# ---------------------------------------------------------------------- numbers


def _add(total: float | None, value: Any) -> float | None:
    v = finite(value)
    return total if v is None else (v if total is None else total + v)


def _max(best: float | None, value: Any) -> float | None:
    v = finite(value)
    return best if v is None else (v if best is None else max(best, v))


def _min(best: float | None, value: Any) -> float | None:
    v = finite(value)
    return best if v is None else (v if best is None else min(best, v))


def as_dict(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def round_no(row: Row, index: int) -> int:
    """Rounds are shown from 1, like the coordinator's log ('round 1/R')."""
    r = row.get("round")
    return int(r) + 1 if isinstance(r, int) and not isinstance(r, bool) else index + 1


def natural_key(name: str) -> list[Any]:
    """Sort key so a2 comes before a10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def kind_bytes(value: Any) -> dict[str, dict[str, float]]:
    """{"up": {kind: bytes}, "down": {...}} with non-numbers dropped."""
    books = as_dict(value)
    return {d: {k: v for k, v in ((str(k), finite(b)) for k, b in as_dict(books.get(d)).items())
                if v is not None} for d in ("up", "down")}


# ---------------------------------------------------------------------- per-agent books


@dataclass
class AgentTotals:
    """One agent over the whole run: times summed, memory extremes, last known state."""

    agent: str
    profile: str | None = None
    state: str | None = None
    selected: int = 0
    missed: int = 0
    compute_s: float | None = None
    transfer_s: float | None = None
    wait_s: float | None = None
    peak_rss_mb: float | None = None
    min_available_mb: float | None = None
    cpu_percent: list[float] = field(default_factory=list)
    max_temperature_c: float | None = None
    gflops: float | None = None
    cut: int | None = None  # the last layer its device trains (per-device cuts)
    power_mode: str | None = None  # the last reported (trace label or nvpmodel)
    estimate: dict[str, float] = field(default_factory=dict)  # the last live estimates
    images_skipped: int | None = None  # undecodable images so far (the last status)
    compute_rounds: int = 0  # rounds that reported compute_s (for per-round means)
    benched: int = 0  # rounds it sat out (missed deadlines, silent at a probe, or awaiting one)
    probes: int = 0  # round-start proof-of-life probes it was sent
    probes_answered: int = 0
    transfer_rounds: int = 0

    def add_round(self, info: dict[str, Any]) -> None:
        if isinstance(info.get("profile"), str):
            self.profile = info["profile"]
        if isinstance(info.get("cut"), int) and not isinstance(info.get("cut"), bool):
            self.cut = info["cut"]
        if isinstance(info.get("state"), str):
            self.state = info["state"]
        if isinstance(info.get("power_mode"), str):
            self.power_mode = info["power_mode"][:32]
        skipped = finite(info.get("images_skipped"), 0.0, 1e12)
        if skipped is not None:
            self.images_skipped = int(skipped)
        estimate = info.get("estimate")
        for key, value in (estimate.items() if isinstance(estimate, dict) else ()):
            number = finite(value, 0.0, 1e12)
            if number is not None and key in ("gflops", "uplink_mbps", "downlink_mbps"):
                self.estimate[key] = number
        self.compute_rounds += finite(info.get("compute_s")) is not None
        self.transfer_rounds += finite(info.get("transfer_s")) is not None
        self.compute_s = _add(self.compute_s, info.get("compute_s"))
        self.transfer_s = _add(self.transfer_s, info.get("transfer_s"))
        self.wait_s = _add(self.wait_s, info.get("wait_s"))
        self.peak_rss_mb = _max(self.peak_rss_mb, info.get("rss_mb"))
        self.min_available_mb = _min(self.min_available_mb, info.get("available_mb"))
        cpu = finite(info.get("cpu_percent"))
        if cpu is not None:
            self.cpu_percent.append(cpu)
        self.max_temperature_c = _max(self.max_temperature_c, info.get("temperature_c"))

    @property
    def label(self) -> str:
        return f"{self.agent} ({self.profile})" if self.profile else self.agent

    @property
    def has_times(self) -> bool:
        return any(v is not None for v in (self.compute_s, self.transfer_s, self.wait_s))

    @property
    def has_memory(self) -> bool:
        return self.peak_rss_mb is not None or self.min_available_mb is not None


def agent_totals(rows: Sequence[Row]) -> dict[str, AgentTotals]:
    """Everything known per agent, from the `agents`, `selected`, `missed`, `benched`,
    `probes` and `device_gflops` fields of every row, naturally sorted by agent id."""
    totals: dict[str, AgentTotals] = {}

    def get(agent: Any) -> AgentTotals:
        return totals.setdefault(str(agent), AgentTotals(str(agent)))

    for row in rows:
        for agent, info in as_dict(row.get("agents")).items():
            if isinstance(info, dict):
                get(agent).add_round(info)
        selected = row.get("selected")
        for agent in selected if isinstance(selected, list) else []:
            get(agent).selected += 1
        for agent in as_dict(row.get("missed")):
            get(agent).missed += 1
        sat_out: set[str] = set()  # benched, or out for silence with a probe pending
        for key in ("benched", "awaiting_probe"):
            listed = row.get(key)
            sat_out.update(str(a) for a in (listed if isinstance(listed, list) else []))
        for agent in sorted(sat_out):
            get(agent).benched += 1
        for agent, answer in as_dict(row.get("probes")).items():
            get(agent).probes += 1
            get(agent).probes_answered += isinstance(answer, str) and answer.startswith("answered")
        for agent, value in as_dict(row.get("device_gflops")).items():
            get(agent).gflops = _add(get(agent).gflops, value)
        for agent, cut in as_dict(row.get("cuts")).items():
            if isinstance(cut, int):
                get(agent).cut = cut
    return {a: totals[a] for a in sorted(totals, key=natural_key)}



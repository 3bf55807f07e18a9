"""`jetsplit report DIR`: one Markdown page with plots for a finished (or running) run.

A trial or simulation leaves `metrics.jsonl` (one row per round), `summary.json` and maybe
`plan.json` and its config in DIR; this turns them into `DIR/report.md` and PNG plots next to
it, so a run can be read in any Markdown viewer (relative image links) or attached to an
issue. Every field is optional: agents on other hardware report less, older runs lack the
per-agent books, and a running trial's last line may be half written. A plot whose data is
absent is skipped with the reason in the report; nothing here raises on missing fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from jetsplit.server.defences.untrusted_numbers import finite
from jetsplit.server.report.defences import defences_section, plot_influence
from jetsplit.server.report.replan import plot_cuts, replan_section

Row = dict[str, Any]
MB = 1e6
PNG_DPI = 110
NO_AGENT_BOOKS = "the metrics rows carry no per-agent `agents` field"
PlotFn = Callable[["RunData", Path, Any], str | None]


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


def _dict(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _round_no(row: Row, index: int) -> int:
    """Rounds are shown from 1, like the coordinator's log ('round 1/R')."""
    r = row.get("round")
    return int(r) + 1 if isinstance(r, int) and not isinstance(r, bool) else index + 1


def _natural(name: str) -> list[Any]:
    """Sort key so a2 comes before a10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _kind_bytes(value: Any) -> dict[str, dict[str, float]]:
    """{"up": {kind: bytes}, "down": {...}} with non-numbers dropped."""
    books = _dict(value)
    return {d: {k: v for k, v in ((str(k), finite(b)) for k, b in _dict(books.get(d)).items())
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
    compute_rounds: int = 0  # rounds that reported compute_s (for per-round means)
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
    """Everything known per agent, from the `agents`, `selected`, `missed` and
    `device_gflops` fields of every row, naturally sorted by agent id."""
    totals: dict[str, AgentTotals] = {}

    def get(agent: Any) -> AgentTotals:
        return totals.setdefault(str(agent), AgentTotals(str(agent)))

    for row in rows:
        for agent, info in _dict(row.get("agents")).items():
            if isinstance(info, dict):
                get(agent).add_round(info)
        selected = row.get("selected")
        for agent in selected if isinstance(selected, list) else []:
            get(agent).selected += 1
        for agent in _dict(row.get("missed")):
            get(agent).missed += 1
        for agent, value in _dict(row.get("device_gflops")).items():
            get(agent).gflops = _add(get(agent).gflops, value)
        for agent, cut in _dict(row.get("cuts")).items():
            if isinstance(cut, int):
                get(agent).cut = cut
    return {a: totals[a] for a in sorted(totals, key=_natural)}


# ---------------------------------------------------------------------- formatting


def _fmt(value: Any, spec: str = "") -> str:
    """A table cell: '—' for unknown, numbers with `spec`, text with pipes escaped."""
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return "—"
    if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _pct(value: Any) -> str:
    v = finite(value)
    return "—" if v is None else f"{100 * v:.2f}"


def _mb(value: Any) -> str:
    v = finite(value)
    return "—" if v is None else f"{v / MB:.2f}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def _cell(value: Any) -> str:
    """Any JSON value as a short cell (plan tables)."""
    if isinstance(value, float):
        return _fmt(value, ",.0f" if abs(value) >= 1000 else ".4g")
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return _fmt(", ".join(_cell(v) for v in value))
    if isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"))
        return _fmt(text if len(text) <= 60 else text[:57] + "...")
    return _fmt(value)


# ---------------------------------------------------------------------- plots


def _figure_class() -> Any:
    """matplotlib's Figure, used without pyplot: no global backend switch, no shared state
    with other users of matplotlib in this process. None when matplotlib is absent."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def _save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight", format="png")


def _rounds_axis(rows: Sequence[Row]) -> list[int]:
    return [_round_no(r, i) for i, r in enumerate(rows)]


def plot_accuracy(run: RunData, path: Path, figure: Any) -> str | None:
    """Top-1 and balanced accuracy per round, ± the spread across clients when reported."""
    rows = run.rows
    acc = [finite(r.get("accuracy")) for r in rows]
    bal = [finite(r.get("balanced_accuracy")) for r in rows]
    if all(v is None for v in acc + bal):
        return "no round reports an accuracy"
    x = _rounds_axis(rows)
    nan = math.nan
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    top = [nan if v is None else 100 * v for v in acc]
    ax.plot(x, top, marker="o", label="top-1")
    ax.plot(x, [nan if v is None else 100 * v for v in bal], marker="s", label="balanced")
    std = [finite(r.get("accuracy_std")) for r in rows]
    if any(s is not None for s in std):
        lo = [nan if s is None else t - 100 * s for t, s in zip(top, std, strict=True)]
        hi = [nan if s is None else t + 100 * s for t, s in zip(top, std, strict=True)]
        ax.fill_between(x, lo, hi, alpha=0.2, label="top-1 ± std across clients")
    ax.set(xlabel="round", ylabel="test accuracy (%)", ylim=(0, 100), title="Accuracy")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    _save(fig, path)
    return None


def _byte_segments(rows: Sequence[Row]) -> dict[str, list[float]]:
    """Per-round MB for each 'direction: kind' (training), plus evaluation traffic; falls
    back to plain up/down totals when rows lack the per-kind books."""
    books = [_kind_bytes(r.get("bytes_by_kind")) for r in rows]
    evals = [_kind_bytes(r.get("eval_bytes")) for r in rows]
    segments: dict[str, list[float]] = {}
    for d in ("up", "down"):
        for kind in sorted({k for b in books for k in b[d]}):
            segments[f"{d}: {kind}"] = [b[d].get(kind, 0.0) / MB for b in books]
        if not any(b[d] for b in books):
            values = [finite(r.get(f"bytes_{d}")) or 0.0 for r in rows]
            segments[f"{d}: all kinds"] = [v / MB for v in values]
        eval_mb = [sum(e[d].values()) / MB for e in evals]
        if any(eval_mb):
            segments[f"{d}: evaluation"] = eval_mb
    bundle = [(finite(r.get("bundle_bytes")) or 0.0) / MB for r in rows]
    if any(bundle):
        segments["down: bundle (setup)"] = bundle
    segments = {k: v for k, v in segments.items() if any(v)}
    grand = sum(sum(v) for v in segments.values()) or 1.0
    small = [k for k, v in segments.items() if sum(v) / grand < 0.01]
    if len(small) > 1:  # fold what would be invisible into one visible entry
        parts = [segments.pop(k) for k in small]
        folded = [sum(p[i] for p in parts) for i in range(len(rows))]
        segments["other kinds (< 1% each)"] = folded
    return segments


def _stacked_bars(figure: Any, x: list[int], segments: dict[str, list[float]], *,
                  title: str, ylabel: str) -> Any:
    from matplotlib import colormaps

    fig = figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    colours = colormaps["tab20"]
    bottom = [0.0] * len(x)
    for i, (label, values) in enumerate(segments.items()):
        ax.bar(x, values, bottom=bottom, label=label, color=colours(i % 20))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="round", ylabel=ylabel, title=title)
    ax.set_xticks(x)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def plot_bytes(run: RunData, path: Path, figure: Any) -> str | None:
    """Traffic per round by message kind, both directions stacked, the bundle (a one-off
    setup cost, often most of the bytes) included as its own segment."""
    segments = _byte_segments(run.rows)
    if not segments:
        return "no round reports any bytes"
    fig = _stacked_bars(figure, _rounds_axis(run.rows), segments,
                        title="Traffic per round by kind (bundle included)", ylabel="MB")
    _save(fig, path)
    return None


def plot_tier_bytes(run: RunData, path: Path, figure: Any) -> str | None:
    """Three-tier methods: bytes per round on each tier's link."""
    tiers = [{k: finite(v) or 0.0 for k, v in _dict(r.get("tier_bytes")).items()}
             for r in run.rows]
    names = sorted({k for t in tiers for k in t}, key=_natural)
    if not names:
        return "no round reports `tier_bytes` (not a three-tier method)"
    segments = {n: [t.get(n, 0.0) / MB for t in tiers] for n in names}
    fig = _stacked_bars(figure, _rounds_axis(run.rows), segments,
                        title="Traffic per round by tier", ylabel="MB")
    _save(fig, path)
    return None


def _agent_height(count: int) -> float:
    return max(2.5, 0.45 * count + 1.5)


def plot_agent_time(run: RunData, path: Path, figure: Any) -> str | None:
    """Where each agent's time went, summed over rounds: compute, transfer, waiting."""
    agents = [a for a in agent_totals(run.rows).values() if a.has_times]
    if not agents:
        return NO_AGENT_BOOKS + " with compute/transfer/wait times"
    fig = figure(figsize=(8, _agent_height(len(agents))))
    ax = fig.add_subplot()
    y = list(range(len(agents)))
    left = [0.0] * len(agents)
    for name, attr in (("compute", "compute_s"), ("transfer", "transfer_s"),
                       ("waiting", "wait_s")):
        values = [getattr(a, attr) or 0.0 for a in agents]
        ax.barh(y, values, left=left, label=name)
        left = [lo + v for lo, v in zip(left, values, strict=True)]
    ax.set_yticks(y, [a.label for a in agents])
    ax.invert_yaxis()
    ax.set(xlabel="seconds (sum over rounds)", title="Agent time")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _save(fig, path)
    return None


def plot_agent_memory(run: RunData, path: Path, figure: Any) -> str | None:
    """Peak resident memory of each agent in GiB against its profile's training-memory
    budget (from plan.json); the host's free memory only when the agents are not emulated
    (an emulated Nano does not have this machine's free memory)."""
    from jetsplit.server.report.views import GIB, plan_rows

    agents = [a for a in agent_totals(run.rows).values() if a.has_memory]
    if not agents:
        return NO_AGENT_BOOKS + " with memory readings"
    budgets = {r.get("profile"): finite(r.get("budget_bytes")) for r in plan_rows(run.plan)}
    emulated = isinstance(run.plan, dict) and isinstance(run.plan.get("emulation"), dict)
    mib = float(1 << 20)  # agents report memory in MiB
    fig = figure(figsize=(8, _agent_height(len(agents))))
    ax = fig.add_subplot()
    y = list(range(len(agents)))
    ax.barh(y, [(a.peak_rss_mb or 0.0) * mib / GIB for a in agents], height=0.5,
            label="peak RSS")
    budget = [budgets.get(a.profile) for a in agents]
    if any(b for b in budget):
        ax.scatter([b / GIB if b else math.nan for b in budget], y, marker="|", s=400,
                   color="tab:red", zorder=3, label="profile's memory budget")
    if not emulated and any(a.min_available_mb for a in agents):
        ax.scatter([(a.min_available_mb or math.nan) * mib / GIB for a in agents], y,
                   marker="x", color="tab:grey", label="least memory available")
    ax.set_yticks(y, [a.label for a in agents])
    ax.invert_yaxis()
    ax.set(xlabel="GiB", title="Agent memory" + (" (emulated devices)" if emulated else ""))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _save(fig, path)
    return None


def _view(draw: Callable[..., str | None]) -> PlotFn:
    """Adapt a report_views plot (rows, plan, path, figure) to the PLOTS signature."""
    return lambda run, path, figure: draw(run.rows, run.plan, path, figure)


def _views() -> dict[str, PlotFn]:
    from jetsplit.server.report import views as v

    return {"loss": _view(v.plot_loss), "cost": _view(v.plot_accuracy_vs_cost),
            "round_time": _view(v.plot_round_time)}


def plot_loss(run: RunData, path: Path, figure: Any) -> str | None:
    return _views()["loss"](run, path, figure)


def plot_accuracy_vs_cost(run: RunData, path: Path, figure: Any) -> str | None:
    return _views()["cost"](run, path, figure)


def plot_round_time(run: RunData, path: Path, figure: Any) -> str | None:
    return _views()["round_time"](run, path, figure)


PLOTS: list[tuple[str, str, PlotFn]] = [
    ("Accuracy per round", "accuracy.png", plot_accuracy),
    ("Loss per round", "loss.png", plot_loss),
    ("Accuracy against traffic and wall time", "accuracy_vs_cost.png", plot_accuracy_vs_cost),
    ("Time per round by phase", "round_time.png", plot_round_time),
    ("Traffic per round by kind", "bytes.png", plot_bytes),
    ("Traffic per round by tier", "tier_bytes.png", plot_tier_bytes),
    ("Agent time: compute, transfer, waiting", "agent_time.png", plot_agent_time),
    ("Agent memory", "agent_memory.png", plot_agent_memory),
    ("Influence of each device", "influence.png",
     lambda run, path, figure: plot_influence(run.rows, path, figure)),
    ("Cuts and round time (re-planning)", "cuts.png",
     lambda run, path, figure: plot_cuts(run.rows, path, figure)),
]


def _plots_section(run: RunData) -> list[str]:
    """Draw every plot that has data; say why each missing one is missing. Stale PNGs from
    an earlier report of the same folder are removed so links and files agree."""
    figure = _figure_class()
    lines = ["## Plots", ""]
    if figure is None:
        for _, name, _ in PLOTS:
            (run.run_dir / name).unlink(missing_ok=True)
        return [*lines, "_Plots skipped: matplotlib is not installed "
                        "(`pip install 'jetsplit[server]'`)._", ""]
    if not run.rows:
        return [*lines, "_No plots: no round has been recorded._", ""]
    for title, name, draw in PLOTS:
        path = run.run_dir / name
        reason = draw(run, path, figure)
        if reason is None:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
        else:
            path.unlink(missing_ok=True)
            # only three-tier methods have tiers; a run where no upload was averaged and
            # no device bounded has no influence to draw (its Defences section says so)
            if name not in ("tier_bytes.png", "influence.png", "cuts.png"):
                lines += [f"### {title}", "", f"_Skipped: {reason}._", ""]
    return lines


# ---------------------------------------------------------------------- text sections


def _final_accuracy(run: RunData) -> str:
    """The last round's accuracy, or the last one measured when the last round has none."""
    if not run.rows:
        return "no round recorded yet"
    last = run.rows[-1]
    acc = finite(last.get("accuracy"))
    if acc is not None:
        text = f"final accuracy {_pct(acc)}% (balanced {_pct(last.get('balanced_accuracy'))}%"
        std = finite(last.get("accuracy_std"))
        return text + (f", ± {_pct(std)} across clients)" if std is not None else ")")
    for i in range(len(run.rows) - 1, -1, -1):
        earlier = finite(run.rows[i].get("accuracy"))
        if earlier is not None:
            return (f"no accuracy in the last round (last measured: {_pct(earlier)}% in "
                    f"round {_round_no(run.rows[i], i)})")
    return "no accuracy measured"


def _total(run: RunData, key: str) -> float:
    value = finite(run.summary.get(key))
    if value is not None:
        return value
    return sum(finite(r.get(key)) or 0.0 for r in run.rows)


def _eval_total(rows: Sequence[Row]) -> float:
    return sum(sum(b[d].values()) for r in rows
               for b in [_kind_bytes(r.get("eval_bytes"))] for d in ("up", "down"))


def _agents_phrase(agents: dict[str, AgentTotals]) -> str:
    if not agents:
        return "no agents recorded"
    shown = ", ".join(a.label for a in list(agents.values())[:8])
    more = f", … ({len(agents) - 8} more)" if len(agents) > 8 else ""
    return f"{len(agents)} agent{'s' if len(agents) != 1 else ''} ({shown}{more})"


def _wall_time(run: RunData) -> str:
    seconds = finite(run.summary.get("seconds"))
    if seconds is not None:
        return f"{seconds:.1f} s"
    per_round = [s for s in (finite(r.get("seconds")) for r in run.rows) if s is not None]
    return f"{sum(per_round):.1f} s (sum of rounds so far)" if per_round else "unknown"


def summary_paragraph(run: RunData) -> str:
    """Algorithm, rounds, agents, final accuracy, traffic and wall time in one paragraph."""
    algorithm = run.summary.get("algorithm") or next(
        (r["algorithm"] for r in run.rows if isinstance(r.get("algorithm"), str)), "unknown")
    planned = run.summary.get("rounds")
    rounds = f"{len(run.rows)} round{'s' if len(run.rows) != 1 else ''}"
    if isinstance(planned, int) and planned != len(run.rows):
        rounds += f" of {planned} planned"
    text = (f"**{_fmt(algorithm)}**, {rounds}, {_agents_phrase(agent_totals(run.rows))}: "
            f"{_final_accuracy(run)}. Training traffic {_total(run, 'bytes_up') / MB:.2f} MB "
            f"up / {_total(run, 'bytes_down') / MB:.2f} MB down")
    extras = [f"{label} {value / MB:.2f} MB" for label, value in
              (("bundle", _total(run, "bundle_bytes")), ("evaluation", _eval_total(run.rows)))
              if value]
    text += f" (plus {', '.join(extras)})" if extras else ""
    text += f"; wall time {_wall_time(run)}."
    if run.skipped_lines:
        text += f" {run.skipped_lines} unreadable line(s) of metrics.jsonl were skipped."
    return text


def rounds_table(rows: Sequence[Row]) -> list[str]:
    """One line per round: who took part, loss, accuracy, traffic, time."""
    has_std = any(finite(r.get("accuracy_std")) is not None for r in rows)
    has_eval = _eval_total(rows) > 0
    headers = ["round", "selected", "missed", "train loss", "accuracy %", "balanced %"]
    headers += ["± std %"] * has_std + ["MB up", "MB down"] + ["eval MB"] * has_eval
    headers += ["bundle MB", "seconds"]
    body = []
    for i, r in enumerate(rows):
        selected = r.get("selected")
        missed = _dict(r.get("missed"))
        line = [str(_round_no(r, i)), _fmt(len(selected) if isinstance(selected, list) else None),
                _fmt(", ".join(sorted(missed, key=_natural)) or "none"),
                _fmt(finite(r.get("train_loss")), ".4f"), _pct(r.get("accuracy")),
                _pct(r.get("balanced_accuracy"))]
        line += [_pct(r.get("accuracy_std"))] * has_std
        line += [_mb(r.get("bytes_up")), _mb(r.get("bytes_down"))]
        if has_eval:
            line.append(_mb(sum(sum(b.values()) for b in
                                _kind_bytes(r.get("eval_bytes")).values())))
        line += [_mb(r.get("bundle_bytes")), _fmt(finite(r.get("seconds")), ".2f")]
        body.append(line)
    return _table(headers, body)


def _registry_facts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    agents = summary.get("agents")
    entries = agents if isinstance(agents, list) else []
    return {str(e["agent"]): e for e in entries if isinstance(e, dict) and "agent" in e}


def agents_table(run: RunData) -> list[str]:
    """One line per agent; optional columns appear only when some agent reports them."""
    agents = agent_totals(run.rows)
    if not agents:
        return ["_No agent recorded._", ""]
    facts = _registry_facts(run.summary)
    optional: list[tuple[str, Callable[[AgentTotals], str]]] = [
        ("state", lambda a: _fmt(a.state or facts.get(a.agent, {}).get("state"))),
        ("min avail GiB", lambda a: _fmt(None if a.min_available_mb is None
                                         else a.min_available_mb / 1024, ".2f")),
        ("mean CPU %", lambda a: _fmt(sum(a.cpu_percent) / len(a.cpu_percent), ".0f")
         if a.cpu_percent else "—"),
        ("max °C", lambda a: _fmt(a.max_temperature_c, ".1f")),
        ("samples", lambda a: _fmt(facts.get(a.agent, {}).get("dataset_size"))),
        ("offline events", lambda a: _fmt(facts.get(a.agent, {}).get("offline_events"))),
        ("cut", lambda a: _fmt(a.cut)),  # the plan's prediction at it: "Split plan"
        ("power mode", lambda a: _fmt(a.power_mode if a.power_mode != "unknown" else None)),
        # the live estimates at the end of the run (server/fleet/live_estimates.py)
        ("GFLOPS (live)", lambda a: _fmt(a.estimate.get("gflops"), ".2f")),
        ("up Mbit/s (live)", lambda a: _fmt(a.estimate.get("uplink_mbps"), ".1f")),
        ("down Mbit/s (live)", lambda a: _fmt(a.estimate.get("downlink_mbps"), ".1f")),
    ]
    columns: list[tuple[str, Callable[[AgentTotals], str]]] = [
        ("agent", lambda a: _fmt(a.agent)), ("profile", lambda a: _fmt(a.profile)),
        ("rounds selected", lambda a: str(a.selected)), ("rounds missed", lambda a: str(a.missed)),
        ("compute s", lambda a: _fmt(a.compute_s, ".2f")),
        ("transfer s", lambda a: _fmt(a.transfer_s, ".2f")),
        ("wait s", lambda a: _fmt(a.wait_s, ".2f")),
        ("peak RSS GiB", lambda a: _fmt(None if a.peak_rss_mb is None
                                        else a.peak_rss_mb / 1024, ".2f")),
        ("device GFLOPs", lambda a: _fmt(a.gflops, ".3f")),
    ]
    columns += [(h, f) for h, f in optional if any(f(a) != "—" for a in agents.values())]
    return _table([h for h, _ in columns], ([f(a) for _, f in columns] for a in agents.values()))


def _per_class_line(rows: Sequence[Row]) -> list[str]:
    per_class = rows[-1].get("per_class_accuracy") if rows else None
    if not isinstance(per_class, list) or not per_class:
        return []
    cells = ", ".join(f"{i}: {_pct(v)}" for i, v in enumerate(per_class))
    return [f"Per-class accuracy in the last round (%): {cells}.", ""]


# ---------------------------------------------------------------------- plan (generic)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _flatten(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[dict]]]:
    """A record's cells (dicts of scalars become 'key.sub' columns) and its nested record
    lists, which get their own tables."""
    cells: dict[str, Any] = {}
    nested: dict[str, list[dict]] = {}
    for key, value in record.items():
        if _is_records(value):
            nested[str(key)] = value
        elif isinstance(value, dict) and value and all(_is_scalar(v) for v in value.values()):
            cells.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            cells[str(key)] = value
    return cells, nested


def _records_table(name: str, records: list[dict], depth: int) -> list[str]:
    flat = [_flatten(r) for r in records]
    headers: list[str] = []
    for cells, _ in flat:
        headers += [k for k in cells if k not in headers]
    lines = [f"**{name}**", ""] if name else []
    lines += _table(headers, ([_cell(c.get(h)) for h in headers] for c, _ in flat))
    for i, (cells, nested) in enumerate(flat):
        label = next((str(v) for v in cells.values() if isinstance(v, str)), str(i))
        for key, sub in nested.items():
            lines += (_records_table(f"{name}[{label}].{key}", sub, depth + 1) if depth < 2
                      else [f"**{name}[{label}].{key}**: {_cell(sub)}", ""])
    return lines


def render_plan(value: Any, name: str = "", depth: int = 0) -> list[str]:
    """Any JSON as Markdown tables: scalars as key/value rows, record lists and mappings
    of records as tables (one row per record), nested structures as their own tables."""
    if _is_records(value):
        return _records_table(name, value, depth)
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return _records_table(name, [{"name": k, **v} for k, v in value.items()], depth)
    if isinstance(value, dict):
        scalars = {k: v for k, v in value.items()
                   if _is_scalar(v) or (isinstance(v, list) and not _is_records(v))}
        lines = [f"**{name}**", ""] if name and scalars else []
        if scalars:
            lines += _table(["key", "value"], ([_fmt(k), _cell(v)] for k, v in scalars.items()))
        for k, v in value.items():
            if k not in scalars:
                lines += render_plan(v, f"{name}.{k}" if name else str(k), depth + 1)
        return lines
    return [f"**{name or 'plan'}**: {_cell(value)}", ""]


def _trial_spec(run: RunData) -> dict[str, Any]:
    """trial.json's settings (which cuts were set by hand), or {}."""
    for name, _, text in run.configs:
        if name == "trial.json":
            try:
                spec = json.loads(text)
            except json.JSONDecodeError:
                return {}
            return spec if isinstance(spec, dict) else {}
    return {}


def _plan_section(run: RunData) -> list[str]:
    """Each device at the cut it trained at: the planner's per-round prediction there
    beside what it measured, the choice in words, the fleet's cost at every common cut and
    the emulation settings; the raw plan stays in plan.json."""
    from jetsplit.server.report.plan import devices, fleet_cost_table, plan_section
    from jetsplit.server.report.views import emulation_note

    plan = run.plan
    lines = ["## Split plan", ""]
    if plan is None:
        return [*lines, "_No plan.json in this run folder._", ""]
    agents = agent_totals(run.rows)
    body = plan_section(plan, agents, run.rows, _trial_spec(run))
    if not body:  # not a planner's output: show it generically
        return lines + (render_plan(plan) or ["_plan.json is empty._", ""])
    lines += [*body, *fleet_cost_table(plan, devices(plan, agents))]
    note = emulation_note(plan)
    if note:
        lines += [note, ""]
    return lines


def _config_section(run: RunData) -> list[str]:
    lines = ["## Configuration", ""]
    configs = list(run.configs)
    settings = run.summary.get("settings")
    if not configs and isinstance(settings, dict):
        configs.append(("settings from summary.json", "json", json.dumps(settings, indent=2)))
    if not configs:
        return [*lines, "_No config.toml, trial.json or recorded settings._", ""]
    for name, lang, text in configs:
        fence = "````" if "```" in text else "```"
        lines += [f"`{name}`:", "", f"{fence}{lang}", text, fence, ""]
    return lines


# ---------------------------------------------------------------------- entry points


def write_report(run_dir: Path, *, title: str | None = None) -> Path:
    """Write DIR/report.md and its PNG plots; returns the report's path."""
    run = load_run(Path(run_dir))
    name = title or f"jetsplit run {run.summary.get('run') or run.run_dir.resolve().name}"
    from jetsplit.server.report.views import headline

    lines = [f"# {name}", "", *headline(run.rows, run.summary, run.plan,
                                        agent_totals(run.rows)),
             summary_paragraph(run), "",
             *_plots_section(run),
             "## Rounds", "", *rounds_table(run.rows), *_per_class_line(run.rows),
             "## Agents", "", *agents_table(run),
             *defences_section(run.rows, run.summary),
             *replan_section(run.rows),
             *_plan_section(run), *_config_section(run)]
    path = run.run_dir / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def report_command(
    run_dir: Annotated[Path, typer.Argument(help="Run folder holding metrics.jsonl.")],
    title: Annotated[str | None, typer.Option("--title", help="Report heading.")] = None,
    compare: Annotated[list[Path] | None, typer.Option(
        "--compare", help="Other run folders to overlay (accuracy vs MB): DIR/compare.png.")
    ] = None,
) -> None:
    """Write DIR/report.md with plots: headline, accuracy, loss, accuracy vs traffic and
    time, time per phase, traffic, agent time and memory."""
    path = write_report(run_dir, title=title)
    typer.echo(f"report in {path}")
    if compare:
        from jetsplit.server.report.views import plot_compare

        runs = [load_run(d) for d in [run_dir, *compare]]
        figure = _figure_class()
        if figure is None:
            raise typer.BadParameter("--compare needs matplotlib (pip install "
                                     "'jetsplit[server]')")
        labels = [f"{r.run_dir.name}: {r.summary.get('algorithm') or '?'}" for r in runs]
        out = run_dir / "compare.png"
        plot_compare(list(zip(labels, [r.rows for r in runs], strict=True)), out, figure)
        typer.echo(f"comparison in {out}")

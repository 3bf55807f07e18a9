"""The report's PNG plots (accuracy, bytes, time and memory per agent, and the views'
plots), each skipped with its reason where the run lacks the data."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite
from jetsplit.server.report.defences import plot_influence
from jetsplit.server.report.replan import plot_cuts
from jetsplit.server.report.run_data import (
    MB,
    NO_AGENT_BOOKS,
    Row,
    RunData,
    agent_totals,
    as_dict,
    kind_bytes,
    natural_key,
    round_no,
)

PNG_DPI = 110
PlotFn = Callable[[RunData, Path, Any], str | None]


# ---------------------------------------------------------------------- plots


def figure_class() -> Any:
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
    return [round_no(r, i) for i, r in enumerate(rows)]


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
    books = [kind_bytes(r.get("bytes_by_kind")) for r in rows]
    evals = [kind_bytes(r.get("eval_bytes")) for r in rows]
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
    return _fold_small({k: v for k, v in segments.items() if any(v)}, len(rows))


def _fold_small(segments: dict[str, list[float]], rounds: int) -> dict[str, list[float]]:
    """Segments under 1% of all bytes folded into one entry (when there are several), so
    what would be invisible on the plot is one visible bar."""
    grand = sum(sum(v) for v in segments.values()) or 1.0
    small = [k for k, v in segments.items() if sum(v) / grand < 0.01]
    if len(small) > 1:
        parts = [segments.pop(k) for k in small]
        segments["other kinds (< 1% each)"] = [sum(p[i] for p in parts) for i in range(rounds)]
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
    tiers = [{k: finite(v) or 0.0 for k, v in as_dict(r.get("tier_bytes")).items()}
             for r in run.rows]
    names = sorted({k for t in tiers for k in t}, key=natural_key)
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


def plots_section(run: RunData) -> list[str]:
    """Draw every plot that has data; say why each missing one is missing. Stale PNGs from
    an earlier report of the same folder are removed so links and files agree."""
    figure = figure_class()
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



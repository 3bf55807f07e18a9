"""The parts of a run report a person reads first: the headline numbers against the plan's
prediction (at the cut each device trained at: report_plan.py), and the plots that answer
"how fast did it learn for the bytes and the time it cost" (loss, accuracy vs cumulative MB
and vs wall time, per-round time by phase), plus `--compare` overlays of several runs.

Units: MB (10^6 bytes) for traffic everywhere, GiB for memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

MB = 1e6
GIB = float(1 << 30)
Row = dict[str, Any]


def _num(value: Any) -> float:
    v = finite(value)
    return 0.0 if v is None else v


def _kind_total(value: Any) -> float:
    """Sum of a {direction: {kind: bytes}} book."""
    if not isinstance(value, dict):
        return 0.0
    return sum(_num(b) for d in value.values() if isinstance(d, dict) for b in d.values())


def round_bytes(row: Row) -> float:
    """Everything one round put on the wire: training, bundle installation, evaluation."""
    return (_num(row.get("bytes_up")) + _num(row.get("bytes_down"))
            + _num(row.get("bundle_bytes")) + _kind_total(row.get("eval_bytes")))


def cumulative(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def emulation_note(plan: Any) -> str | None:
    """One sentence on how trial timings relate to real devices (None outside trials)."""
    emulation = plan.get("emulation") if isinstance(plan, dict) else None
    if not isinstance(emulation, dict):
        return None
    dilation = finite(emulation.get("compute_dilation"))
    profiles = emulation.get("profiles") if isinstance(emulation.get("profiles"), dict) else {}
    links = sorted({f"{_num(p.get('uplink_mbps')):g}/{_num(p.get('downlink_mbps')):g} Mbit/s"
                    for p in profiles.values() if isinstance(p, dict)
                    and p.get("uplink_mbps") is not None})
    if dilation is None:
        return None
    return (f"Emulated devices: compute runs ×{dilation:.1f} slower than the profiles say "
            f"(this machine cannot run faster than it does; ratios between devices hold); "
            f"links {', '.join(links) or 'unlimited'} (up/down).")


# ---------------------------------------------------------------------- plan


def plan_rows(plan: Any) -> list[dict[str, Any]]:
    """Per device profile, the planner's row at the server cut (the agent-memory plot reads
    its budget, the same at every cut; each device's own cut: report_plan.py)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("devices"), list):
        return []
    used = plan.get("used_split", plan.get("chosen_k"))
    out = []
    for device in plan["devices"]:
        if not isinstance(device, dict):
            continue
        rows = [r for r in device.get("rows", []) if isinstance(r, dict) and r.get("k") == used]
        if rows:
            out.append({"profile": device.get("profile"), **rows[0]})
    return out


def predicted(plan: Any, agents: Mapping[str, Any]) -> dict[str, float] | None:
    """The plan's prediction for the whole run at the cut each device trained at: training
    MB (each device's MB per round at its cut, summed, × rounds) and seconds (the fleet's
    ms per iteration for those cuts × iterations × rounds). `agents`: AgentTotals by id."""
    from jetsplit.server.report.plan import predicted_run

    return predicted_run(plan, agents)


# ---------------------------------------------------------------------- headline


def headline(rows: Sequence[Row], summary: dict[str, Any], plan: Any,
             agents: Mapping[str, Any]) -> list[str]:
    """The numbers first: accuracy, bytes, wall time, each beside the plan's prediction."""
    last_acc = next((finite(r.get("accuracy")) for r in reversed(rows)
                     if finite(r.get("accuracy")) is not None), None)
    training = sum(_num(r.get("bytes_up")) + _num(r.get("bytes_down")) for r in rows)
    bundle = sum(_num(r.get("bundle_bytes")) for r in rows)
    evaluation = sum(_kind_total(r.get("eval_bytes")) for r in rows)
    seconds = finite(summary.get("seconds"))
    if seconds is None:
        seconds = sum(_num(r.get("seconds")) for r in rows)
    guess = predicted(plan, agents)
    dilation = None
    if isinstance(plan, dict) and isinstance(plan.get("emulation"), dict):
        dilation = finite(plan["emulation"].get("compute_dilation"))
    best = max((finite(r.get("accuracy")) or 0.0 for r in rows), default=0.0)
    predicted_mb = "—" if guess is None else f"{guess['mb']:.2f} MB"
    lines = ["## Headline", "", "| | measured | plan predicted |", "|---|---|---|",
             f"| final test accuracy | {'—' if last_acc is None else f'{100 * last_acc:.2f}%'}"
             f" (best {100 * best:.2f}%) | — |",
             f"| training traffic | {training / MB:.2f} MB | "
             f"{predicted_mb} |",
             f"| all traffic (with bundle {bundle / MB:.2f} MB, evaluation "
             f"{evaluation / MB:.2f} MB) | {(training + bundle + evaluation) / MB:.2f} MB | — |"]
    if guess is None:
        pred_time = "—"
    else:
        pred_time = f"{guess['seconds']:.1f} s at the profiles' speed"
        if dilation:
            pred_time += f" (compute ×{dilation:.1f} here)"
    lines.append(f"| wall time | {seconds:.1f} s over {len(rows)} rounds | {pred_time} |")
    return lines + [""]


# ---------------------------------------------------------------------- plots


def _series(rows: Sequence[Row], key: str) -> list[float]:
    return [math.nan if finite(r.get(key)) is None else finite(r.get(key)) for r in rows]


def _x(rows: Sequence[Row]) -> list[int]:
    """Rounds from 1, as in the report's tables and the coordinator's log."""
    return [int(r["round"]) + 1 if isinstance(r.get("round"), int) else i + 1
            for i, r in enumerate(rows)]


def _note(ax: Any, text: str | None) -> None:
    if text:
        ax.text(0.0, -0.22, text, transform=ax.transAxes, fontsize="x-small", wrap=True,
                va="top")


def plot_loss(rows: Sequence[Row], plan: Any, path: Path, figure: Any) -> str | None:
    train, test = _series(rows, "train_loss"), _series(rows, "test_loss")
    if all(math.isnan(v) for v in train + test):
        return "no round reports a loss"
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    x = _x(rows)
    if not all(math.isnan(v) for v in train):
        ax.plot(x, train, marker="o", label="training loss (mean over agents)")
    if not all(math.isnan(v) for v in test):
        ax.plot(x, test, marker="s", label="test loss")
    ax.set(xlabel="round", ylabel="cross-entropy", title="Loss per round")
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None


def plot_accuracy_vs_cost(rows: Sequence[Row], plan: Any, path: Path,
                          figure: Any) -> str | None:
    """Accuracy against cumulative MB (bundle and evaluation included) and against
    cumulative wall time, side by side."""
    acc = [100 * v if not math.isnan(v) else v for v in _series(rows, "accuracy")]
    if all(math.isnan(v) for v in acc):
        return "no round reports an accuracy"
    mb = cumulative([round_bytes(r) / MB for r in rows])
    secs = cumulative([_num(r.get("seconds")) for r in rows])
    fig = figure(figsize=(10, 4))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.plot(mb, acc, marker="o")
    left.set(xlabel="cumulative MB on the wire (bundle and evaluation included)",
             ylabel="test accuracy (%)", ylim=(0, 100), title="Accuracy vs traffic")
    right.plot(secs, acc, marker="o", color="tab:green")
    right.set(xlabel="cumulative wall time (s)", ylim=(0, 100), title="Accuracy vs time")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    _note(right, emulation_note(plan))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None


def plot_round_time(rows: Sequence[Row], plan: Any, path: Path, figure: Any) -> str | None:
    """Per-round wall time split into the coordinator's phases (stacked)."""
    phases = [r.get("phases_s") if isinstance(r.get("phases_s"), dict) else {} for r in rows]
    names = sorted({k for p in phases for k in p})
    if not names:
        return "no round reports `phases_s`"
    totals = {n: sum(_num(p.get(n)) for p in phases) for n in names}
    grand = sum(totals.values()) or 1.0
    main = [n for n in names if totals[n] / grand >= 0.01]  # no invisible legend entries
    fig = figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    x = _x(rows)
    bottom = [0.0] * len(rows)
    for name in main:
        values = [_num(p.get(name)) for p in phases]
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    rest = [sum(_num(p.get(n)) for n in names if n not in main) for p in phases]
    if any(rest):
        ax.bar(x, rest, bottom=bottom, label="other (< 1% each)", color="lightgrey")
    ax.set(xlabel="round", ylabel="seconds", title="Time per round by phase")
    ax.set_xticks(x)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    _note(ax, emulation_note(plan))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None


def plot_compare(runs: Sequence[tuple[str, Sequence[Row]]], path: Path, figure: Any) -> None:
    """Several runs' accuracy against cumulative MB on one axis."""
    fig = figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for label, rows in runs:
        acc = [100 * v if not math.isnan(v) else v for v in _series(rows, "accuracy")]
        ax.plot(cumulative([round_bytes(r) / MB for r in rows]), acc, marker="o", label=label)
    ax.set(xlabel="cumulative MB on the wire (bundle and evaluation included)",
           ylabel="test accuracy (%)", ylim=(0, 100), title="Accuracy vs traffic")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110, bbox_inches="tight")

"""The report's "Re-planning" section and plot: where each device's cut was in every round,
each switch with its reason (the round time predicted before and after, and the time
measured after it), and the bytes each switch cost (server/cuts/replanning.py writes the rows'
`replan` field; `cuts` and `seconds` are in every row).

Rows are untrusted files like any other: numbers are range-checked, notes cut to length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

Row = dict[str, Any]
MAX_REASON = 200
MAX_DEVICES_DRAWN = 40


def _round(row: Row, index: int) -> int:
    value = row.get("round")
    return value if isinstance(value, int) and not isinstance(value, bool) else index


def switches(rows: Sequence[Row]) -> list[tuple[int, dict[str, Any]]]:
    """(round, the `replan` field) of every row that switched."""
    return [(_round(r, i), r["replan"]) for i, r in enumerate(rows)
            if isinstance(r.get("replan"), dict)]


def moves_text(replan: Any) -> str:
    """A `replan` field's moves as `a0 1→4, a2 1→10` (empty when it names none)."""
    moved = replan.get("moved") if isinstance(replan, dict) else None
    if not isinstance(moved, dict):
        return ""
    return ", ".join(f"{str(a)[:32]} {v[0]}→{v[1]}" for a, v in sorted(moved.items())
                     if isinstance(v, list) and len(v) == 2)


def _mean_seconds(rows: Sequence[Row], first: int, last: int) -> float | None:
    """Mean measured round time over rows first..last (indices), or None."""
    values = [finite(r.get("seconds"), 0.0, 1e9) for r in rows[first:last]]
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def replan_section(rows: Sequence[Row]) -> list[str]:
    """Markdown lines; empty when the run never switched."""
    found = switches(rows)
    if not found:
        return []
    lines = ["## Re-planning", "",
             "Each switch moved devices' cuts before the next round (server/cuts/replanning.py): "
             "predicted round times under the live estimates, and the mean time measured "
             "over the rounds until the next switch.", "",
             "| after round | moved | predicted before → after (s) | measured after (s) | "
             "bytes to ship (predicted) | bundle bytes shipped next round | reason |",
             "|---|---|---|---|---|---|---|"]
    indices = [i for i, r in enumerate(rows) if isinstance(r.get("replan"), dict)]
    for n, ((round_no, switch), index) in enumerate(zip(found, indices, strict=True)):
        text = moves_text(switch)
        before = finite(switch.get("predicted_before_s"), 0.0, 1e9)
        after = finite(switch.get("predicted_after_s"), 0.0, 1e9)
        end = indices[n + 1] + 1 if n + 1 < len(indices) else len(rows)
        measured = _mean_seconds(rows, index + 1, end)
        shipped = switch.get("switch_bytes")
        total = sum(v for v in shipped.values() if isinstance(v, int)) \
            if isinstance(shipped, dict) else 0
        reason = str(switch.get("reason", ""))[:MAX_REASON].replace("|", "\\|")
        shipped_next = finite(rows[index + 1].get("bundle_bytes"), 0, 1e15) \
            if index + 1 < len(rows) else None
        lines.append(f"| {round_no} | {text or '-'} | {_num(before)} → {_num(after)} | "
                     f"{_num(measured)} | {total:,} | "
                     f"{'-' if shipped_next is None else f'{shipped_next:,.0f}'} | {reason} |")
    return [*lines, ""]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_cuts(rows: Sequence[Row], path: Path, figure: Any) -> str | None:
    """Each device's cut per round (the rounds it trained) over the measured round time,
    switches marked. None when drawn, else why not."""
    if not switches(rows):
        return "the run never re-planned"
    x = [_round(r, i) for i, r in enumerate(rows)]
    cuts: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        values = row.get("cuts")
        for agent, cut in (values.items() if isinstance(values, dict) else ()):
            number = finite(cut, 1, 1000)
            if number is not None:
                cuts.setdefault(str(agent)[:32], [math.nan] * len(rows))[i] = number
    seconds = [finite(r.get("seconds"), 0.0, 1e9) for r in rows]
    fig = figure(figsize=(7, 5.6))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    for agent, values in sorted(cuts.items())[:MAX_DEVICES_DRAWN]:
        top.step(x, values, where="mid", marker="o", markersize=3, label=agent)
    top.set(ylabel="cut (last device layer)", title="Each device's cut per round")
    top.legend(fontsize=7, loc="best")
    bottom.plot(x, [math.nan if s is None else s for s in seconds], marker="o", markersize=3)
    bottom.set(xlabel="round", ylabel="seconds", title="Round time (measured)")
    for round_no, _ in switches(rows):
        for ax in (top, bottom):
            ax.axvline(round_no + 0.5, color="grey", linestyle="--", alpha=0.6)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight", format="png")
    return None

"""The report's "Defences" section: which devices the coordinator did not simply believe.

Per round and device, from the metrics rows: activations bounded against the fleet and
server-loss terms down-weighted (server/defences/step_bounds.py), uploads clipped or left out by the
aggregator (server/defences/aggregators.py),
sitting out after missed deadlines (server/defences/sitting_out.py); from the summary, registered
sizes
capped and label histograms the labels sent disproved (server/defences/size_claims.py). The rows are
untrusted files like any other: anything not a string note is skipped, and every cell is
cut to a readable length.

The influence plot draws, per device and round, its share of the round's averages (the
rows' `influence`, server/defences/aggregators.py) and the scale its activations were bounded to
(`activation_scale`, server/defences/step_bounds.py): the numbers behind the notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jetsplit.server.defences.size_claims import BY_CAP, BY_PROVISIONED
from jetsplit.server.defences.untrusted_numbers import finite

MAX_NOTE = 160
MAX_DEVICES_DRAWN = 40  # legend and lines stay readable; the table names the rest

Row = dict[str, Any]


def _notes(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:64]: v[:MAX_NOTE] for k, v in value.items() if isinstance(v, str)}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def row_notes(row: Row) -> dict[str, list[str]]:
    """What the coordinator did to each device in one round's row: bounded, down-weighted,
    left out, clipped, aggregated otherwise, benched (devices it believed are absent)."""
    found: dict[str, list[str]] = {}
    for key in ("bounded", "down_weighted", "excluded", "gradient_clipped", "aggregation"):
        for agent, note in _notes(row.get(key)).items():
            found.setdefault(agent, []).append(note)
    benched = row.get("benched")
    for agent in benched if isinstance(benched, list) else []:
        if isinstance(agent, str):
            found.setdefault(agent[:64], []).append("sat out (missed deadlines)")
    return found


def limited_rounds(rows: Sequence[Row]) -> dict[str, int]:
    """Per device, in how many rounds the coordinator limited it (any of `row_notes`)."""
    counts: dict[str, int] = {}
    for row in rows:
        for agent in row_notes(row):
            counts[agent] = counts.get(agent, 0) + 1
    return counts


def defences_section(rows: Sequence[Row], summary: dict[str, Any]) -> list[str]:
    """Markdown lines: a table of (round, device, what) and the capped claims."""
    body: list[tuple[str, str, str]] = []
    counts = limited_rounds(rows)
    for i, row in enumerate(rows):
        round_no = str(row.get("round", i) if isinstance(row.get("round", i), int) else i)
        for agent, notes in sorted(row_notes(row).items()):
            body.append((round_no, agent, "; ".join(notes)))
    capped = summary.get("capped_claims")
    capped = capped if isinstance(capped, dict) else {}
    histograms = summary.get("histogram_claims")
    histograms = histograms if isinstance(histograms, dict) else {}
    lines = ["## Defences", ""]
    if not body and not capped and not histograms:
        return [*lines, "No device's size claim was capped, and no device was bounded, "
                "down-weighted, clipped, left out or benched.", ""]
    if counts:
        most = ", ".join(f"{a} ({n} of {len(rows)} rounds)"
                         for a, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        lines += [f"Devices the coordinator limited: {most}.", ""]
    if body:
        lines += ["| round | device | what the coordinator did |", "|---|---|---|"]
        lines += [f"| {r} | {_cell(a)} | {_cell(n)} |" for r, a, n in body] + [""]
    lines += _capped_lines(capped) + _histogram_lines(histograms)
    return [*lines, ""] if capped or histograms else lines


def _capped_lines(capped: dict[str, Any]) -> list[str]:
    """One line per device whose size claim was capped: claimed, weighed as, by what."""
    lines = []
    for agent, books in sorted(capped.items()):
        if isinstance(books, dict):
            by = books.get("by") if books.get("by") in (BY_PROVISIONED, BY_CAP) else BY_CAP
            lines.append(f"- {_cell(str(agent)[:64])}: claimed {books.get('claimed')} samples, "
                         f"weighed as {books.get('weight')} ({by}).")
    return lines


def _histogram_lines(histograms: dict[str, Any]) -> list[str]:
    """One line per device whose registered label histogram its labels contradicted."""
    lines = []
    for agent, books in sorted(histograms.items()):
        numbers = [finite(books.get(k), 0.0, 1e15) if isinstance(books, dict) else None
                   for k in ("distance", "labels", "bound")]
        if None not in numbers:
            distance, labels, bound = numbers
            lines.append(f"- {_cell(str(agent)[:64])}: its label histogram was {distance:.3f} "
                         f"(total variation) from the {labels:.0f} labels it sent, over "
                         f"{bound:.3f}: its prior came from those labels.")
    return lines


def _per_device(rows: Sequence[Row], key: str, low: float, high: float
                ) -> dict[str, list[float]]:
    """{device: value per round (NaN where absent)} of one numeric per-device row field."""
    series: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        values = row.get(key)
        for agent, value in (values.items() if isinstance(values, dict) else ()):
            number = finite(value, low, high)
            if number is not None:
                series.setdefault(str(agent)[:64], [math.nan] * len(rows))[i] = number
    return dict(sorted(series.items())[:MAX_DEVICES_DRAWN])


def plot_influence(rows: Sequence[Row], path: Path, figure: Any) -> str | None:
    """Each device's share of the round's averages and, where any device was bounded, the
    scale its activations got (1 = untouched; log axis). None when drawn, else why not."""
    shares = _per_device(rows, "influence", 0.0, 1.0)
    scales = _per_device(rows, "activation_scale", 0.0, 1.0)
    if not shares and not scales:
        return "no round records a device's share of an average or a bounded activation"
    x = [r.get("round", i) if isinstance(r.get("round"), int) else i
         for i, r in enumerate(rows)]
    panels = [p for p in (shares, scales) if p]
    fig = figure(figsize=(7, 3.2 * len(panels)))
    axes = [fig.add_subplot(len(panels), 1, k + 1) for k in range(len(panels))]
    for ax, series in zip(axes, panels, strict=True):
        for agent, values in series.items():
            ax.plot(x, values, marker="o", markersize=3, label=agent)
        ax.grid(alpha=0.3)
        ax.set_xlabel("round")
        if series is shares:
            ax.set(ylabel="share of the averages", ylim=(0, 1.05),
                   title="Each device's weight in the aggregated blocks")
        else:
            ax.set_yscale("log")
            ax.set(ylabel="activation scale", title="Activations bounded (1 = untouched)")
        ax.legend(fontsize=7, ncol=max(1, len(series) // 10), loc="best")
    fig.savefig(path, dpi=110, bbox_inches="tight", format="png")
    return None

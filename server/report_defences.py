"""The report's "Defences" section: which devices the coordinator did not simply believe.

Per round and device, from the metrics rows: activations bounded against the fleet
(server/influence.py), uploads clipped or left out by the aggregator (server/aggregators.py),
sitting out after missed deadlines (server/benching.py); from the summary, registered sizes
capped (server/claims.py). The rows are untrusted files like any other: anything not a
string note is skipped, and every cell is cut to a readable length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_NOTE = 160

Row = dict[str, Any]


def _notes(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:64]: v[:MAX_NOTE] for k, v in value.items() if isinstance(v, str)}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def defences_section(rows: Sequence[Row], summary: dict[str, Any]) -> list[str]:
    """Markdown lines: a table of (round, device, what) and the capped claims."""
    body: list[tuple[str, str, str]] = []
    counts: dict[str, int] = {}
    for i, row in enumerate(rows):
        round_no = str(row.get("round", i) if isinstance(row.get("round", i), int) else i)
        found: dict[str, list[str]] = {}
        for key in ("bounded", "aggregation"):
            for agent, note in _notes(row.get(key)).items():
                found.setdefault(agent, []).append(note)
        benched = row.get("benched")
        for agent in benched if isinstance(benched, list) else []:
            if isinstance(agent, str):
                found.setdefault(agent[:64], []).append("sat out (missed deadlines)")
        for agent, notes in sorted(found.items()):
            counts[agent] = counts.get(agent, 0) + 1
            body.append((round_no, agent, "; ".join(notes)))
    capped = summary.get("capped_claims")
    capped = capped if isinstance(capped, dict) else {}
    lines = ["## Defences", ""]
    if not body and not capped:
        return [*lines, "No device's size claim was capped, and no device was bounded, "
                "clipped, left out or benched.", ""]
    if counts:
        most = ", ".join(f"{a} ({n} of {len(rows)} rounds)"
                         for a, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        lines += [f"Devices the coordinator limited: {most}.", ""]
    if body:
        lines += ["| round | device | what the coordinator did |", "|---|---|---|"]
        lines += [f"| {r} | {_cell(a)} | {_cell(n)} |" for r, a, n in body] + [""]
    for agent, books in sorted(capped.items()):
        if isinstance(books, dict):
            lines.append(f"- {_cell(str(agent)[:64])}: claimed {books.get('claimed')} samples, "
                         f"weighed as {books.get('weight')} (size cap).")
    return [*lines, ""] if capped else lines

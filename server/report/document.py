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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from jetsplit.server.defences.untrusted_numbers import finite
from jetsplit.server.report.defences import defences_section
from jetsplit.server.report.plots import figure_class, plots_section
from jetsplit.server.report.replan import replan_section
from jetsplit.server.report.run_data import (
    MB,
    AgentTotals,
    Row,
    RunData,
    agent_totals,
    as_dict,
    kind_bytes,
    load_run,
    natural_key,
    round_no,
)

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
                    f"round {round_no(run.rows[i], i)})")
    return "no accuracy measured"


def _total(run: RunData, key: str) -> float:
    value = finite(run.summary.get(key))
    if value is not None:
        return value
    return sum(finite(r.get(key)) or 0.0 for r in run.rows)


def _eval_total(rows: Sequence[Row]) -> float:
    return sum(sum(b[d].values()) for r in rows
               for b in [kind_bytes(r.get("eval_bytes"))] for d in ("up", "down"))


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
    has_deadline = any(_step_deadline(r) is not None for r in rows)
    headers += ["step deadline s"] * has_deadline
    body = []
    for i, r in enumerate(rows):
        selected = r.get("selected")
        missed = as_dict(r.get("missed"))
        line = [str(round_no(r, i)), _fmt(len(selected) if isinstance(selected, list) else None),
                _fmt(", ".join(sorted(missed, key=natural_key)) or "none"),
                _fmt(finite(r.get("train_loss")), ".4f"), _pct(r.get("accuracy")),
                _pct(r.get("balanced_accuracy"))]
        line += [_pct(r.get("accuracy_std"))] * has_std
        line += [_mb(r.get("bytes_up")), _mb(r.get("bytes_down"))]
        if has_eval:
            line.append(_mb(sum(sum(b.values()) for b in
                                kind_bytes(r.get("eval_bytes")).values())))
        line += [_mb(r.get("bundle_bytes")), _fmt(finite(r.get("seconds")), ".2f")]
        line += [_fmt(_step_deadline(r), ".1f")] * has_deadline
        body.append(line)
    return _table(headers, body)


def _step_deadline(row: Row) -> float | None:
    """The round's step deadline (`deadlines_s`, server/defences/step_deadlines.py): its
    forwards', else the longest of its kinds; None where the row has none."""
    given = as_dict(row.get("deadlines_s"))
    if "forward" in given:
        return finite(given["forward"], 0.0, 1e9)
    values = [finite(v, 0.0, 1e9) for v in given.values()]
    return max((v for v in values if v is not None), default=None)


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
        # proof of life (server/defences/sitting_out.py): rounds sat out, probes answered
        ("rounds benched", lambda a: str(a.benched) if a.benched or a.probes else "—"),
        ("probes answered", lambda a: f"{a.probes_answered}/{a.probes}" if a.probes else "—"),
        ("cut", lambda a: _fmt(a.cut)),  # the plan's prediction at it: "Split plan"
        ("power mode", lambda a: _fmt(a.power_mode if a.power_mode != "unknown" else None)),
        ("images skipped", lambda a: _fmt(a.images_skipped or None)),  # undecodable files
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


def _per_class_line(rows: Sequence[Row], summary: dict[str, Any]) -> list[str]:
    """The last round's accuracy per class, by the run's class names where it has them."""
    per_class = rows[-1].get("per_class_accuracy") if rows else None
    if not isinstance(per_class, list) or not per_class:
        return []
    names = summary.get("classes")
    if not (isinstance(names, list) and len(names) == len(per_class)
            and all(isinstance(n, str) for n in names)):
        names = [str(i) for i in range(len(per_class))]
    cells = ", ".join(f"{_fmt(name[:64])}: {_pct(v)}" for name, v in zip(names, per_class,
                                                                          strict=True))
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
             *plots_section(run),
             "## Rounds", "", *rounds_table(run.rows), *_per_class_line(run.rows, run.summary),
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
        figure = figure_class()
        if figure is None:
            raise typer.BadParameter("--compare needs matplotlib (pip install "
                                     "'jetsplit[server]')")
        labels = [f"{r.run_dir.name}: {r.summary.get('algorithm') or '?'}" for r in runs]
        out = run_dir / "compare.png"
        plot_compare(list(zip(labels, [r.rows for r in runs], strict=True)), out, figure)
        typer.echo(f"comparison in {out}")

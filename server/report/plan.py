"""The report's "Split plan" section: each device at the cut it trained at, the planner's
prediction for that device at that cut beside what the run measured, and the planner's
choice in words.

plan.json (written by `jetsplit trial`, see `plan_cuts` in server/cuts/planning.py) holds, per
device profile, the planner's row for every candidate cut (`devices[].rows`: compute,
transfer and server ms per iteration, memory, bytes per round), its choice (`chosen`,
profile → cut), and per agent the profile and cut (`agents`). The metrics rows say which
cut each agent trained at (`cuts`, `agents[a].cut`) and what it measured (compute and
transfer seconds, RSS). A device's prediction is always read from its own profile's row at
its own cut, so a cut set by hand is predicted at that cut, not the planner's.

Everything is optional: a plan without rows, agents without books, or an older plan shape
read as far as they go; nothing here raises on missing fields.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

MB = 1e6
GIB = float(1 << 30)
MIB = float(1 << 20)
REASON_KEYS = ("reason", "why")  # a plan that explains its own choice says it here


# ---------------------------------------------------------------------- reading the plan


def _natural(name: str) -> list[Any]:
    """Sort key so a2 comes before a10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _dict(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def used_split(plan: Mapping[str, Any]) -> int | None:
    return _int(plan.get("used_split", plan.get("chosen_k")))


def device_rows(plan: Any) -> dict[str, dict[int, dict[str, Any]]]:
    """Per profile, the planner's rows by cut k (empty for a plan of another shape)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("devices"), list):
        return {}
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for device in plan["devices"]:
        if not isinstance(device, dict) or not isinstance(device.get("rows"), list):
            continue
        rows = {r["k"]: r for r in device["rows"] if isinstance(r, dict) and _int(r.get("k"))}
        if rows:
            out[str(device.get("profile"))] = rows
    return out


def iterations(plan: Mapping[str, Any]) -> int | None:
    """Iterations per round the plan's per-iteration times add up over: T, or for a method
    that uploads its activations once (Ampere) an epoch of the planned dataset."""
    settings = _dict(plan.get("settings"))
    steps = _int(settings.get("local_steps"))
    size, batch = _int(settings.get("dataset_size")), _int(settings.get("batch"))
    try:
        from jetsplit.export.planner import ALGORITHMS

        one_shot = ALGORITHMS[str(settings.get("algorithm"))].one_shot_activations
    except (ImportError, KeyError, AttributeError):
        one_shot = False
    if one_shot and size and batch:
        return math.ceil(size / batch)
    return steps if steps else None


def _ms(row: Mapping[str, Any], key: str) -> float | None:
    return finite(row.get(key))


def _memory(row: Mapping[str, Any]) -> float | None:
    memory = row.get("memory")
    return finite(memory.get("total")) if isinstance(memory, dict) else None


def _round_mb(row: Mapping[str, Any]) -> float | None:
    value = finite(row.get("bytes_amortised"))
    value = finite(row.get("bytes_round")) if value is None else value
    return None if value is None else value / MB


def _pace_ms(row: Mapping[str, Any]) -> float | None:
    """A device's own part of an iteration: compute + transfer (the straggler sets it)."""
    compute, transfer = _ms(row, "compute_ms"), _ms(row, "transfer_ms")
    return None if compute is None or transfer is None else compute + transfer


def fleet_ms(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The planner's time per iteration for these rows (one per device profile): the
    slowest device's compute + transfer plus the server's work for every device."""
    paces = [_pace_ms(r) for r in rows]
    servers = [_ms(r, "server_ms") for r in rows]
    if not rows or any(v is None for v in paces + servers):
        return None
    return max(p for p in paces if p is not None) + sum(s for s in servers if s is not None)


# ---------------------------------------------------------------------- the devices


@dataclass
class Device:
    """One agent: its profile, the cut it trained at, the planner's row there, and its
    measured per-round means."""

    agent: str
    profile: str | None
    cut: int | None
    row: dict[str, Any] | None
    planned: dict[str, Any]  # the plan's own `agents` entry (per-round predictions)
    compute_s: float | None = None  # measured, mean per round it reported
    transfer_s: float | None = None
    peak_rss_mb: float | None = None


def _per_round(total: float | None, count: int) -> float | None:
    return None if total is None or count <= 0 else total / count


def devices(plan: Any, agents: Mapping[str, Any]) -> list[Device]:
    """Every agent the run or the plan knows, at the cut it trained at: the metrics' cut
    first, then the plan's per-agent cut, then the plan's server cut. `agents` are the
    report's `AgentTotals` by agent id. Where the plan lists its agents, one it did not
    plan (a three-tier run's edge) gets no row, whatever its profile."""
    plan = plan if isinstance(plan, dict) else {}
    planned = {a: _dict(v) for a, v in _dict(plan.get("agents")).items()}
    rows = device_rows(plan)
    whole = bool(rows) and all(len(r) == 1 for r in rows.values())  # no split (FedAvg)
    out = []
    for agent in sorted({*agents, *planned}, key=_natural):
        totals = agents.get(agent)
        info = planned.get(agent, {})
        profile = getattr(totals, "profile", None) or info.get("profile")
        cut = _int(getattr(totals, "cut", None))
        cut = cut if cut is not None else _int(info.get("cut"))
        unplanned = bool(planned) and agent not in planned
        cut = cut if cut is not None or unplanned else used_split(plan)
        by_k = {} if unplanned else rows.get(str(profile)) or (
            next(iter(rows.values())) if len(rows) == 1 else {})
        row = next(iter(by_k.values())) if whole and by_k else by_k.get(cut) if cut else None
        device = Device(agent, profile, cut, row, info)
        if totals is not None:
            device.compute_s = _per_round(totals.compute_s, totals.compute_rounds)
            device.transfer_s = _per_round(totals.transfer_s, totals.transfer_rounds)
            device.peak_rss_mb = totals.peak_rss_mb
        out.append(device)
    return out


def predicted_round(device: Device, iters: int | None) -> dict[str, float | None]:
    """The planner's per-round numbers for this device at its cut: compute and transfer
    seconds, training memory and budget (bytes), MB on the wire. From its profile's row at
    that cut; without a row, from the plan's per-agent entry when it is for that cut."""
    row = device.row
    if row is not None:
        def seconds(key: str) -> float | None:
            ms = _ms(row, key)
            return None if ms is None or not iters else ms * iters / 1e3
        return {"compute_s": seconds("compute_ms"), "transfer_s": seconds("transfer_ms"),
                "memory": _memory(row), "budget": finite(row.get("budget_bytes")),
                "mb": _round_mb(row), "fits": row.get("fits")}
    info = device.planned if _int(device.planned.get("cut")) == device.cut else {}
    memory, budget = finite(info.get("predicted_memory_mb")), finite(info.get("budget_mb"))
    return {"compute_s": finite(info.get("predicted_compute_s")),
            "transfer_s": finite(info.get("predicted_transfer_s")),
            "memory": None if memory is None else memory * MIB,
            "budget": None if budget is None else budget * MIB, "mb": None, "fits": None}


def _distinct_rows(fleet: Sequence[Device]) -> list[dict[str, Any]] | None:
    """One row per (profile, cut) in use, as the planner counts a fleet; None when some
    device has no row."""
    seen: dict[tuple[str | None, int | None], dict[str, Any]] = {}
    for d in fleet:
        if d.row is None:
            return None
        seen.setdefault((d.profile, d.cut), d.row)
    return list(seen.values())


def fleet_value_ms(plan: Mapping[str, Any], fleet: Sequence[Device]) -> float | None:
    """The planner's time per iteration for the cuts the run used: its own number where
    the run used its choice (or one common cut it costed), else from the devices' rows."""
    cuts = {d.cut for d in fleet}
    chosen = _dict(plan.get("chosen"))
    if fleet and all(d.profile in chosen and chosen[d.profile] == d.cut for d in fleet):
        value = finite(plan.get("value"))
        if value is not None:
            return value
    if len(cuts) == 1:
        for f in plan.get("fleet", []) if isinstance(plan.get("fleet"), list) else []:
            if isinstance(f, dict) and f.get("k") in cuts and finite(f.get("value")) is not None:
                return finite(f.get("value"))
    rows = _distinct_rows(fleet)
    return None if rows is None else fleet_ms(rows)


def predicted_run(plan: Any, agents: Mapping[str, Any]) -> dict[str, float] | None:
    """The plan's prediction for the whole run at the cuts the devices trained at: training
    MB (each device's MB per round, summed, × rounds) and seconds (the fleet's ms per
    iteration × iterations × rounds)."""
    if not isinstance(plan, dict):
        return None
    rounds = _int(_dict(plan.get("settings")).get("rounds"))
    fleet = [d for d in devices(plan, agents) if d.row is not None]
    if not fleet or not rounds:
        return None
    iters = iterations(plan) or 0
    value = fleet_value_ms(plan, fleet)
    return {"mb": sum(_round_mb(d.row) or 0.0 for d in fleet if d.row) * rounds,
            "seconds": (value or 0.0) * iters * rounds / 1e3}


# ---------------------------------------------------------------------- the choice in words


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _cut_name(row: Mapping[str, Any] | None, cut: int | None) -> str:
    name = row.get("cut") if isinstance(row, Mapping) else None
    return f"k = {cut} (after {name})" if isinstance(name, str) else f"k = {cut}"


def _ks(ks: Sequence[int]) -> str:
    if len(ks) > 2 and list(ks) == list(range(ks[0], ks[-1] + 1)):
        return f"{ks[0]}–{ks[-1]}"
    return ", ".join(str(k) for k in ks)


def _hand_cuts(trial: Mapping[str, Any]) -> tuple[dict[str, int], int | None]:
    """The cuts a trial's settings set by hand: (--cut per agent, --split)."""
    cuts = {a: k for a, k in _dict(trial.get("cuts")).items() if _int(k) is not None}
    return cuts, _int(trial.get("split"))


def _objective_words(objective: str) -> tuple[str, str, str]:
    """(what a device minimises, its row key, unit) for the planner's objective."""
    if objective == "bytes":
        return "MB per round on the wire", "bytes", "MB"
    if objective == "device-flops":
        return "device GFLOPs per iteration", "device_gflops", "GFLOPs"
    return "round time", "total_ms", "s"


def _row_value(row: Mapping[str, Any], objective: str, iters: int) -> float | None:
    if objective == "bytes":
        return _round_mb(row)
    if objective == "device-flops":
        return finite(row.get("device_gflops"))
    total = finite(row.get("total_ms"))
    return None if total is None else total * iters / 1e3


def _position(cut: int, fitting: list[int], unfit: list[int]) -> str:
    if fitting and cut == fitting[0]:
        return "the shallowest cut"
    if fitting and cut == fitting[-1]:
        return "the deepest cut that fits" if unfit and unfit[-1] > cut else "the deepest cut"
    return "this cut"


def _unfit(plan: Mapping[str, Any], profiles: Sequence[str | None], *, named: bool) -> str:
    """'; k = 6–7 would not fit its 2.40 GiB' for each profile with cuts that do not fit
    (named: 'the <profile>'s' for a note on several profiles)."""
    rows = device_rows(plan)
    notes = []
    for profile in dict.fromkeys(profiles):
        by_k = rows.get(str(profile), {})
        unfit = sorted(k for k, r in by_k.items() if not r.get("fits"))
        budget = next((finite(r.get("budget_bytes")) for r in by_k.values()), None)
        if unfit and budget:
            whose = f"the {profile}'s" if named else "its"
            notes.append(f"k = {_ks(unfit)} would not fit {whose} {budget / GIB:.2f} GiB")
    return "".join(f"; {n}" for n in notes)


def _own_choice(rows: Mapping[int, Mapping[str, Any]], cut: int, objective: str,
                iters: int) -> str:
    """Why `cut` on its own: it minimised this device's objective; the runner-up named."""
    what, _, unit = _objective_words(objective)
    values = {k: _row_value(r, objective, iters) for k, r in rows.items() if r.get("fits")}
    mine = values.get(cut)
    others = sorted((v, k) for k, v in values.items() if k != cut and v is not None)
    spec = ".3f" if objective == "device-flops" else ".2f"
    text = f"it minimised this device's predicted {what}: {_fmt(mine, spec)} {unit}"
    if objective == "time":
        text += (f" per round ({iters} iterations of its compute + transfer + the server's "
                 f"work for it)")
    if others:
        text += f" against {others[0][0]:{spec}} {unit} at k = {others[0][1]}, the next best"
    return text


def _fleet_choice(plan: Mapping[str, Any], fleet: Sequence[Device], device: Device,
                  best_k: int, iters: int) -> str:
    """Why a per-device cut that is not this device's own best: what it costs the device,
    what it saves the coordinator, and the fleet's time with and without it."""
    rows = device_rows(plan).get(str(device.profile), {})
    here, best = rows.get(device.cut or 0), rows.get(best_k)
    if here is None or best is None:
        return f"the fleet's predicted round time is least with it (its own best is k = {best_k})"
    alternative = [Device(d.agent, d.profile, best_k if d.profile == device.profile else d.cut,
                          best if d.profile == device.profile else d.row, {}) for d in fleet]
    alt_rows = _distinct_rows(alternative)
    now, then = fleet_value_ms(plan, fleet), (fleet_ms(alt_rows) if alt_rows else None)
    side = "deeper" if (device.cut or 0) > best_k else "shallower"
    text = (f"{side} than its own fastest k = {best_k}: its compute + transfer goes from "
            f"{_fmt(_pace_ms(best), '.0f')} to {_fmt(_pace_ms(here), '.0f')} ms per iteration "
            f"and the server's work for it from {_fmt(_ms(best, 'server_ms'), '.0f')} to "
            f"{_fmt(_ms(here, 'server_ms'), '.0f')} ms")
    if now is not None and then is not None:
        text += (f", so the fleet's iteration takes {now:.0f} ms against {then:.0f} ms with "
                 f"this device at k = {best_k} ({now * iters / 1e3:.2f} s against "
                 f"{then * iters / 1e3:.2f} s per round)")
    return text


def _common_choice(plan: Mapping[str, Any], k: int | None, objective: str) -> str:
    fleet = [f for f in plan.get("fleet", []) if isinstance(f, dict)] \
        if isinstance(plan.get("fleet"), list) else []
    values = sorted((v, f.get("k")) for f in fleet
                    if f.get("fits") and (v := finite(f.get("value"))) is not None)
    mine = next((v for v, kk in values if kk == k), None)
    what = {"bytes": "bytes per round", "device-flops": "largest device GFLOPs per "
            "iteration"}.get(objective, "time per iteration (the slowest device's compute + "
                                        "transfer plus the server's work for every device)")
    spec = ",.0f" if objective == "bytes" else ".3f" if objective == "device-flops" else ".0f"
    unit = " ms" if objective == "time" else ""
    if mine is None:
        return f"k = {k} is not among the fleet's costed cuts"
    low, low_k = values[0]
    if mine > low * (1 + 1e-9):  # the plan's cut is not its own minimum: say so
        return (f"the fleet's predicted {what} at k = {k} is {mine:{spec}}{unit}; the least "
                f"is k = {low_k} at {low:{spec}}{unit}")
    text = f"k = {k} minimised the fleet's predicted {what}: {mine:{spec}}{unit}"
    runner = next(((v, kk) for v, kk in values if kk != k), None)
    if runner is not None:
        text += f", next best k = {runner[1]} at {runner[0]:{spec}}{unit}"
    return text


def why(plan: Mapping[str, Any], fleet: Sequence[Device], members: Sequence[Device],
        trial: Mapping[str, Any]) -> str:
    """The choice for `members` (one profile at one cut, or every device at a common cut)
    in words, after 'k = c —': a reason the plan carries, else the cut set by hand, else
    the planner's choice explained from its rows (which cut minimised the predicted round
    time, for the device or for the fleet) and the cuts that would not fit."""
    device = members[0]
    given = _given_reason(plan, device)
    if given is not None:
        return given
    if device.cut is None:
        return "the cut it trained at is not recorded"
    if device_rows(plan) and all(len(r) == 1 for r in device_rows(plan).values()):
        return "no split: the whole model trains on the device"
    chosen = {_int(_dict(plan.get("chosen")).get(str(d.profile))) for d in members}
    planner = chosen == {device.cut}
    hand, split = _hand_cuts(trial)
    if device.agent in hand or split is not None:
        return _hand_why(plan, fleet, members, chosen, hand, split)
    if not planner and chosen != {None}:
        known = sorted(k for k in chosen if k is not None)
        return f"not the planner's choice (k = {_ks(known)})"
    return _planner_why(plan, fleet, members, lead=True)


def _given_reason(plan: Mapping[str, Any], device: Device) -> str | None:
    """A reason the plan itself carries for this device's cut, if any."""
    for source in (device.planned, _dict(_dict(plan.get("per_device")).get(str(device.profile)))):
        for key in REASON_KEYS:
            if isinstance(source.get(key), str) and source[key].strip():
                return source[key].strip()
    return None


def _hand_why(plan: Mapping[str, Any], fleet: Sequence[Device], members: Sequence[Device],
              chosen: set[int | None], hand: Mapping[str, int], split: int | None) -> str:
    """A cut set by hand (`--split` or `--cut`), and how it stands to the planner's."""
    device = members[0]
    how = (f"set by hand (--split {split})" if split is not None else "set by hand ("
           + " ".join(f"--cut {d.agent}={hand[d.agent]}" for d in members
                      if d.agent in hand) + ")")
    if chosen == {device.cut}:
        return f"{how}, which is also the planner's choice: " + _planner_why(
            plan, fleet, members, lead=False)
    known = sorted(k for k in chosen if k is not None)
    profiles = [d.profile for d in members]
    return (how + (f"; the planner chose k = {_ks(known)}" if known else "")
            + _unfit(plan, profiles, named=len(set(profiles)) > 1))


def _common_why(plan: Mapping[str, Any], members: Sequence[Device], cut: int,
                objective: str) -> str:
    """Why every device trains at one cut: asked for, or no per-device choice beat it."""
    if plan.get("common_split"):
        head = "one cut for every device (a common split was asked for)"
    elif isinstance(plan.get("chosen"), dict) and len(device_rows(plan)) > 1:
        head = "no per-device choice beat one cut for every device"
    else:
        head = "the plan's cut"
    profiles = [d.profile for d in members]
    return (f"{head}: {_common_choice(plan, cut, objective)}"
            + _unfit(plan, profiles, named=len(set(profiles)) > 1))


def _best_k(plan: Mapping[str, Any], device: Device) -> int | None:
    """The cut the planner found best for this device's profile on its own."""
    return next((_int(d.get("best_k")) for d in plan.get("devices", [])
                 if isinstance(d, dict) and str(d.get("profile")) == str(device.profile)),
                None)


def _planner_why(plan: Mapping[str, Any], fleet: Sequence[Device], members: Sequence[Device],
                 *, lead: bool) -> str:
    device, cut = members[0], members[0].cut or 0
    rows = device_rows(plan).get(str(device.profile), {})
    objective = str(plan.get("objective") or "time")
    iters = iterations(plan) or 1
    if len({d.cut for d in fleet}) == 1:  # one cut for every device
        return _common_why(plan, members, cut, objective)
    fitting = sorted(k for k, r in rows.items() if r.get("fits"))
    unfit = sorted(k for k, r in rows.items() if not r.get("fits"))
    position = _position(cut, fitting, unfit)
    best_k = _best_k(plan, device)
    own = objective != "time" or best_k is None or best_k == cut
    reason = (_own_choice(rows, cut, objective, iters) if own
              else _fleet_choice(plan, fleet, device, best_k or cut, iters))
    if lead:
        text = f"the planner chose {position}{' because' if own else ','} {reason}"
    elif position == "this cut":
        text = reason
    else:
        text = f"{position}{', because' if own else ','} {reason}"
    return text + _unfit(plan, [device.profile], named=False)


# ---------------------------------------------------------------------- the section


def _group(fleet: Sequence[Device], hand: Mapping[str, int]) -> list[list[Device]]:
    """Devices grouped by (profile, cut, whether set by hand), in order of first
    appearance; one group when every device trained at one cut, set alike."""
    if len({d.cut for d in fleet}) == 1 and len({d.agent in hand for d in fleet}) == 1:
        return [list(fleet)]
    groups: dict[tuple[str | None, int | None, bool], list[Device]] = {}
    for d in fleet:
        groups.setdefault((d.profile, d.cut, d.agent in hand), []).append(d)
    return list(groups.values())


def _names(members: Sequence[Device]) -> str:
    ids = ", ".join(d.agent for d in members)
    profiles = list(dict.fromkeys(d.profile for d in members))
    if len(profiles) == 1 and profiles[0]:
        return f"{ids} ({profiles[0]})"
    return f"every device ({ids})"


def _intro(plan: Mapping[str, Any], fleet: Sequence[Device]) -> str:
    planned_as = plan.get("planned_as") or plan.get("algorithm")
    objective = plan.get("objective") or "time"
    how = f"planned as {planned_as}, objective {objective}"
    cuts = sorted({d.cut for d in fleet if d.cut is not None})
    if not cuts:
        return f"No device's cut is recorded ({how})."
    if len({d.cut for d in fleet}) == 1:
        only = fleet[0]
        return f"Every device at {_cut_name(only.row, only.cut)}; {how}."
    groups = "; ".join(f"{_names(m)} at {_cut_name(m[0].row, m[0].cut)}"
                       for m in _group(fleet, {}))
    server = used_split(plan)
    server = max(cuts) if server is None else server
    return (f"Each device trains at its own cut ({how}); the coordinator completes the "
            f"shallower ones to the server cut k = {server}: {groups}.")


def _gib(value: float | None) -> str:
    return _fmt(None if value is None else value / GIB, ".2f")


def devices_table(fleet: Sequence[Device], iters: int | None) -> list[str]:
    """Per agent: its cut, and the planner's per-round prediction at that cut next to what
    the agent measured."""
    headers = ["agent", "profile", "cut (k)", "compute s/round: plan", "measured",
               "transfer s/round: plan", "measured", "memory GiB: plan", "peak RSS",
               "budget GiB", "fits", "MB/round: plan"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for d in fleet:
        p = predicted_round(d, iters)
        cut = "—" if d.cut is None else (f"{d.row['cut']} ({d.cut})" if d.row and
                                         isinstance(d.row.get("cut"), str) else str(d.cut))
        fits = "—" if p["fits"] is None else "yes" if p["fits"] else "NO"
        rss = None if d.peak_rss_mb is None else d.peak_rss_mb * MIB
        lines.append("| " + " | ".join([
            d.agent, d.profile or "—", cut, _fmt(p["compute_s"], ".2f"),
            _fmt(d.compute_s, ".2f"), _fmt(p["transfer_s"], ".2f"), _fmt(d.transfer_s, ".2f"),
            _gib(p["memory"]), _gib(rss), _gib(p["budget"]), fits,
            _fmt(p["mb"], ".2f")]) + " |")
    return [*lines, ""]


def _traffic_line(fleet: Sequence[Device], rows: Sequence[Mapping[str, Any]]) -> str | None:
    planned = [_round_mb(d.row) for d in fleet if d.row is not None]
    per_round = [finite(r.get("bytes_up")) for r in rows]
    down = [finite(r.get("bytes_down")) for r in rows]
    measured = [u + w for u, w in zip(per_round, down, strict=True)
                if u is not None and w is not None]
    if not planned or any(v is None for v in planned) or not measured:
        return None
    mean = sum(measured) / len(measured) / MB
    return (f"Traffic is measured for the fleet, not per device: {mean:.2f} MB per round on "
            f"average (training, up + down) against the plan's "
            f"{sum(v for v in planned if v is not None):.2f} MB (the devices' MB/round summed).")


def _pace_line(plan: Mapping[str, Any], fleet: Sequence[Device], iters: int | None,
               rows: Sequence[Mapping[str, Any]]) -> str | None:
    value = fleet_value_ms(plan, fleet)
    if value is None or not iters:
        return None
    text = (f"Predicted round for these cuts: {value:.0f} ms per iteration (the slowest "
            f"device's compute + transfer plus the server's work for every device), "
            f"{value * iters / 1e3:.2f} s per round of {iters} iterations")
    common_k, common = _int(plan.get("best_common_k")), finite(plan.get("best_common_value"))
    if len({d.cut for d in fleet}) > 1 and common_k is not None and common is not None:
        text += (f", against {common:.0f} ms ({common * iters / 1e3:.2f} s) with every device "
                 f"at the best common cut k = {common_k}")
    seconds = [s for s in (finite(r.get("seconds")) for r in rows) if s is not None]
    if seconds:
        text += (f"; rounds took {sum(seconds) / len(seconds):.2f} s on average here "
                 f"(evaluation and emulation included)")
    return text + "."


def plan_section(plan: Any, agents: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                 trial: Mapping[str, Any] | None = None) -> list[str]:
    """The section's body for a planner's plan (empty when `plan` is not one): the cuts,
    the per-agent table, the traffic and pace lines, and the choice per device in words."""
    if not device_rows(plan) and not _dict(plan.get("agents") if isinstance(plan, dict)
                                           else None):
        return []
    fleet = devices(plan, agents)
    if not fleet:
        return []
    iters = iterations(plan)
    lines = [_intro(plan, fleet), "", *devices_table(fleet, iters)]
    lines += [f"Per-round predictions are the planner's ms per iteration × {iters} "
              f"iterations; measured: each agent's mean over the rounds it reported."
              if iters else "Measured: each agent's mean over the rounds it reported.", ""]
    for line in (_pace_line(plan, fleet, iters, rows), _traffic_line(fleet, rows)):
        if line:
            lines += [line, ""]
    trial = trial or {}
    lines += ["Why these cuts:", ""]
    lines += [f"- {_names(m)}: {_cut_name(m[0].row, m[0].cut)} — {why(plan, fleet, m, trial)}."
              for m in _group(fleet, _hand_cuts(trial)[0])]
    return [*lines, ""]


def fleet_cost_table(plan: Mapping[str, Any], fleet: Sequence[Device]) -> list[str]:
    """The fleet's cost at every common cut; the common cut in use, or in a per-device run
    the best common cut, in bold."""
    costs = [f for f in plan.get("fleet", []) if isinstance(f, dict)] \
        if isinstance(plan.get("fleet"), list) else []
    if not costs:
        return []
    cuts = {d.cut for d in fleet}
    per_device = len(cuts) > 1
    mark = _int(plan.get("best_common_k")) if per_device else next(iter(cuts), None)
    title = ("One cut for every device instead (fleet, predicted ms per iteration; the best "
             "in bold):" if per_device else
             "Cost against split point (fleet, predicted ms per iteration):")
    cells = []
    for f in costs:
        text = _fmt(finite(f.get("value")), ".0f")
        if f.get("k") == mark:
            text = f"**{text}**"
        cells.append(text + ("" if f.get("fits") else " ✗"))
    return [title, "", "| k | " + " | ".join(str(f.get("k")) for f in costs) + " |",
            "|---|" + "---|" * len(costs), "| ms | " + " | ".join(cells) + " |", ""]

"""A fleet plan as JSON: what `jetsplit export plan --json` prints, what a trial saves as
plan.json and what the report reads back (per-device predictions at each device's cut)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from jetsplit.export.planner import FleetPlan


def plan_to_dict(plan: FleetPlan) -> dict[str, Any]:
    """The whole plan as plain JSON types."""
    devices = []
    for d in plan.devices:
        rows = []
        for r in d.rows:
            row = {k: v for k, v in asdict(r).items() if k != "memory"}
            row.update(memory=r.memory.as_dict(), fits=r.fits, total_ms=r.total_ms,
                       bytes_amortised=r.bytes_amortised(plan.settings.rounds))
            rows.append(row)
        devices.append({"profile": d.profile, "time_source": d.time_source,
                        "best_k": d.best_k, "rows": rows})
    return {
        "model": plan.model, "algorithm": plan.algorithm, "objective": plan.objective,
        "settings": asdict(plan.settings), "common_split": plan.common,
        "chosen": plan.chosen, "chosen_k": plan.common_k, "server_cut": plan.server_cut,
        "per_device": per_device(plan), "value": plan.value,
        "best_common_k": plan.best_common_k,
        "best_common_value": (None if plan.best_common_k is None
                              else plan.fleet_values[plan.best_common_k]),
        "devices": devices,
        "fleet": [{"k": k, "value": v, "fits": plan.fleet_fits[k]}
                  for k, v in plan.fleet_values.items()],
    }


def per_device(plan: FleetPlan) -> dict[str, dict[str, Any]]:
    """Per profile: the chosen cut and its predicted compute, transfer, server (completion
    included) time per iteration, and training memory against the budget."""
    out = {}
    for name, k in plan.chosen.items():
        if k is None:
            out[name] = {"cut": None}
            continue
        r = plan.row(name, k)
        out[name] = {"cut": k, "cut_after": r.cut, "compute_ms": r.compute_ms,
                     "transfer_ms": r.transfer_ms, "server_ms": r.server_ms,
                     "memory_bytes": r.memory.total, "budget_bytes": r.budget_bytes}
    return out

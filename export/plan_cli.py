"""`jetsplit export plan`: every split candidate's cost on each device, and the choice.

Kept torch-free on the cached path (see export/cost_model.py) so it answers in well under
two seconds.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from jetsplit.catalog import DEFAULT_METHOD
from jetsplit.export.plan_json import per_device, plan_to_dict
from jetsplit.export.planner import ALGORITHMS, NOT_PLANNED, OBJECTIVES, FleetPlan, PlanSettings

_ALGO_HELP = (" | ".join(ALGORITHMS) + ". The split methods get a cut per device (the "
              "coordinator completes shallow devices to the deepest cut; ampere: each device's "
              "block + aux head at its own cut, §3.2.1); fedavg one common cut. "
              + "; ".join(NOT_PLANNED.values()) + ".")


def plan(
    model: Annotated[str, typer.Option(
        "--model", help="Model source: zoo name, module:factory, torchvision:NAME.")],
    profile: Annotated[list[str], typer.Option(
        "--profile", help="Device profile (path or bundled name); repeat for a fleet.")],
    algorithm: Annotated[str, typer.Option("--algorithm", help=_ALGO_HELP)] = DEFAULT_METHOD,
    batch: Annotated[int, typer.Option("--batch", help="Batch size per device.")] = 32,
    local_steps: Annotated[int, typer.Option(
        "--local-steps", help="T: iterations per round (Ampere: per epoch).")] = 10,
    dataset_size: Annotated[int | None, typer.Option(
        "--dataset-size", help="Samples per device: Ampere's epoch length and one-shot "
        "activation upload (default T × batch).")] = None,
    rounds: Annotated[int, typer.Option(
        "--rounds", help="Rounds that one-shot transfers are amortised over.")] = 100,
    bandwidth: Annotated[float | None, typer.Option(
        "--bandwidth", help="Link speed in Mbit/s for up and down, overriding profiles.")
    ] = None,
    objective: Annotated[str, typer.Option(
        "--objective", help=f"What to minimise: {' | '.join(OBJECTIVES)}.")] = "time",
    input_shape: Annotated[str, typer.Option("--input-shape", help="C,H,W per sample.")
                           ] = "3,32,32",
    classes: Annotated[int, typer.Option("--classes", help="Number of classes.")] = 10,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", help="sgd | momentum | adam (optimizer state 0×, 1×, 2× params).")
    ] = "sgd",
    codec: Annotated[str, typer.Option(
        "--codec", help="Activation codec on the wire: fp32 | fp16 | bf16 | int8.")] = "fp32",
    server_profile: Annotated[str, typer.Option(
        "--server-profile", help="Profile of the machine running the server block.")
    ] = "x86-cpu",
    context_mb: Annotated[float | None, typer.Option(
        "--context-mb", help="Runtime context per device in MiB (default by device kind: "
        "300 Jetson/GPU CUDA context, 250 CPU).")] = None,
    common_split: Annotated[bool, typer.Option(
        "--common-split", help="One cut for the whole fleet (no per-device cuts).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Cost of every split candidate and the planner's choice."""
    from jetsplit.cli_types import parse_shape
    from jetsplit.export.cost_model import get_costs
    from jetsplit.export.planner import check_feasible, plan_fleet
    from jetsplit.profiles import resolve_profile

    settings = PlanSettings(
        algorithm=algorithm, batch=batch, local_steps=local_steps, dataset_size=dataset_size,
        rounds=rounds, bandwidth_mbps=bandwidth, objective=objective, optimizer=optimizer,
        codec=codec, context_mb=context_mb, common_split=common_split)
    settings.validate()
    shape = parse_shape(input_shape)
    devices = [resolve_profile(p) for p in profile]
    server = resolve_profile(server_profile)
    costs = get_costs(model, shape, classes)
    result = plan_fleet(costs, devices, server, settings)
    if json_out:
        typer.echo(json.dumps(plan_to_dict(result)))
    else:
        _print_tables(result)
    check_feasible(result)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _print_tables(plan: FleetPlan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    s = plan.settings
    for d in plan.devices:
        chosen = plan.chosen.get(d.profile)
        table = Table(title=f"{plan.model} on {d.profile} — {plan.algorithm}, batch {s.batch}, "
                      f"T={s.local_steps}, {s.codec}, objective {plan.objective} "
                      f"(times: {d.time_source})", title_justify="left")
        once = any(r.bytes_once for r in d.rows)
        cols = ["k", "cut after", "dev GFLOP/it", "train MiB", "fits", "act KiB/sample",
                "bytes/iter", "bytes/round", *(["bytes once"] if once else []), "ms/iter",
                "compute/xfer/server ms", ""]
        for col in cols:
            table.add_column(col, justify="left" if col in ("cut after", "") else "right")
        for r in d.rows:
            mark = "◀ chosen" if r.k == chosen else ("own best" if r.k == d.best_k else "")
            table.add_row(
                str(r.k), r.cut, f"{r.device_gflops:.2f}", f"{r.memory.total / 2**20:.0f}",
                "yes" if r.fits else "[red]no[/red]", f"{r.activation_bytes_per_sample / 1024:.1f}",
                _bytes(r.bytes_iter), _bytes(r.bytes_round),
                *([_bytes(r.bytes_once)] if once else []), f"{r.total_ms:.1f}",
                f"{r.compute_ms:.1f}/{r.transfer_ms:.1f}/{r.server_ms:.1f}", mark,
                style="bold" if r.k == chosen else None)
        console.print(table)
    if plan.common and len(plan.devices) > 1:
        what = {"time": "max device ms + server ms", "bytes": "fleet bytes/round",
                "device-flops": "max device GFLOP/it"}[plan.objective]
        console.print(f"fleet, one common split for {len(plan.devices)} devices: {what}")
        fleet = Table()
        for col in ("k", "fits all", "value", ""):
            fleet.add_column(col, justify="right")
        for k, value in plan.fleet_values.items():
            fleet.add_row(str(k), "yes" if plan.fleet_fits[k] else "[red]no[/red]",
                          f"{value:,.2f}", "◀ chosen" if k == plan.common_k else "")
        console.print(fleet)
    if not plan.common:
        _print_per_device(console, plan)
    if plan.common_k is not None:
        cut = plan.devices[0].rows[[r.k for r in plan.devices[0].rows].index(plan.common_k)].cut
        console.print(f"chosen split: k={plan.common_k} (after {cut}) for "
                      f"{'every device' if len(plan.devices) > 1 else plan.devices[0].profile}")
    else:
        for name, k in plan.chosen.items():
            console.print(f"chosen split on {name}: {k if k is not None else 'none fits'}")


def _print_per_device(console: Any, plan: FleetPlan) -> None:
    """Each device's cut and predicted times, and the round against the best common cut."""
    from rich.table import Table

    s = plan.settings
    table = Table(title=f"per-device cuts ({plan.objective}); the coordinator completes "
                  f"shallow devices to k={plan.server_cut}", title_justify="left")
    for col in ("device", "cut", "cut after", "compute ms/it", "transfer ms/it",
                "server ms/it", "train MiB", "budget MiB"):
        table.add_column(col, justify="left" if col in ("device", "cut after") else "right")
    for name, d in per_device(plan).items():
        if d["cut"] is None:
            table.add_row(name, "none fits", *[""] * 6)
            continue
        table.add_row(name, str(d["cut"]), d["cut_after"], f"{d['compute_ms']:.1f}",
                      f"{d['transfer_ms']:.1f}", f"{d['server_ms']:.1f}",
                      f"{d['memory_bytes'] / 2**20:.0f}", f"{d['budget_bytes'] / 2**20:.0f}")
    console.print(table)
    common = plan.best_common_k
    if plan.objective == "time" and plan.value is not None:
        iters = s.iterations_per_round(ALGORITHMS[plan.algorithm])  # Ampere: one epoch
        line = f"predicted round time (T={iters}): {plan.value * iters / 1e3:.3f} s"
        if common is not None:
            base = plan.fleet_values[common]
            line += (f" per-device vs {base * iters / 1e3:.3f} s at the best common cut "
                     f"k={common} (ratio {plan.value / base:.3f})")
        console.print(line)
    elif common is not None:
        console.print(f"best common cut: k={common}")

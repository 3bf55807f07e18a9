"""`jetsplit profile`: measure this machine and write a measured device profile that
`jetsplit export plan --profile` accepts in place of datasheet peaks."""

# No `from __future__ import annotations` here: typer reads this module's signatures, and on
# Python < 3.10 it does not evaluate string annotations (every typer.Option would be lost).

from pathlib import Path
from typing import Optional

import typer
from typing_extensions import Annotated


def profile(
    model: Annotated[str, typer.Option("--model", help="Zoo model id to time layer by layer.")],
    input_shape: Annotated[str, typer.Option("--input-shape", help="C,H,W per sample.")
                           ] = "3,32,32",
    classes: Annotated[int, typer.Option("--classes", help="Number of classes.")] = 10,
    batch: Annotated[int, typer.Option("--batch", help="Batch size to time.")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats (median).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up repeats.")] = 2,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Profile to write (default profiles/<name>.toml; its stem names it).")
    ] = None,
    base_profile: Annotated[Optional[str], typer.Option(
        "--base-profile", help="Copy device/memory/compute/network fields from this profile "
        "(else they are measured on this host, network as a placeholder).")] = None,
    ort: Annotated[bool, typer.Option(
        "--ort/--no-ort", help="Also time each layer's forward in ONNX Runtime.")] = True,
    device: Annotated[str, typer.Option(
        "--device", help="auto | cpu | cuda (auto: CUDA when torch sees a GPU).")] = "auto",
) -> None:
    """Measure this machine: per-layer latency, memory, GFLOPS."""
    from jetsplit.cli_types import parse_shape
    from jetsplit.errors import ConfigError

    for flag, value, low in (("--batch", batch, 1), ("--repeats", repeats, 1),
                             ("--warmup", warmup, 0)):
        if value < low:  # checked before torch is imported: ~17 s on an emulated device
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    shape = parse_shape(input_shape)
    from rich.console import Console
    from rich.table import Table

    from jetsplit.export.profiler import profile_machine, profile_name
    from jetsplit.profiles import dump_profile, resolve_profile

    base = resolve_profile(base_profile) if base_profile else None
    console = Console(stderr=True)
    with console.status("measuring") as status:
        run = profile_machine(
            model, shape, classes, batch, repeats, base=base, out=out, ort=ort, warmup=warmup,
            device=device, on_layer=lambda name: status.update(f"measuring {name}"))
    path = out if out is not None else Path("profiles") / f"{profile_name(None, base, model)}.toml"
    dump_profile(run.profile, path)

    table = Table(title=f"{model} {shape} batch {batch}, median of {repeats}",
                  title_justify="left")
    for col in ("layer", "fwd ms", "bwd ms", "ORT fwd ms", "saved MiB", "peak MiB"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for m in run.layers:
        table.add_row(m.name, f"{m.fwd_ms:.2f}", f"{m.bwd_ms:.2f}",
                      "-" if m.ort_fwd_ms is None else f"{m.ort_fwd_ms:.2f}",
                      f"{m.saved_mb:.1f}", f"{m.peak_mem_mb:.1f}")
    out_console = Console()
    out_console.print(table)
    for note in run.notes:
        out_console.print(f"note: {note}")
    rss = "n/a" if run.peak_rss_mb is None else f"{run.peak_rss_mb:.0f} MiB"
    out_console.print(f"achieved {run.achieved_gflops:.2f} GFLOPS (fwd+bwd); "
                      f"process peak RSS {rss}")
    out_console.print(f"wrote {path}")

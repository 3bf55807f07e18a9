"""`jetsplit doctor`: what this device has, in one table (JetPack, CUDA, TensorRT, ONNX
Runtime providers, torch, memory, broker reachability). Optional parts say "absent" in
one line each; nothing here needs a GPU to run."""

# No `from __future__ import annotations` here: typer reads this module's signatures, and on
# Python < 3.10 it does not evaluate string annotations (every typer.Option would be lost).

import os
import platform
import re
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

import typer
from typing_extensions import Annotated

Row = Tuple[str, str, str]  # (check, value, verdict: ok | absent | problem)
RELEASE = Path("/etc/nv_tegra_release")
MODEL = Path("/proc/device-tree/model")


def jetpack_release(path: Path = RELEASE) -> Optional[str]:
    """L4T release from the file every Jetson image carries (e.g. "R35 (release), REVISION:
    4.1" → "L4T R35.4.1"); None elsewhere."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"L4T R{match.group(1)}.{match.group(2)}" if match else text.splitlines()[0][:60]


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def jetpack4_rows(release: Optional[str], model: Optional[str], cuda: bool,
                  env: Mapping[str, str]) -> List[Row]:
    """On JetPack 4 (L4T R32): why training runs on the CPU, and whether numpy's OpenBLAS is
    told the core type (without it numpy dies with "illegal instruction" on the A57)."""
    from jetsplit.edge_agent import jetpack

    l4t = jetpack.parse_l4t(release)
    if l4t is None or l4t[0] != 32:
        return []
    rows: List[Row] = []
    if not cuda:
        rows.append(("training on", jetpack.cpu_line((model or "").strip("\x00 \n")), "ok"))
    name, value = jetpack.OPENBLAS_ENV
    if env.get(name) == value:
        rows.append(("OpenBLAS core", f"{name}={value}", "ok"))
    else:
        rows.append(("OpenBLAS core", f"{name} is {env.get(name, 'unset')}: numpy dies with "
                     f"'illegal instruction' on the Cortex-A57; set {name}={value} (the "
                     "installer puts it in /etc/jetsplit/agent.env and the venv)", "problem"))
    return rows


def checks(broker: Optional[str] = None, wait_s: float = 5.0) -> List[Row]:
    """Every row of the report, in display order."""
    import psutil
    import torch

    from jetsplit.edge_agent.backends import detect_backends

    found = detect_backends()
    rows: List[Row] = [
        ("machine", f"{platform.machine()}, Python {found['python']}", "ok"),
    ]
    jetpack = jetpack_release()
    rows.append(("JetPack / L4T", jetpack or "not a Jetson", "ok" if jetpack else "absent"))
    rows.append(("torch", str(found["torch"]), "ok"))
    cuda = found["cuda"]
    rows.append(("torch CUDA", f"{cuda} on {found['gpu']}" if cuda else
                 "no CUDA device visible to torch", "ok" if cuda else "absent"))
    rows += jetpack4_rows(_read(RELEASE), _read(MODEL), bool(cuda), os.environ)
    trt = found["tensorrt"]
    rows.append(("TensorRT", str(trt) if trt else "not installed", "ok" if trt else "absent"))
    ort = found["onnxruntime"]
    rows.append(("ONNX Runtime", f"{ort}: {', '.join(found['onnxruntime_providers'])}" if ort
                 else "not installed (pip install onnxruntime)", "ok" if ort else "problem"))
    memory = psutil.virtual_memory()
    rows.append(("memory", f"{memory.available / 2**30:.1f} GiB available of "
                 f"{memory.total / 2**30:.1f} GiB", "ok"))
    rows.append(("CPU threads", f"{psutil.cpu_count()} logical, torch uses "
                 f"{torch.get_num_threads()}", "ok"))
    if broker:
        rows.append(("broker", *_broker(broker, wait_s)))
    return rows


def _broker(url: str, wait_s: float) -> Tuple[str, str]:
    from jetsplit.broker_url import parse_broker_url
    from jetsplit.errors import JetsplitError
    from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint

    try:
        address = parse_broker_url(url)
        endpoint = MqttEndpoint(address, f"jetsplit-doctor-{platform.node()}"[:64],
                                EndpointOptions(connect_timeout_s=wait_s))
        endpoint.start(wait_s=wait_s)
    except JetsplitError as exc:
        return str(exc), "problem"
    protocol = endpoint.protocol
    endpoint.close()
    return f"{address.url()} reachable (MQTT {protocol})", "ok"


def doctor(
    broker: Annotated[Optional[str], typer.Option(
        "--broker", help="Also check this broker: mqtt[s]://[user:pass@]host:port")] = None,
    wait_s: Annotated[float, typer.Option("--wait", help="Seconds to wait for the broker.")
                      ] = 5.0,
) -> None:
    """Report what this device has; exit 1 when something required is missing."""
    from rich.console import Console
    from rich.table import Table

    rows = checks(broker, wait_s)
    table = Table(title="jetsplit doctor", title_justify="left")
    for column in ("check", "value", "status"):
        table.add_column(column)
    style = {"ok": "green", "absent": "yellow", "problem": "red"}
    for name, value, verdict in rows:
        table.add_row(name, value, f"[{style[verdict]}]{verdict}[/]")
    Console().print(table)
    if any(verdict == "problem" for _, _, verdict in rows):
        raise typer.Exit(1)

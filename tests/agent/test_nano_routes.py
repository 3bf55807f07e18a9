"""The Nano's two stacks agree everywhere they are described: the field guide's device table,
the bundled profiles and what the installer does on JetPack 4 (its CPU route).
Torch-free: these also run under Python 3.8 and 3.9 in `.ci/run` (marker `device_pure`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from jetsplit.edge_agent import install as inst
from jetsplit.edge_agent import jetpack
from jetsplit.profiles import load_profile

pytestmark = pytest.mark.device_pure
ROOT = Path(__file__).resolve().parents[2]
NANO = "NVIDIA Jetson Nano Developer Kit"


def _nano_rows() -> dict[str, list[str]]:
    """The field guide's device table rows for the Nano, by their first cell."""
    text = (ROOT / "docs/field-guide.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("Jetson Nano"):
            rows[cells[0]] = cells
    return rows


def _profile_names(cell: str) -> list[str]:
    return re.findall(r"profile `([a-z0-9.-]+)`", cell)


def test_stock_nano_row_matches_the_installers_cpu_route() -> None:
    rows = _nano_rows()
    stock = rows["Jetson Nano, stock"]
    assert stock[1] == "4.6 (R32)"
    version = jetpack.R32_TORCH.split("==")[1]
    assert f"torch=={version}" in stock[3] and "CPU only" in stock[3]
    assert " ".join(jetpack.apt_packages(jetpack.R32_PYTHON)) in stock[4]
    assert "`--yes`" in stock[4]
    [profile] = _profile_names(stock[3])
    host = inst.Host(l4t=(32, 7), l4t_text=None, model=NANO, python=sys.executable,
                     python_version=jetpack.R32_PYTHON, torch=None, euid=0)
    assert host.cpu_route and inst.guess_profile(NANO, cpu=True, source=ROOT) == profile
    assert inst.constraints(host) == [jetpack.R32_TORCH, "numpy<2"]


def test_nano_profiles_say_what_runs() -> None:
    rows = _nano_rows()
    [cpu_name] = _profile_names(rows["Jetson Nano, stock"][3])
    [gpu_name] = _profile_names(rows["Jetson Nano, community Ubuntu 20.04 image"][3])
    python = "{}.{}".format(*jetpack.R32_PYTHON)
    cpu = load_profile(ROOT / "profiles" / f"{cpu_name}.toml")
    assert cpu.device.kind == "cpu" and cpu.compute.cuda_cores is None
    assert cpu.software.jetpack == "4.6" and cpu.software.python == python
    assert cpu.compute.peak_fp32_gflops < 0.25 * load_profile(
        ROOT / "profiles" / f"{gpu_name}.toml").compute.peak_fp32_gflops
    assert "estimate" in cpu.device.source and "Optimization Guide" in cpu.device.source
    for path in sorted((ROOT / "profiles").glob("jetson-nano-4gb*.toml")):
        profile = load_profile(path)
        # Every Nano profile describes a stack the agent runs on: Python 3.8, never 3.6.
        assert profile.software.python == python, path.name
        assert (profile.device.kind == "cpu") == path.stem.endswith("-cpu"), path.name
    assert "jetson-nano-4gb-cpu.toml" in (ROOT / "profiles/README.md").read_text()

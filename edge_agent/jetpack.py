"""What each JetPack release gives the agent: its Python, NVIDIA's PyTorch wheel folder, and
what pip must leave alone (NVIDIA's torch, onnxruntime-gpu, the numpy torch was built with).

Standard library only: the installer runs this from a checkout before anything is installed.
The agent needs Python >= 3.8 and torch >= 1.13: JetPack 5 (Python 3.8) and JetPack 6
(Python 3.10) qualify as they are. JetPack 4 (the Nano's last release: Ubuntu 18.04, Python
3.6) takes the CPU route: Ubuntu's own python3.8 from apt and PyPI's torch 1.13.1 for it,
which has no CUDA (NVIDIA's CUDA wheels for JetPack 4 stop at torch 1.10 for Python 3.6).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

MIN_PYTHON = (3, 8)
MIN_TORCH = (1, 13)
_REDIST = "https://developer.download.nvidia.com/compute/redist/jp"


@dataclass(frozen=True)
class JetPack:
    name: str  # "JetPack 5"
    ubuntu: str
    python: Tuple[int, int]  # the Python NVIDIA's torch wheels for it are built for


# L4T major → release. R34/R35 are JetPack 5 (Xavier NX, AGX Xavier, Orin on JP5).
RELEASES: Dict[int, JetPack] = {
    32: JetPack("JetPack 4", "18.04", (3, 6)),
    34: JetPack("JetPack 5", "20.04", (3, 8)),
    35: JetPack("JetPack 5", "20.04", (3, 8)),
    36: JetPack("JetPack 6", "22.04", (3, 10)),
}

# L4T (major, minor) → NVIDIA's PyTorch wheel folder for that JetPack; a minor that is not
# listed takes the newest folder of its major (5.1.3/5.1.4 use 5.1.2's wheels).
TORCH_WHEELS: Dict[Tuple[int, int], str] = {
    (36, 4): f"{_REDIST}/v61/pytorch/",
    (36, 3): f"{_REDIST}/v60/pytorch/",
    (36, 2): f"{_REDIST}/v60/pytorch/",
    (35, 4): f"{_REDIST}/v512/pytorch/",
    (35, 3): f"{_REDIST}/v511/pytorch/",
    (35, 2): f"{_REDIST}/v51/pytorch/",
    (35, 1): f"{_REDIST}/v502/pytorch/",
    (34, 1): f"{_REDIST}/v50/pytorch/",
}

# The CPU route on JetPack 4 (L4T R32): Ubuntu 18.04's universe carries python3.8 for arm64,
# PyPI carries torch 1.13.1 for cp38 aarch64 (CPU only): the torch the device floor is tested
# with. Unpinned, pip picks 2.1.0 (the newest wheel that fits 18.04's glibc 2.27), which the
# floor is not tested on. scripts/install-agent.sh names the same Python (a test holds them
# equal).
R32_PYTHON = (3, 8)
R32_TORCH = "torch==1.13.1"
# numpy's OpenBLAS misdetects the Nano's Cortex-A57 and dies with "illegal instruction"
# unless told the core type (jetson-inference #1023).
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "ARMV8")
NANO_LINE = ("JetPack 4 (L4T R32: Ubuntu 18.04, Python 3.6) needs Ubuntu's python3.8 for the "
             "agent: re-run scripts/install-agent.sh, which installs it with apt (asking "
             "first, or --yes), or set PYTHON=python3.8")


def parse_l4t(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """(major, minor) from /etc/nv_tegra_release ("# R32 (release), REVISION: 7.4, ...");
    None where there is no file, (0, 0) where it does not parse (still a Jetson)."""
    if text is None:
        return None
    match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def release(l4t: Optional[Tuple[int, int]]) -> Optional[JetPack]:
    return RELEASES.get(l4t[0]) if l4t else None


def describe(l4t: Tuple[int, int]) -> str:
    """"L4T R35.4 (JetPack 5)"."""
    found = release(l4t)
    return f"L4T R{l4t[0]}.{l4t[1]} ({found.name if found else 'JetPack ?'})"


def torch_wheels(l4t: Tuple[int, int]) -> Optional[str]:
    """NVIDIA's wheel folder for this L4T release (None where NVIDIA has none we know)."""
    if l4t in TORCH_WHEELS:
        return TORCH_WHEELS[l4t]
    same_major = sorted(k for k in TORCH_WHEELS if k[0] == l4t[0])
    return TORCH_WHEELS[same_major[-1]] if same_major else None


def version_tuple(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """(major, minor) of "2.4.0a0+3bcc3cddb5.nv24.07", "1.13.0", "1.24.4"; None if absent."""
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def numpy_constraint(torch: Optional[str], numpy: Optional[str]) -> Optional[str]:
    """The numpy pin that keeps the system torch loadable: torch < 2.3 was built against
    numpy 1.x (numpy 2 breaks its C API), and a system numpy 1.x is what NVIDIA's wheel
    was built with; None where pip may choose freely."""
    torch_v, numpy_v = version_tuple(torch), version_tuple(numpy)
    if (torch_v is not None and torch_v < (2, 3)) or (numpy_v is not None and numpy_v[0] < 2):
        return "numpy<2"
    return None


def pins(torch: Optional[str], numpy: Optional[str]) -> List[str]:
    """pip constraints that keep what the system's torch needs: NVIDIA's CUDA torch itself
    (never swapped for a PyPI CPU wheel) and the numpy it was built against."""
    held = [f"torch=={torch}"] if torch else []
    pin = numpy_constraint(torch, numpy)
    return held + ([pin] if pin else [])


def cpu_route(l4t: Optional[Tuple[int, int]], torch: Optional[str]) -> bool:
    """JetPack 4 with no torch for the agent's Python: PyPI's CPU-only torch 1.13.1 (a torch
    already there, such as one the user built with CUDA, is kept instead)."""
    return l4t is not None and l4t[0] == 32 and torch is None


def cpu_pins() -> List[str]:
    """pip constraints on the CPU route: torch 1.13.1 was built against numpy 1.x."""
    return [R32_TORCH, "numpy<2"]


def apt_packages(python: Tuple[int, int]) -> List[str]:
    """Ubuntu's packages for an interpreter, the venv module and its headers (the few sdists
    left build against them)."""
    name = f"python{python[0]}.{python[1]}"
    return [name, f"{name}-venv", f"{name}-dev"]


def cpu_line(model: Optional[str] = None) -> str:
    """Why a JetPack 4 device trains on its CPU, and what to do if it has a CUDA torch: the
    installer prints it, `jetsplit doctor` shows it."""
    device = "this Jetson Nano" if "nano" in (model or "").lower() else "this Jetson"
    return (f"{device} trains on its CPU: NVIDIA ships no CUDA torch for Python >= 3.8 on "
            "JetPack 4 (its wheels stop at torch 1.10 for Python 3.6), so the agent uses "
            f"PyPI's CPU-only {R32_TORCH}; for GPU training put a CUDA torch built for "
            "Python 3.8 into python3.8 before installing (it is kept), or flash an Ubuntu "
            "20.04 image (docs/field-guide.md)")


def installed(name: str) -> Optional[str]:
    """Version of a distribution this interpreter sees, None where absent."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def python_problem(l4t: Optional[Tuple[int, int]], python: Tuple[int, int],
                   torch: Optional[str]) -> Optional[str]:
    """One line when this interpreter cannot run the agent here, else None."""
    found = release(l4t)
    if python < MIN_PYTHON:
        if found is not None and found.name == "JetPack 4":
            return NANO_LINE
        return (f"the agent needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} (JetPack 5 ships "
                f"3.8, JetPack 6 3.10); this is {python[0]}.{python[1]}")
    torch_v = version_tuple(torch)
    if torch_v is not None and torch_v < MIN_TORCH:
        where = torch_wheels(l4t) if l4t else None
        return (f"torch {torch} is older than the agent needs ({MIN_TORCH[0]}.{MIN_TORCH[1]}"
                + (f"); install NVIDIA's newer wheel from {where}" if where else
                   "); install torch >= 1.13 first"))
    return None


def torch_hint(l4t: Tuple[int, int], python_path: str, python: Tuple[int, int]) -> str:
    """What to do when a Jetson's interpreter has no torch: NVIDIA's wheel, for the Python
    that JetPack ships (a PyPI torch would be CPU-only)."""
    found, url = release(l4t), torch_wheels(l4t)
    where = describe(l4t)
    if found is not None and found.name == "JetPack 4":
        return (f"torch is missing on this Jetson ({where}): NVIDIA has no torch >= 1.13 for "
                f"JetPack 4; the installer's CPU route puts PyPI's {R32_TORCH} into its "
                f"venv, or install a torch 1.13 built for Python {python[0]}.{python[1]} "
                f"into {python_path} first")
    if found is not None and python != found.python:
        want = f"{found.python[0]}.{found.python[1]}"
        return (f"torch is missing on this Jetson ({where}): NVIDIA's wheels for "
                f"{found.name} are built for Python {want}, this is {python[0]}.{python[1]}; "
                f"re-run with PYTHON=/usr/bin/python{want} after installing the wheel from "
                f"{url or 'NVIDIA'} into it")
    if url is None:
        return (f"torch is missing on this Jetson ({where}): install NVIDIA's PyTorch wheel "
                f"for your JetPack into {python_path} first (see NVIDIA's 'Installing PyTorch "
                "for Jetson Platform'), then re-run; never `pip install torch` from PyPI here")
    return (f"torch is missing on this Jetson ({where}): install NVIDIA's wheel from {url} "
            f"into {python_path} first (sudo {python_path} -m pip install <that .whl>), then "
            "re-run; a PyPI torch would be CPU-only")


def main(argv: List[str]) -> int:
    """`python3 edge_agent/jetpack.py constraints`: the pins for this interpreter, one per
    line (Dockerfile.jetson feeds them to pip; runs from a checkout, nothing installed)."""
    if argv != ["constraints"]:
        print("usage: jetpack.py constraints", file=sys.stderr)
        return 2
    for line in pins(installed("torch"), installed("numpy")):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

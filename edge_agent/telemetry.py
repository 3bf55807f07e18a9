"""What this agent costs its device right now, for the `status` reply: process RSS, memory
available (MemAvailable: Jetson memory is unified, so this is what the GPU can get too),
CPU load, the hottest thermal zone, and — on a Jetson — GPU/EMC load and power.

GPU figures come from jetson-stats (`jtop`, AGPL, optional and imported lazily; it needs its
root service) or else one line of `tegrastats`, whose format differs per board and JetPack;
the power mode (MAXN, 15W, ...) from `nvpmodel -q` where it is on PATH.
Those probes take up to a second, so they run in a background thread and their last result
is cached: a status call never waits on them. Everything else is a few /proc and /sys reads.
"""

from __future__ import annotations

import functools
import math
import os
import re
import select
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

MB = 1024 * 1024
THERMAL_ROOT = Path("/sys/class/thermal")
# A Jetson PMIC die zone reads a fixed 100 °C until a threshold trips (no real sensor), and an
# unpowered sensor reads -256 °C: neither is a temperature worth reporting.
_FAKE_ZONES = ("pmic",)
_VALID_C = (-40.0, 150.0)

# --- tegrastats -------------------------------------------------------------------------------
# One line, e.g. Nano/JP4 "... EMC_FREQ 0%@1600 GR3D_FREQ 0%@76 ... POM_5V_IN 2003/2003",
# Orin/JP6 "... EMC_FREQ 0%@2133 GR3D_FREQ 0%@[305,0] ... VDD_GPU_SOC 3175mW/3175mW", AGX
# Xavier "GPU 18401/18525 CPU 2301/2330 SOC 4602/4602 ...", old TX1 "EMC 1%@1600 GR3D 3%@76".
_GR3D = re.compile(r"\bGR3D(?:_FREQ)?\s+(\d+)%(?:@\[?([\d,]+)\]?)?")
_EMC = re.compile(r"\bEMC(?:_FREQ)?\s+(\d+)%(?:@(\d+))?")
# A power rail: NAME current/average, each optionally in mW ("VDD_IN 5336/4970",
# "VDD_IN 7421mW/8050mW"), or a lone current value with its unit ("VDD_IN 5765mW"). The
# lookahead stops "RAM 1409/3964MB" or "IRAM 0/252kB" from passing for rails.
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*)\s+(\d+)(?:mW)?/(\d+)(?:mW)?(?=\s|$)"
                   r"|\b([A-Z][A-Z0-9_]*)\s+(\d+)mW(?=\s|$)")
_INPUT_RAILS = ("VDD_IN", "POM_5V_IN")  # the board's input: its total draw where measured
_NOT_RAILS = {"RAM", "SWAP", "IRAM", "LFB"}


def parse_tegrastats(line: str) -> dict[str, Any]:
    """GPU (GR3D) and memory-controller (EMC) load and clock, and power per rail, from one
    tegrastats line of any board; fields the line lacks are None. `power_mw` is the input
    rail where the board has one, else the sum of its rails (AGX Xavier and AGX Orin
    measure only sub-rails)."""
    out: dict[str, Any] = {"gpu_load_pct": None, "gpu_freq_mhz": None,
                           "emc_load_pct": None, "emc_freq_mhz": None,
                           "power_mw": None, "power_rail": None, "rails_mw": {}}
    gr3d = _GR3D.search(line)
    if gr3d:
        out["gpu_load_pct"] = float(gr3d.group(1))
        clocks = [int(c) for c in (gr3d.group(2) or "").split(",") if c]
        out["gpu_freq_mhz"] = float(max(clocks)) if clocks else None  # GPC0/GPC1 on Orin
    emc = _EMC.search(line)
    if emc:
        out["emc_load_pct"] = float(emc.group(1))
        out["emc_freq_mhz"] = float(emc.group(2)) if emc.group(2) else None
    rails: dict[str, float] = {}
    for match in _RAIL.finditer(line):
        name = match.group(1) or match.group(4)
        value = match.group(2) or match.group(5)
        if name not in _NOT_RAILS:
            rails[name] = float(value)
    out["rails_mw"] = rails
    if rails:
        source = next((r for r in _INPUT_RAILS if r in rails), None)
        out["power_mw"] = rails[source] if source else float(sum(rails.values()))
        out["power_rail"] = source or "sum of rails"
    return out


def _tegrastats_line(binary: str, timeout_s: float) -> str:
    """The first line tegrastats prints, within `timeout_s` (it runs until killed)."""
    proc = subprocess.Popen([binary, "--interval", "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"tegrastats printed nothing within {timeout_s:.1f}s")
            ready, _, _ = select.select([proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"tegrastats exited with code {proc.wait()}")
                data += chunk
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _read_jtop(timeout_s: float) -> dict[str, Any]:
    """One reading through the jtop service (raises where the package or service is absent)."""
    from jtop import jtop  # AGPL optional extra: imported only here

    with jtop(interval=min(0.5, timeout_s)) as jetson:
        if not jetson.ok():  # waits for the service's next update
            raise RuntimeError("jtop service stopped answering")
        stats = dict(jetson.stats)
        emc = (getattr(jetson, "memory", None) or {}).get("EMC") or {}
    rails = {str(k)[len("Power "):]: float(v) for k, v in stats.items()
             if str(k).startswith("Power ") and k != "Power TOT" and _number(v)}
    total = stats.get("Power TOT")
    return {"gpu_load_pct": _finite(stats.get("GPU")), "gpu_freq_mhz": None,
            "emc_load_pct": _finite(emc.get("val")), "emc_freq_mhz": None,
            "power_mw": _finite(total) if total is not None else
            (float(sum(rails.values())) if rails else None),
            "power_rail": "jtop total" if total is not None else
            ("sum of rails" if rails else None),
            "rails_mw": rails}


_POWER_MODE = re.compile(r"NV Power Mode:\s*(\S.{0,31}?)\s*$", re.MULTILINE)


def parse_nvpmodel(text: str) -> str | None:
    """The mode name `nvpmodel -q` prints ("NV Power Mode: MAXN"), or None."""
    found = _POWER_MODE.search(text)
    return found.group(1) if found else None


def _nvpmodel_mode(binary: str, timeout_s: float) -> str | None:
    done = subprocess.run([binary, "-q"], capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)
    return parse_nvpmodel(done.stdout) if done.returncode == 0 else None


class GpuProbe:
    """Jetson GPU/EMC load and power, refreshed in the background at most every `ttl_s`.

    Which source to use is decided once (cheaply): jtop if importable, else tegrastats if on
    PATH, else a one-line "absent: …" reason and no thread at all. A failing jtop (service
    not running, user not in the `jtop` group) falls back to tegrastats for that reading.
    """

    def __init__(self, ttl_s: float = 5.0, timeout_s: float = 1.5,
                 tegrastats: str | None = None, use_jtop: bool | None = None,
                 nvpmodel: str | None = None) -> None:
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.tegrastats = tegrastats if tegrastats is not None else shutil.which("tegrastats")
        self.nvpmodel = nvpmodel if nvpmodel is not None else shutil.which("nvpmodel")
        self.use_jtop = _jtop_importable() if use_jtop is None else use_jtop
        self._lock = threading.Lock()
        self._reading: dict[str, Any] | None = None
        self._note: str | None = None
        self._at = -math.inf
        self._thread: threading.Thread | None = None
        self._started = 0.0

    @property
    def available(self) -> bool:
        return self.use_jtop or self.tegrastats is not None

    def read(self) -> tuple[dict[str, Any] | None, str]:
        """(last reading or None, a one-line note saying where it came from or why not);
        starts a refresh when the reading is older than `ttl_s`, never waits for it."""
        if not self.available:
            return None, "absent: no jetson-stats (jtop) and no tegrastats on PATH"
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl_s and self._thread is None:
                self._thread = threading.Thread(target=self._refresh, daemon=True,
                                                name="jetsplit-gpu-probe")
                self._started = now
                self._thread.start()
            if self._thread is not None and now - self._started > 10 * self.timeout_s:
                return None, f"error: GPU probe hung for {now - self._started:.0f}s"
            if self._reading is None:
                return None, self._note or "pending: first reading in progress"
            reading = {**self._reading, "age_s": round(now - self._at, 2)}
            return reading, self._note or "ok"

    def wait(self, timeout_s: float) -> None:
        """Block until a refresh in flight finishes (for tests and one-shot tools)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _refresh(self) -> None:
        reading, note = self._probe()
        if reading is not None:  # the power mode rides along (None: not a Jetson, or failed)
            try:
                mode = _nvpmodel_mode(self.nvpmodel, self.timeout_s) if self.nvpmodel else None
            except (OSError, subprocess.SubprocessError):
                mode = None
            reading = {**reading, "power_mode": mode}
        with self._lock:
            if reading is not None:
                self._reading = reading
            self._note, self._at, self._thread = note, time.monotonic(), None

    def _probe(self) -> tuple[dict[str, Any] | None, str]:
        reasons: list[str] = []
        if self.use_jtop:
            try:
                return {"source": "jtop", **_read_jtop(self.timeout_s)}, "ok: jtop"
            except Exception as exc:  # noqa: BLE001 - JtopException and friends: fall back
                reasons.append(f"jtop: {_one_line(exc)}")
        if self.tegrastats is not None:
            try:
                line = _tegrastats_line(self.tegrastats, self.timeout_s)
                fell_back = f" ({reasons[0]})" if reasons else ""
                return ({"source": "tegrastats", **parse_tegrastats(line)},
                        "ok: tegrastats" + fell_back)
            except Exception as exc:  # noqa: BLE001 - any failure becomes the reason
                reasons.append(f"tegrastats: {_one_line(exc)}")
        return None, "error: " + "; ".join(reasons)


class Telemetry:
    """Samples this process and its device. Holds the primed CPU counters (psutil's
    non-blocking `cpu_percent(None)` measures since the previous call) and the GPU probe."""

    def __init__(self, gpu: GpuProbe | None = None, thermal_root: Path = THERMAL_ROOT) -> None:
        self.process = psutil.Process()
        self.gpu = gpu if gpu is not None else GpuProbe()
        self.thermal_root = thermal_root
        self.process.cpu_percent(None)
        psutil.cpu_percent(None)

    def sample(self) -> dict[str, Any]:
        """One JSON-safe reading (no NaN: the wire header rejects it)."""
        memory = psutil.virtual_memory()  # MemAvailable
        temp, zone = hottest_zone(self.thermal_root)
        gpu, note = self.gpu.read()
        return {
            "rss_mb": round(self.process.memory_info().rss / MB, 1),
            "mem_available_mb": round(memory.available / MB, 1),
            "mem_total_mb": round(memory.total / MB, 1),
            "cpu_process_pct": _finite(self.process.cpu_percent(None)),
            "cpu_system_pct": _finite(psutil.cpu_percent(None)),
            "temp_c": temp, "temp_zone": zone,
            "gpu": gpu, "gpu_note": note,
        }


def hottest_zone(root: Path = THERMAL_ROOT) -> tuple[float | None, str | None]:
    """(°C, zone type) of the hottest real thermal zone; (None, None) where there is none."""
    best: tuple[float | None, str | None] = (None, None)
    for zone in sorted(root.glob("thermal_zone*")):
        try:
            celsius = int((zone / "temp").read_text().strip()) / 1000.0
            name = (zone / "type").read_text().strip() if (zone / "type").exists() else zone.name
        except (OSError, ValueError):
            continue  # some zones refuse reads (EINVAL/ENODATA) while their sensor is off
        if name.lower().startswith(_FAKE_ZONES) or not _VALID_C[0] < celsius < _VALID_C[1]:
            continue
        if best[0] is None or celsius > best[0]:
            best = (round(celsius, 1), name)
    return best


@functools.lru_cache(maxsize=None)
def default_telemetry() -> Telemetry:
    """One per process: it measures this process, and its CPU counters must stay primed."""
    return Telemetry()


def sample() -> dict[str, Any]:
    """This process's telemetry now (see `Telemetry.sample`)."""
    return default_telemetry().sample()


def _jtop_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("jtop") is not None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _finite(value: Any) -> float | None:
    return round(float(value), 1) if _number(value) else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]

"""Device capability profiles: the numbers the split planner trusts, validated on load.

A profile is one TOML file per module and power mode (see ``profiles/README.md``). Datasheet
profiles carry peak numbers and an efficiency estimate; ``jetsplit profile`` adds a
``[measured]`` section with per-layer timings taken on the device itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, List, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from typing_extensions import Annotated

from jetsplit.compat import removesuffix
from jetsplit.config_io import load_toml_model, model_from_dict
from jetsplit.errors import ConfigError

__all__ = [
    "ComputeSection",
    "DeviceProfile",
    "DeviceSection",
    "MeasuredLayer",
    "MeasuredSection",
    "MemorySection",
    "NetworkSection",
    "SoftwareSection",
    "bundled_profiles_dir",
    "dump_profile",
    "find_profile",
    "list_profiles",
    "profile_from_dict",
    "profile_to_toml",
    "load_profile",
    "profile_search_dirs",
    "resolve_profile",
]

Precision = Literal["fp32", "fp16"]
# Every number is bounded: a profile also arrives in a device's registration (untrusted), and
# an unbounded int (10^400 CUDA cores) overflowed the planner's float arithmetic. No device
# comes near 10^9 of any unit here (GFLOPS, MB, GB/s, Mbit/s, MHz, ms).
MAX_QUANTITY = 1e9
PositiveFloat = Annotated[float, Field(gt=0, le=MAX_QUANTITY, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, le=MAX_QUANTITY, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0, le=2**31 - 1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]

# Strict: a TOML string where a number belongs is a mistake, not something to coerce.
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
_PEAK_TOLERANCE = 0.02  # peak_fp32 may differ this much from cores*2*clock (rounding)


class _Section(BaseModel):
    model_config = _STRICT


class DeviceSection(_Section):
    """Identity of the module and where its numbers come from."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    module: NonEmptyStr
    kind: Literal["jetson", "cpu", "gpu"]
    source: NonEmptyStr
    cpu: Optional[NonEmptyStr] = None
    gpu: Optional[NonEmptyStr] = None


class MemorySection(_Section):
    """RAM the device has and the share training may use (Jetson memory is unified)."""

    total_mb: PositiveFloat
    usable_fraction: Fraction
    bandwidth_gbps: PositiveFloat


class ComputeSection(_Section):
    """Peak throughput and the fraction of it conv-net training sustains."""

    cuda_cores: Optional[PositiveInt] = None
    gpu_clock_mhz: Optional[PositiveFloat] = None
    cpu_cores: Optional[PositiveInt] = None
    peak_fp32_gflops: PositiveFloat
    peak_fp16_gflops: Optional[PositiveFloat] = None
    efficiency: Fraction

    @field_validator("peak_fp32_gflops")
    @classmethod
    def _peak_matches_clock(cls, peak: float, info: ValidationInfo) -> float:
        """Catch a power-mode edit that changed the clock but not the peak."""
        cores, clock = info.data.get("cuda_cores"), info.data.get("gpu_clock_mhz")
        if cores is not None and clock is not None:
            expected = cores * 2 * clock / 1000
            if abs(peak - expected) > _PEAK_TOLERANCE * expected:
                raise ValueError(
                    f"{peak:g} disagrees with cuda_cores*2*gpu_clock_mhz/1000 = {expected:.1f}"
                )
        return peak


class NetworkSection(_Section):
    """Link to the coordinator, in megabits per second."""

    uplink_mbps: PositiveFloat
    downlink_mbps: PositiveFloat
    rtt_ms: NonNegFloat = 0.0


class SoftwareSection(_Section):
    """The software stack and power mode the numbers are valid for."""

    power_mode: Optional[NonEmptyStr] = None
    jetpack: Optional[NonEmptyStr] = None
    tensorrt: Optional[NonEmptyStr] = None
    python: Optional[NonEmptyStr] = None
    jetson_clocks: Optional[bool] = None


class MeasuredLayer(_Section):
    """One layer's cost measured on the device: times are per batch of ``measured.batch``."""

    name: NonEmptyStr
    fwd_ms: NonNegFloat
    bwd_ms: NonNegFloat
    peak_mem_mb: NonNegFloat
    ort_fwd_ms: Optional[NonNegFloat] = None
    trt_fwd_ms: Optional[NonNegFloat] = None


class MeasuredSection(_Section):
    """Written by ``jetsplit profile``: what was run, at which batch, and what it cost."""

    model: NonEmptyStr
    input_shape: Annotated[List[PositiveInt], Field(min_length=3, max_length=3)]
    batch: PositiveInt
    achieved_gflops: PositiveFloat
    measured_at: Optional[NonEmptyStr] = None
    layers: List[MeasuredLayer] = Field(default_factory=list)

    def per_sample_ms(self, layer: MeasuredLayer) -> tuple[float, float]:
        """(forward, backward) milliseconds per sample, from the per-batch timings."""
        return layer.fwd_ms / self.batch, layer.bwd_ms / self.batch


class DeviceProfile(_Section):
    """A validated capability profile; the planner reads the properties, not raw fields."""

    device: DeviceSection
    memory: MemorySection
    compute: ComputeSection
    network: NetworkSection
    software: SoftwareSection = Field(default_factory=SoftwareSection)
    measured: Optional[MeasuredSection] = None

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def total_memory_bytes(self) -> int:
        return int(self.memory.total_mb * 2**20)

    @property
    def usable_memory_bytes(self) -> int:
        """Bytes training may claim: the rest belongs to the OS, CUDA context and cache."""
        return int(self.memory.total_mb * 2**20 * self.memory.usable_fraction)

    @property
    def uplink_bytes_per_s(self) -> float:
        return self.network.uplink_mbps * 1e6 / 8

    @property
    def downlink_bytes_per_s(self) -> float:
        return self.network.downlink_mbps * 1e6 / 8

    def peak_gflops(self, precision: Precision = "fp32") -> float:
        """Vendor peak; fp16 falls back to fp32 where the device has no faster fp16 path."""
        if precision == "fp16" and self.compute.peak_fp16_gflops is not None:
            return self.compute.peak_fp16_gflops
        if precision not in ("fp32", "fp16"):
            raise ValueError(f"precision must be 'fp32' or 'fp16', not {precision!r}")
        return self.compute.peak_fp32_gflops

    def sustained_gflops(self, precision: Precision = "fp32") -> float:
        """Datasheet estimate of training throughput: peak × efficiency."""
        return self.peak_gflops(precision) * self.compute.efficiency

    def effective_gflops(self, precision: Precision = "fp32") -> float:
        """Measured throughput when the device was profiled, else the datasheet estimate."""
        if self.measured is not None and precision == "fp32":
            return self.measured.achieved_gflops
        return self.sustained_gflops(precision)


# --------------------------------------------------------------------------- loading


def profile_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> DeviceProfile:
    """Validate an already-parsed profile; errors name ``source`` and the dotted field."""
    return model_from_dict(DeviceProfile, data, "profile", source)


def load_profile(path: str | Path) -> DeviceProfile:
    """Read and validate one profile TOML; every failure is a one-line ConfigError."""
    return load_toml_model(DeviceProfile, path, "profile")


# --------------------------------------------------------------------------- dumping

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+\Z")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(lines: list[str], prefix: str, table: Mapping[str, Any]) -> None:
    """Scalars first, then sub-tables, then arrays of tables: the order TOML requires."""
    for key, value in table.items():
        if value is None or isinstance(value, dict) or _is_table_array(value):
            continue
        lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        if isinstance(value, dict):
            lines.extend(["", f"[{name}]"])
            _emit_table(lines, name, value)
        elif _is_table_array(value):
            for item in value:
                lines.extend(["", f"[[{name}]]"])
                _emit_table(lines, name, item)


def profile_to_toml(profile: DeviceProfile) -> str:
    """Render a profile as TOML that ``load_profile`` reads back to an equal profile."""
    lines = ["# jetsplit device capability profile (see profiles/README.md for units)"]
    _emit_table(lines, "", profile.model_dump(mode="python", exclude_none=True))
    return "\n".join(lines).lstrip("\n") + "\n"


def dump_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write a profile atomically (temp file + rename) so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(profile_to_toml(profile), encoding="utf-8")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- finding


def bundled_profiles_dir() -> Path:
    """The profiles shipped with jetsplit: the ``jetsplit.bundled_profiles`` package data
    (``profiles/`` of the checkout), wherever the package is installed."""
    import importlib.util

    spec = importlib.util.find_spec("jetsplit.bundled_profiles")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return Path(__file__).resolve().parents[1] / "profiles"  # a bare checkout on sys.path


def profile_search_dirs() -> list[Path]:
    """Where bare profile names are looked up: $JETSPLIT_PROFILES_DIR, repo, ./profiles."""
    dirs: list[Path] = []
    env = os.environ.get("JETSPLIT_PROFILES_DIR")
    if env:
        dirs.append(Path(env))
    dirs += [bundled_profiles_dir(), Path.cwd() / "profiles"]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in {u.resolve() for u in unique}:
            unique.append(d)
    return unique


def list_profiles(directory: str | Path | None = None) -> list[Path]:
    """Profile files in ``directory`` (default: every search dir), sorted; [] if none."""
    dirs = [Path(directory)] if directory is not None else profile_search_dirs()
    found: dict[str, Path] = {}
    for d in dirs:
        if d.is_dir():
            for p in sorted(d.glob("*.toml")):
                found.setdefault(p.stem, p)
    return sorted(found.values(), key=lambda p: p.stem)


def find_profile(name_or_path: str | Path) -> Path:
    """Path of a profile given as a file path or a bare name such as ``jetson-nano-4gb``."""
    candidate = Path(name_or_path)
    if candidate.is_file():
        return candidate
    text = str(name_or_path)
    is_bare = os.sep not in text and "/" not in text
    if is_bare:
        stem = removesuffix(text, ".toml")
        for d in profile_search_dirs():
            p = d / f"{stem}.toml"
            if p.is_file():
                return p
    known = ", ".join(p.stem for p in list_profiles()) or "none found"
    if is_bare and candidate.suffix != ".toml":
        raise ConfigError(f"profile {text}: no such file or bundled profile (known: {known})")
    raise ConfigError(f"profile {text}: file not found")


def resolve_profile(name_or_path: str | Path) -> DeviceProfile:
    """Load a profile from a path or a bare bundled name."""
    return load_profile(find_profile(name_or_path))

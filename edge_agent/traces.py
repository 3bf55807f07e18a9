"""Time-varying device conditions for emulated trials: a trace per agent.

A Jetson in the field does not keep the speed and link it started with: it throttles when
hot, its power mode changes (`nvpmodel`), its GPU clock moves, its Wi-Fi or LTE uplink
drops and recovers. A trace says how, as rows keyed by round or by seconds since the
agent started; each row sets any of

- `compute`: the device's speed as a fraction of its profile's (0.5: half as fast);
- `uplink_mbps`, `downlink_mbps`: the link's rates;
- `power_mode`: a label for the books (e.g. "10W"), nothing more.

A field a row leaves out keeps its value from the rows before (the profile's at first).
Files are TOML (`[[at]]` tables) or CSV (a header row naming the same fields); the trial
reads them and writes the rows into each agent's `[emulation]`, so an agent never opens a
file it was not given. Bundled traces live in `profiles/traces/`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Annotated

from jetsplit.config_io import one_line, tomllib, validation_message
from jetsplit.errors import ConfigError

MAX_ROWS = 10_000
MAX_TRACE_BYTES = 1 << 20
FIELDS = ("round", "seconds", "compute", "uplink_mbps", "downlink_mbps", "power_mode")
# The largest stated condition of each kind (each is over 0): what a trace may set, and what
# the coordinator takes from an emulated agent's books (server/fleet/books.py).
LIMITS = {"compute": 100.0, "uplink_mbps": 1e6, "downlink_mbps": 1e6}


class TraceRow(BaseModel):
    """From `round` (or `seconds`) on: what changes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    round: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = None
    seconds: Optional[Annotated[float, Field(ge=0, le=1e9)]] = None
    compute: Optional[Annotated[float, Field(gt=0, le=LIMITS["compute"])]] = None
    uplink_mbps: Optional[Annotated[float, Field(gt=0, le=LIMITS["uplink_mbps"])]] = None
    downlink_mbps: Optional[Annotated[float, Field(gt=0, le=LIMITS["downlink_mbps"])]] = None
    power_mode: Optional[Annotated[str, Field(min_length=1, max_length=32)]] = None

    @model_validator(mode="after")
    def _one_key(self) -> TraceRow:
        if (self.round is None) == (self.seconds is None):
            raise ValueError("each row needs exactly one of 'round' and 'seconds'")
        return self

    @property
    def key(self) -> float:
        return float(self.round if self.round is not None else self.seconds)  # type: ignore[arg-type]


class Trace(BaseModel):
    """Rows in increasing order of one key (all `round` or all `seconds`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    at: Annotated[List[TraceRow], Field(min_length=1, max_length=MAX_ROWS)]

    @model_validator(mode="after")
    def _ordered(self) -> Trace:
        by_round = self.at[0].round is not None
        for i, row in enumerate(self.at):
            if (row.round is not None) != by_round:
                raise ValueError(f"row {i + 1}: every row is keyed by "
                                 f"{'round' if by_round else 'seconds'}, as the first is")
            if i and row.key <= self.at[i - 1].key:
                raise ValueError(f"row {i + 1}: {'round' if by_round else 'seconds'} must "
                                 f"increase (got {row.key:g} after {self.at[i - 1].key:g})")
        return self

    @property
    def by_round(self) -> bool:
        return self.at[0].round is not None

    def state(self, round_: int, seconds: float) -> TraceState:
        """What holds at this round (a round-keyed trace) or this many seconds since start."""
        now = float(round_) if self.by_round else seconds
        state = TraceState()
        for row in self.at:
            if row.key > now:
                break
            state = TraceState(
                compute=row.compute if row.compute is not None else state.compute,
                uplink_mbps=row.uplink_mbps if row.uplink_mbps is not None
                else state.uplink_mbps,
                downlink_mbps=row.downlink_mbps if row.downlink_mbps is not None
                else state.downlink_mbps,
                power_mode=row.power_mode if row.power_mode is not None else state.power_mode)
        return state


class TraceState:
    """The conditions in force: a compute fraction, links (None: the profile's), a label."""

    __slots__ = ("compute", "uplink_mbps", "downlink_mbps", "power_mode")

    def __init__(self, compute: float = 1.0, uplink_mbps: Optional[float] = None,
                 downlink_mbps: Optional[float] = None, power_mode: Optional[str] = None
                 ) -> None:
        self.compute, self.uplink_mbps = compute, uplink_mbps
        self.downlink_mbps, self.power_mode = downlink_mbps, power_mode

    def as_tuple(self) -> Tuple[float, Optional[float], Optional[float], Optional[str]]:
        return self.compute, self.uplink_mbps, self.downlink_mbps, self.power_mode


def _csv_rows(text: str, source: str) -> List[dict]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    unknown = [h for h in header if h not in FIELDS]
    if not header or unknown:
        raise ConfigError(f"trace {source}: header row: unknown column "
                          f"{(unknown or ['(none)'])[0]!r} (columns: {', '.join(FIELDS)})")
    rows = []
    for number, raw in enumerate(reader, start=1):
        row: dict = {}
        for key, value in raw.items():
            if key is None or value is None:
                raise ConfigError(f"trace {source}: row {number}: wrong number of columns")
            value = value.strip()
            if value == "":
                continue
            key = key.strip()
            try:
                row[key] = (value if key == "power_mode" else
                            int(value) if key == "round" else float(value))
            except ValueError:
                raise ConfigError(f"trace {source}: row {number}: {key}: not a number "
                                  f"({one_line(value, 40)!r})") from None
        rows.append(row)
    return rows


def parse_trace(text: str, source: str) -> Trace:
    """A trace from TOML (`[[at]]` tables) or, if `source` ends in .csv, CSV; a problem is
    one ConfigError line naming the source and the row."""
    if len(text.encode("utf-8", "replace")) > MAX_TRACE_BYTES:
        raise ConfigError(f"trace {source}: larger than {MAX_TRACE_BYTES} bytes")
    if source.endswith(".csv"):
        data: dict = {"at": _csv_rows(text, source)}
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"trace {source}: not valid TOML ({one_line(str(exc), 120)})"
                              ) from None
    if isinstance(data, dict) and not data.get("at"):
        raise ConfigError(f"trace {source}: no rows (TOML: [[at]] tables; CSV: a header row "
                          f"and rows)")
    try:
        return Trace.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_readable(validation_message("trace", source, exc, Trace))) from None


def _readable(message: str) -> str:
    """`at[2].compute` as `row 3: compute` (rows count from 1, as in the file), and a
    misspelt column named with the one it resembles."""
    import difflib
    import re

    message = re.sub(r"at\[(\d+)\]\.?", lambda m: f"row {int(m.group(1)) + 1}: ", message
                     ).replace(": : ", ": ").replace("(top level): ", "")
    typo = re.search(r": (\w+): unknown field$", message)
    close = difflib.get_close_matches(typo.group(1), FIELDS, n=1) if typo else []
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def bundled_traces_dir() -> Path:
    from jetsplit.profiles import bundled_profiles_dir

    return bundled_profiles_dir() / "traces"


def find_trace(name_or_path: str) -> Path:
    """A trace file given as a path, or a bare name from `profiles/traces/`."""
    candidate = Path(name_or_path)
    if candidate.is_file():
        return candidate
    for suffix in ("", ".toml", ".csv"):
        bundled = bundled_traces_dir() / f"{name_or_path}{suffix}"
        if "/" not in name_or_path and bundled.is_file():
            return bundled
    known = ", ".join(sorted(p.stem for p in bundled_traces_dir().glob("*.toml"))) or "none"
    raise ConfigError(f"trace {name_or_path}: no such file or bundled trace (bundled: {known})")


def load_trace(name_or_path: str) -> Trace:
    path = find_trace(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"trace {path}: cannot read it ({one_line(str(exc), 100)})") from None
    return parse_trace(text, str(path))

"""Start-up checks for `jetsplit trial` and `jetsplit server run`: every option is checked
before anything expensive (host benchmark, broker, agent processes), and while the
coordinator waits for its fleet it watches the agent processes it started, so a dead agent
ends the wait at once with the first error line of its log."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from jetsplit.config_io import field_problem, one_line
from jetsplit.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)
WAIT_SLICE_S = 0.5


def validate_options(model: type[ModelT], values: Mapping[str, Any],
                     flags: Mapping[str, str]) -> ModelT:
    """Validate CLI values against a config section; an error names the flag the user typed
    (`--local-steps: input should be greater than or equal to 1 (got 0)`), not the field."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        loc, problem = field_problem(exc, model)
        head = str(loc[0]) if loc else ""
        if not head:  # a check across options (another method's option): says which itself
            raise ConfigError(one_line(problem, 300)) from None
        flag = flags.get(head, f"--{head.replace('_', '-')}")
        raise ConfigError(one_line(f"{flag}: {problem}", 300)) from None


def check_split(model: str, input_shape: tuple[int, ...], classes: int,
                split: int | None, flag: str = "--split") -> int:
    """A split index must leave at least one layer on each side; returns the layer count."""
    from jetsplit.export.cost_model import get_costs

    layers = len(get_costs(model, tuple(input_shape), classes).layers)
    if split is not None and not 1 <= split < layers:
        raise ConfigError(f"{flag}: {split} is out of range for {model} ({layers} layers: "
                          f"1..{layers - 1})")
    return layers


def first_error_line(log_path: Path, limit: int = 200) -> str | None:
    """The line of a log that says why the process failed: its `error:` line, else the first
    ERROR/CRITICAL record, else the last line of a traceback; None when nothing is there."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln]
    for predicate in (lambda ln: ln.startswith("error:"),
                      lambda ln: " ERROR " in ln or " CRITICAL " in ln):
        hit = next((ln for ln in lines if predicate(ln)), None)
        if hit is not None:
            return one_line(hit, limit)
    if any(ln.startswith("Traceback") for ln in lines):
        return one_line(lines[-1], limit)
    return None


def wait_for_fleet(wait: Callable[[int, float], list[str]], count: int, timeout_s: float,
                   dead: Callable[[], list[str]], log_of: Callable[[str], Path]) -> list[str]:
    """Wait until `count` agents registered; stop early when a watched agent process dies,
    naming it and its log's error line. `wait(count, seconds)` is the engine's own wait."""
    deadline = time.monotonic() + timeout_s
    online: list[str] = []
    while True:
        online = wait(count, min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
        if len(online) >= count:
            return online
        gone = [name for name in dead() if name not in online]
        if gone:
            name = gone[0]
            reason = first_error_line(log_of(name)) or "no error line in its log"
            more = f" (also dead: {', '.join(gone[1:])})" if len(gone) > 1 else ""
            raise ConfigError(one_line(f"agent {name} exited during start-up: {reason}{more}; "
                                       f"log: {log_of(name)}", 400))
        if time.monotonic() >= deadline:
            return online

"""Reading TOML files into strict pydantic models with one-line errors naming the field.

Profiles, agent configs and server configs all go through here, so a typo reads the same
everywhere: ``agent agent.toml: broker.port: input should be ≤ 65535 (got 70000)``.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from jetsplit.compat import removeprefix
from jetsplit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - JetPack 6 ships Python 3.10
    import tomli as tomllib

ModelT = TypeVar("ModelT", bound=BaseModel)


def one_line(text: str, limit: int = 160) -> str:
    """Collapse whitespace and cap the length: errors are one terminal line."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _known_fields(model: type[BaseModel] | None, parent: tuple[Any, ...]) -> list[str]:
    """Field names of the (sub-)model at `parent`, for "did you mean" hints."""
    for part in parent:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(
            annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def _describe(err: Mapping[str, Any], errors: list[Any],
              model: type[BaseModel] | None = None) -> str:
    kind = err.get("type", "")
    if kind == "missing":
        return "missing required field"
    if kind == "extra_forbidden":
        # A typo shows up as one unknown and one missing key under the same parent.
        parent = tuple(err["loc"][:-1])
        missing = [
            str(e["loc"][-1])
            for e in errors
            if e.get("type") == "missing" and tuple(e["loc"][:-1]) == parent
        ]
        candidates = missing or _known_fields(model, parent)
        close = difflib.get_close_matches(str(err["loc"][-1]), candidates, n=1)
        return f"unknown field (did you mean {close[0]!r}?)" if close else "unknown field"
    msg = str(err.get("msg", "invalid value"))
    msg = removeprefix(msg, "Value error, ")
    msg = msg[:1].lower() + msg[1:]
    value = err.get("input")
    if isinstance(value, (dict, list)) or kind.startswith("model_") or kind == "value_error":
        return msg
    return f"{msg} (got {value!r})"


def field_problem(exc: ValidationError,
                  model: type[BaseModel] | None = None) -> tuple[tuple[Any, ...], str]:
    """The most telling error of a validation: its field path and the problem in words (CLI
    commands put the flag name in front of it)."""
    errors = exc.errors(include_url=False)
    first = min(errors, key=lambda e: e.get("type") != "extra_forbidden")
    return tuple(first["loc"]), _describe(first, errors, model)


def validation_message(what: str, source: str, exc: ValidationError,
                       model: type[BaseModel] | None = None) -> str:
    """`<what> <source>: <dotted.field>: <problem>` for the most telling of the errors."""
    errors = exc.errors(include_url=False)
    # Report a typo'd key before the "missing" it causes: the unknown key is the real mistake.
    first = min(errors, key=lambda e: e.get("type") != "extra_forbidden")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = _dotted(tuple(first["loc"]))
    return one_line(f"{what} {source}: {where}: {_describe(first, errors, model)}{more}", limit=300)


def model_from_dict(model: type[ModelT], data: Mapping[str, Any], what: str,
                    source: str = "<dict>") -> ModelT:
    """Validate already-parsed data; errors name `what`, `source` and the dotted field."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(validation_message(what, source, exc, model)) from None


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """Parse one TOML file; a missing, unreadable or malformed file is one ConfigError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path}: is a directory, not a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: toml: file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(one_line(f"{what} {path}: toml: syntax error: {exc}", 300)) from None


def load_toml_model(model: type[ModelT], path: str | Path, what: str) -> ModelT:
    """Read a TOML file and validate it against `model` (one-line errors throughout)."""
    return model_from_dict(model, read_toml(path, what), what, str(path))

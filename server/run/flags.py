"""The [train] options as command-line flags: one table that `jetsplit server run`,
`jetsplit simulate` and `jetsplit trial` all take their training flags from.

A flag is spelled like its server.toml key (`local_steps` is `--local-steps`), says what
the key means in the one help line the key is declared with (server/training/settings.py
`TrainFields`), and shows server.toml's default; its type, bounds and choices are
`TrainSection`'s, checked where the launcher builds its settings. A command
decorated with `train_flags(...)` receives the values as one dict, `train`, holding only
the flags that were given (a config's value, or the default, stands for the rest).
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import typer

from jetsplit.server.run.config import TrainSection

F = TypeVar("F", bound=Callable[..., Any])

def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _plain_type(annotation: Any) -> type:
    """int, float or str: what the command line parses a [train] key as (TrainSection
    checks the bounds and choices after)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [_plain_type(a) for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0]
    return annotation


def _parameter(name: str) -> inspect.Parameter:
    info = TrainSection.model_fields[name]
    kind = _plain_type(info.annotation)
    shown = "unset" if info.default is None else str(info.default)
    option = typer.Option(flag(name), help=info.description, show_default=shown)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[kind | None, option])


def train_flags(*names: str) -> Callable[[F], F]:
    """Give a typer command a flag for each of these [train] keys; it receives the ones
    given as `train: dict[str, Any]`."""
    params = [_parameter(n) for n in names]

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "train"]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names}
            return command(train={k: v for k, v in given.items() if v is not None}, **kwargs)

        wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*own, *params])
        wrapper.__annotations__ = {**{p.name: p.annotation for p in own},
                                   **{p.name: p.annotation for p in params}}
        return typing.cast(F, wrapper)

    return decorate


# Data and model flags `simulate` and `trial` share (server.toml's [data] image_size and
# [model] weights).
ImageSizeFlag = Annotated[int | None, typer.Option(
    "--image-size", min=4, max=4096, help="folder:/csv: images come out N×N (resize and "
    "centre crop to evaluate, random-resized crop and flip to train).")]
WeightsFlag = Annotated[str | None, typer.Option(
    "--weights", help="Initial weights (safetensors, or a state dict read with "
    "weights_only=True), mapped by parameter name.")]

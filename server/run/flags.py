"""The [train] options as command-line flags: one table that `jetsplit server run`,
`jetsplit simulate` and `jetsplit trial` all take their training flags from.

A flag is spelled like its server.toml key (`local_steps` is `--local-steps`), says what
the key means in one help line, and shows server.toml's default; its type, bounds and
choices are `TrainSection`'s, checked where the launcher builds its settings. A command
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

from jetsplit import catalog
from jetsplit.server.run.config import TrainSection

F = TypeVar("F", bound=Callable[..., Any])

#: Help for every [train] key a command may take as a flag (names as in docs/methods.md).
HELP: dict[str, str] = {
    "algorithm": f"Training method: {catalog.CHOICES}.",
    "rounds": "Training rounds.",
    "local_steps": "T: iterations per round.",
    "batch": "B: samples per iteration over all selected agents (B_k ∝ |D_k|).",
    "lr": "Learning rate of every tier without its own (default: the method's, 0.01 for "
          "most; docs/methods.md).",
    "fraction": "Share of the eligible agents selected per round.",
    "deadline_s": "Seconds an agent has to answer a step.",
    "aggregator": "How device uploads are combined: mean (FedAvg's) | clipped | median | "
                  "trimmed-mean | multi-krum.",
    "clip_factor": "clipped: each update's norm bounded at this many times the median.",
    "robust_fraction": "trimmed-mean: share trimmed at each end; multi-krum: assumed "
                       "attackers' share.",
    "outlier_bound": "A device whose update norm is over this many times the median is left "
                     "out of that average (0: never).",
    "activation_bound": "Each sample's activation norm at most this many times the fleet's "
                        "median (0: no bound).",
    "loss_bound": "A device whose server loss is over this many times the fleet's median is "
                  "down-weighted in that step's server update (0: never).",
    "gradient_bound": "Each device's share of the server gradient at most this many times "
                      "the median share (gapsl; the others under --gradient-shares; 0: no "
                      "bound).",
    "gradient_shares": "free | all: free bounds only gapsl's shares (computed anyway); all "
                       "also scala's family and psl (one extra backward per "
                       "device per step) and splitfed-v2 (each step against the recent "
                       "steps').",
    "max_misses": "Deadline misses in a row before an agent sits out 1, 2, 4 ... rounds "
                  "(0: never).",
    "size_cap": "A device's registered sample count weighs at most this many times the "
                "fleet's median claim (0: no cap).",
    "histogram_check": "on | off: a device whose registered label histogram the labels it "
                       "sends disprove gets its prior from those labels.",
    "label_check": "on | off: a device whose labels do not fit its activations (its samples "
                   "labelled c sit nearest the fleet's other classes) weighs 0.",
    "direction_check": "on | off: a device whose uploaded updates point away from the "
                       "fleet's median update (running mean cosine below 0) weighs 0 in the "
                       "averages.",
    "codec": "Activation/gradient codec: fp32 | fp16 | bf16 | int8.",
    "replan": "on | off: move devices' cuts between rounds when the live estimates predict "
              "a shorter round (trials: on).",
    "replan_threshold": "Re-plan only for a predicted round at least this share shorter.",
    "replan_clock": "measured | model: re-plan on measured times, or on what emulated agents "
                    "state of their conditions (same switches on a busy machine).",
    "compression": "Payload compression: none | lz4 | zstd.",
    "preset": "Per-method defaults: default | paper (the papers' own settings).",
    "optimizer": "sgd | adam (default: the method's preset, else sgd).",
    "momentum": "SGD momentum (default: the method's preset, else 0).",
    "weight_decay": "Weight decay on every tier.",
    "client_lr": "Client tier learning rate (default: the preset's, else --lr).",
    "server_lr": "Server tier learning rate (default: the preset's, else --lr).",
    "client_batch": "Fixed batch per client (ampere's B(d); gapsl's paper preset 128) "
                    "instead of B_k ∝ |D_k|.",
    "psl_reduction": "psl/gapsl server loss over the clients: mean | sum (the papers').",
    "k_min": "gapsl: lower bound of the selection ratio.",
    "k_max": "gapsl: upper bound of the selection ratio.",
    "lam": "gapsl: alignment weight λ.",
    "eta": "gapsl: threshold width η.",
    "patience": "ampere: device epochs without a better validation accuracy before "
                "phase 2.",
    "device_epochs": "ampere: at most this many device epochs (N_d; default: half the "
                     "rounds).",
    "server_batch": "ampere: server batch B(s) (default --batch).",
    "server_epochs": "ampere: at most this many server epochs (N_s).",
    "tau1": "sherl: iterations between edge aggregations (default tau2).",
    "tau2": "sherl: iterations between cloud aggregations (default T).",
    "margin": "sherl: contrastive margin m on the cosine distance.",
    "edge_lr": "sherl: edge tier learning rate (default: the preset's).",
    "cloud_lr": "sherl: the cloud head's learning rate (default: the preset's).",
}


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
    if name not in HELP:
        raise KeyError(f"no flag for [train] {name}")
    info = TrainSection.model_fields[name]
    kind = _plain_type(info.annotation)
    shown = "unset" if info.default is None else str(info.default)
    option = typer.Option(flag(name), help=HELP[name], show_default=shown)
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

"""The training methods, one file each, written against the trainer
(server/training/trainer.py): base.py holds the base classes, each method's file its class
and `*_math.py` its pure math on plain tensors; Ampere's activation store lives beside it.
Which class implements a method is the catalog's to say (jetsplit/catalog.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jetsplit import catalog

if TYPE_CHECKING:
    from jetsplit.server.methods.base import Method
    from jetsplit.server.training.trainer import Trainer


def method_class(name: str) -> type[Method]:
    """The class the catalog names for method `name` (one-line ConfigError if unknown)."""
    module, _, cls = catalog.method(name).implementation.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_method(name: str, trainer: Trainer) -> Method:
    """The method called `name` (the names used in configs, the CLI and reports)."""
    return method_class(name)(trainer)

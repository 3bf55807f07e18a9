"""Cheap checks of data options before anything expensive starts (nothing is loaded)."""

from __future__ import annotations

from typing import Optional

from jetsplit.data.datasets import parse_spec
from jetsplit.data.partition import parse_scheme
from jetsplit.errors import ConfigError


def check_data_options(dataset: str, partition: Optional[str] = None) -> None:
    """The dataset spec and the partition scheme parse; one ConfigError line naming the flag."""
    try:
        parse_spec(dataset)
    except ConfigError as exc:
        raise ConfigError(f"--dataset: {exc}") from None
    if partition is not None:
        try:
            parse_scheme(partition)
        except ConfigError as exc:
            raise ConfigError(f"--partition: {exc}") from None

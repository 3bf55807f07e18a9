"""Shared fixtures: a private Mosquitto on a free loopback port, started by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server.brokers import MosquittoProcess


@pytest.fixture()
def mosquitto() -> Iterator[MosquittoProcess]:
    with MosquittoProcess() as broker:
        yield broker

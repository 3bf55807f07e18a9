"""A simulation keeps freed memory for reuse (server/run/allocator.py): on glibc the
thresholds are set, elsewhere nothing changes; values never depend on it."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest

from jetsplit.server.run.allocator import keep_freed_memory


def test_glibc_takes_the_thresholds_and_values_stay() -> None:
    try:
        ctypes.CDLL(None).mallopt  # noqa: B018 - is this glibc?
    except AttributeError:
        pytest.skip("not glibc")
    assert keep_freed_memory() is sys.platform.startswith("linux")
    a = np.arange(1 << 24, dtype=np.float32)  # 64 MiB: over glibc's default threshold
    total = float(a.sum(dtype=np.float64))
    del a
    b = np.arange(1 << 24, dtype=np.float32)  # served from the freed block
    assert float(b.sum(dtype=np.float64)) == total


def test_elsewhere_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False

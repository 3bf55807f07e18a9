"""Freed memory kept for reuse in a simulation process, instead of going back to the kernel.

A simulation frees and allocates the same large buffers over and over: every server-copy
step of SplitFed V1 frees its gradients (one copy's alive at a time) and the next step
allocates them again, every FedAvg client its whole model's. glibc serves blocks over its
mmap threshold (at most 32 MiB by default) with fresh `mmap`s and unmaps them on `free`, so
each such allocation faults in every page again: AlexNet's 64 MiB fc2 gradient cost SplitFed
V1 about 8 CPU seconds of page faults in 200 steps, four times what the plain loop pays.
Raising the threshold and the trim threshold lets glibc reuse the freed block at once;
values are untouched (only where bytes live changes), and the peak grows by at most one
freed block that is not reused.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LARGEST_REUSED = 256 << 20  # blocks up to this size come from (and return to) the heap


def keep_freed_memory(largest: int = LARGEST_REUSED) -> bool:
    """Ask glibc to serve blocks up to `largest` bytes from its heap and to keep up to
    twice that freed at its top; whether it agreed (False off glibc: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, largest)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * largest))

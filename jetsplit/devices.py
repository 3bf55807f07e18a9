"""Where and with how many threads torch computes: one place for `device = auto|cpu|cuda`
and for the intra-op thread count a block of compute runs under.

Agents, the coordinator and the profiler resolve devices here, so "auto" and the CUDA error
mean the same everywhere. The in-process engine runs each simulated agent's compute under
that agent's thread count (what an agent process sets once at start), and the coordinator
runs its own compute under `[server] threads`: CPU kernels (reductions, convolutions, GEMM)
split work by thread count, so the same numbers need the same threads to give the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from jetsplit.errors import BackendUnavailable, ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str, where: str) -> str:
    """`auto` → "cuda" when torch sees a GPU, else "cpu"; `cuda` without one is a
    `BackendUnavailable` naming `where` (the option or config field that asked for it)."""
    if choice not in DEVICES:
        raise ConfigError(f"{where} must be auto, cpu or cuda, got {choice!r}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(f"{where} = cuda, but torch sees no CUDA device here "
                                 f"(torch {torch.__version__}; use cpu or auto)")
    return choice


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the body with `threads` intra-op threads (0: leave the process's setting), and
    put the previous count back afterwards."""
    before = torch.get_num_threads()
    if threads <= 0 or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

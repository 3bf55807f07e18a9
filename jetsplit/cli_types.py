"""Parsers for CLI values shared by every command (shapes, integer lists).

Each raises ConfigError with one line naming the flag, so a typo never ends in a traceback.
"""

from __future__ import annotations

from jetsplit.errors import ConfigError


def parse_ints(text: str, *, flag: str, count: int | None = None,
               minimum: int = 1) -> tuple[int, ...]:
    """``"3,32,32"`` → ``(3, 32, 32)``; commas or ``x`` separate, spaces are ignored."""
    parts = [p.strip() for p in str(text).replace("x", ",").replace("×", ",").split(",")]
    want = f"{count} " if count is not None else ""
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"{flag}: expected {want}comma-separated integers, got {text!r}"
                          ) from None
    if count is not None and len(values) != count:
        raise ConfigError(f"{flag}: expected {count} comma-separated integers, got {text!r}")
    if any(v < minimum for v in values):
        raise ConfigError(f"{flag}: every value must be at least {minimum}, got {text!r}")
    return values


def parse_shape(text: str, *, flag: str = "--input-shape") -> tuple[int, int, int]:
    """A per-sample image shape ``C,H,W`` (e.g. ``1,28,28`` for MNIST)."""
    c, h, w = parse_ints(text, flag=flag, count=3)
    return c, h, w

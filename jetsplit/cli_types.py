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


def check_port(port: int | None, flag: str) -> None:
    """A TCP port flag: 0 (any free port) to 65535."""
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"{flag}: {port} is not a TCP port (0-65535)")


def parse_agent_options(options: list[str], flag: str, what: str, example: str
                        ) -> dict[str, str]:
    """Repeated `FLAG AGENT=WHAT` options as {agent: value}; a malformed or repeated one is
    one line showing `example`."""
    values: dict[str, str] = {}
    for option in options:
        agent, sep, value = option.partition("=")
        if not sep or not agent or not value or agent in values:
            raise ConfigError(f"{flag} {option!r}: write AGENT={what} (e.g. {example}), "
                              f"once per agent")
        values[agent] = value
    return values


def parse_cuts(values: list[str] | None) -> dict[str, int] | None:
    """`--cut a0=2 --cut a1=5` → {"a0": 2, "a1": 5}; one error line otherwise."""
    if not values:
        return None
    out = {}
    for agent, k in parse_agent_options(values, "--cut", "K", "a0=2").items():
        try:
            out[agent.strip()] = int(k)
        except ValueError:
            raise ConfigError(f"--cut {agent}={k}: expected AGENT=K with K an integer"
                              ) from None
    return out

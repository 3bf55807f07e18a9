"""`--broker mqtt[s]://[user[:password]@]host[:port]` parsed and validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import unquote, urlsplit

from jetsplit.errors import ConfigError

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is and how to log in; TLS for `mqtts`."""

    host: str
    port: int
    tls: bool = False
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)  # never in logs or tracebacks

    def url(self) -> str:
        """The address without credentials (safe to log)."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(text: str) -> BrokerAddress:
    """Parse a broker URL; anything malformed is one ConfigError line naming the problem."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"broker URL {text!r}: {exc}") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise ConfigError(f"broker URL {text!r}: scheme must be mqtt:// or mqtts://")
    if not parts.hostname:
        raise ConfigError(f"broker URL {text!r}: missing host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"broker URL {text!r}: unexpected path or query")
    return BrokerAddress(
        host=parts.hostname,
        port=port or DEFAULT_PORTS[parts.scheme],
        tls=parts.scheme == "mqtts",
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )

"""The `[mqtt]` section shared by agent.toml and server.toml, turned into endpoint options."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from jetsplit.broker_url import BrokerAddress, parse_broker_url
from jetsplit.errors import ConfigError
from jetsplit.transport.mqtt import REASSEMBLY_TIMEOUT_S, EndpointOptions, TlsOptions
from jetsplit.wire import DEFAULT_CHUNK_BYTES, Limits
from jetsplit.wire.envelope import DEFAULT_MAX_MESSAGE_BYTES

FLEET_KEY_ENV = "JETSPLIT_FLEET_KEY"
MIN_KEY_BYTES = 16


class MqttSection(BaseModel):
    """Broker address, protocol and security; every key has a CLI override."""

    model_config = ConfigDict(extra="forbid", strict=True)

    broker: str = "mqtt://127.0.0.1:1883"
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    keepalive_s: Annotated[int, Field(ge=2, le=3600)] = 30
    chunk_bytes: Annotated[int, Field(ge=16 * 1024, le=256 * 1024 * 1024)] = DEFAULT_CHUNK_BYTES
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_insecure: bool = False
    connect_wait_s: Annotated[float, Field(gt=0, le=3600)] = 10.0  # coordinator's first connect
    fleet_key_file: Optional[str] = None  # else $JETSPLIT_FLEET_KEY; none: CRC only, no HMAC
    # Per-device identity (from `jetsplit provision`): this device's own Ed25519 key, and a
    # folder of the public keys it trusts (<id>.pub). Messages are then signed and verified
    # per sender; the shared fleet key gives no per-device identity and cannot be combined.
    signing_key: Optional[str] = None
    trusted_keys: Optional[str] = None
    # The fleet CLI's own certificate and key (`operator.crt` in the coordinator's kit): a
    # broker that names sessions by certificate CN would otherwise hand it the running
    # coordinator's session. Only `jetsplit fleet` reads them.
    operator_cert: Optional[str] = None
    operator_key: Optional[str] = None
    # Largest message accepted, encoded and decoded (chunked messages after reassembly).
    max_message_mib: Annotated[int, Field(ge=1, le=256)] = DEFAULT_MAX_MESSAGE_BYTES >> 20
    # How long an unfinished chunked message is kept after its first chunk: a sender that
    # hangs mid-message holds buffer until then (wire/chunking.py).
    reassembly_timeout_s: Annotated[float, Field(ge=1, le=3600)] = REASSEMBLY_TIMEOUT_S

    def address(self) -> BrokerAddress:
        return parse_broker_url(self.broker)

    def fleet_key(self) -> bytes | None:
        """The shared HMAC key from the file or the environment (never from the TOML itself)."""
        if self.fleet_key_file:
            path = Path(self.fleet_key_file).expanduser()
            try:
                key = path.read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"fleet key {path}: cannot read: {exc.strerror or exc}"
                                  ) from None
            source = str(path)
        elif os.environ.get(FLEET_KEY_ENV):
            key, source = os.environ[FLEET_KEY_ENV].strip().encode(), f"${FLEET_KEY_ENV}"
        else:
            return None
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"fleet key {source}: must be at least {MIN_KEY_BYTES} bytes")
        return key

    def endpoint_options(self) -> EndpointOptions:
        for name in ("tls_ca", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if value and not Path(value).expanduser().is_file():
                raise ConfigError(f"mqtt.{name}: {value}: file not found")
        tls = TlsOptions(self.tls_ca, self.tls_cert, self.tls_key, self.tls_insecure)
        signer, keyring = self.identity()
        fleet_key = self.fleet_key()
        if fleet_key and signer is not None:
            raise ConfigError("mqtt: use either per-device keys (signing_key, trusted_keys) "
                              "or a shared fleet key, not both")
        return EndpointOptions(protocol=self.protocol, keepalive_s=self.keepalive_s,
                               chunk_bytes=self.chunk_bytes, fleet_key=fleet_key,
                               tls=tls, limits=Limits.of_mib(self.max_message_mib),
                               signer=signer, keyring=keyring,
                               reassembly_timeout_s=self.reassembly_timeout_s)

    def identity(self) -> tuple[Any, Any]:
        """(Signer, KeyRing) for per-device signing, or (None, None) when not configured."""
        if not self.signing_key and not self.trusted_keys:
            return None, None
        if not (self.signing_key and self.trusted_keys):
            raise ConfigError("mqtt: signing_key and trusted_keys go together (both come from "
                              "a `jetsplit provision` kit)")
        from jetsplit.identity import load_keyring, load_signer  # imports cryptography

        key = Path(self.signing_key).expanduser()
        return load_signer(key, key.stem), load_keyring(self.trusted_keys)

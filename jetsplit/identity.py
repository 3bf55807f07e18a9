"""Per-device message signing: each device signs with its own Ed25519 key, and a receiver
verifies against the public key provisioned for the sender the message names.

Unlike the shared fleet key (HMAC, one secret on every device, so any holder can speak for
any agent or the coordinator), a device here can only sign as itself: agents hold only
their own private key and the coordinator's public key, so only the coordinator's key can
sign commands. `cryptography` is imported only when a key is loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from jetsplit.errors import ConfigError
from jetsplit.wire.errors import BadSignature

SIGNATURE_BYTES = 64
PUBLIC_SUFFIX = ".pub"


def _crypto() -> Any:  # noqa: ANN401 - the module, imported lazily
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigError("per-device signing needs the cryptography package: "
                          "pip install cryptography") from None
    return serialization, ed25519


CLIENT_ID_CONTEXT = b"jetsplit mqtt client id v1"  # what `client_id_suffix` signs


class Signer:
    """Signs envelopes as one identity (its own private key)."""

    def __init__(self, name: str, private_key: Any) -> None:  # noqa: ANN401
        self.name, self._key = name, private_key

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def client_id_suffix(self) -> str:
        """16 hex digits only this key can produce (Ed25519 signs deterministically), the
        same on every start. Appended to the MQTT client id: the broker hands a session to
        whoever connects with its client id, and Mosquitto cannot tie client ids to
        certificates, so an enrolled device that knows another's id could take its session
        over; without the other's key it cannot know it."""
        return hashlib.sha256(self.sign(CLIENT_ID_CONTEXT)).hexdigest()[:16]

    def public_key(self) -> Any:  # noqa: ANN401 - an Ed25519PublicKey
        return self._key.public_key()

    def public_pem(self) -> bytes:
        serialization, _ = _crypto()
        return self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    @classmethod
    def generate(cls, name: str) -> Signer:
        _, ed25519 = _crypto()
        return cls(name, ed25519.Ed25519PrivateKey.generate())

    def private_pem(self) -> bytes:
        serialization, _ = _crypto()
        return self._key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())


class KeyRing:
    """Public keys by sender id; a message verifies only under its own sender's key."""

    def __init__(self, keys: dict[str, Any]) -> None:
        self._keys = dict(keys)

    def __contains__(self, sender: str) -> bool:
        return sender in self._keys

    @property
    def senders(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, sender: str, data: bytes, signature: bytes) -> None:
        key = self._keys.get(sender)
        if key is None:
            raise BadSignature(f"no provisioned key for sender {sender!r}")
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(bytes(signature), bytes(data))
        except InvalidSignature:
            raise BadSignature(f"signature does not verify under {sender}'s key") from None


def _load_ed25519(path: Path, what: str, private: bool) -> Any:  # noqa: ANN401
    """An Ed25519 key from a PEM file, or one ConfigError line saying what is wrong."""
    serialization, ed25519 = _crypto()
    kind = "private" if private else "public"
    try:
        data = path.read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, TypeError):
        raise ConfigError(f"{what} {path}: not a PEM {kind} key") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise ConfigError(f"{what} {path}: not an Ed25519 key")
    return key


def load_signer(path: str | Path, name: str) -> Signer:
    """This device's private signing key (PKCS#8 PEM, as `jetsplit provision` writes it)."""
    return Signer(name, _load_ed25519(Path(path).expanduser(), "signing key", private=True))


def load_public_key(path: Path) -> Any:  # noqa: ANN401
    return _load_ed25519(path, "public key", private=False)


def load_keyring(folder: str | Path) -> KeyRing:
    """Every `<sender>.pub` in `folder` (the coordinator: one per agent; an agent: the
    coordinator's only)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"trusted keys {folder}: not a folder")
    keys = {p.name[:-len(PUBLIC_SUFFIX)]: load_public_key(p)
            for p in sorted(folder.glob(f"*{PUBLIC_SUFFIX}"))}
    if not keys:
        raise ConfigError(f"trusted keys {folder}: no *{PUBLIC_SUFFIX} files")
    return KeyRing(keys)

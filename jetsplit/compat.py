"""Python 3.8 stand-ins for str methods the device side needs (JetPack 5 ships Python 3.8)."""

from __future__ import annotations


def removeprefix(text: str, prefix: str) -> str:
    """`str.removeprefix` (3.9+): `text` without a leading `prefix`."""
    return text[len(prefix):] if prefix and text.startswith(prefix) else text


def removesuffix(text: str, suffix: str) -> str:
    """`str.removesuffix` (3.9+): `text` without a trailing `suffix`."""
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text

"""What the export tool reads from torch differently on torch 1.13 (JetPack 5) and 2.x."""

from __future__ import annotations

from typing import Any, Tuple


def storage_of(tensor: Any) -> Tuple[int, int]:
    """(data pointer, bytes) of the storage behind ``tensor``: two views of one buffer give
    the same pair. ``untyped_storage`` is torch ≥ 2.0; torch 1.13 has only ``storage()``,
    whose typed storage has the same ``data_ptr``/``nbytes`` (2.x deprecates it)."""
    untyped = getattr(tensor, "untyped_storage", None)
    storage = untyped() if untyped is not None else tensor.storage()
    return int(storage.data_ptr()), int(storage.nbytes())

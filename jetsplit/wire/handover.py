"""Messages handed over by reference inside one process, as if they had crossed the wire.

The in-process engine (server/engines/seam.py) runs agents as objects beside the
coordinator. Encoding every message there only to decode it again costs a copy of every
tensor, two CRC passes over it and, for whole-model uploads, a message-sized buffer per
reply; it changes nothing where the codec is exact (fp32 and raw tensors, no compression),
since decoding then gives back the very values that were encoded.

`hand_over` therefore does what encoding and decoding would do, but the tensor body: the
header is built by the encoder's own function and parsed by the decoder's (strict schema,
limits, allowances: every check on untrusted input still applies), the length booked is
the length the encoding would have, byte for byte, and the tensors pass as read-only
views of the sender's arrays, exactly as decoded tensors are read-only views of the
message. Where the codec would change values (fp16, bf16, int8) or sizes (lz4, zstd), or
an array would travel in an unusual form (a non-native byte order), it returns None and
the caller encodes.

Ownership: the receiver holds read-only views, so it cannot write through them (NumPy
refuses), and every receiver already copies what it trains on (`from_arrays`,
`to_device`, the agent's backward); the sender never writes an array after sending it
(`to_arrays` and `to_host` make fresh arrays per message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from jetsplit.wire.codecs import CODECS, RAW_DTYPES
from jetsplit.wire.envelope import (
    CRC,
    PREFIX,
    Allowance,
    Limits,
    Message,
    accounted_limits,
    check_descriptors,
    header_json,
    parse_header,
)
from jetsplit.wire.errors import OversizedMessage


@dataclass(frozen=True)
class Handover:
    """A message ready to be received: its header bytes, its tensors as they would
    decode, and the length of the envelope it would have travelled in."""

    message: Message
    header: bytes
    tensors: Dict[str, np.ndarray]
    nbytes: int

    def receive(self, limits: Limits = Limits(),
                allowance: Optional[Allowance] = None) -> Message:
        """What `decode_message` of the encoding would return (its checks, in its order,
        raising its typed errors), with the tensors by reference."""
        body_len = self.nbytes - PREFIX.size - len(self.header) - CRC.size
        header_len = len(self.header)
        if self.nbytes > limits.max_message_bytes:
            refused = OversizedMessage(f"message of {self.nbytes} bytes exceeds "
                                       f"{limits.max_message_bytes}")
            if allowance is None or header_len > limits.max_header_bytes:
                raise refused
            limits = accounted_limits(self.nbytes, parse_header(self.header, limits), limits,
                                      allowance, refused)
        if header_len > limits.max_header_bytes:
            raise OversizedMessage(f"header of {header_len} bytes exceeds "
                                   f"{limits.max_header_bytes}")
        header = parse_header(self.header, limits)
        check_descriptors(header.tensors, body_len, limits)
        m = self.message
        return Message(type=m.type, run=header.run, sender=header.sender, seq=header.seq,
                       round=header.round, step=header.step, kind=header.kind,
                       meta=header.meta, tensors=dict(self.tensors), ts=header.ts,
                       signed=False)


def hand_over(msg: Message, *, codec: str = "fp32", compression: str = "none"
              ) -> Optional[Handover]:
    """`msg` as an unsigned `encode_message(msg, codec=, compression=)` would carry it,
    without its body; None where that encoding would not give back the same arrays (the
    caller then encodes). Raises what the encoder raises on a header it cannot write."""
    if msg.tensors and (compression != "none" or codec not in CODECS):
        return None
    descriptors = []
    tensors: Dict[str, np.ndarray] = {}
    body_len = 0
    for name, array in msg.tensors.items():
        decoded = _as_decoded(np.asarray(array), codec)
        if decoded is None:
            return None
        x, used = decoded
        view = x.view()
        view.flags.writeable = False
        tensors[name] = view
        descriptors.append({"name": name, "dtype": x.dtype.name, "shape": list(x.shape),
                            "codec": used, "compression": "none", "length": x.nbytes,
                            "params": []})
        body_len += x.nbytes
    header = header_json(msg, descriptors)
    return Handover(msg, header, tensors, PREFIX.size + len(header) + body_len + CRC.size)


def _as_decoded(x: np.ndarray, codec: str) -> Optional[Tuple[np.ndarray, str]]:
    """`x` as the exact codecs decode it, with the codec its descriptor names: floats as
    contiguous float32 under fp32, other dtypes raw and contiguous, the shape kept (0-d
    too); None where only encoding can say (lossy float codecs, dtypes the wire refuses,
    a non-native byte order, an empty array)."""
    name = x.dtype.name
    if (name not in RAW_DTYPES and name != "float16") or x.size == 0:
        return None  # (an empty tensor: the encoder's own error)
    shape = tuple(int(d) for d in x.shape)
    if np.issubdtype(x.dtype, np.floating):
        if codec != "fp32":
            return None
        return np.ascontiguousarray(x, dtype=np.float32).reshape(shape), "fp32"
    if not x.dtype.isnative:
        return None
    return np.ascontiguousarray(x).reshape(shape), "raw"

"""A seeded mutator for the wire decoder, and the decompression bombs it must refuse.

Used by the test suite (a fast and a slow run) and by `benchmarks/fuzz_wire.py`, which also
measures peak memory. It builds hostile frames on purpose, so it is not part of the
installed package: it lives in the checkout's `testing/` folder, which tests/conftest.py
and the benchmark put on `sys.path` (that folder only, never the checkout root, so
`server`/`export` never import under bare names). It stays Python 3.8 code, like the wire it
fuzzes: the torch-free device tests (.ci/device-pure-tests.sh) import it on 3.8 and 3.9.

Frames are rebuilt with correct lengths, CRC and (when a key is given) the fleet HMAC or the
sender's Ed25519 signature (`key` a `jetsplit.identity.Signer`), so mutated
headers reach the header parser, the size checks and the codecs instead of stopping at the
checksum.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jetsplit.wire.chunking import Reassembler
from jetsplit.wire.codecs import CODECS, COMPRESSIONS
from jetsplit.wire.envelope import (
    CRC,
    FLAG_ED25519,
    FLAG_SIGNED,
    MAGIC,
    PREFIX,
    WIRE_VERSION,
    Limits,
    Message,
    MessageType,
    decode_message,
    encode_message,
)
from jetsplit.wire.errors import WireError

FUZZ_KEY = b"fuzz-fleet-key-0123456789"
_HUGE = [0, 1, -1, 2**31, 2**31 - 1, 2**32, 2**62, 2**63, 2**64, 10**30]
_ODD = [None, True, "x", "Infinity", "NaN", [], {}, 1.5, -0.0, 1e308]


def frame(mtype: int, header: dict[str, Any], body: bytes = b"", *,
          key: Any = None, raw_header: bytes | None = None) -> bytes:
    """An envelope with consistent lengths, CRC and HMAC around any header and body."""
    head = raw_header if raw_header is not None else json.dumps(
        header, separators=(",", ":")).encode()
    hmac_key = key if isinstance(key, bytes) else None
    flags = FLAG_SIGNED if hmac_key else FLAG_ED25519 if key is not None else 0
    prefix = PREFIX.pack(MAGIC, WIRE_VERSION, mtype, flags, 0, len(head),
                         len(body))
    covered = prefix + head + body
    out = covered + CRC.pack(zlib.crc32(covered))
    if hmac_key:
        out += hmac.new(hmac_key, covered, hashlib.sha256).digest()
    elif key is not None:
        out += key.sign(covered)
    return out


def split(data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """(type, header, body) of a well-formed envelope (for structured mutation)."""
    _, _, mtype, _, _, header_len, body_len = PREFIX.unpack_from(data)
    head = json.loads(data[PREFIX.size:PREFIX.size + header_len])
    return mtype, head, data[PREFIX.size + header_len:PREFIX.size + header_len + body_len]


def _zstd_zeros(nbytes: int) -> bytes:
    """zstd of `nbytes` zero bytes, compressed in pieces (the builder never holds them all)."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=nbytes)
    block = bytes(1 << 20)
    parts = [compressor.compress(block) for _ in range(nbytes >> 20)]
    parts.append(compressor.compress(bytes(nbytes & ((1 << 20) - 1))))
    parts.append(compressor.flush())
    return b"".join(parts)


def bombs() -> dict[str, bytes]:
    """The decompression bombs reported against the decoder, each a few KB on the wire."""
    def tensor(name: str, dtype: str, shape: list[int], codec: str, payload: bytes,
               params: list[float] | None = None) -> bytes:
        header = {"run": "r", "seq": 1, "sender": "s", "ts": 1.0, "kind": "activations",
                  "tensors": [{"name": name, "dtype": dtype, "shape": shape, "codec": codec,
                               "compression": "zstd", "length": len(payload),
                               "params": params or []}]}
        return frame(int(MessageType.REPLY), header, payload)

    return {
        # declares 1,024 int8 values, but the payload inflates to 256 MiB
        "lying-256MiB": tensor("act", "float32", [1024], "int8", _zstd_zeros(1 << 28),
                               [0.0, 1.0]),
        # 60 MiB of raw bytes: under the default 64 MiB limit, so it is decoded
        "raw-60MiB-ok": tensor("labels", "uint8", [60 << 20], "raw", _zstd_zeros(60 << 20)),
        # 2^28 int8 values (256 MiB) that dequantise to a 1 GiB float32 tensor
        "int8-256MiB": tensor("act", "float32", [1 << 28], "int8", _zstd_zeros(1 << 28),
                              [0.0, 1.0]),
        # 512 MiB of raw int64 labels
        "raw-512MiB": tensor("labels", "int64", [1 << 26], "raw", _zstd_zeros(1 << 29)),
        # a 4-D int8 activation just under the old element cap, per-channel parameters
        "int8-4d-255MiB": tensor("act", "float32", [255, 4, 512, 512], "int8",
                                 _zstd_zeros(255 * 4 * 512 * 512), [0.0, 1.0] * 4),
    }


def _signing(key: Any) -> dict[str, Any]:
    """encode_message's arguments for a fleet key (bytes) or a device Signer."""
    return {"fleet_key": key} if isinstance(key, bytes) or key is None else {"signer": key}


def seeds(key: Any = None) -> list[bytes]:
    """Valid messages of every codec and compression, plus a chunk and a signed ACK."""
    rng = np.random.default_rng(0)
    out = []
    for codec in CODECS:
        for compression in COMPRESSIONS:
            msg = Message(MessageType.REPLY, run="r", sender="s", seq=7, kind="activations",
                          meta={"n": 3},
                          tensors={"act": rng.standard_normal((2, 3, 4, 4)).astype(np.float32),
                                   "labels": np.arange(2)})
            out.append(encode_message(msg, codec=codec, compression=compression,
                                      **_signing(key)))
    piece = np.frombuffer(bytes(range(200)), dtype=np.uint8)
    out.append(encode_message(Message(MessageType.CHUNK, run="r", sender="s", seq=9,
                                      kind="chunk", meta={"id": "m", "index": 1, "count": 3,
                                                          "total": 500, "size": 200},
                                      tensors={"data": piece}), **_signing(key)))
    out.append(encode_message(Message(MessageType.ACK, run="r", sender="s", seq=1),
                              **_signing(key)))
    return out


def _randbytes(rng: random.Random, n: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(n))


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One random byte-level mutation of an encoded frame (the harness's and the tests' one
    mutator): bit flips, truncation, extension, a random span, a re-checksummed body byte
    (so the header and body parsers see it), or corrupted declared lengths."""
    buf = bytearray(data)
    op = rng.randrange(6)
    if op == 0:  # flip bits
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncate
        del buf[rng.randrange(len(buf)):]
    elif op == 2:  # extend
        buf += _randbytes(rng, rng.randint(1, 64))
    elif op == 3:  # overwrite a span
        i = rng.randrange(len(buf))
        buf[i:i + 16] = _randbytes(rng, 16)
    elif op == 4 and len(buf) > 24:  # mutate a byte, then fix the trailing crc32
        i = rng.randrange(20, len(buf) - 4)
        buf[i] = rng.randrange(256)
        buf[-4:] = zlib.crc32(bytes(buf[:-4])).to_bytes(4, "big")
    else:  # corrupt the declared lengths
        buf[8:20] = _randbytes(rng, 12)
    return bytes(buf)


def _mutate_value(value: Any, rng: random.Random) -> Any:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.choice(_HUGE) * rng.choice([1, -1])
    if choice == 1:
        return rng.choice(_ODD)
    if choice == 2 and isinstance(value, list):
        return [rng.choice(_HUGE) for _ in range(rng.randint(0, 6))]
    return float("nan") if rng.random() < 0.5 else float("inf")


def _mutate_header(mtype: int, header: dict[str, Any], body: bytes, rng: random.Random,
                   key: Any) -> bytes:
    """Change one header field (shapes, dtypes, codecs, params, lengths, meta, ts, seq) and
    re-frame it, so the decoder's schema, size checks and codecs see the lie."""
    header = json.loads(json.dumps(header))
    tensors = header.get("tensors") or []
    op = rng.randrange(7)
    if op <= 2 and tensors:
        t = rng.choice(tensors)
        field = rng.choice(["shape", "shape", "dtype", "codec", "compression", "length",
                            "params"])
        if field == "shape":
            t["shape"] = rng.choice([
                [2**31, 2**31, 4], [0] * rng.randint(1, 4), [4, 0, 2, 2], [-1, 4],
                [rng.choice(_HUGE) for _ in range(rng.randint(1, 9))], [1 << 28], []])
        elif field == "dtype":
            t["dtype"] = rng.choice(["float32", "int8", "float64", "object", "V8", "<U4", "M8",
                                     "float16", "uint64", ""])
        elif field == "codec":
            t["codec"] = rng.choice(["fp32", "fp16", "bf16", "int8", "raw", "pickle"])
        elif field == "compression":
            t["compression"] = rng.choice(["none", "lz4", "zstd", "gzip"])
        elif field == "length":
            t["length"] = _mutate_value(t["length"], rng)
        else:
            t["params"] = rng.choice([[], [float(rng.random())], [0.0, 1.0] * 3,
                                      [1e308, -1e308], _mutate_value([], rng)])
    elif op == 3:
        header["meta"] = {k: _mutate_value(v, rng) for k, v in header.get("meta", {}).items()
                          } or {"index": _mutate_value(0, rng)}
    elif op == 4:
        header[rng.choice(["ts", "seq", "round", "step"])] = _mutate_value(0, rng)
    elif op == 5:
        header[rng.choice(["run", "sender", "kind", "extra"])] = rng.choice(
            ["a b", "", "x" * 200, "../../etc", 7, None])
    else:
        body = body[:rng.randrange(len(body) + 1)] + _randbytes(rng, rng.randint(0, 8))
    try:
        head = json.dumps(header, separators=(",", ":")).encode()  # NaN -> "NaN" on purpose
    except (TypeError, ValueError):
        head = b"{"
    return frame(mtype, {}, body, key=key, raw_header=head)


def frames(count: int, seed: int = 1234, key: Any = None) -> Iterator[bytes]:
    """`count` hostile frames: random bytes, byte-level and header-level mutations."""
    rng = random.Random(seed)
    valid = seeds(key)
    parsed = [split(v) for v in valid]
    for i in range(count):
        kind = i % 8
        if kind == 0:
            yield (b"JSPL\x01" if i % 16 == 0 else b"") + _randbytes(rng, rng.randint(0, 300))
        elif kind <= 3:
            yield mutate_bytes(rng.choice(valid), rng)
        else:
            mtype, header, body = rng.choice(parsed)
            yield _mutate_header(mtype, header, body, rng, key)


def run(count: int, seed: int = 1234, *, key: Any = None, keyring: Any = None,
        limits: Limits = Limits(), decode: Callable[[bytes], Any] | None = None,
        count_untyped: bool = False) -> dict[str, int]:
    """Decode `count` hostile frames (chunks also go through a Reassembler); returns counts
    by outcome. Any exception that is not a WireError propagates (that is the bug the harness
    exists to find), or with `count_untyped` is counted as ``untyped:<class>``."""
    if decode is None:
        reassembler = Reassembler(limits)

        def decode(data: bytes) -> Any:
            message = decode_message(data, fleet_key=key if isinstance(key, bytes) else None,
                                     limits=limits, keyring=keyring)
            if message.type == MessageType.CHUNK:
                reassembler.feed(message)
            return message
    counts: dict[str, int] = {}
    for data in frames(count, seed, key):
        try:
            decode(data)
            name = "accepted"
        except WireError as exc:
            name = type(exc).__name__
            if not str(exc) or "\n" in str(exc):
                raise AssertionError(f"{name} without a one-line message: {exc!r}") from None
        except Exception as exc:  # noqa: BLE001 - only when asked to count them
            if not count_untyped:
                raise
            name = f"untyped:{type(exc).__name__}"
        counts[name] = counts.get(name, 0) + 1
    return counts

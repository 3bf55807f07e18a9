"""Fuzz the wire decoder and measure what decompression bombs cost, side by side.

    python benchmarks/fuzz_wire.py --frames 10000            # counts by outcome, both modes
    python benchmarks/fuzz_wire.py --bombs                   # peak RSS growth per bomb

Each bomb is decoded in a fresh interpreter (so one bomb's peak cannot hide another's);
the growth is that process's peak RSS (VmHWM) after decoding minus its peak before.
`--python PATH` decodes the bombs with another interpreter (another checkout's venv) to
compare builds; the bombs themselves are built here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The fuzzer is test code, not part of the installed package: the checkout's testing/ folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testing"))
import wire_fuzz as fuzz  # noqa: E402

_PROBE = """
import sys
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
from jetsplit.wire import WireError, decode_message
data = open(sys.argv[1], 'rb').read()
before = hwm()
try:
    decode_message(data)
    outcome = 'accepted'
except WireError as exc:
    outcome = type(exc).__name__ + ': ' + str(exc)
except MemoryError:
    outcome = 'MemoryError'
print(hwm() - before, outcome)
"""


def bomb_growth(python: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in fuzz.bombs().items():
            path = Path(tmp) / name
            path.write_bytes(data)
            done = subprocess.run([python, "-c", _PROBE, str(path)], capture_output=True, cwd=tmp,
                                  text=True, timeout=600)
            line = (done.stdout.strip() or done.stderr.strip().splitlines()[-1:] or ["?"])
            growth, _, outcome = (line if isinstance(line, str) else line[0]).partition(" ")
            mib = f"{int(growth) / 2**20:8.1f} MiB" if growth.isdigit() else growth
            print(f"{name:16s} {len(data):7,d} B on the wire  peak RSS +{mib}  {outcome[:90]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bombs", action="store_true")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 200 frames per mode, then every bomb
        args.frames, args.bombs = args.frames or 200, True
    if args.frames:
        from jetsplit.identity import KeyRing, Signer

        signer = Signer.generate("s")  # the seed messages' sender
        modes = (("unsigned", None, None), ("fleet-key HMAC", fuzz.FUZZ_KEY, None),
                 ("device key Ed25519", signer, KeyRing({"s": signer.public_key()})))
        for label, key, keyring in modes:
            start = time.perf_counter()
            counts = fuzz.run(args.frames, args.seed, key=key, keyring=keyring,
                              count_untyped=True)
            elapsed = time.perf_counter() - start
            untyped = sum(n for k, n in counts.items() if k.startswith("untyped:"))
            accepted = counts.get("accepted", 0)
            print(f"{label}: {args.frames} frames in {elapsed:.1f}s: "
                  f"{args.frames - untyped - accepted} typed rejections, "
                  f"{untyped} untyped exceptions, {accepted} accepted")
            print("   ", dict(sorted(counts.items())))
    if args.bombs:
        bomb_growth(args.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())

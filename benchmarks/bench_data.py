"""Image loading on an agent: peak RSS and images/s of a folder of camera-sized pictures,
against the client block's own step rate, at two dataset sizes.

N pictures of 1920×1080 (a class folder each of two; every fifth a PNG, the rest JPEG;
generated into a temporary folder) are trained on at `image_size = 96` by an agent worker
(`jetsplit.edge_agent.worker.AgentWorker`, mobilenetv3-small split 2 with its aux head,
batch 32, local `train` commands). Each size runs in a fresh process, so its peak RSS
(VmHWM, and the decoding worker processes' own) is its own. Printed per size:

- loading: images/s of the batch feed alone (decode, random-resized crop, flip, normalise);
- client step: images/s of the same training on a batch already in memory;
- training: images/s of the real thing, loading included;
- peak RSS of the agent process and of its decoding workers.

Loading is not the bottleneck when training's rate is the client step's; peak RSS must not
grow with N (the images are decoded per batch, never all at once).

    .venv/bin/python benchmarks/bench_data.py [--sizes 2000 200] [--workers N] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 32
IMAGE_SIZE = 96


def generate(root: Path, count: int, size: tuple[int, int], seed: int = 0) -> None:
    """`count` smooth random pictures of `size` in two class folders, every fifth a PNG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        grid = rng.integers(0, 256, size=(14, 24, 3), dtype=np.uint8)
        image = Image.fromarray(grid).resize(size, Image.BICUBIC)
        folder = root / ("a" if i % 2 else "b")
        if i % 5 == 4:
            image.save(folder / f"{i:05d}.png", compress_level=1)
        else:
            image.save(folder / f"{i:05d}.jpg", quality=90)


def subset_folder(src: Path, dst: Path, count: int) -> None:
    """The first `count` pictures of `src` (hard links: nothing is generated twice)."""
    files = sorted(p for p in src.rglob("*") if p.is_file())
    files = sorted(files, key=lambda p: p.name)[:count]
    for f in files:
        (dst / f.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(f, dst / f.parent.name / f.name)


def _peak_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def child(folder: Path, steps: int, workers: int) -> dict[str, float]:
    """One size, in this (fresh) process: the three rates and the peaks."""
    import torch

    from jetsplit.data import ArrayDataset, ImageOptions, load_image_folder
    from jetsplit.data.feed import BatchFeed
    from jetsplit.edge_agent.worker import AgentWorker
    from jetsplit.export.bundle_writer import write_bundle
    from jetsplit.models import ModelSpec
    from jetsplit.server.cuts.shipping import BundleShipper
    from jetsplit.server.engines.seam import Command, InProcessEngine

    torch.set_num_threads(max(1, (os.cpu_count() or 1) - workers))
    started = time.perf_counter()
    data = load_image_folder(folder, ImageOptions(image_size=IMAGE_SIZE))
    index_s = time.perf_counter() - started
    feed = BatchFeed(data, seed=0, workers=workers)
    feed.next(BATCH, 0)  # workers started, first batch decoded
    started = time.perf_counter()
    for i in range(steps):
        feed.next(BATCH, 1 + i // 1000)
    loading = steps * BATCH / (time.perf_counter() - started)
    feed.close()

    archive = write_bundle(ModelSpec("mobilenetv3-small", (3, IMAGE_SIZE, IMAGE_SIZE), 2), 2,
                           Path(tempfile.mkdtemp()) / "bundle", seed=0, tar=True).tar_path
    rng = np.random.default_rng(0)
    held = ArrayDataset(rng.standard_normal((BATCH, 3, IMAGE_SIZE, IMAGE_SIZE))
                        .astype(np.float32), np.arange(BATCH, dtype=np.int64) % 2, "held", 2)
    rates = {}
    for name, source, w in (("client_step", held, 0), ("training", data, workers)):
        worker = AgentWorker("a0", source, loader_workers=w)
        engine = InProcessEngine({"a0": worker})
        BundleShipper(engine, archive, lr=0.01, deadline_s=600,
                      content="aux").ensure(engine.online())
        train = {"a0": Command("train", {"steps": 2, "batch": BATCH})}
        engine.send_and_receive(train)  # warm-up (and the workers' start)
        started = time.perf_counter()
        out = engine.send_and_receive({"a0": Command("train", {"steps": steps, "batch": BATCH})},
                                      round=1, deadline_s=3600)
        assert not out.missed, out.missed
        rates[name] = steps * BATCH / (time.perf_counter() - started)
        worker.feed.close()
    return {"images": len(data), "index_s": index_s, "loading": loading, **rates,
            "peak_mb": _peak_mb(resource.RUSAGE_SELF),
            "workers_peak_mb": _peak_mb(resource.RUSAGE_CHILDREN),
            "skipped": data.skips.count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 200])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=None,
                        help="decoding processes (default: what this machine's cores allow)")
    parser.add_argument("--smoke", action="store_true", help="tiny: 24 and 8 small pictures")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from jetsplit.data.feed import default_workers

    workers = default_workers() if args.workers is None else args.workers
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps, workers)))
        return
    sizes, steps, picture = args.sizes, args.steps, (1920, 1080)
    if args.smoke:
        sizes, steps, picture = [24, 8], 2, (192, 108)
    cmd = " ".join(["python benchmarks/bench_data.py", *sys.argv[1:]])
    print(f"command: {cmd}")
    print(f"{max(sizes)} pictures of {picture[0]}×{picture[1]} (every fifth a PNG) at "
          f"image_size {IMAGE_SIZE}, batch {BATCH}, {steps} steps, {workers} decoding workers, "
          f"{os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="jetsplit-bench-data-") as tmp:
        full = Path(tmp) / f"n{max(sizes)}"
        started = time.perf_counter()
        generate(full, max(sizes), picture)
        print(f"generated in {time.perf_counter() - started:.0f} s")
        rows = []
        for n in sizes:
            folder = full if n == max(sizes) else Path(tmp) / f"n{n}"
            if folder != full:
                subset_folder(full, folder, n)
            done = subprocess.run([sys.executable, __file__, "--child", str(folder),
                                   "--steps", str(steps), "--workers", str(workers)],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| images | loading img/s | client step img/s | training img/s | "
          "peak RSS MiB | workers' peak RSS MiB | index s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['images']} | {r['loading']:.0f} | {r['client_step']:.0f} | "
              f"{r['training']:.0f} | {r['peak_mb']:.0f} | {r['workers_peak_mb']:.0f} | "
              f"{r['index_s']:.2f} |")
    big, small = rows[0], rows[-1]
    print("ratio training / client step: "
          + ", ".join(f"{r['training'] / r['client_step']:.2f} (N={r['images']})" for r in rows))
    print("ratio loading / client step: "
          + ", ".join(f"{r['loading'] / r['client_step']:.2f} (N={r['images']})" for r in rows))
    print(f"peak RSS N={big['images']} / N={small['images']}: "
          f"{big['peak_mb'] / small['peak_mb']:.2f}")


if __name__ == "__main__":
    main()

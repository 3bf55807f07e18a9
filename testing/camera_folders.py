"""Image folders like a camera fleet's, for the end-to-end tests and the field guide's
example: class folders of JPEG and PNG files of many sizes and modes (RGB, RGBA,
grayscale, palette), and a truncated file a field run must skip and count.

Each class is a colour (its channel dominates, with noise and a random bright square), so a
small network learns it in a few rounds: the example shows training move, not a benchmark.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": 0, "green": 1, "blue": 2}
MODES = ("RGB", "RGBA", "L", "P")


def picture(rng: np.random.Generator, channel: int) -> Image.Image:
    """One picture of a class: its colour channel high, the others low, a bright patch."""
    h, w = int(rng.integers(20, 90)), int(rng.integers(20, 90))
    pixels = rng.integers(0, 90, size=(h, w, 3))
    pixels[..., channel] += 140
    y, x = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
    pixels[y:y + h // 3, x:x + w // 3] = 250
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def write_folder(root: Path, per_class: int = 24, seed: int = 0,
                 classes: tuple[str, ...] = tuple(COLOURS), truncated: int = 1) -> Path:
    """`root/<class>/<n>.jpg|.png` for each class; `truncated` files cut in half."""
    rng = np.random.default_rng(seed)
    for name in classes:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = picture(rng, COLOURS[name])
            mode = MODES[i % len(MODES)]
            if i % 2:  # JPEG holds RGB and L only
                image.convert("L" if mode == "L" else "RGB").save(folder / f"{i}.jpg",
                                                                   quality=90)
            else:
                image.convert(mode).save(folder / f"{i}.png")
    for n in range(truncated):
        victim = root / classes[n % len(classes)] / "0.png"
        data = victim.read_bytes()
        victim.write_bytes(data[:len(data) // 2])
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--per-class", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_folder(args.root, args.per_class, args.seed)
    print(args.root)


if __name__ == "__main__":
    main()

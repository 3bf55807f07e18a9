"""One image file to one normalised ``C×H×W`` float32 array, with Pillow and numpy only.

A device has no torchvision, so the usual transforms are written here: decode (EXIF
orientation applied, any mode Pillow reads brought to 1 or 3 channels, 16-bit kept at full
precision), then for training a random-resized crop and a horizontal flip, for evaluation a
resize and centre crop; each is switchable. Random choices come from a generator the caller
seeds per sample, so a batch's pixels do not depend on which process decoded it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np

#: File suffixes an image folder is scanned for (others, e.g. a README, are ignored).
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})

# Modes whose pixels are one grey level; "I;16…" and "I" are 16/32-bit integers, "F" floats.
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
_HIGH_BIT_MODES = frozenset({"I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
# torchvision's RandomResizedCrop defaults: the crop covers 8-100 % of the area, aspect 3:4-4:3.
_CROP_SCALE = (0.08, 1.0)
_CROP_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))


class BadImage(Exception):
    """A file that cannot be used as an image (not one, truncated, empty, too large)."""


def pillow() -> Any:
    """Pillow's Image module; one line saying how to get it when it is missing."""
    try:
        from PIL import Image
    except ImportError:
        from jetsplit.errors import ConfigError

        raise ConfigError("reading images needs Pillow: pip install 'jetsplit[agent]'") from None
    return Image


def decode_errors() -> Tuple[type, ...]:
    """What Pillow raises for a file that is not a usable image."""
    image = pillow()
    return (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError,
            image.DecompressionBombError)


@dataclass(frozen=True)
class Pipeline:
    """How every image of a dataset becomes a model input: output size and channels,
    which transforms run, and the per-channel statistics it is normalised by."""

    height: int
    width: int
    channels: int  # 1 or 3
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    random_crop: bool = True  # training: random-resized crop (else the evaluation crop)
    flip: bool = True  # training: horizontal flip with probability 1/2
    centre_crop: bool = True  # evaluation: centre crop to the output's aspect (else squash)

    def load(self, path: str, rng: Optional[np.random.Generator] = None) -> np.ndarray:
        """The normalised ``C×H×W`` float32 input for one file; ``rng`` given: training.
        Raises BadImage for a file that cannot be used."""
        return self.normalise(self.pixels(path, rng))

    def pixels(self, path: str, rng: Optional[np.random.Generator] = None) -> np.ndarray:
        """``C×H×W`` float32 in [0, 1], transformed but not normalised."""
        image = open_image(path, self.channels, self._draft_side(rng is not None))
        try:
            train = rng is not None
            if train and self.random_crop:
                box = random_box(image.size, rng)
            else:
                box = centre_box(image.size, (self.width, self.height), self.centre_crop)
            out = image.resize((self.width, self.height), resample=pillow().BILINEAR,
                               box=box)
            arr = to_array(out)
        finally:
            image.close()
        if train and self.flip and rng.random() < 0.5:
            arr = arr[:, :, ::-1]
        if arr.shape[0] != self.channels:  # a grey image in a colour set
            arr = np.repeat(arr, self.channels, axis=0)
        return np.ascontiguousarray(arr)

    def normalise(self, arr: np.ndarray) -> np.ndarray:
        mean = np.asarray(self.mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(-1, 1, 1)
        return ((arr - mean) / std).astype(np.float32)

    def _draft_side(self, train: bool) -> int:
        """The shorter side a JPEG may be decoded at (DCT scaling, far cheaper than a full
        decode): the output's, or four times it when a small random crop may be taken."""
        side = min(self.height, self.width)
        return side * 4 if train and self.random_crop else side


def open_image(path: str, channels: int, draft_side: int = 0) -> Any:
    """Decoded, EXIF-oriented, as mode ``L`` or ``RGB`` (8-bit) or ``F`` (one channel of
    16/32-bit or float pixels scaled to [0, 1]). Raises BadImage naming the reason."""
    image_mod = pillow()
    from PIL import ImageOps

    try:
        image = image_mod.open(path)
    except decode_errors() as exc:
        raise BadImage(f"{Path(path).name}: not a readable image ({_reason(exc)})") from None
    try:
        width, height = image.size
        if width * height > (image_mod.MAX_IMAGE_PIXELS or 1 << 62):
            raise BadImage(f"{Path(path).name}: {width}×{height} pixels is over the "
                           f"{image_mod.MAX_IMAGE_PIXELS} limit (a decompression bomb?)")
        if draft_side and image.format == "JPEG":
            scale = max(draft_side / max(min(width, height), 1), 1 / 8)
            image.draft("L" if channels == 1 else "RGB",
                        (max(1, int(width * scale)), max(1, int(height * scale))))
        image.load()
        image = ImageOps.exif_transpose(image) or image
        return _to_mode(image, channels)
    except BadImage:
        image.close()
        raise
    except decode_errors() as exc:
        image.close()
        raise BadImage(f"{Path(path).name}: cannot decode ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _to_mode(image: Any, channels: int) -> Any:
    """Bring any Pillow mode to ``L``/``RGB``, or ``F`` in [0, 1] for high-bit grey."""
    mode = image.mode
    if mode in _HIGH_BIT_MODES:
        arr = np.asarray(image, dtype=np.float64)
        arr = np.clip(arr if mode == "F" else arr / 65535.0, 0.0, 1.0)
        return pillow().fromarray(arr.astype(np.float32))  # 2-D float32: mode F
    if channels == 1 or mode in GREY_MODES:
        return image.convert("L") if mode != "L" else image
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow warns converting such a palette straight
    return image.convert("RGB") if image.mode != "RGB" else image


def to_array(image: Any) -> np.ndarray:
    """A mode ``L``/``RGB``/``F`` image as ``C×H×W`` float32 in [0, 1]."""
    arr = np.asarray(image, dtype=np.float32)
    if image.mode != "F":
        arr = arr / np.float32(255.0)
    return arr[None] if arr.ndim == 2 else np.transpose(arr, (2, 0, 1))


def centre_box(size: Tuple[int, int], out: Tuple[int, int], crop: bool
               ) -> Tuple[float, float, float, float]:
    """The largest centred box of the output's aspect (crop), or the whole image."""
    width, height = size
    if not crop:
        return 0.0, 0.0, float(width), float(height)
    aspect = out[0] / out[1]
    w, h = (height * aspect, float(height)) if width / height > aspect \
        else (float(width), width / aspect)
    left, top = (width - w) / 2, (height - h) / 2
    return left, top, left + w, top + h


def random_box(size: Tuple[int, int], rng: np.random.Generator
               ) -> Tuple[float, float, float, float]:
    """torchvision's random-resized crop: 8-100 % of the area at aspect 3:4-4:3, placed
    uniformly; after ten misses the whole image's centred box of clamped aspect."""
    width, height = size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*_CROP_SCALE)
        aspect = math.exp(rng.uniform(*_CROP_LOG_RATIO))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return float(left), float(top), float(left + w), float(top + h)
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        w, h = int(round(height * (4 / 3))), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return float(left), float(top), float(left + w), float(top + h)


def sample_rng(seed: int, round_: int, draw: int, index: int) -> np.random.Generator:
    """The generator one training sample's crop and flip come from: a function of the
    data seed, the round, the draw within the round and the sample, nothing else."""
    return np.random.default_rng([seed, round_, draw, int(index)])

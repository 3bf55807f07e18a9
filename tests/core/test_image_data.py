"""Image folders and manifests: lazy decoding, skipped files, modes, EXIF, transforms."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from jetsplit.data import (
    ArrayDataset,
    ImageOptions,
    load_dataset,
    load_dataset_split,
    load_image_folder,
    load_manifest,
    with_classes,
)
from jetsplit.data import images as images_mod
from jetsplit.data.feed import BatchFeed, BatchSampler, default_workers
from jetsplit.errors import ConfigError

Image = pytest.importorskip("PIL.Image")

FIXED = ImageOptions(image_size=16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def _photo(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> object:
    arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def _folder(root: Path, per_class: int, classes: tuple[str, ...] = ("cat", "dog"),
            seed: int = 0) -> Path:
    """Class folders of mixed-size JPEGs and PNGs."""
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            w, h = int(rng.integers(20, 60)), int(rng.integers(20, 60))
            suffix = ".jpg" if i % 2 else ".png"
            _photo(rng, w, h).save(root / c / f"{i:04d}{suffix}")
    return root


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


class _Counter:
    """Counts Image.open calls (every decode starts with one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = Image.open

        def counting(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(Image, "open", counting)


# --------------------------------------------------------------------------- lazy decoding


def test_a_batch_decodes_only_its_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    ds = load_image_folder(_folder(tmp_path, 100), FIXED)  # given statistics: no sample
    counter = _Counter(monkeypatch)
    idx = np.asarray([0, 7, 50, 99, 100, 120, 150, 199])
    x, y = ds.batch(idx, train=True, key=(0, 0))
    assert counter.calls == 8 and x.shape == (8, 3, 16, 16) and x.dtype == np.float32
    np.testing.assert_array_equal(y, ds.y[idx])
    assert ds.x[10:13].shape == (3, 3, 16, 16) and counter.calls == 11
    assert ds.x.shape == (200, 3, 16, 16)  # no decode for a shape
    part = ds.subset(np.arange(100, 200))
    assert counter.calls == 11 and part.num_classes == 2 and set(part.y.tolist()) == {1}


def test_measured_statistics_decode_a_bounded_seeded_sample(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    root = _folder(tmp_path, 100)
    counter = _Counter(monkeypatch)
    options = ImageOptions(image_size=16, stats_sample=24, seed=5)
    ds = load_image_folder(root, options)
    assert counter.calls == 2 * 24  # the sample's headers, then the sample's pixels
    again = load_image_folder(root, options)
    assert ds.pipeline == again.pipeline and len(ds.pipeline.mean) == 3
    other = load_image_folder(root, ImageOptions(image_size=16, stats_sample=24, seed=6))
    assert other.pipeline.mean != ds.pipeline.mean
    x = ds.x[:]  # the measured statistics standardise the evaluation inputs
    assert abs(float(x.mean())) < 0.2 and 0.8 < float(x.std()) < 1.2


# --------------------------------------------------------------------------- bad files


def test_undecodable_files_are_skipped_and_counted(tmp_path: Path) -> None:
    root = _folder(tmp_path, 6)
    good = io.BytesIO()
    _photo(np.random.default_rng(1), 64, 48).save(good, format="JPEG")
    (root / "cat" / "truncated.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 3])
    (root / "dog" / "empty.png").write_bytes(b"")
    (root / "dog" / "text.png").write_text("not an image")
    ds = load_image_folder(root, FIXED)
    assert len(ds) == 15
    x, y = ds.batch(np.arange(15), train=True, key=(0, 0))
    assert x.shape[0] == 15 and np.isfinite(x).all()  # a bad file's place goes to a good one
    assert ds.skips.count == 3
    report = ds.skips.report()
    assert report["skipped"] == 3 and any("truncated.jpg" in r for r in report["skipped_examples"])
    ds.batch(np.arange(15))
    assert ds.skips.count == 3  # counted once each


def test_nothing_decodable_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.png").write_bytes(b"")
    with pytest.raises(ConfigError) as exc:
        load_image_folder(tmp_path)
    assert "can be read" in _one_line(exc)


def test_a_decompression_bomb_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    root = _folder(tmp_path, 2)
    _photo(np.random.default_rng(2), 300, 300).save(root / "cat" / "huge.png")
    ds = load_image_folder(root, FIXED)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 60 * 60)
    ds.batch(np.arange(len(ds)))
    assert ds.skips.count == 1 and "limit" in ds.skips.report()["skipped_examples"][0]


def test_folder_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_dataset(f"folder:{tmp_path / 'nowhere'}")
    assert "not found" in _one_line(exc)
    with pytest.raises(ConfigError) as exc:
        load_image_folder(tmp_path)
    assert "no class folders" in _one_line(exc)
    _folder(tmp_path, 2)
    (tmp_path / "zebra").mkdir()
    (tmp_path / "zebra" / "notes.txt").write_text("no images here")
    with pytest.raises(ConfigError) as exc:
        load_image_folder(tmp_path)
    assert "'zebra' has no images" in _one_line(exc)


# --------------------------------------------------------------------------- modes, EXIF


def _mode_image(mode: str) -> object:
    rng = np.random.default_rng(4)
    if mode == "I;16":
        arr = np.full((12, 10), 65535, np.uint16)
        arr[:, :5] = 0
        return Image.fromarray(arr)  # uint16: mode I;16
    base = _photo(rng, 10, 12)
    if mode == "P":
        return base.convert("P", palette=Image.Palette.ADAPTIVE)
    return base.convert(mode)


@pytest.mark.parametrize(("mode", "suffix"), [
    ("RGB", ".png"), ("RGBA", ".png"), ("P", ".png"), ("L", ".png"), ("LA", ".png"),
    ("1", ".png"), ("I;16", ".png"), ("CMYK", ".jpg"), ("L", ".jpg"), ("RGB", ".bmp"),
])
def test_every_mode_becomes_the_right_channels(tmp_path: Path, mode: str, suffix: str) -> None:
    (tmp_path / "a").mkdir()
    _mode_image(mode).save(tmp_path / "a" / f"x{suffix}")
    grey = mode in ("L", "LA", "1", "I;16")
    auto = load_image_folder(tmp_path, ImageOptions(image_size=8))
    assert auto.input_shape == ((1 if grey else 3), 8, 8)
    for channels in (1, 3):
        opts = ImageOptions(image_size=8, channels=channels, mean=(0.0,), std=(1.0,))
        x = load_image_folder(tmp_path, opts).x[:]
        assert x.shape == (1, channels, 8, 8) and np.isfinite(x).all()
        assert x.min() >= 0.0 and x.max() <= 1.0


def test_sixteen_bit_keeps_its_range(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _mode_image("I;16").save(tmp_path / "a" / "x.png")
    opts = ImageOptions(centre_crop=False, mean=(0.0,), std=(1.0,))
    x = load_image_folder(tmp_path, opts).x[0]
    assert x.shape == (1, 12, 10)
    np.testing.assert_allclose(x[0, :, :5], 0.0)
    np.testing.assert_allclose(x[0, :, 5:], 1.0)  # 65535 is white, not clipped at 255


def test_a_grey_image_in_a_colour_set_gets_three_channels(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _mode_image("RGB").save(tmp_path / "a" / "0.png")
    _mode_image("L").save(tmp_path / "a" / "1.png")
    ds = load_image_folder(tmp_path, ImageOptions(image_size=8, mean=(0.0,), std=(1.0,)))
    x = ds.x[:]
    assert x.shape == (2, 3, 8, 8)
    np.testing.assert_array_equal(x[1, 0], x[1, 2])


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = 255  # stored: white left half, black right half, 40 wide
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise: white on top, 20 wide
    Image.fromarray(arr).save(tmp_path / "a" / "turned.jpg", exif=exif, quality=95)
    ds = load_image_folder(tmp_path, ImageOptions(mean=(0.0,), std=(1.0,)))
    assert ds.input_shape == (3, 40, 20)
    x = ds.x[0]
    assert x[:, :20].mean() > 0.9 and x[:, 20:].mean() < 0.1


# --------------------------------------------------------------------------- transforms


def test_transforms_are_seeded_and_switchable(tmp_path: Path) -> None:
    ds = load_image_folder(_folder(tmp_path, 4), FIXED)
    idx = np.arange(8)
    a, _ = ds.batch(idx, train=True, key=(1, 2))
    b, _ = ds.batch(idx, train=True, key=(1, 2))
    c, _ = ds.batch(idx, train=True, key=(1, 3))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    plain = load_image_folder(tmp_path, ImageOptions(
        image_size=16, mean=FIXED.mean, std=FIXED.std, random_crop=False, flip=False))
    np.testing.assert_array_equal(plain.batch(idx, train=True)[0], plain.x[:8])
    assert not np.array_equal(ds.x[:8], a)  # training crops are not the evaluation crop
    flip_only = load_image_folder(tmp_path, ImageOptions(
        image_size=16, mean=FIXED.mean, std=FIXED.std, random_crop=False))
    flipped, _ = flip_only.batch(idx, train=True, key=(0, 0))
    for got, want in zip(flipped, plain.x[:8], strict=True):  # each unchanged or mirrored
        assert np.array_equal(got, want) or np.array_equal(got, want[:, :, ::-1])


def test_centre_crop_or_squash(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    arr = np.zeros((10, 30, 3), np.uint8)
    arr[:, 10:20] = 255  # a white middle third, 30 wide
    Image.fromarray(arr).save(tmp_path / "a" / "wide.png")
    crop = load_image_folder(tmp_path, ImageOptions(image_size=10, mean=(0.0,), std=(1.0,)))
    assert crop.x[0].min() > 0.99  # the centred 10×10 box is all white
    squash = load_image_folder(tmp_path, ImageOptions(image_size=10, centre_crop=False,
                                                      mean=(0.0,), std=(1.0,)))
    assert squash.x[0].min() < 0.01  # the whole image, squeezed


# --------------------------------------------------------------------------- manifests


def _manifest(tmp_path: Path, rows: str) -> Path:
    path = tmp_path / "m.csv"
    path.write_text(rows)
    return path


def test_manifest_reads_paths_relative_to_itself(tmp_path: Path) -> None:
    _folder(tmp_path / "img", 2)
    m = _manifest(tmp_path, "path,label\nimg/cat/0000.png,kitten\nimg/dog/0001.jpg,puppy\n"
                            "img/dog/0000.png,kitten\n")
    ds = load_dataset(f"csv:{m}", FIXED)
    assert ds.classes == ("kitten", "puppy") and ds.y.tolist() == [0, 1, 0]
    assert ds.summary()["classes"] == ["kitten", "puppy"] and ds.x[:].shape == (3, 3, 16, 16)
    train, test = load_dataset_split(f"csv:{m}", 0.34, 0, FIXED)
    assert len(train) + len(test) == 3


@pytest.mark.parametrize(("rows", "expected"), [
    ("img/cat/0000.png,cat\nimg/cat/9999.png,cat\n", "line 2: img/cat/9999.png: no such file"),
    ("img/cat/0000.png\n", "line 1: expected 'path,label'"),
    ("img/cat/0000.png,cat,extra\n", "line 1: expected 'path,label'"),
    ("path,label\n", "no images listed"),
    ("", "no images listed"),
])
def test_manifest_errors_are_one_line(tmp_path: Path, rows: str, expected: str) -> None:
    _folder(tmp_path / "img", 1)
    with pytest.raises(ConfigError) as exc:
        load_manifest(_manifest(tmp_path, rows), FIXED)
    assert expected in _one_line(exc)


def test_manifest_size_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jetsplit.data import image_sets

    monkeypatch.setattr(image_sets, "MAX_MANIFEST_BYTES", 10)
    with pytest.raises(ConfigError) as exc:
        load_manifest(_manifest(tmp_path, "a.png,cat\nb.png,dog\n"))
    assert "over the 10 limit" in _one_line(exc)


# --------------------------------------------------------------------------- classes


def test_classes_are_agreed_by_name(tmp_path: Path) -> None:
    ds = load_image_folder(_folder(tmp_path, 2, classes=("cat", "dog")), FIXED)
    run = with_classes(ds, ["bird", "cat", "dog"])
    assert run.classes == ("bird", "cat", "dog") and run.y.tolist() == [1, 1, 2, 2]
    assert run.summary()["label_histogram"] == [0, 2, 2]
    with pytest.raises(ConfigError) as exc:
        with_classes(ds, ["cat", "bird"])
    assert "class 'dog' is not one of the run's 2 classes" in _one_line(exc)


# --------------------------------------------------------------------------- the feed


def test_feed_gives_the_same_bits_with_and_without_workers(tmp_path: Path) -> None:
    ds = load_image_folder(_folder(tmp_path, 12), FIXED)
    here, ahead = BatchFeed(ds, seed=3, workers=0), BatchFeed(ds, seed=3, workers=2)
    try:
        for round_, batch in ((0, 5), (0, 5), (0, 3), (1, 5), (1, 5), (2, 8)):
            xa, ya = here.next(batch, round_)
            xb, yb = ahead.next(batch, round_)
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ya, yb)
    finally:
        ahead.close()
    fresh = BatchFeed(ds, seed=3, workers=0)  # a restarted agent: round 1 as before
    fresh_x, _ = fresh.next(5, 1)
    replay = BatchFeed(ds, seed=3, workers=0)
    replay.next(5, 0)
    np.testing.assert_array_equal(fresh_x, replay.next(5, 1)[0])


def test_feed_counts_what_its_workers_skip(tmp_path: Path) -> None:
    root = _folder(tmp_path, 4)
    (root / "dog" / "empty.png").write_bytes(b"")
    ds = load_image_folder(root, FIXED)
    feed = BatchFeed(ds, seed=0, workers=1)
    try:
        feed.next(9, 0)
    finally:
        feed.close()
    assert ds.skips.count == 1


def test_feed_indexes_arrays_in_place() -> None:
    rng = np.random.default_rng(0)
    ds = ArrayDataset(rng.standard_normal((30, 1, 4, 4)).astype(np.float32),
                      rng.integers(0, 3, 30).astype(np.int64), "a", 3)
    feed, sampler = BatchFeed(ds, seed=2, workers=4), BatchSampler(30, 2)
    for round_ in (0, 0, 1):
        x, y = feed.next(7, round_)
        idx = sampler.next(7, round_)
        np.testing.assert_array_equal(x, ds.x[idx])
        np.testing.assert_array_equal(y, ds.y[idx])


def test_default_workers_leave_small_devices_alone() -> None:
    assert [default_workers(c) for c in (1, 2, 4, 6, 12)] == [0, 0, 2, 3, 4]


def test_pipeline_boxes() -> None:
    assert images_mod.centre_box((30, 10), (10, 10), True) == (10.0, 0.0, 20.0, 10.0)
    assert images_mod.centre_box((30, 10), (10, 10), False) == (0.0, 0.0, 30.0, 10.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        left, top, right, bottom = images_mod.random_box((64, 32), rng)
        assert 0 <= left < right <= 64 and 0 <= top < bottom <= 32

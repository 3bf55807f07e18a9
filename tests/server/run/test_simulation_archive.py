"""A simulation's bundle archive is stored, not deflated (only its own process reads it;
deflating float weights cost seconds of CPU per run for a few percent of their size), and
loads like any bundle."""

from __future__ import annotations

import gzip
from pathlib import Path
from types import SimpleNamespace

from jetsplit.bundle import load_bundle
from jetsplit.server.run.simulate import fresh_bundle


def test_a_simulation_stores_its_archive_and_it_loads(tmp_path: Path) -> None:
    test = SimpleNamespace(input_shape=(1, 8, 8), num_classes=10)
    archive = fresh_bundle("mobilenetv3-small", test, 2, tmp_path,  # type: ignore[arg-type]
                           aux_ratio=None, seed=0)
    tar_bytes = gzip.decompress(archive.read_bytes())
    assert archive.name.endswith(".tar.gz")
    assert archive.stat().st_size > len(tar_bytes)  # stored blocks: a little over the tar
    bundle = load_bundle(archive)
    assert bundle.split == 2 and bundle.spec.name == "mobilenetv3-small"

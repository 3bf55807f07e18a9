"""Bundles: write → load round trips, and every kind of tampering fails in one line."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from jetsplit.bundle import load_bundle, sha256_file
from jetsplit.errors import BundleError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ZOO_VERSION, ModelSpec, build_aux_head, build_model, split

pytest.importorskip("onnxruntime")

SPEC = ModelSpec("alexnet", (3, 32, 32), 10)
SPLIT = 2


@pytest.fixture(scope="module")
def original() -> dict[str, torch.nn.Module]:
    """Weights unlike the writer's own seeded ones, to prove the bundle carries them."""
    model = build_model(SPEC, seed=7)
    aux = build_aux_head(model, SPLIT, 0.5, seed=8)
    client, server = split(model, SPLIT)
    return {"model": model, "client": client, "server": server, "aux": aux}


@pytest.fixture(scope="module")
def written(original, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "alexnet-2"
    weights = dict(original["model"].state_dict())
    weights.update({f"aux.{k}": v for k, v in original["aux"].state_dict().items()})
    report = write_bundle(SPEC, SPLIT, out, weights=weights, tar=True)
    for diffs in report.max_abs_diff.values():
        assert set(diffs) == {1, 32} and max(diffs.values()) <= 1e-4
    assert report.tar_path is not None and report.tar_path.is_file()
    return out


@pytest.fixture()
def copy(written: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "bundle"
    shutil.copytree(written, dest)
    return dest


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _one_line_error(source: Path, *needles: str) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(source)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def _edit_manifest(root: Path, **changes) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_round_trip_rebuilds_the_original_weights(written: Path, original) -> None:
    bundle = load_bundle(written)
    assert bundle.spec == SPEC and bundle.split == SPLIT and bundle.has_aux
    assert bundle.manifest.client_layers == ("conv1", "conv2")
    assert bundle.manifest.activation_shape == (192, 4, 4)
    client, server, aux = bundle.client_module(), bundle.server_module(), bundle.aux_module()
    _assert_same(client, original["client"])
    _assert_same(server, original["server"])
    _assert_same(aux, original["aux"])
    assert client.training and server.training  # rebuilt modules are ready to train
    x = torch.randn(4, *SPEC.input_shape)
    with torch.no_grad():
        assert torch.equal(server.eval()(client.eval()(x)), original["model"].eval()(x))


def test_manifest_lists_every_file_with_its_hash(written: Path) -> None:
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["jetsplit_version"] and manifest["zoo_version"] == ZOO_VERSION
    assert manifest["codec"] == "fp32" and manifest["opset"] == 17
    names = {p.name for p in written.iterdir()} - {"manifest.json"}
    assert names == set(manifest["files"]) == {"client.safetensors", "server.safetensors",
                                               "aux.safetensors", "client.onnx", "aux.onnx"}
    for name, entry in manifest["files"].items():
        assert entry == {"sha256": sha256_file(written / name),
                         "size": (written / name).stat().st_size}
    assert not any(name.endswith(".engine") for name in names)


def test_same_spec_and_seed_give_identical_files(tmp_path: Path) -> None:
    a = write_bundle(SPEC, 1, tmp_path / "a", aux_ratio=None)
    b = write_bundle(SPEC, 1, tmp_path / "b", aux_ratio=None)
    assert a.files == b.files and "aux.onnx" not in a.files
    with pytest.raises(BundleError, match="no auxiliary head"):
        load_bundle(tmp_path / "a").aux_module()


def test_tampered_byte_fails_in_one_line(copy: Path) -> None:
    path = copy / "client.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    message = _one_line_error(copy)
    assert message == f"bundle {copy}: client.safetensors: sha256 mismatch (file was modified)"


def test_truncated_file_fails(copy: Path) -> None:
    path = copy / "client.onnx"
    path.write_bytes(path.read_bytes()[:-10])
    _one_line_error(copy, "client.onnx", "size")


def test_file_swapped_after_loading_is_caught(copy: Path) -> None:
    bundle = load_bundle(copy)
    path = copy / "server.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="server.safetensors: sha256 mismatch"):
        bundle.server_module()


def test_extra_file_fails(copy: Path) -> None:
    (copy / "evil.py").write_text("print('hi')")
    _one_line_error(copy, "unlisted file 'evil.py'")


def test_engine_built_on_device_is_tolerated(copy: Path) -> None:
    (copy / "client.10.3.0.orin.engine").write_bytes(b"engine")
    assert load_bundle(copy).split == SPLIT


def test_missing_file_fails(copy: Path) -> None:
    (copy / "aux.onnx").unlink()
    _one_line_error(copy, "aux.onnx", "missing")


def test_symlink_fails(copy: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside.onnx"
    shutil.move(copy / "client.onnx", target)
    (copy / "client.onnx").symlink_to(target)
    _one_line_error(copy, "client.onnx", "symlink")


def test_path_traversal_name_fails(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["../evil"] = manifest["files"]["client.onnx"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    _one_line_error(copy, "field files", "unsafe file name '../evil'")


def test_wrong_zoo_version_names_both_versions(copy: Path) -> None:
    _edit_manifest(copy, zoo_version=ZOO_VERSION + 98)
    _one_line_error(copy, f"zoo version {ZOO_VERSION + 98}", f"zoo version {ZOO_VERSION}")


def test_newer_format_version_asks_for_an_upgrade(copy: Path) -> None:
    _edit_manifest(copy, format_version=3, something_new=True)
    _one_line_error(copy, "format version 2", "upgrade jetsplit")


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"split": "2"}, "field split"), ({"unknown": 1}, "field unknown"),
     ({"codec": "fp7"}, "field codec"), ({"aux_ratio": 3.0}, "field aux_ratio"),
     ({"split": 3}, "split 3 but 2 client layers"),
     ({"model": {"name": "nope", "input_shape": [3, 32, 32], "num_classes": 10}},
      "field model"),
     ({"classes": ["cat", "dog"]}, "name each of the model's 10 classes once"),
     ({"classes": ["cat"] * 10}, "name each of the model's 10 classes once"),
     ({"classes": [f"c{i}" for i in range(9)] + [""]}, "field classes")],
)
def test_bad_manifest_field_is_named(copy: Path, changes: dict, field: str) -> None:
    _edit_manifest(copy, **changes)
    _one_line_error(copy, "manifest.json", field)


def test_missing_manifest_field_is_named(copy: Path) -> None:
    data = json.loads((copy / "manifest.json").read_text())
    del data["opset"]
    (copy / "manifest.json").write_text(json.dumps(data))
    _one_line_error(copy, "field opset", "required")


def test_wrong_weight_shapes_fail_on_rebuild(copy: Path) -> None:
    from safetensors.torch import save_file

    path = copy / "client.safetensors"
    save_file({"conv1.conv.weight": torch.zeros(3, 3, 3, 3), "conv1.conv.bias": torch.zeros(3),
               "conv2.conv.weight": torch.zeros(192, 64, 3, 3),
               "conv2.conv.bias": torch.zeros(192)}, str(path))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["client.safetensors"] = {"sha256": sha256_file(path),
                                              "size": path.stat().st_size}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    bundle = load_bundle(copy)
    with pytest.raises(BundleError, match=r"tensor 'conv1.conv.weight' is .*needs|needs"):
        bundle.client_module()


def test_tar_round_trip(written: Path, original, tmp_path: Path) -> None:
    archive = written.with_name(written.name + ".tar.gz")
    bundle = load_bundle(archive)
    assert bundle.root != written
    _assert_same(bundle.client_module(), original["client"])
    target = tmp_path / "extracted"
    assert load_bundle(archive, extract_to=target).root == target
    assert (target / "manifest.json").is_file()


def test_stored_archive_holds_the_same_tar_and_loads(written: Path, original,
                                                     tmp_path: Path) -> None:
    """A simulation's archive (gzip level 0, `compresslevel=0`): the same tar, byte for
    byte, as the default archive's, stored rather than deflated, and it loads the same."""
    import gzip

    from jetsplit.export.bundle_writer import _write_tar

    stored = tmp_path / "stored.tar.gz"
    _write_tar(written, stored, compresslevel=0)
    default = written.with_name(written.name + ".tar.gz")
    tar_bytes = gzip.decompress(default.read_bytes())
    assert gzip.decompress(stored.read_bytes()) == tar_bytes
    assert stored.stat().st_size > len(tar_bytes) > default.stat().st_size  # not deflated
    _assert_same(load_bundle(stored).client_module(), original["client"])


def test_tar_of_a_folder_loads(written: Path, tmp_path: Path) -> None:
    archive = tmp_path / "b.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(written, arcname="alexnet-2")
    assert load_bundle(archive).split == SPLIT


def _tar_with(tmp_path: Path, written: Path, extra: tarfile.TarInfo, data: bytes = b"") -> Path:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(written.iterdir()):
            tar.add(path, arcname=path.name)
        tar.addfile(extra, io.BytesIO(data) if data else None)
    return archive


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", "a/b/c.onnx"])
def test_tar_traversal_fails(written: Path, tmp_path: Path, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.size = 4
    _one_line_error(_tar_with(tmp_path, written, info, b"evil"), "unsafe tar member")


def test_tar_symlink_fails(written: Path, tmp_path: Path) -> None:
    info = tarfile.TarInfo("aux.onnx")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    _one_line_error(_tar_with(tmp_path, written, info), "link")


def test_tar_with_engine_fails(written: Path, tmp_path: Path) -> None:
    info = tarfile.TarInfo("client.8.5.2.xavier.engine")
    info.size = 4
    _one_line_error(_tar_with(tmp_path, written, info, b"eng!"), "never shipped")


def test_not_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "x.tar.gz").write_bytes(b"not a tar")
    _one_line_error(tmp_path / "x.tar.gz", "tar")
    _one_line_error(tmp_path / "missing", "not found")
    _one_line_error(tmp_path, "manifest.json not found")


def test_writer_refuses_to_replace_a_non_bundle(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not empty and not a bundle"):
        write_bundle(SPEC, 1, tmp_path, aux_ratio=None)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- CLI


def test_cli_export_bundle(tmp_path: Path, capsys) -> None:
    from jetsplit.cli import main

    out = tmp_path / "b"
    code = main(["export", "bundle", "--model", "alexnet", "--split", "2", "--out", str(out),
                 "--aux-ratio", "0.25", "--tar"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "client.onnx" in captured.out and "max |Δ| batch 32" in captured.out
    bundle = load_bundle(out)
    assert bundle.manifest.aux_ratio == 0.25
    assert load_bundle(out.with_name("b.tar.gz")).split == 2


def test_cli_bad_split_is_one_line(tmp_path: Path, capsys) -> None:
    from jetsplit.cli import main

    code = main(["export", "bundle", "--model", "alexnet", "--split", "99", "--out",
                 str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_cli_bad_input_shape_is_one_line(tmp_path: Path, capsys) -> None:
    from jetsplit.cli import main

    code = main(["export", "bundle", "--model", "alexnet", "--split", "2", "--out",
                 str(tmp_path / "b"), "--input-shape", "3,32"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_cli_engine_without_tensorrt(written: Path, capsys) -> None:
    from jetsplit.cli import main
    from jetsplit.runtimes.tensorrt_runtime import tensorrt_available

    if tensorrt_available():
        pytest.skip("TensorRT is installed here")
    code = main(["export", "engine", str(written)])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and err.count("\n") == 1 and "TensorRT" in err
    assert not any(p.name.endswith(".engine") for p in written.iterdir())

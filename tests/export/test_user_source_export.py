"""A user's network through the export tool: costs (cache keyed by the code's hash), a bundle
checked in ONNX Runtime, its blocks rebuilt from the bundle, and the same bundle weights for a
factory returning a zoo model as for the zoo name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from jetsplit.bundle import load_bundle
from jetsplit.export import cost_model
from jetsplit.export.bundle_writer import ONNX_ATOL, write_bundle
from jetsplit.export.cost_model import cache_path, get_costs
from jetsplit.models import ModelSpec, build_model

TINY = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 10)


def test_costs_of_a_user_network_and_a_cache_key_with_its_code(tmp_path: Path,
                                                               monkeypatch) -> None:
    costs = get_costs(TINY.name, TINY.input_shape, 10, cache_dir=tmp_path)
    assert costs.layer_names == build_model(TINY, seed=0).layer_names
    assert costs.layers[3].fwd_flops > 0 and costs.layers[2].fwd_flops == 0  # block1, relu
    before = cache_path(TINY.name, TINY.input_shape, 10, cache_dir=tmp_path)
    assert before.is_file()
    monkeypatch.setattr(cost_model, "source_fingerprint", lambda name: "edited-code")
    assert cache_path(TINY.name, TINY.input_shape, 10, cache_dir=tmp_path) != before


def test_a_bundle_of_a_user_network_loads_and_matches(tmp_path: Path) -> None:
    state = build_model(TINY, seed=9).state_dict()
    weights = tmp_path / "w.safetensors"
    save_file({k.split(".", 1)[1]: v.contiguous() for k, v in state.items()}, str(weights))
    report = write_bundle(TINY, 8, tmp_path / "b", seed=0, initial_weights=weights)
    assert max(max(d.values()) for d in report.max_abs_diff.values()) <= ONNX_ATOL
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["model"]["name"] == TINY.name
    assert manifest["code"]["module"] == "usernets" and len(manifest["code"]["sha256"]) == 64
    assert len(manifest["initial_weights_sha256"]) == 64
    assert "initial weights" in report.notes[0]
    bundle = load_bundle(tmp_path / "b")
    client, server = bundle.client_module().eval(), bundle.server_module().eval()
    model = build_model(TINY, seed=9).eval()
    x = torch.randn(3, *TINY.input_shape)
    with torch.no_grad():
        assert torch.equal(server(client(x)), model(x))


def test_a_factory_returning_the_zoo_model_ships_the_same_weights(tmp_path: Path) -> None:
    spec = ModelSpec("resnet18", (3, 8, 8), 10)
    zoo = write_bundle(spec, 3, tmp_path / "zoo", seed=4, aux_ratio=None)
    user = write_bundle(ModelSpec("usernets:zoo_resnet18", (3, 8, 8), 10), 3,
                        tmp_path / "user", seed=4, aux_ratio=None)
    for name in ("client.safetensors", "server.safetensors", "client.onnx"):
        assert zoo.files[name] == user.files[name], name
    zoo_manifest = json.loads((tmp_path / "zoo" / "manifest.json").read_text())
    assert "code" not in zoo_manifest and "initial_weights_sha256" not in zoo_manifest


def test_a_bundle_for_code_not_installed_fails_in_one_line(tmp_path: Path) -> None:
    from jetsplit.errors import ModelError

    with pytest.raises(ModelError, match="not installed here"):
        write_bundle(ModelSpec("nosuchpkg_abc:make", (3, 8, 8), 10), 1, tmp_path / "b")

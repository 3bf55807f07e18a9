"""server.toml's [model] names a user's network (`source`) and its initial weights
(`weights`); the coordinator's bundle is built from them and records the weights' sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from jetsplit.bundle import load_bundle
from jetsplit.errors import ConfigError
from jetsplit.models import ModelSpec, build_model
from jetsplit.server.run.assembly import prepare_bundle
from jetsplit.server.run.config import load_server_config

SOURCE = "usernets:plain_net"


def _config(tmp_path: Path, model_lines: str) -> Path:
    path = tmp_path / "server.toml"
    path.write_text(f'[model]\n{model_lines}input_shape = [3, 16, 16]\nsplit = 2\n'
                    '[data]\ndataset = "digits"\n')
    return path


def test_source_names_the_network_and_a_second_name_is_one_line(tmp_path: Path) -> None:
    cfg = load_server_config(_config(tmp_path, f'source = "{SOURCE}"\n'))
    assert cfg.model.name == SOURCE
    with pytest.raises(ConfigError, match="differ: give one") as caught:
        load_server_config(_config(tmp_path, f'source = "{SOURCE}"\nname = "alexnet"\n'))
    assert "\n" not in str(caught.value)


def test_the_bundle_starts_from_the_weights_file_and_records_its_hash(tmp_path: Path) -> None:
    from usernets import plain_net  # testing/, on the path in tests

    spec = ModelSpec(SOURCE, (3, 16, 16), 10)
    torch.manual_seed(7)  # another seed than the run's: the file must win
    start = {k: v.contiguous() for k, v in plain_net().state_dict().items()}
    weights = tmp_path / "start.safetensors"
    save_file(start, str(weights))
    cfg = load_server_config(_config(tmp_path, f'source = "{SOURCE}"\nweights = "{weights}"\n'))
    bundle = load_bundle(prepare_bundle(cfg, tmp_path / "build"))
    assert bundle.manifest.initial_weights_sha256 == hashlib.sha256(
        weights.read_bytes()).hexdigest()
    # the device block's tensors under the network's own names (its layer's name first)
    started = {k.split(".", 1)[1]: v for k, v in bundle.client_module().state_dict().items()}
    seeded = build_model(spec, seed=cfg.seed).state_dict()
    fresh = {k.split(".", 1)[1]: v for k, v in seeded.items()}
    assert started and all(torch.equal(v, start[k]) for k, v in started.items())
    assert not all(torch.equal(v, fresh[k]) for k, v in started.items())

"""The weights helpers a simulation leans on to hold fewer copies: shape stand-ins for
checking replies, and arrays loaded without a defensive copy first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit.models.weights import load_strict, stand_ins, to_arrays, to_load


def test_stand_ins_carry_shape_dtype_and_size_but_hold_no_memory() -> None:
    layer = nn.Linear(300, 200)
    layer.register_buffer("count", torch.tensor(7, dtype=torch.int64))
    got = stand_ins(layer, "server")
    assert sorted(got) == ["server/bias", "server/count", "server/weight"]
    assert got["server/weight"].shape == (200, 300) and got["server/weight"].dtype == np.float32
    assert got["server/weight"].nbytes == 200 * 300 * 4  # what a reply is accounted for
    assert got["server/count"].shape == () and got["server/count"].dtype == np.int64
    assert got["server/weight"].strides == (0, 0)  # one element's memory, not 240 kB
    assert not got["server/weight"].flags.writeable


def test_to_load_shares_a_writable_average_and_copies_a_read_only_one() -> None:
    torch.manual_seed(0)
    target = nn.Linear(3, 2)
    average = {"server/weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
               "server/bias": np.array([-1.5, 2.0], np.float32), "client/x": np.zeros(1)}
    frozen = average["server/bias"].copy()
    frozen.flags.writeable = False
    tensors = to_load({**average, "server/bias": frozen}, "server")
    assert sorted(tensors) == ["bias", "weight"]
    assert np.shares_memory(tensors["weight"].numpy(), average["server/weight"])
    assert not np.shares_memory(tensors["bias"].numpy(), frozen)
    load_strict(target, tensors, "test")
    loaded = to_arrays(target, "server")
    assert loaded["server/weight"].tolist() == [[0.0, 0.25, 0.5], [0.75, 1.0, 1.25]]
    assert loaded["server/bias"].tolist() == [-1.5, 2.0]
    average["server/weight"][0, 0] = 9.0  # the module holds its own copy after the load
    assert float(target.weight.detach()[0, 0]) == 0.0


def test_a_bundle_block_is_the_same_whether_built_on_meta_or_initialised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_to_load` skips initialisation where torch has the meta-device context (2.x)
    and builds initialised where it has not (the device floor's 1.13): either way the
    bundle's block holds the file's weights, and the global RNG is left where it was."""
    from jetsplit.bundle import load_bundle
    from jetsplit.export.bundle_writer import write_bundle
    from jetsplit.models import ModelSpec, sources

    report = write_bundle(ModelSpec("alexnet", (1, 28, 28), 10), 2, tmp_path / "b", seed=4,
                          tar=True)
    assert report.tar_path is not None
    torch.manual_seed(11)
    meta = to_arrays(load_bundle(report.tar_path).server_module(), "server")
    after_meta = torch.rand(3)
    monkeypatch.setattr(sources, "_META_CONTEXT", False)
    torch.manual_seed(11)
    built = to_arrays(load_bundle(report.tar_path).server_module(), "server")
    assert torch.equal(torch.rand(3), after_meta)
    assert sorted(meta) == sorted(built) and len(meta) > 4
    assert all(np.array_equal(meta[k], built[k]) for k in meta)

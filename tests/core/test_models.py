"""The zoo: every model × split candidate × input shape composes back to the full model."""

from __future__ import annotations

import pytest
import torch

from jetsplit.errors import ModelError
from jetsplit.models import (
    MODEL_NAMES,
    ModelSpec,
    activation_shape,
    build_aux_head,
    build_model,
    split,
)

SHAPES = [(1, 28, 28), (3, 32, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_split_composes_to_the_full_model(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 7, seed=1).eval()
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        assert full.shape == (3, 7)
        for k in model.split_candidates():
            client, server = split(model, k)
            torch.testing.assert_close(server(client(x)), full, atol=1e-5, rtol=0)
            assert client(x).shape[1:] == activation_shape(model, k)
            assert len(client) == k and len(client) + len(server) == len(model)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_aux_head_shapes_for_every_split(name: str) -> None:
    model = build_model(name, (3, 32, 32), 10, seed=0)
    for k in model.split_candidates():
        act = torch.randn(2, *activation_shape(model, k))
        head = build_aux_head(model, k, 0.5)
        assert head(act).shape == (2, 10)
        full_width = build_aux_head(model, k, 1.0)
        n_half = sum(p.numel() for p in head.parameters())
        n_full = sum(p.numel() for p in full_width.parameters())
        assert n_half < n_full, f"{name} split {k}: half-width head is not smaller"


def test_split_in_train_mode_also_composes() -> None:
    model = build_model("resnet18", (3, 32, 32), 10, seed=0).train()
    x = torch.randn(4, 3, 32, 32)
    client, server = split(model, 4)
    assert client.training and server.training
    torch.testing.assert_close(server(client(x)), model(x), atol=1e-5, rtol=0)


def test_seed_makes_weights_reproducible_without_touching_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("alexnet", (1, 28, 28), 10, seed=5)
    b = build_model("alexnet", (1, 28, 28), 10, seed=5)
    assert torch.rand(1).item() == before.item()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_alexnet_split_two_is_scala_client_block() -> None:
    model = build_model("alexnet", (3, 32, 32), 10)
    client, _ = split(model, 2)
    assert [name for name, _ in client.named_children()] == ["conv1", "conv2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="lenet"), "unknown model"),
        (dict(name="alexnet", input_shape=(3, 32)), "three positive integers"),
        (dict(name="alexnet", input_shape=(3, 0, 32)), "three positive integers"),
        (dict(name="alexnet", input_shape=(3, 4096, 32)), "out of range"),
        (dict(name="alexnet", num_classes=1), "class count"),
    ],
)
def test_bad_specs_are_one_line_model_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message) as info:
        ModelSpec(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("k", [0, 8, -1, 100])
def test_split_out_of_range(k: int) -> None:
    model = build_model("alexnet", (1, 28, 28), 10)
    with pytest.raises(ModelError, match=r"choose 1\.\.7"):
        split(model, k)


def test_spec_round_trips_and_rejects_bad_json() -> None:
    spec = ModelSpec("vgg11", (1, 28, 28), 10)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ModelError):
        ModelSpec.from_dict({"name": "vgg11"})
    with pytest.raises(ModelError):
        ModelSpec.from_dict({"name": 3, "input_shape": [1, 28, 28], "num_classes": 10})

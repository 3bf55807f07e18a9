"""Model sources: a user's network (a module:factory, testing/usernets.py) becomes the same
LayeredModel form as a zoo model; the cut finder against hand-listed cuts; the same bits for a
factory that returns a zoo model; initial weights; each bad input in one line."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.model_source import check_identity, code_identity, parse_source
from jetsplit.models import LayeredModel, ModelSpec, build_model, split
from jetsplit.models.fx_cuts import segment
from jetsplit.models.sources import factory_kwargs, resolve_module

TINY = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 10)
PLAIN = ModelSpec("usernets:plain_net", (3, 16, 16), 10)


def test_the_cut_finder_finds_the_hand_listed_cuts_of_a_residual_net() -> None:
    model = build_model(TINY, seed=0)
    # cuts after: stem, stem_bn, the stem's relu, block1's add, its relu, block2's add, its
    # relu, the pooling, the flatten; none inside a residual block (two tensors cross there)
    assert model.layer_names == ["stem", "stem_bn", "relu", "block1", "relu_2", "block2",
                                 "relu_4", "adaptive_avg_pool2d", "flatten", "fc"]
    assert model.split_candidates() == list(range(1, 10))
    block1 = dict(model.block1.named_parameters())
    assert set(block1) == {"block1.conv1.weight", "block1.bn1.weight", "block1.bn1.bias",
                           "block1.conv2.weight", "block1.bn2.weight", "block1.bn2.bias"}
    assert "block2.project.weight" in dict(model.block2.named_parameters())


def test_the_cut_finder_finds_the_hand_listed_cuts_of_a_plain_net() -> None:
    model = build_model(PLAIN, seed=0)
    assert model.layer_names == ["conv1", "relu", "max_pool2d", "conv2", "relu_1",
                                 "adaptive_avg_pool2d", "flatten", "head"]


def test_the_blocks_compute_the_network_and_split_anywhere() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        network = resolve_module(TINY).eval()
    model = build_model(TINY, seed=0).eval()
    x = torch.randn(4, *TINY.input_shape)
    with torch.no_grad():
        want = network(x)
        assert torch.equal(model(x), want)
        for k in model.split_candidates():
            client, server = split(model, k)
            assert torch.equal(server(client(x)), want)
    # the user's parameter names survive inside the blocks
    assert {n.split(".", 1)[1] for n in model.state_dict()} == set(network.state_dict())


class _InplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_no_cut_before_an_in_place_operation() -> None:
    layers = segment(_InplaceNet(), (3, 8, 8), "test")
    assert list(layers) == ["conv", "bn_act", "adaptive_avg_pool2d", "flatten", "fc"]


def test_a_factory_returning_the_zoo_model_gives_the_zoo_names_bits() -> None:
    zoo = build_model(ModelSpec("resnet18", (3, 32, 32), 10), seed=7)
    user = build_model(ModelSpec("usernets:zoo_resnet18", (3, 32, 32), 10), seed=7)
    assert isinstance(user, LayeredModel) and user.layer_names == zoo.layer_names
    a, b = zoo.state_dict(), user.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_building_is_deterministic_under_the_seed() -> None:
    a, b, c = (build_model(TINY, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["stem.stem.weight"], c["stem.stem.weight"])


def test_factory_arguments_follow_the_signature() -> None:
    def takes_classes(num_classes: int) -> None: ...
    def takes_all(**kwargs: object) -> None: ...
    def takes_none() -> None: ...

    assert factory_kwargs(takes_classes, TINY) == {"num_classes": 10}
    assert factory_kwargs(takes_all, TINY) == {"num_classes": 10, "input_shape": (3, 16, 16)}
    assert factory_kwargs(takes_none, TINY) == {}


def test_declared_blocks_split_an_untraceable_model() -> None:
    model = build_model(ModelSpec("usernets:declared_gated", (3, 8, 8), 10), seed=0)
    assert model.layer_names == ["body", "tail"]


@pytest.mark.parametrize(("source", "message"), [
    ("usernets:broken", "the factory raised RuntimeError: the factory failed on purpose"),
    ("usernets:not_a_module", "the factory returned dict, not a torch.nn.Module"),
    ("usernets:gated", "torch.fx cannot trace Gated (TraceError"),
    ("usernets:missing", "usernets has no missing"),
    ("nosuchpackage_xyz:make", "cannot import nosuchpackage_xyz"),
    ("bad source!", "or give module.path:factory"),
    ("bad:source!", "expected a zoo name, module.path:factory"),
])
def test_bad_sources_fail_in_one_line(source: str, message: str) -> None:
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec(source, (3, 8, 8), 10), seed=0)
    text = str(info.value)
    assert message in text and "\n" not in text
    if source == "usernets:gated":
        assert "jetsplit_blocks" in text  # how to declare the blocks instead


def test_library_sources_parse_and_say_when_absent() -> None:
    assert parse_source("torchvision:resnet18").kind == "torchvision"
    assert parse_source("timm:vit_small_patch16_224.augreg_in21k").attr.startswith("vit_")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(ModelError, match="torchvision is not installed here"):
            code_identity("torchvision:resnet18")


def test_code_identity_hashes_the_installed_source_and_refuses_another(tmp_path: Path,
                                                                       monkeypatch) -> None:
    pkg = tmp_path / "fleetnets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("def make(num_classes=10):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recorded = code_identity("fleetnets.nets:make")
    assert recorded is not None and recorded["module"] == "fleetnets.nets"
    check_identity("fleetnets.nets:make", recorded, "here")  # the same code: accepted
    (pkg / "nets.py").write_text("def make(num_classes=10):\n    return 1\n")
    with pytest.raises(ModelError) as info:
        check_identity("fleetnets.nets:make", recorded, "bundle b")
    text = str(info.value)
    assert "refused" in text and recorded["sha256"][:16] in text
    assert code_identity("fleetnets.nets:make")["sha256"][:16] in text  # type: ignore[index]
    assert code_identity("resnet18") is None  # the zoo version covers a zoo model


# --------------------------------------------------------------------------- initial weights


def _net_state(num_classes: int, seed: int) -> OrderedDict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return resolve_module(ModelSpec(TINY.name, TINY.input_shape, num_classes)).state_dict()


def test_initial_weights_from_safetensors_map_by_the_users_names(tmp_path: Path) -> None:
    state = _net_state(10, 5)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model = build_model(TINY, seed=0, weights=path)
    assert torch.equal(model.stem.stem.weight, state["stem.weight"])
    assert torch.equal(model.fc.fc.bias, state["fc.bias"])
    assert model.initial_weights.reinitialised == ()
    assert len(model.initial_weights.sha256) == 64


def test_a_new_class_count_reinitialises_only_the_classifier(tmp_path: Path) -> None:
    state = _net_state(5, 5)  # a file for 5 classes, fine-tuned on 10
    path = tmp_path / "w.pt"
    torch.save(state, path)
    fresh = build_model(TINY, seed=0)
    model = build_model(TINY, seed=0, weights=path)
    assert model.initial_weights.reinitialised == ("fc",)
    assert "re-initialised fc" in model.initial_weights.note()
    assert torch.equal(model.fc.fc.weight, fresh.fc.fc.weight)  # the seeded initialisation
    assert torch.equal(model.block2.block2.conv1.weight, state["block2.conv1.weight"])


def test_a_pickle_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(resolve_module(TINY), path)  # the whole module: needs unpickling code
    with pytest.raises(ModelError) as info:
        build_model(TINY, seed=0, weights=path)
    assert "refused" in str(info.value) and "\n" not in str(info.value)


def test_mis_shaped_missing_and_unexpected_names_are_listed_in_one_line(tmp_path: Path
                                                                        ) -> None:
    state = dict(_net_state(10, 5))
    state["stem.weight"] = torch.zeros(4, 3, 3, 3)
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    with pytest.raises(ModelError) as info:
        build_model(TINY, seed=0, weights=path)
    text = str(info.value)
    assert "mis-shaped stem.weight [4, 3, 3, 3] (model [8, 3, 3, 3])" in text
    del state["stem.weight"]
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(path))
    with pytest.raises(ModelError) as info:
        build_model(TINY, seed=0, weights=path)
    text = str(info.value)
    assert "missing stem.weight" in text and "unexpected extra.weight" in text
    assert "\n" not in text

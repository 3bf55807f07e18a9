"""Fast tier (`-m fast`): Ampere's aux head and SHeRL-FL's tiers at every candidate cut of
user networks (testing/usernets.py), with hand-computed widths, parameter counts, FLOPs and
outputs; the zoo's heads keep their narrow twins.

Hand counts: a block without a narrow twin gets pool → Linear(C, h) + ReLU → Linear(h, K),
h = clamp(round(ratio·C), max(16, K), 512): C·h + h + h·K + K parameters, and per sample
2·(C·h + h·K) forward FLOPs (the two matmuls; the mean and the ReLU count none), twice that
backward (gradients for the weights and for the input, which trains the client block).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jetsplit.export.cost_model import aux_block, get_costs
from jetsplit.export.planner import classifier_start
from jetsplit.models import ModelSpec, activation_shape, build_aux_head, build_model, split
from jetsplit.models.split import AUX_MAX_HIDDEN, AUX_MIN_HIDDEN, aux_hidden_width
from jetsplit.tiers import carve

pytestmark = pytest.mark.fast

TINY = ModelSpec("usernets:tiny_resnet", (3, 16, 16), 10)
TOKENS = ModelSpec("usernets:token_net", (3, 16, 16), 10)

# tiny_resnet's blocks: stem, stem_bn, relu, block1, relu_2, block2, relu_4, pool, flatten,
# fc. Cuts 1-5 carry 8 channels at 16×16, 6-7 16 channels at 8×8, 8 (16,1,1), 9 (16,).
TINY_SHAPES = {1: (8, 16, 16), 2: (8, 16, 16), 3: (8, 16, 16), 4: (8, 16, 16),
               5: (8, 16, 16), 6: (16, 8, 8), 7: (16, 8, 8), 8: (16, 1, 1), 9: (16,)}
# C = 8: h = max(16, 10, 4) = 16 → 8·16 + 16 + 16·10 + 10 = 314
# C = 16: h = max(16, 10, 8) = 16 → 16·16 + 16 + 16·10 + 10 = 442
TINY_PARAMS = {k: 314 if k <= 5 else 442 for k in TINY_SHAPES}
TINY_FWD = {k: 2 * (8 * 16 + 16 * 10) if k <= 5 else 2 * (16 * 16 + 16 * 10)
            for k in TINY_SHAPES}  # 576 and 832


@pytest.mark.parametrize(("channels", "classes", "ratio", "hidden"), [
    (8, 10, 0.5, 16),      # 4 → the floor 16
    (64, 10, 0.5, 32),     # the paper's half width
    (64, 10, 0.25, 16),    # 16
    (64, 10, 1.0, 64),
    (100, 100, 0.5, 100),  # never narrower than the logits
    (1000, 10, 0.5, 500),
    (4096, 10, 0.5, 512),  # the ceiling
    (4096, 1000, 0.5, 512),  # the ceiling wins over the class count
    (3, 2, 1.0, 16),
])
def test_hidden_width_is_ratio_times_channels_clamped(channels: int, classes: int,
                                                      ratio: float, hidden: int) -> None:
    assert (AUX_MIN_HIDDEN, AUX_MAX_HIDDEN) == (16, 512)
    assert aux_hidden_width(channels, classes, ratio) == hidden


def test_tiny_resnet_head_at_every_cut_by_hand() -> None:
    model = build_model(TINY, seed=0)
    assert model.split_candidates() == list(TINY_SHAPES)
    torch.manual_seed(3)
    for k, shape in TINY_SHAPES.items():
        assert activation_shape(model, k) == shape
        head = build_aux_head(model, k, 0.5, seed=0).eval()
        channels = shape[0]
        assert head.hidden.fc.in_features == channels and head.hidden.fc.out_features == 16
        assert head.classifier.in_features == 16 and head.classifier.out_features == 10
        assert sum(p.numel() for p in head.parameters()) == TINY_PARAMS[k], k
        assert list(head.state_dict()) == ["hidden.fc.weight", "hidden.fc.bias",
                                           "classifier.weight", "classifier.bias"]
        x = torch.randn(3, *shape)
        pooled = x.mean(dim=(2, 3)) if x.dim() == 4 else x
        want = F.linear(F.relu(F.linear(pooled, head.hidden.fc.weight, head.hidden.fc.bias)),
                        head.classifier.weight, head.classifier.bias)
        with torch.no_grad():
            got = head(x)
        assert got.shape == (3, 10)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_ratio_sizes_the_head_of_wide_cuts() -> None:
    """The zoo's resnet18 inside a plain module: its blocks have no narrow twin, the
    hidden width follows the channels: 64 → 32, 512 → 256 at 0.5; 64 → 64 at 1.0."""
    model = build_model(ModelSpec("usernets:wrapped_resnet18", (3, 8, 8), 10), seed=0)
    widths = {}
    for k in model.split_candidates():
        shape = activation_shape(model, k)
        head = build_aux_head(model, k, 0.5, seed=0)
        widths[shape[0]] = head.hidden.fc.out_features
        c, h = shape[0], widths[shape[0]]
        assert sum(p.numel() for p in head.parameters()) == c * h + h + h * 10 + 10
    assert widths == {64: 32, 128: 64, 256: 128, 512: 256}
    first = build_aux_head(model, 1, 1.0, seed=0)
    assert first.hidden.fc.out_features == 64  # stem: 64 channels
    assert sum(p.numel() for p in first.parameters()) == 64 * 64 + 64 + 64 * 10 + 10  # 4810


def test_token_sequences_pool_over_tokens() -> None:
    """(tokens, dim) activations are averaged over the tokens, as the zoo's ViT head does;
    a (C, L) map is read the same way (the documented limit of a 3-D activation)."""
    model = build_model(TOKENS, seed=0)
    shapes = {k: activation_shape(model, k) for k in model.split_candidates()}
    assert shapes == {1: (8, 4, 4), 2: (8, 16), 3: (16, 8), 4: (16, 8), 5: (16, 8), 6: (8,),
                      7: (16,), 8: (16,)}
    head = build_aux_head(model, 3, 0.5, seed=0).eval()
    assert head.hidden.fc.in_features == 8  # the token width, after the token mean
    assert sum(p.numel() for p in head.parameters()) == 8 * 16 + 16 + 16 * 10 + 10  # 314
    x = torch.randn(2, 16, 8)
    with torch.no_grad():
        torch.testing.assert_close(head(x), head.classifier(head.hidden(x.mean(dim=1))),
                                   rtol=0, atol=0)
    wide = build_aux_head(model, 2, 0.5, seed=0)  # (8, 16): the 16-wide axis is kept
    assert wide.hidden.fc.in_features == 16
    assert sum(p.numel() for p in wide.parameters()) == 16 * 16 + 16 + 16 * 10 + 10  # 442


def test_zoo_heads_keep_their_narrow_twin_and_a_factory_gives_the_same_bits() -> None:
    zoo = build_model("resnet18", (3, 8, 8), 10, seed=0)
    user = build_model(ModelSpec("usernets:zoo_resnet18", (3, 8, 8), 10), seed=0)
    for k in zoo.split_candidates():
        a, b = build_aux_head(zoo, k, 0.5, seed=1), build_aux_head(user, k, 0.5, seed=1)
        assert isinstance(a.hidden, torch.nn.Identity)
        assert not any(n.startswith("hidden") for n in a.state_dict())
        assert list(a.state_dict()) == list(b.state_dict())
        assert all(torch.equal(v, b.state_dict()[n]) for n, v in a.state_dict().items())


def test_the_cost_model_counts_the_new_head_by_hand(tmp_path: Path) -> None:
    costs = get_costs(TINY.name, TINY.input_shape, 10, cache_dir=tmp_path)
    for k in TINY_SHAPES:
        aux = aux_block(costs, k)
        assert aux.params == TINY_PARAMS[k], k
        assert aux.param_bytes == 4 * TINY_PARAMS[k]
        assert aux.fwd_flops == TINY_FWD[k], k
        assert aux.bwd_flops == 2 * TINY_FWD[k], k
    wide = get_costs(TINY.name, TINY.input_shape, 10, aux_ratio=1.0, cache_dir=tmp_path)
    assert aux_block(wide, 6).params == 442  # ratio·16 = 16: still the floor


@pytest.mark.parametrize("spec", [TINY, TOKENS], ids=["tiny_resnet", "token_net"])
def test_every_carve_of_every_server_block_composes_exactly(spec: ModelSpec) -> None:
    """SHeRL-FL's tiers by block count at every (k1, k2): the edge hosts exactly the
    blocks [k1:k2], and cloud∘edge is the server block bit for bit."""
    model = build_model(spec, seed=0).eval()
    names = model.layer_names
    x = torch.randn(4, *spec.input_shape)
    checked = 0
    for k1 in model.split_candidates()[:-1]:
        client, server = split(model, k1)
        with torch.no_grad():
            a = client(x)
            whole = server(a)
        for m in range(1, len(server)):
            edge, head = carve(server, m)
            assert [n for n, _ in edge.named_children()] == names[k1:k1 + m]
            with torch.no_grad():
                assert torch.equal(head(edge(a)), whole), (k1, m)
            checked += 1
    n = len(names)
    assert checked == (n - 1) * (n - 2) // 2  # 36 pairs for 10 blocks, 28 for 9


def test_the_cloud_tier_of_a_user_network_starts_at_its_vector_fed_blocks(tmp_path: Path
                                                                          ) -> None:
    """The names fc…/head are the zoo's; a user's head is found by shape too."""
    tiny = get_costs(TINY.name, TINY.input_shape, 10, cache_dir=tmp_path)
    assert classifier_start(tiny) == 9  # fc (flatten takes (16,1,1): a feature map)
    tokens = get_costs(TOKENS.name, TOKENS.input_shape, 10, cache_dir=tmp_path)
    assert tokens.layer_names[6:] == ["classifier_0", "classifier_1", "classifier_2"]
    assert classifier_start(tokens) == 6  # by names alone it would be 8
    alexnet = get_costs("alexnet", (1, 28, 28), 10, cache_dir=tmp_path)
    assert classifier_start(alexnet) == 5  # the zoo's fc1..fc3, as before

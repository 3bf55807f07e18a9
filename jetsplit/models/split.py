"""Splitting a layered model into client and server blocks, and Ampere's auxiliary head."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.models.layers import ZooLayer, he_init
from jetsplit.models.zoo import LayeredModel

DEFAULT_AUX_RATIO = 0.5
AUX_MIN_HIDDEN = 16  # aux_hidden_width's floor (with the class count)
AUX_MAX_HIDDEN = 512  # and its ceiling


def check_split(model: LayeredModel, k: int) -> None:
    """Reject a split index outside 1..n-1 with one line naming the valid range."""
    candidates = model.split_candidates()
    if not isinstance(k, int) or k not in candidates:
        raise ModelError(
            f"split {k} is out of range for {model.spec.name}: choose 1..{candidates[-1]} "
            f"(the client runs the first k of {len(model)} layers)"
        )


def split(model: LayeredModel, k: int) -> tuple[nn.Sequential, nn.Sequential]:
    """Client block = layers[:k], server block = layers[k:]; they share the model's modules,
    so server(client(x)) is exactly model(x)."""
    check_split(model, k)
    children = list(model.named_children())
    client = nn.Sequential(OrderedDict(children[:k])).train(model.training)
    server = nn.Sequential(OrderedDict(children[k:])).train(model.training)
    return client, server


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Run a probe in eval mode (no batch-norm statistics updated), then restore every
    submodule's own mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, mode in modes:
            m.training = mode


def activation_shape(model: LayeredModel, k: int) -> tuple[int, ...]:
    """Per-sample shape of the activation crossing split k (what travels over the wire)."""
    check_split(model, k)
    client, _ = split(model, k)
    with eval_mode(client), torch.no_grad():
        out = client(torch.zeros(1, *model.spec.input_shape))
    return tuple(out.shape[1:])


def aux_hidden_width(channels: int, num_classes: int, ratio: float) -> int:
    """Width of the hidden layer of the aux head of a block with no narrow twin.

    hidden = clamp(round(ratio × C), max(AUX_MIN_HIDDEN, classes), AUX_MAX_HIDDEN), C the
    pooled activation's features (channels of a feature map, width of a token or a vector).
    Ampere (§3.2.2) makes the aux net's first layer the first server layer at `ratio` (0.5)
    of its width; a user's block has no width to read, but the layer after a cut of C
    channels is about C wide in the networks Ampere trains (ResNet, VGG, MobileNet), so
    ratio × C stands in for it. The floor keeps the hidden layer at least as wide as the
    logits (narrower, it caps their rank: an 8-channel stem cut at 0.5 would give 4 units
    for 10 classes) and at least 16; the ceiling (512, the widest feature of ResNet-18 and
    of VGG's classifier) keeps the head light next to the server block however wide a late
    cut is (Ampere's s_aux ≪ s_server, §4.2): at most 512·(C + K + 1) + K parameters."""
    floor = max(AUX_MIN_HIDDEN, num_classes)
    return min(AUX_MAX_HIDDEN, max(floor, int(round(ratio * channels))))


class AuxiliaryHead(nn.Module):
    """Ampere's auxiliary network (the Ampere paper §3.2.2): the first server layer replicated at a
    fraction of its width, global pooling, and a linear classifier, so the client block can
    train on a local loss without server gradients.

    A block of a user's network (or any layer without a narrow twin) cannot be replicated:
    its head is global pooling, then a hidden linear layer + ReLU of `aux_hidden_width`
    units, then the linear classifier, the paper's two layers with the replica's
    convolution dropped (docs/methods.md#auxiliary-heads-and-edge-tiers-at-any-cut)."""

    def __init__(self, first_server_layer: nn.Module, activation: torch.Tensor,
                 num_classes: int, ratio: float) -> None:
        super().__init__()
        self.ratio = ratio
        twin = isinstance(first_server_layer, ZooLayer)
        self.replica = first_server_layer.narrow(ratio) if twin else nn.Identity()
        with eval_mode(self.replica), torch.no_grad():
            features = self.pool(self.replica(activation)).shape[1]
        self.hidden: nn.Module = nn.Identity()
        if not twin:
            width = aux_hidden_width(features, num_classes, ratio)
            fc = nn.Linear(features, width)
            he_init(fc, "relu")
            self.hidden = nn.Sequential(OrderedDict(fc=fc, act=nn.ReLU()))
            features = width
        self.classifier = nn.Linear(features, num_classes)

    @staticmethod
    def pool(x: torch.Tensor) -> torch.Tensor:
        """Feature maps → channel means; token sequences → token means; vectors unchanged."""
        if x.dim() == 4:
            return x.mean(dim=(2, 3))
        if x.dim() == 3:
            return x.mean(dim=1)
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.hidden(self.pool(self.replica(x))))


def build_aux_head(model: LayeredModel, k: int, ratio: float = DEFAULT_AUX_RATIO,
                   *, seed: int | None = None) -> AuxiliaryHead:
    """Auxiliary head for split k at width `ratio` of the first server layer."""
    if not 0.0 < ratio <= 1.0:
        raise ModelError(f"aux ratio must be in (0, 1], got {ratio}")
    check_split(model, k)
    first = model[k]
    probe = torch.zeros(1, *activation_shape(model, k))
    if seed is None:
        return AuxiliaryHead(first, probe, model.spec.num_classes, ratio)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AuxiliaryHead(first, probe, model.spec.num_classes, ratio)

"""Networks a user might bring, for the model-source tests (`usernets:<factory>`).

Importable as a top-level module from the checkout's testing/ folder (tests/conftest.py puts
it on sys.path; on the command line: PYTHONPATH=testing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetsplit.models import LayeredModel, build_model


class Residual(nn.Module):
    """conv-bn-relu-conv-bn plus the input (projected when the shape changes), then relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.project = nn.Conv2d(cin, cout, 1, stride, bias=False) \
            if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.project is None else self.project(x)
        return F.relu(out + shortcut)


class TinyResNet(nn.Module):
    """A small residual network, not a Sequential: the cut finder must find its cuts.

    Hand-listed cuts, after: stem, stem_bn, the stem's relu, block1's add, its relu,
    block2's add, its relu, the pooling, the flatten (9 cuts, 10 blocks); none inside a
    residual block, where the branch and the shortcut both cross.
    """

    def __init__(self, num_classes: int = 10, input_shape: tuple = (3, 16, 16)) -> None:
        super().__init__()
        channels = input_shape[0]
        self.stem = nn.Conv2d(channels, 8, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.block1 = Residual(8, 8)
        self.block2 = Residual(8, 16, stride=2)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        x = self.block2(self.block1(x))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


def tiny_resnet(num_classes: int = 10, input_shape: tuple = (3, 16, 16)) -> nn.Module:
    return TinyResNet(num_classes, input_shape)


def plain_net(num_classes: int = 10) -> nn.Module:
    """A plain (skip-free) network written as a module, not a Sequential."""
    return PlainNet(num_classes)


class PlainNet(nn.Module):
    """conv → relu → pool → conv → relu → global pool → flatten → linear (8 operations)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.relu(self.conv2(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TokenNet(nn.Module):
    """Patches as a token sequence, a per-token mixing layer, the token mean, and a
    two-layer classifier named `classifier` (not fc…/head): for the aux head's token
    pooling and the shape rule of the cloud tier's head.

    Hand-listed blocks (per-sample output): embed (8,4,4), flatten (8,16), transpose
    (16,8), mix (16,8), relu (16,8), mean (8,), classifier_0 (16,), classifier_1 (16,),
    classifier_2 (classes,)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.mix = nn.Linear(8, 8)
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.flatten(self.embed(x), 2).transpose(1, 2)
        return self.classifier(F.relu(self.mix(tokens)).mean(dim=1))


def token_net(num_classes: int = 10) -> nn.Module:
    return TokenNet(num_classes)


def zoo_resnet18(num_classes: int, input_shape: tuple) -> LayeredModel:
    """The zoo's resnet18, returned by a factory: must give the zoo name's bits."""
    return build_model("resnet18", input_shape, num_classes)


class Wrapped(nn.Module):
    """A zoo model inside a plain module: split by the cut finder, not as a Sequential."""

    def __init__(self, name: str, num_classes: int, input_shape: tuple) -> None:
        super().__init__()
        self.net = build_model(name, input_shape, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def wrapped_resnet18(num_classes: int, input_shape: tuple) -> nn.Module:
    return Wrapped("resnet18", num_classes, input_shape)


class Gated(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        if x.sum() > 0:
            x = torch.relu(x)
        return self.fc(x.mean(dim=(2, 3)))


def gated(num_classes: int = 10) -> nn.Module:
    return Gated(num_classes)


class DeclaredGated(nn.Module):
    """An untraceable network that declares its blocks by submodule name."""

    jetsplit_blocks = ["body", "tail"]

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 4, 3, padding=1)
        self.tail = _Tail(nn.Linear(4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(x))


class _Tail(nn.Module):
    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = torch.relu(x)
        return self.fc(x.mean(dim=(2, 3)))


def declared_gated(num_classes: int = 10) -> nn.Module:
    return DeclaredGated(num_classes)


def broken(num_classes: int = 10) -> nn.Module:
    raise RuntimeError("the factory failed on purpose")


def not_a_module(num_classes: int = 10) -> object:
    return {"num_classes": num_classes}

"""Atomic layers of the model zoo.

A split point may fall between any two of these and never inside one (residual and
transformer blocks stay whole). Each layer knows how to build its *narrow twin* — the same
kind of layer, taking the same input, at a fraction of its width — which is what Ampere's
auxiliary head replicates from the first server layer (the Ampere paper §3.2.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def scaled(width: int, ratio: float, divisor: int = 1) -> int:
    """Width scaled by `ratio`, rounded to a multiple of `divisor`, never below it."""
    return max(divisor, int(round(width * ratio / divisor)) * divisor)


def make_divisible(value: float, divisor: int = 8) -> int:
    """MobileNet channel rounding: nearest multiple of `divisor`, at most 10% below `value`."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def activation(name: str | None) -> nn.Module:
    """Activation by name; `None` means identity (a logit layer)."""
    table: dict[str | None, type[nn.Module]] = {
        "relu": nn.ReLU,
        "hswish": nn.Hardswish,
        "gelu": nn.GELU,
        None: nn.Identity,
    }
    if name not in table:
        raise ValueError(f"unknown activation {name!r}")
    return table[name]()


class ZooLayer(nn.Module):
    """A layer of the zoo: one split unit with a narrow twin for auxiliary heads."""

    def narrow(self, ratio: float) -> nn.Module:
        """The same kind of layer on the same input, with its width scaled by `ratio`.

        Only layers that can open a server block need one; a model's first layer cannot.
        """
        raise TypeError(f"{type(self).__name__} cannot open a server block")


def he_init(layer: nn.Conv2d | nn.Linear, act: str | None) -> None:
    """He (fan-in) init before a ReLU, a small one for a logit layer.

    PyTorch's default (uniform, gain √(1/3)) shrinks the signal ~3× in variance per layer;
    through AlexNet's eight plain layers that left the logits near zero and SGD crawling
    (MNIST, lr 0.1, 100 steps: 31% test accuracy; with this init at lr 0.01: 64%)."""
    if act is None:
        nn.init.normal_(layer.weight, std=0.01)
    else:
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class ConvStage(ZooLayer):
    """conv → [batch norm] → activation → [max pool 2×2]: one stage of AlexNet/VGG or a stem."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int = 3,
        stride: int = 1,
        padding: int = 1,
        *,
        batch_norm: bool = True,
        pool: bool = False,
        act: str | None = "relu",
    ) -> None:
        super().__init__()
        self.config = dict(kernel=kernel, stride=stride, padding=padding,
                           batch_norm=batch_norm, pool=pool, act=act)
        self.cin, self.cout = cin, cout
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=not batch_norm)
        self.norm = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
        self.act = activation(act)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()
        he_init(self.conv, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.norm(self.conv(x))))

    def narrow(self, ratio: float) -> nn.Module:
        return ConvStage(self.cin, scaled(self.cout, ratio), **self.config)


class LinearStage(ZooLayer):
    """[flatten] → linear → activation: a fully connected layer of AlexNet/VGG classifiers."""

    def __init__(self, fin: int, fout: int, *, act: str | None = "relu", flatten: bool = False):
        super().__init__()
        self.fin, self.fout, self.act_name, self.flatten = fin, fout, act, flatten
        self.fc = nn.Linear(fin, fout)
        self.act = activation(act)
        he_init(self.fc, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten:
            x = torch.flatten(x, 1)
        return self.act(self.fc(x))

    def narrow(self, ratio: float) -> nn.Module:
        # A logit layer's twin is a hidden layer: the aux head adds its own classifier after it.
        return LinearStage(self.fin, scaled(self.fout, ratio), act=self.act_name or "relu",
                           flatten=self.flatten)


class BasicBlock(ZooLayer):
    """ResNet basic block (two 3×3 convs, identity or 1×1 projection shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.cin, self.cout, self.stride = cin, cout, stride
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))

    def narrow(self, ratio: float) -> nn.Module:
        return BasicBlock(self.cin, scaled(self.cout, ratio), self.stride)


class SqueezeExcite(nn.Module):
    """MobileNetV3 squeeze-and-excitation with a hard-sigmoid gate."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = make_divisible(channels / 4)
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = F.hardsigmoid(self.expand(F.relu(self.reduce(scale))))
        return x * scale


class InvertedResidual(ZooLayer):
    """MobileNetV3 bneck: [1×1 expand] → k×k depthwise → [SE] → 1×1 project (+ residual)."""

    def __init__(
        self, cin: int, expanded: int, cout: int, kernel: int, stride: int, se: bool, act: str
    ) -> None:
        super().__init__()
        self.args = (cin, expanded, cout, kernel, stride, se, act)
        self.residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expanded != cin:
            layers += [nn.Conv2d(cin, expanded, 1, bias=False), nn.BatchNorm2d(expanded),
                       activation(act)]
        layers += [
            nn.Conv2d(expanded, expanded, kernel, stride, kernel // 2, groups=expanded,
                      bias=False),
            nn.BatchNorm2d(expanded),
            activation(act),
        ]
        if se:
            layers.append(SqueezeExcite(expanded))
        layers += [nn.Conv2d(expanded, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + x if self.residual else out

    def narrow(self, ratio: float) -> nn.Module:
        cin, expanded, cout, kernel, stride, se, act = self.args
        return InvertedResidual(cin, make_divisible(expanded * ratio),
                                make_divisible(cout * ratio), kernel, stride, se, act)


class PoolHead(ZooLayer):
    """Classifier head: global pooling (spatial mean or class token) → [hidden] → logits."""

    def __init__(
        self,
        fin: int,
        num_classes: int,
        *,
        hidden: int | None = None,
        act: str = "relu",
        pool: str = "avg",
    ) -> None:
        super().__init__()
        if pool not in ("avg", "cls"):
            raise ValueError(f"unknown pool {pool!r}")
        self.fin, self.hidden, self.act_name, self.pool = fin, hidden, act, pool
        self.norm = nn.LayerNorm(fin) if pool == "cls" else nn.Identity()
        body: list[nn.Module] = []
        width = fin
        if hidden is not None:
            body += [nn.Linear(fin, hidden), activation(act)]
            width = hidden
        body.append(nn.Linear(width, num_classes))
        self.body = nn.Sequential(*body)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == "cls":
            return self.norm(x)[:, 0]
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.features(x))

    def narrow(self, ratio: float) -> nn.Module:
        return _PooledLinear(self, scaled(self.hidden or self.fin, ratio))


class _PooledLinear(nn.Module):
    """Narrow twin of a PoolHead: its pooling, then a hidden layer of the scaled width."""

    def __init__(self, head: PoolHead, width: int) -> None:
        super().__init__()
        self.pool = head.pool
        self.norm = nn.LayerNorm(head.fin) if head.pool == "cls" else nn.Identity()
        self.fc = nn.Linear(head.fin, width)
        self.act = activation(head.act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)[:, 0] if self.pool == "cls" else torch.flatten(
            F.adaptive_avg_pool2d(x, 1), 1)
        return self.act(self.fc(x))


class PatchEmbed(ZooLayer):
    """ViT stem: non-overlapping patches → tokens, class token prepended, learned positions."""

    def __init__(self, cin: int, dim: int, patch: int, num_patches: int) -> None:
        super().__init__()
        self.cin, self.dim, self.patch, self.num_patches = cin, dim, patch, num_patches
        self.proj = nn.Conv2d(cin, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed


class TransformerBlock(ZooLayer):
    """Pre-norm transformer encoder block; attention written with matmuls so FLOP counting and
    every ONNX opset see plain ops."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by {heads} heads")
        self.dim, self.heads, self.mlp_ratio = dim, heads, mlp_ratio
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        head_dim = dim // self.heads
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = torch.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(head_dim)), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def narrow(self, ratio: float) -> nn.Module:
        head_dim = self.dim // self.heads
        heads = max(1, int(round(self.heads * ratio)))
        return nn.Sequential(
            nn.Linear(self.dim, heads * head_dim),
            TransformerBlock(heads * head_dim, heads, self.mlp_ratio),
        )

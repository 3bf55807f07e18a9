"""The model zoo: every model is an ordered list of named atomic layers.

Models are built for any input shape (1×28×28, 3×32×32, 3×64×64, ...) and class count;
pooling that would shrink a feature map below 1×1 is dropped, and every layer's input width
is found by running a probe tensor through the layers built so far. Changing what a name
builds changes `ZOO_VERSION`: bundles record it, and agents refuse a mismatch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Tuple

import torch
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.model_source import is_zoo, parse_source
from jetsplit.models.layers import (
    BasicBlock,
    ConvStage,
    InvertedResidual,
    LinearStage,
    PatchEmbed,
    PoolHead,
    TransformerBlock,
    ZooLayer,
    make_divisible,
)

ZOO_VERSION = 1
MAX_INPUT_SIDE = 512
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class ModelSpec:
    """What rebuilds a model exactly: name, input shape (C, H, W) and number of classes.

    `name` is a model source: a zoo name, `module.path:factory`, `torchvision:NAME` or
    `timm:NAME` (jetsplit/model_source.py); only a zoo name is checked against the zoo here."""

    name: str
    input_shape: Tuple[int, int, int] = (3, 32, 32)
    num_classes: int = 10

    def __post_init__(self) -> None:
        parse_source(self.name)
        if is_zoo(self.name) and self.name not in MODEL_BUILDERS:
            raise ModelError(
                f"unknown model {self.name!r}; choose one of {', '.join(MODEL_BUILDERS)}, "
                "or give module.path:factory, torchvision:NAME or timm:NAME"
            )
        shape = tuple(self.input_shape)
        if len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape):
            raise ModelError(f"input shape must be three positive integers C,H,W, got {shape}")
        if shape[0] > 16 or max(shape[1:]) > MAX_INPUT_SIDE:
            raise ModelError(f"input shape {shape} is out of range (C ≤ 16, H, W ≤ 512)")
        if not isinstance(self.num_classes, int) or not 2 <= self.num_classes <= MAX_CLASSES:
            raise ModelError(f"class count must be an integer in 2..{MAX_CLASSES}")
        object.__setattr__(self, "input_shape", shape)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelSpec:
        """Rebuild from untrusted JSON (a manifest, a message header), validating every field."""
        try:
            name, shape, classes = data["name"], data["input_shape"], data["num_classes"]
        except (KeyError, TypeError) as exc:
            raise ModelError(f"model spec is missing field {exc}") from None
        if not isinstance(name, str) or not isinstance(shape, (list, tuple)):
            raise ModelError("model spec: name must be a string and input_shape a list")
        return cls(name, tuple(shape), classes)  # type: ignore[arg-type]


class LayeredModel(nn.Sequential):
    """A model as jetsplit splits it: `nn.Sequential` of named layers (a zoo model's atomic
    layers, or the blocks derived from a user's network) plus the spec that rebuilds it."""

    def __init__(self, spec: ModelSpec, layers: OrderedDict[str, nn.Module]) -> None:
        super().__init__(layers)
        self.spec = spec
        # what a weights file gave (jetsplit/models/initial_weights.py), None when seeded
        self.initial_weights: object = None

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.named_children()]

    def split_candidates(self) -> list[int]:
        """Valid split indices k: the client runs layers[:k], the server layers[k:]."""
        return list(range(1, len(self)))


class _Builder:
    """Appends layers while tracking the activation shape with a probe tensor."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.layers: OrderedDict[str, nn.Module] = OrderedDict()
        self.probe = torch.zeros(1, *spec.input_shape)

    @property
    def channels(self) -> int:
        return self.probe.shape[1]

    @property
    def side(self) -> int:
        return min(self.probe.shape[2:]) if self.probe.dim() == 4 else 0

    def can_pool(self, after_stride: int = 1) -> bool:
        """Whether a 2×2 max pool still leaves at least a 1×1 map after a conv of this stride."""
        return self.side // after_stride >= 2

    def add(self, name: str, layer: ZooLayer) -> None:
        layer.eval()
        with torch.no_grad():
            self.probe = layer(self.probe)
        layer.train()
        self.layers[name] = layer

    def flat_features(self) -> int:
        return int(self.probe[0].numel())

    def build(self) -> LayeredModel:
        return LayeredModel(self.spec, self.layers)


def _alexnet(b: _Builder) -> None:
    """AlexNet as adapted for small images in SCALA (the SCALA paper (ICML) App. E): 5 conv
    stages and 3 fully connected layers; split 2 is SCALA's client block (conv-relu-pool ×2)."""
    stages = [(64, 3, 2, True), (192, 3, 1, True), (384, 3, 1, False), (256, 3, 1, False),
              (256, 3, 1, True)]
    for i, (cout, kernel, stride, pool) in enumerate(stages, 1):
        pool = pool and b.can_pool(stride)
        b.add(f"conv{i}", ConvStage(b.channels, cout, kernel, stride, 1, batch_norm=False,
                                    pool=pool))
    b.add("fc1", LinearStage(b.flat_features(), 4096, flatten=True))
    b.add("fc2", LinearStage(4096, 4096))
    b.add("fc3", LinearStage(4096, b.spec.num_classes, act=None))


_VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
}


def _vgg(b: _Builder, config: list[int | str]) -> None:
    """VGG with batch norm; each max pool is fused into the conv stage before it."""
    convs = [(c, i + 1 < len(config) and config[i + 1] == "M")
             for i, c in enumerate(config) if c != "M"]
    for i, (cout, pool) in enumerate(convs, 1):
        b.add(f"conv{i}", ConvStage(b.channels, int(cout), pool=pool and b.can_pool()))
    b.add("fc1", LinearStage(b.flat_features(), 512, flatten=True))
    b.add("fc2", LinearStage(512, 512))
    b.add("fc3", LinearStage(512, b.spec.num_classes, act=None))


def _resnet18(b: _Builder) -> None:
    """ResNet-18 with the CIFAR stem (3×3 conv, stride 1, no max pool)."""
    b.add("stem", ConvStage(b.channels, 64))
    width = 64
    for stage, cout in enumerate((64, 128, 256, 512), 1):
        for block in range(2):
            stride = 2 if stage > 1 and block == 0 else 1
            b.add(f"layer{stage}_{block}", BasicBlock(width, cout, stride))
            width = cout
    b.add("head", PoolHead(width, b.spec.num_classes))


# (kernel, expanded, out, squeeze-excite, activation, stride) — Howard et al. 2019, Tables 1–2.
_MNV3_LARGE = [
    (3, 16, 16, False, "relu", 1), (3, 64, 24, False, "relu", 2), (3, 72, 24, False, "relu", 1),
    (5, 72, 40, True, "relu", 2), (5, 120, 40, True, "relu", 1), (5, 120, 40, True, "relu", 1),
    (3, 240, 80, False, "hswish", 2), (3, 200, 80, False, "hswish", 1),
    (3, 184, 80, False, "hswish", 1), (3, 184, 80, False, "hswish", 1),
    (3, 480, 112, True, "hswish", 1), (3, 672, 112, True, "hswish", 1),
    (5, 672, 160, True, "hswish", 2), (5, 960, 160, True, "hswish", 1),
    (5, 960, 160, True, "hswish", 1),
]
_MNV3_SMALL = [
    (3, 16, 16, True, "relu", 2), (3, 72, 24, False, "relu", 2), (3, 88, 24, False, "relu", 1),
    (5, 96, 40, True, "hswish", 2), (5, 240, 40, True, "hswish", 1),
    (5, 240, 40, True, "hswish", 1), (5, 120, 48, True, "hswish", 1),
    (5, 144, 48, True, "hswish", 1), (5, 288, 96, True, "hswish", 2),
    (5, 576, 96, True, "hswish", 1), (5, 576, 96, True, "hswish", 1),
]


def _mobilenetv3(b: _Builder, config: list[tuple], last: int, hidden: int) -> None:
    """MobileNetV3; the stem keeps stride 1 below 64 px so small images keep a feature map."""
    stem_stride = 2 if b.side >= 64 else 1
    b.add("stem", ConvStage(b.channels, 16, 3, stem_stride, 1, act="hswish"))
    for i, (kernel, expanded, cout, se, act, stride) in enumerate(config):
        b.add(f"bneck{i}", InvertedResidual(b.channels, make_divisible(expanded),
                                            make_divisible(cout), kernel, stride, se, act))
    b.add("last", ConvStage(b.channels, last, 1, 1, 0, act="hswish"))
    b.add("head", PoolHead(last, b.spec.num_classes, hidden=hidden, act="hswish"))


def _vit_small(b: _Builder, patch: int = 4, dim: int = 384, depth: int = 12,
               heads: int = 6) -> None:
    """ViT-Small with 4×4 patches (for 28–64 px inputs)."""
    channels, height, width = b.spec.input_shape
    if height < patch or width < patch:
        raise ModelError(f"vit-small needs inputs of at least {patch}×{patch} pixels")
    num_patches = (height // patch) * (width // patch)
    b.add("embed", PatchEmbed(channels, dim, patch, num_patches))
    for i in range(depth):
        b.add(f"block{i}", TransformerBlock(dim, heads))
    b.add("head", PoolHead(dim, b.spec.num_classes, pool="cls"))


MODEL_BUILDERS: dict[str, Callable[[_Builder], None]] = {
    "alexnet": _alexnet,
    "vgg11": lambda b: _vgg(b, _VGG_CONFIGS["vgg11"]),
    "vgg16": lambda b: _vgg(b, _VGG_CONFIGS["vgg16"]),
    "resnet18": _resnet18,
    "mobilenetv3-large": lambda b: _mobilenetv3(b, _MNV3_LARGE, 960, 1280),
    "mobilenetv3-small": lambda b: _mobilenetv3(b, _MNV3_SMALL, 576, 1024),
    "vit-small": _vit_small,
}
MODEL_NAMES = tuple(MODEL_BUILDERS)


def build_model(
    spec: ModelSpec | str,
    input_shape: tuple[int, int, int] | None = None,
    num_classes: int | None = None,
    *,
    seed: int | None = None,
) -> LayeredModel:
    """Build a zoo model; with `seed`, weights are reproducible without touching global RNG."""
    if isinstance(spec, str):
        spec = ModelSpec(spec, input_shape or (3, 32, 32), num_classes or 10)
    if seed is None:
        return _build(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(spec)


def _build(spec: ModelSpec) -> LayeredModel:
    builder = _Builder(spec)
    try:
        MODEL_BUILDERS[spec.name](builder)
    except RuntimeError as exc:  # a probe that no longer fits: input too small for the model
        raise ModelError(
            f"{spec.name} cannot be built for input shape {spec.input_shape}: {exc}"
        ) from None
    return builder.build()

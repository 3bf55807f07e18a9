"""What every split of a layered model (zoo or user source) costs: FLOPs, parameters,
activations, training memory, and per-layer time on a device profile.

Counting runs the model once per layer under ``jetsplit.export.flop_count.FlopCounter``
(torch 2.x's FlopCounterMode formulas on any torch ≥ 1.13; forward and backward separately)
and ``saved_tensors_hooks`` (what autograd really keeps).
That needs torch, and importing torch alone takes ~1.8 s on a 2-core build box while
``jetsplit export plan`` must answer in under 2 s. So layer costs are counted once per
(model spec, zoo code, torch version; for a user's model source also the sha256 of its code
or its library's version) and cached as JSON under
``~/.cache/jetsplit/costs/<spec-hash>-zoo<ZOO_VERSION>.json``; a cache hit never imports torch.

Conventions: FLOPs are real FLOPs (a multiply-add is 2), per sample, counted by
FlopCounter, which counts convolutions and matmuls and nothing else (norms,
activations and pooling are free in FLOPs but not in time — that is what a measured profile
corrects). Bytes are bytes; MB in tables are MiB.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import TYPE_CHECKING, List, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import Annotated

from jetsplit.errors import ConfigError
from jetsplit.export.torch_compat import storage_of
from jetsplit.model_source import is_zoo, source_fingerprint

if TYPE_CHECKING:
    import torch
    from torch import nn

    from jetsplit.export.flop_count import FlopCounter
    from jetsplit.models import LayeredModel
    from jetsplit.profiles import DeviceProfile

COST_FORMAT = 1  # bump when what is counted changes; part of every cache key
COUNT_BATCHES = (2, 3)  # two batches give per-sample slope and per-batch constant; >1 for BN
DEFAULT_AUX_RATIO = 0.5  # mirrors jetsplit.models.DEFAULT_AUX_RATIO without importing torch

# Bytes per activation element on the wire (mirrors jetsplit.wire.codecs.CODECS; a test pins it).
CODEC_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# int8 sends one (min, scale) pair per channel of a 4-D activation (one per tensor otherwise);
# counted as two float64 — the JSON header spends about as much.
INT8_PARAM_BYTES = 16
FP32 = 4
# Optimizer state as a multiple of the trainable parameter bytes.
OPTIMIZER_STATE: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}
# Runtime context a training process holds besides tensors, by profile device kind, in MiB.
# jetson/gpu: the CUDA context + cuDNN/cuBLAS handles (hundreds of MB); cpu:
# measured RSS of `import torch` plus a first conv/backward, torch 2.13 on x86 (~226 MiB).
# Estimates: override with --context-mb once measured on the device.
RUNTIME_CONTEXT_MB: dict[str, float] = {"jetson": 300.0, "gpu": 300.0, "cpu": 250.0}

Codec = Literal["fp32", "fp16", "bf16", "int8"]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]

_ZOO_VERSION_RE = re.compile(r"^ZOO_VERSION\s*=\s*(\d+)\s*$", re.MULTILINE)


def models_dir() -> Path:
    """The installed ``jetsplit.models`` package's folder, found without importing it (which
    would import torch): in a wheel install this module is site-packages/jetsplit/export/."""
    spec = util.find_spec("jetsplit.models")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise ConfigError("cannot find the jetsplit.models package (is jetsplit installed?)")
    return Path(next(iter(locations))).resolve()


# Sources whose text is part of the cache fingerprint besides the zoo: what counts.
_COUNTING_SOURCES = ("cost_model.py", "flop_count.py", "torch_compat.py")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerCost(_Frozen):
    """One atomic layer, per sample unless named ``*_const`` (per batch)."""

    name: str
    fwd_flops: NonNeg
    bwd_flops: NonNeg  # input gradient computed: any layer but the first of a trained block
    bwd_flops_no_input_grad: NonNeg  # the first layer of a block whose input needs no grad
    params: NonNegInt  # trainable parameter count
    param_bytes: NonNegInt
    buffer_bytes: NonNegInt  # batch-norm running statistics: sent with the weights, no grads
    in_shape: List[int]
    out_shape: List[int]
    # Saved-for-backward storage, each storage counted once: attributed to the first layer
    # that saved it (prefix sums give a client block exactly) and to the last one (suffix
    # sums give a server block exactly). Parameters and buffers are not counted here.
    saved_first_bytes: NonNeg
    saved_last_bytes: NonNeg
    saved_first_const: NonNeg
    saved_last_const: NonNeg

    @property
    def in_numel(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)


class AuxCost(_Frozen):
    """Ampere's auxiliary head for split k, per sample; its input (the client output) needs
    a gradient, and the storage of that input is not counted again."""

    k: int
    fwd_flops: NonNeg
    bwd_flops: NonNeg
    params: NonNegInt
    param_bytes: NonNegInt
    buffer_bytes: NonNegInt
    saved_bytes: NonNeg
    saved_const: NonNeg
    max_numel: NonNegInt  # largest tensor it produces, per sample (gradient workspace)


class ModelCosts(_Frozen):
    """Everything the planner needs about one model spec; what the disk cache holds."""

    format: int
    name: str
    input_shape: List[int]
    num_classes: int
    zoo_version: int
    fingerprint: str  # hash of the zoo and cost-model sources and the torch version
    aux_ratio: float
    layers: List[LayerCost]
    aux: List[AuxCost]  # one per split candidate k = 1..n-1

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def split_candidates(self) -> list[int]:
        return list(range(1, len(self.layers)))

    def check_k(self, k: int, *, allow_whole: bool = False) -> None:
        top = len(self.layers) if allow_whole else len(self.layers) - 1
        if not 1 <= k <= top:
            raise ConfigError(f"split {k} is out of range for {self.name}: choose 1..{top}")

    def aux_for(self, k: int) -> AuxCost:
        self.check_k(k)
        return self.aux[k - 1]


# --------------------------------------------------------------------------- cache keys


def zoo_fingerprint() -> tuple[int, str]:
    """(ZOO_VERSION, hash of the zoo + cost-model sources + torch version), without torch.

    ZOO_VERSION is read from zoo.py's text because importing it would import torch; hashing
    the sources as well catches a zoo edit that forgot to bump the version.
    """
    digest = hashlib.sha256()
    version = None
    zoo_dir = models_dir()
    here = Path(__file__).resolve().parent
    for path in sorted(zoo_dir.glob("*.py")) + [here / name for name in _COUNTING_SOURCES]:
        text = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + text)
        if path.name == "zoo.py":
            match = _ZOO_VERSION_RE.search(text.decode("utf-8"))
            version = int(match.group(1)) if match else None
    if version is None:
        raise ConfigError(f"cannot read ZOO_VERSION from {zoo_dir / 'zoo.py'}")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    digest.update(f"torch={torch_version};format={COST_FORMAT}".encode())
    return version, digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$JETSPLIT_CACHE_DIR/costs``, else ``$XDG_CACHE_HOME/jetsplit/costs``, else
    ``~/.cache/jetsplit/costs``."""
    if os.environ.get("JETSPLIT_CACHE_DIR"):
        return Path(os.environ["JETSPLIT_CACHE_DIR"]) / "costs"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jetsplit" / "costs"


def _spec_key(name: str, input_shape: tuple[int, ...], num_classes: int, aux_ratio: float,
              fingerprint: str) -> str:
    """The spec and the counting code; a user's source adds its code's hash (or library
    version), so an edited network is counted again."""
    parts = [name, list(input_shape), num_classes, aux_ratio, fingerprint]
    if not is_zoo(name):
        parts.append(source_fingerprint(name))
    blob = json.dumps(parts)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_path(name: str, input_shape: tuple[int, ...], num_classes: int,
               aux_ratio: float = DEFAULT_AUX_RATIO, cache_dir: Path | None = None) -> Path:
    version, fingerprint = zoo_fingerprint()
    key = _spec_key(name, input_shape, num_classes, aux_ratio, fingerprint)
    return (cache_dir or default_cache_dir()) / f"{key}-zoo{version}.json"


def _load_cached(path: Path, name: str, input_shape: tuple[int, ...], num_classes: int,
                 aux_ratio: float) -> ModelCosts | None:
    """The cached costs if the file is intact and is about this spec; None otherwise."""
    try:
        costs = ModelCosts.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError):
        return None
    version, fingerprint = zoo_fingerprint()
    same = (costs.format == COST_FORMAT and costs.name == name
            and tuple(costs.input_shape) == tuple(input_shape)
            and costs.num_classes == num_classes and costs.aux_ratio == aux_ratio
            and costs.zoo_version == version and costs.fingerprint == fingerprint
            and len(costs.aux) == max(0, len(costs.layers) - 1))
    return costs if same else None


def _save(costs: ModelCosts, path: Path) -> None:
    """Atomic write; a cache that cannot be written is not an error, only slower next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(costs.model_dump_json(), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def get_costs(name: str, input_shape: tuple[int, int, int] = (3, 32, 32),
              num_classes: int = 10, *, aux_ratio: float = DEFAULT_AUX_RATIO,
              cache_dir: Path | None = None, use_cache: bool = True) -> ModelCosts:
    """Costs of a zoo model spec: from the disk cache when valid, else counted and cached.

    Unknown models and bad shapes raise ModelError (from the zoo) on the counting path.
    """
    shape = tuple(int(v) for v in input_shape)
    path = cache_path(name, shape, num_classes, aux_ratio, cache_dir)
    if use_cache and path.is_file():
        cached = _load_cached(path, name, shape, num_classes, aux_ratio)
        if cached is not None:
            return cached
    from jetsplit.models import build_model

    model = build_model(name, shape, num_classes, seed=0)  # type: ignore[arg-type]
    costs = count_costs(model, aux_ratio=aux_ratio)
    if use_cache:
        _save(costs, path)
    return costs


# --------------------------------------------------------------------------- counting


class _SavedTracker:
    """Records every tensor autograd saves, keyed by storage, with the layer that saved it.

    Saved tensors are kept alive until the count ends so a freed storage's address can never
    be reused by a later tensor and mistaken for the same one.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # parameter and buffer storages
        self.layer = 0
        self.first: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, first layer)
        self.last: dict[int, int] = {}  # ptr -> last layer
        self.keep: list[object] = []
        self.max_numel = 0  # largest saved non-parameter tensor

    def pack(self, tensor: object) -> object:
        ptr, nbytes = storage_of(tensor)
        if ptr and ptr not in self.exclude:
            self.first.setdefault(ptr, (nbytes, self.layer))
            self.last[ptr] = self.layer
            self.max_numel = max(self.max_numel, tensor.numel())  # type: ignore[attr-defined]
        self.keep.append(tensor)
        return tensor

    def per_layer(self, n: int) -> tuple[list[int], list[int]]:
        first, last = [0] * n, [0] * n
        for ptr, (nbytes, layer) in self.first.items():
            first[layer] += nbytes
            last[self.last[ptr]] += nbytes
        return first, last


def flop_counter() -> FlopCounter:
    """A fresh FlopCounter (one per count): the same counts on torch 1.13 and 2.x."""
    from jetsplit.export.flop_count import FlopCounter

    return FlopCounter()


def _state_storages(module: nn.Module) -> set[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return {storage_of(t)[0] for t in tensors}


def _count_pass(model: LayeredModel, batch: int) -> dict[str, list[float]]:
    """One layer-by-layer forward+backward at ``batch``, in training mode, as a client trains:
    the model input needs no gradient, every later layer's input does."""
    import torch

    layers = list(model.children())
    tracker = _SavedTracker(_state_storages(model))
    fwd, bwd, bwd_nig = [], [], []
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *model.spec.input_shape, generator=generator)
    outputs = []
    for i, layer in enumerate(layers):
        tracker.layer = i
        inp = x.detach().requires_grad_(i > 0)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t), \
                flop_counter() as counter:
            out = layer(inp)
        fwd.append(counter.get_total_flops())
        bwd_i = _backward_flops(out)
        # The other mode of this layer's first-layer question, counted on a separate graph.
        other = x.detach().requires_grad_(i == 0)
        bwd_other = _backward_flops(layer(other))
        bwd.append(bwd_other if i == 0 else bwd_i)
        bwd_nig.append(bwd_i if i == 0 else bwd_other)
        outputs.append(out)
        x = out.detach()
    model.zero_grad(set_to_none=True)
    first, last = tracker.per_layer(len(layers))
    return {"fwd": fwd, "bwd": bwd, "bwd_nig": bwd_nig, "first": first, "last": last,
            "out_shapes": [list(o.shape[1:]) for o in outputs]}


def _backward_flops(out: torch.Tensor) -> float:
    """FLOPs of backward from `out`; none when nothing before it needs a gradient (a
    parameter-free block of a user's network fed an input that needs none)."""
    import torch

    if not out.requires_grad:
        return 0.0
    with flop_counter() as counter:
        out.backward(torch.ones_like(out))
    return counter.get_total_flops()


def _slope(at: dict[int, float]) -> tuple[float, float]:
    """(per sample, per batch) from values at the two COUNT_BATCHES."""
    (b1, v1), (b2, v2) = sorted(at.items())
    per_sample = max(0.0, (v2 - v1) / (b2 - b1))
    return per_sample, max(0.0, v1 - per_sample * b1)


def _module_bytes(module: nn.Module) -> tuple[int, int, int]:
    """(trainable parameter count, parameter bytes, buffer bytes)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return (sum(p.numel() for p in params),
            sum(p.numel() * p.element_size() for p in params),
            sum(b.numel() * b.element_size() for b in module.buffers()))


def _count_aux(model: LayeredModel, k: int, ratio: float) -> AuxCost:
    """The aux head of split k, as Ampere trains it: its input is the client output and
    carries the gradient back into the client block."""
    import torch

    from jetsplit.models import activation_shape, build_aux_head

    head = build_aux_head(model, k, ratio, seed=0).train()
    shape = activation_shape(model, k)
    saved: dict[int, float] = {}
    flops: dict[int, tuple[float, float]] = {}
    numel = 0
    for batch in COUNT_BATCHES:
        x = torch.randn(batch, *shape).requires_grad_(True)
        exclude = _state_storages(head) | {storage_of(x)[0]}
        tracker = _SavedTracker(exclude)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t), \
                flop_counter() as counter:
            out = head(x)
        fwd = counter.get_total_flops()
        with flop_counter() as counter:
            out.backward(torch.ones_like(out))
        flops[batch] = (fwd / batch, counter.get_total_flops() / batch)
        saved[batch] = float(sum(n for n, _ in tracker.first.values()))
        numel = max(numel, -(-tracker.max_numel // batch))
    per_sample, const = _slope(saved)
    params, pbytes, bbytes = _module_bytes(head)
    fwd, bwd = flops[COUNT_BATCHES[0]]
    return AuxCost(k=k, fwd_flops=fwd, bwd_flops=bwd, params=params, param_bytes=pbytes,
                   buffer_bytes=bbytes, saved_bytes=per_sample, saved_const=const,
                   max_numel=numel)


def count_costs(model: LayeredModel, *, aux_ratio: float = DEFAULT_AUX_RATIO) -> ModelCosts:
    """Count every layer and every split's aux head of ``model`` (no cache; see get_costs).

    Works on a deep copy so the caller's weights, grads and batch-norm statistics are
    untouched.
    """
    import copy

    import torch

    work = copy.deepcopy(model).train()
    with torch.random.fork_rng(devices=[]):
        passes = {b: _count_pass(work, b) for b in COUNT_BATCHES}
        b0 = COUNT_BATCHES[0]
        layers = []
        in_shape = list(model.spec.input_shape)
        for i, (name, layer) in enumerate(work.named_children()):
            first = _slope({b: float(p["first"][i]) for b, p in passes.items()})
            last = _slope({b: float(p["last"][i]) for b, p in passes.items()})
            params, pbytes, bbytes = _module_bytes(layer)
            out_shape = passes[b0]["out_shapes"][i]
            layers.append(LayerCost(
                name=name, fwd_flops=passes[b0]["fwd"][i] / b0,
                bwd_flops=passes[b0]["bwd"][i] / b0,
                bwd_flops_no_input_grad=passes[b0]["bwd_nig"][i] / b0,
                params=params, param_bytes=pbytes, buffer_bytes=bbytes,
                in_shape=in_shape, out_shape=out_shape,
                saved_first_bytes=first[0], saved_first_const=first[1],
                saved_last_bytes=last[0], saved_last_const=last[1],
            ))
            in_shape = out_shape
        aux = [_count_aux(work, k, aux_ratio) for k in work.split_candidates()]
    version, fingerprint = zoo_fingerprint()
    return ModelCosts(format=COST_FORMAT, name=model.spec.name,
                      input_shape=list(model.spec.input_shape),
                      num_classes=model.spec.num_classes, zoo_version=version,
                      fingerprint=fingerprint, aux_ratio=aux_ratio, layers=layers, aux=aux)


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class BlockCost:
    """A contiguous run of layers as one device trains it, per sample unless ``*_const``."""

    fwd_flops: float
    bwd_flops: float
    params: int
    param_bytes: int
    state_bytes: int  # parameters + buffers: what a model exchange sends
    saved_bytes: float
    saved_const: float
    max_grad_numel: int  # largest (input + output) gradient pair of one layer

    @property
    def train_flops(self) -> float:
        return self.fwd_flops + self.bwd_flops

    def __add__(self, other: BlockCost) -> BlockCost:
        return BlockCost(
            self.fwd_flops + other.fwd_flops, self.bwd_flops + other.bwd_flops,
            self.params + other.params, self.param_bytes + other.param_bytes,
            self.state_bytes + other.state_bytes, self.saved_bytes + other.saved_bytes,
            self.saved_const + other.saved_const,
            max(self.max_grad_numel, other.max_grad_numel))


def _block(layers: list[LayerCost], *, input_grad: bool, saved: Literal["first", "last"]
           ) -> BlockCost:
    if not layers:
        return BlockCost(0.0, 0.0, 0, 0, 0, 0.0, 0.0, 0)
    bwd = sum(la.bwd_flops for la in layers[1:])
    bwd += layers[0].bwd_flops if input_grad else layers[0].bwd_flops_no_input_grad
    return BlockCost(
        fwd_flops=sum(la.fwd_flops for la in layers), bwd_flops=bwd,
        params=sum(la.params for la in layers),
        param_bytes=sum(la.param_bytes for la in layers),
        state_bytes=sum(la.param_bytes + la.buffer_bytes for la in layers),
        saved_bytes=sum(la.saved_first_bytes if saved == "first" else la.saved_last_bytes
                        for la in layers),
        saved_const=sum(la.saved_first_const if saved == "first" else la.saved_last_const
                        for la in layers),
        max_grad_numel=max(la.out_numel + (la.in_numel if i or input_grad else 0)
                           for i, la in enumerate(layers)),
    )


def client_block(costs: ModelCosts, k: int) -> BlockCost:
    """Layers [:k] trained on raw data (k = n: the whole model, as FedAvg trains it)."""
    costs.check_k(k, allow_whole=True)
    return _block(costs.layers[:k], input_grad=False, saved="first")


def server_block(costs: ModelCosts, k: int, *, input_grad: bool = True) -> BlockCost:
    """Layers [k:]; ``input_grad`` when the activation gradient goes back to the client
    (SplitFed-style), False when the server trains on stored activations (Ampere phase 2)."""
    costs.check_k(k)
    return _block(costs.layers[k:], input_grad=input_grad, saved="last")


def edge_block(costs: ModelCosts, k1: int, k2: int) -> BlockCost:
    """Layers [k1:k2] as a SHeRL-FL edge trains them: on its clients' activations, whose
    gradient goes back to them (input_grad). Saved storage is attributed as for a server
    block, which can miss a tensor layer k2 shares with k2-1 (a few bytes per sample)."""
    costs.check_k(k1)
    costs.check_k(k2, allow_whole=True)
    if k2 <= k1:
        raise ConfigError(f"edge block [{k1}:{k2}] of {costs.name} is empty")
    return _block(costs.layers[k1:k2], input_grad=True, saved="last")


def aux_block(costs: ModelCosts, k: int) -> BlockCost:
    aux = costs.aux_for(k)
    return BlockCost(aux.fwd_flops, aux.bwd_flops, aux.params, aux.param_bytes,
                     aux.param_bytes + aux.buffer_bytes, aux.saved_bytes, aux.saved_const,
                     aux.max_numel + costs.layers[k - 1].out_numel)


def activation_numel(costs: ModelCosts, k: int) -> int:
    costs.check_k(k)
    return costs.layers[k - 1].out_numel


def activation_bytes(costs: ModelCosts, k: int, codec: str = "fp32", batch: int = 1) -> float:
    """Bytes of one message carrying the activation (or its gradient) at split k for a batch:
    payload at the codec, plus int8's per-channel (min, scale) pairs."""
    if codec not in CODEC_BYTES:
        raise ConfigError(f"unknown codec {codec!r}; choose one of {', '.join(CODEC_BYTES)}")
    costs.check_k(k)
    shape = costs.layers[k - 1].out_shape
    payload = batch * math.prod(shape) * CODEC_BYTES[codec]
    if codec == "int8":
        channels = shape[0] if len(shape) == 3 else 1  # per sample C,H,W ⇒ a 4-D batch
        payload += channels * INT8_PARAM_BYTES
    return float(payload)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryEstimate:
    """Training-memory footprint of a device's blocks for one batch, in bytes."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    workspace: int
    context: int

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations
                + self.workspace + self.context)

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "context": self.context, "total": self.total}


def runtime_context_bytes(profile: DeviceProfile | None, override_mb: float | None = None
                          ) -> int:
    """Runtime context: ``override_mb`` if given, else RUNTIME_CONTEXT_MB by device kind."""
    if override_mb is not None:
        return int(override_mb * 2**20)
    kind = profile.device.kind if profile is not None else "cpu"
    return int(RUNTIME_CONTEXT_MB.get(kind, RUNTIME_CONTEXT_MB["cpu"]) * 2**20)


def training_memory(block: BlockCost, batch: int, optimizer: str = "sgd",
                    context_bytes: int = 0) -> MemoryEstimate:
    """weights (+ buffers) + grads + optimizer state + saved activations for the batch +
    workspace + runtime context.

    Saved activations are measured (unique storages autograd kept), not guessed. Workspace
    is an estimate: the gradient buffers of the largest layer alive during backward
    (its input and output gradients, fp32).
    """
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of "
                          f"{', '.join(OPTIMIZER_STATE)}")
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    return MemoryEstimate(
        weights=block.state_bytes,
        grads=block.param_bytes,
        optimizer=OPTIMIZER_STATE[optimizer] * block.param_bytes,
        activations=int(math.ceil(batch * block.saved_bytes + block.saved_const)),
        workspace=batch * block.max_grad_numel * FP32,
        context=context_bytes,
    )


# --------------------------------------------------------------------------- time


@dataclass(frozen=True)
class LayerTime:
    """Predicted milliseconds of one layer for one batch on one profile."""

    name: str
    fwd_ms: float
    bwd_ms: float  # input gradient computed
    bwd_no_input_grad_ms: float
    source: Literal["measured", "peak"]

    def train_ms(self, *, input_grad: bool = True) -> float:
        return self.fwd_ms + (self.bwd_ms if input_grad else self.bwd_no_input_grad_ms)


def measured_matches(costs: ModelCosts, profile: DeviceProfile) -> bool:
    """Whether the profile's [measured] section timed this very model (name, input shape,
    layer names): only then are its per-layer times used."""
    m = profile.measured
    return (m is not None and m.model == costs.name
            and list(m.input_shape) == list(costs.input_shape)
            and [layer.name for layer in m.layers] == costs.layer_names)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 1.0


def predict_layer_times(costs: ModelCosts, profile: DeviceProfile, batch: int
                        ) -> list[LayerTime]:
    """Per-layer time at ``batch`` on ``profile``.

    With a [measured] section for this model: the measured times (Neurosurgeon-style),
    scaled linearly from the measured batch; the measured backward of layer 0 ran without
    an input gradient and the others with one, and the other mode is scaled by its FLOP
    ratio. Otherwise FLOPs / (peak × efficiency) — or / achieved GFLOPS of a measured
    profile of another model (``profile.effective_gflops``).
    """
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    if measured_matches(costs, profile):
        m = profile.measured
        assert m is not None
        scale = batch / m.batch
        out = []
        # measured_matches compared the layer names: the two lists have the same length
        for i, (la, meas) in enumerate(zip(costs.layers, m.layers)):
            fwd, bwd = meas.fwd_ms * scale, meas.bwd_ms * scale
            if i == 0:
                nig, full = bwd, bwd * _ratio(la.bwd_flops, la.bwd_flops_no_input_grad)
            else:
                full, nig = bwd, bwd * _ratio(la.bwd_flops_no_input_grad, la.bwd_flops)
            out.append(LayerTime(la.name, fwd, full, nig, "measured"))
        return out
    per_ms = profile.effective_gflops() * 1e9 / 1e3  # FLOPs per millisecond
    return [LayerTime(la.name, batch * la.fwd_flops / per_ms, batch * la.bwd_flops / per_ms,
                      batch * la.bwd_flops_no_input_grad / per_ms, "peak")
            for la in costs.layers]


def flops_ms(flops: float, profile: DeviceProfile) -> float:
    """Milliseconds for ``flops`` at the profile's effective throughput (aux heads)."""
    return flops / (profile.effective_gflops() * 1e9) * 1e3


def block_ms(times: list[LayerTime], start: int, stop: int, *, input_grad: bool) -> float:
    """Forward + backward milliseconds of layers [start:stop]; ``input_grad`` for the first."""
    if start >= stop:
        return 0.0
    first = times[start].train_ms(input_grad=input_grad)
    return first + sum(t.train_ms() for t in times[start + 1:stop])

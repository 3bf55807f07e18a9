"""Any model source as a LayeredModel: the one form the planner, bundles and agents use.

A source (jetsplit/model_source.py) resolves to an `nn.Module`: the zoo builds its own; a
factory is imported from the code the operator installed and called (with `num_classes` and
`input_shape` where its signature takes them) under the run's seed; torchvision and timm
build their model without pretrained weights (initial weights come from a file, never the
network). The module then becomes ordered blocks: blocks it declares (`jetsplit_blocks`),
else an `nn.Sequential`'s children, else the cut finder's segments (fx_cuts.py).
"""

from __future__ import annotations

import importlib
import inspect
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from jetsplit.errors import ModelError
from jetsplit.model_source import Source, parse_source
from jetsplit.models.fx_cuts import segment
from jetsplit.models.initial_weights import InitialWeights, load_initial_weights
from jetsplit.models.zoo import LayeredModel, ModelSpec
from jetsplit.models.zoo import build_model as build_zoo_model

FACTORY_ARGS = ("num_classes", "input_shape")
DECLARED_ATOL = 1e-5  # declared blocks must compute the model's own forward


def _import(source: Source) -> Any:
    try:
        return importlib.import_module(source.module)
    except ImportError as exc:
        raise ModelError(f"model source {source.text}: cannot import {source.module} ({exc}); "
                         "install the model package here or add its folder to PYTHONPATH"
                         ) from None


def _factory(source: Source) -> Callable[..., Any]:
    target: Any = _import(source)
    for part in source.attr.split("."):
        if not hasattr(target, part):
            raise ModelError(f"model source {source.text}: {source.module} has no {source.attr}")
        target = getattr(target, part)
    if not callable(target):
        raise ModelError(f"model source {source.text}: {source.attr} is not callable")
    return target


def factory_kwargs(factory: Callable[..., Any], spec: ModelSpec) -> Dict[str, Any]:
    """The config values the factory's signature takes (all of them with **kwargs)."""
    values = {"num_classes": spec.num_classes, "input_shape": tuple(spec.input_shape)}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return values
    return {k: v for k, v in values.items() if k in params}


def _library_model(source: Source, spec: ModelSpec) -> nn.Module:
    library = _import(source)
    if source.kind == "timm":
        return library.create_model(source.attr, pretrained=False,
                                    num_classes=spec.num_classes, in_chans=spec.input_shape[0])
    models = library.models
    if hasattr(models, "get_model"):
        return models.get_model(source.attr, weights=None, num_classes=spec.num_classes)
    if not hasattr(models, source.attr):
        raise ModelError(f"model source {source.text}: torchvision has no model {source.attr}")
    return getattr(models, source.attr)(num_classes=spec.num_classes)


def resolve_module(spec: ModelSpec) -> nn.Module:
    """The network a source names, freshly initialised (the caller seeds the RNG)."""
    source = parse_source(spec.name)
    if source.kind == "zoo":
        return build_zoo_model(spec)
    try:
        if source.kind == "factory":
            factory = _factory(source)
            module = factory(**factory_kwargs(factory, spec))
        else:
            module = _library_model(source, spec)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 (the user's code may raise anything)
        reason = " ".join(str(exc).split())[:160]
        raise ModelError(f"model source {spec.name}: the factory raised "
                         f"{type(exc).__name__}: {reason}") from None
    if not isinstance(module, nn.Module):
        raise ModelError(f"model source {spec.name}: the factory returned "
                         f"{type(module).__name__}, not a torch.nn.Module")
    return module


def _declared(module: nn.Module, where: str) -> Optional[OrderedDict[str, nn.Module]]:
    """The blocks a model declares: `jetsplit_blocks` as submodule names, or a method that
    returns the ordered modules. None when it declares none."""
    declared = getattr(module, "jetsplit_blocks", None)
    if declared is None:
        return None
    items = declared() if callable(declared) else declared
    names = {id(m): n for n, m in module.named_modules()}
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    for item in items:
        if isinstance(item, str):
            try:
                block = module.get_submodule(item)
            except AttributeError:
                raise ModelError(f"{where}: jetsplit_blocks names {item!r}, which is not a "
                                 "submodule of the model") from None
            name = item
        elif isinstance(item, nn.Module) and id(item) in names:
            block, name = item, names[id(item)]
        else:
            raise ModelError(f"{where}: jetsplit_blocks must give submodule names or the "
                             "model's own submodules")
        blocks[name.replace(".", "_") or f"block{len(blocks)}"] = block
    if len(blocks) < 2:
        raise ModelError(f"{where}: jetsplit_blocks must give at least two blocks")
    return blocks


def _check_declared(module: nn.Module, blocks: OrderedDict[str, nn.Module],
                    shape: Tuple[int, ...], where: str) -> None:
    """Declared blocks in sequence must compute what the model computes."""
    from jetsplit.models.split import eval_mode

    probe = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0))
    with eval_mode(module), torch.no_grad():
        want = module(probe)
        got = probe
        for block in blocks.values():
            got = block(got)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or \
            not torch.allclose(got, want, atol=DECLARED_ATOL, rtol=1e-4):
        raise ModelError(f"{where}: the declared jetsplit_blocks, run in order, do not compute "
                         "the model's forward; list every block, in the order forward runs them")


def to_layers(module: nn.Module, spec: ModelSpec) -> OrderedDict[str, nn.Module]:
    """A network as ordered blocks: declared, a Sequential's children, or fx segments."""
    where = f"model source {spec.name}"
    blocks = _declared(module, where)
    if blocks is not None:
        _check_declared(module, blocks, spec.input_shape, where)
        return blocks
    if isinstance(module, nn.Sequential):
        return OrderedDict(module.named_children())
    return segment(module, spec.input_shape, where)


def _check_output(model: LayeredModel) -> None:
    from jetsplit.models.split import eval_mode

    spec = model.spec
    with eval_mode(model), torch.no_grad():
        out = model(torch.zeros(2, *spec.input_shape))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, spec.num_classes):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model source {spec.name}: gives {shape} for a batch of 2 inputs of "
                         f"shape {list(spec.input_shape)}, not [2, {spec.num_classes}] logits "
                         "(does the factory take num_classes?)")


def _build(spec: ModelSpec, weights: Optional[Path]) -> LayeredModel:
    if parse_source(spec.name).kind == "zoo" and weights is None:
        return build_zoo_model(spec)
    module = resolve_module(spec)
    initial: Optional[InitialWeights] = None
    if weights is not None:
        initial = load_initial_weights(module, weights, spec, lambda s: resolve_module(s))
    if isinstance(module, LayeredModel) and module.spec == spec:
        model = module
    else:
        try:
            model = LayeredModel(spec, to_layers(module, spec))
            _check_output(model)
        except RuntimeError as exc:  # the network cannot take the data's input shape
            reason = " ".join(str(exc).strip().splitlines()[:1])[:200] or type(exc).__name__
            raise ModelError(f"model source {spec.name}: cannot run on inputs of shape "
                             f"{list(spec.input_shape)} ({reason})") from None
    model.initial_weights = initial
    return model


def build_model(
    spec: Union[ModelSpec, str],
    input_shape: Optional[Tuple[int, int, int]] = None,
    num_classes: Optional[int] = None,
    *,
    seed: Optional[int] = None,
    weights: Optional[Union[str, Path]] = None,
) -> LayeredModel:
    """Build any model source as a LayeredModel. With `seed`, fresh weights are reproducible
    without touching the global RNG; `weights` (a file) then replaces them by name."""
    if isinstance(spec, str):
        spec = ModelSpec(spec, input_shape or (3, 32, 32), num_classes or 10)
    path = None if weights is None else Path(weights)
    if seed is None:
        return _build(spec, path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(spec, path)


# torch.device as a context manager (torch >= 2.0); the device floor's torch 1.13 builds
# as before, initialised.
_META_CONTEXT = hasattr(torch.device("meta"), "__enter__")


def build_to_load(spec: ModelSpec) -> LayeredModel:
    """A model whose every tensor the caller loads next (a bundle's blocks): a zoo model's
    layers get storage but no initialisation, which for AlexNet's 20M weights was most of
    a second of CPU per block built, the random values then overwritten. Other sources are
    built as usual (their factories may do more than allocate), and so is a model with a
    buffer outside its state dict, which no load would fill."""
    if parse_source(spec.name).kind != "zoo" or not _META_CONTEXT:
        return build_model(spec, seed=0)
    with torch.device("meta"):
        model = build_zoo_model(spec, seed=0)
    model = model.to_empty(device="cpu")
    if {name for name, _ in model.named_buffers()} - set(model.state_dict()):
        return build_model(spec, seed=0)
    return model

"""A FLOP counter that gives the same numbers on torch 1.13 (JetPack 5) and torch 2.x.

``torch.utils.flop_counter.FlopCounterMode`` exists only from torch 2.1, and its formulas
could drift between versions; cost caches and measured profiles compare FLOPs across
machines, so the cost model counts with this one instead. It is a ``TorchDispatchMode``
(torch ≥ 1.13) that sees the aten ops autograd dispatches and applies torch 2.13's
FlopCounterMode formulas to the ones the zoo runs — matmuls and convolutions, forward and
backward — with one deliberate difference: a grouped convolution's weight gradient is
divided by ``groups`` (torch ignores groups there, which overcounted MobileNet's depthwise
backward by its channel count).

Conventions, as torch's: a multiply-add is 2 FLOPs, bias additions are free, and every op
not listed (norms, activations, pooling, softmax, fused attention kernels) counts 0. The
zoo writes attention as matmuls, so no fused attention op is needed.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch.utils._python_dispatch import TorchDispatchMode

Shape = Sequence[int]


def _shape(value: Any) -> Optional[List[int]]:
    """A tensor's shape as a list; None for anything else (a masked-out gradient)."""
    shape = getattr(value, "shape", None)
    return None if shape is None else [int(v) for v in shape]


def mm_flops(a: Shape, b: Shape) -> int:
    """(m×k) @ (k×n): 2·m·n·k."""
    m, k = a
    k2, n = b
    if k != k2:
        raise ValueError(f"mm: inner dimensions differ ({k} and {k2})")
    return 2 * m * n * k


def bmm_flops(a: Shape, b: Shape) -> int:
    """(b×m×k) @ (b×k×n): 2·b·m·n·k."""
    batch, m, k = a
    batch2, k2, n = b
    if batch != batch2 or k != k2:
        raise ValueError(f"bmm: shapes {list(a)} and {list(b)} do not multiply")
    return 2 * batch * m * n * k


def conv_flops(x: Shape, w: Shape, out: Shape, transposed: bool = False) -> int:
    """Output points (input points when transposed) × kernel size × batch × the weight's
    two channel dimensions × 2; ``w[1]`` is already per group, so groups are counted."""
    spatial = (x if transposed else out)[2:]
    c_out, c_in = w[0], w[1]
    return 2 * math.prod(spatial) * math.prod(w[2:]) * x[0] * c_out * c_in


def _swap01(shape: Shape) -> List[int]:
    return [shape[1], shape[0], *shape[2:]]


def conv_backward_flops(grad_out: Shape, x: Shape, w: Shape, transposed: bool, groups: int,
                        output_mask: Sequence[bool], grad_input: Optional[Shape],
                        grad_weight: Optional[Shape]) -> int:
    """Input gradient as a transposed conv of grad_out with the weight; weight gradient as a
    conv of the input with grad_out, divided by ``groups`` (see the module docstring)."""
    total = 0
    if output_mask[0]:
        assert grad_input is not None
        total += conv_flops(grad_out, w, grad_input, not transposed)
    if output_mask[1]:
        assert grad_weight is not None
        if transposed:
            weight = conv_flops(_swap01(grad_out), _swap01(x), _swap01(grad_weight))
        else:
            weight = conv_flops(_swap01(x), _swap01(grad_out), _swap01(grad_weight))
        total += weight // groups if groups > 1 else weight
    return total


# Each formula takes the op's (args, kwargs, out); shapes are read from the tensors.
Formula = Callable[[Sequence[Any], Dict[str, Any], Any], int]


def _mm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    return mm_flops(_shape(args[0]), _shape(args[1]))  # type: ignore[arg-type]


def _addmm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    return mm_flops(_shape(args[1]), _shape(args[2]))  # type: ignore[arg-type]


def _bmm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    return bmm_flops(_shape(args[0]), _shape(args[1]))  # type: ignore[arg-type]


def _baddbmm(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    return bmm_flops(_shape(args[1]), _shape(args[2]))  # type: ignore[arg-type]


def _convolution(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    # convolution(input, weight, bias, stride, padding, dilation, transposed, ...)
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    return conv_flops(_shape(args[0]), _shape(args[1]), _shape(out),  # type: ignore[arg-type]
                      transposed)


def _convolution_backward(args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding,
    #                      dilation, transposed, output_padding, groups, output_mask)
    return conv_backward_flops(
        _shape(args[0]), _shape(args[1]), _shape(args[2]),  # type: ignore[arg-type]
        transposed=bool(args[7]), groups=int(args[9]), output_mask=list(args[10]),
        grad_input=_shape(out[0]), grad_weight=_shape(out[1]))


# aten op name -> formula; names, not ops, so that an op a torch version lacks is skipped.
FORMULAS: Dict[str, Formula] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "convolution": _convolution,
    "_convolution": _convolution,
    "convolution_overrideable": _convolution,
    "convolution_backward": _convolution_backward,
}


def _registry() -> Dict[Any, Tuple[str, Formula]]:
    """FORMULAS keyed by this torch's op overload packets."""
    import torch

    return {getattr(torch.ops.aten, name): (name, formula) for name, formula in FORMULAS.items()
            if hasattr(torch.ops.aten, name)}


class FlopCounter(TorchDispatchMode):
    """``with FlopCounter() as counter: ...`` then ``counter.get_total_flops()``.

    Counts the ops dispatched while active (a CPU backward runs on the calling thread, so a
    ``backward()`` inside the block is counted). ``by_op`` holds the total per aten op name.
    Counts accumulate over every ``with`` of one instance; take a new one per count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.registry = _registry()
        self.by_op: Dict[str, int] = {}

    def get_total_flops(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        entry = self.registry.get(func.overloadpacket)
        # As torch 2.x's FlopCounterMode: an op with no formula that reached the mode
        # undecomposed is decomposed so that the matmuls inside it are seen. torch 1.13's
        # ops have no ``decompose``; there composite ops decompose before the mode anyway.
        decompose = getattr(func, "decompose", None)
        if entry is None and decompose is not None:
            with self:
                result = decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        if entry is not None:
            name, formula = entry
            self.by_op[name] = self.by_op.get(name, 0) + int(formula(args, kwargs, out))
        return out

"""The cut finder: any traceable network as an ordered list of blocks.

`torch.fx` traces the network into a graph of operations in execution order. Between two
consecutive operations lies a candidate cut when exactly ONE value computed before is used
after it, and that value is a floating-point tensor: that tensor is all a client block would
send. Inside a residual block two values cross (the branch and the shortcut), so there is no
cut there. A cut is also dropped when an operation after it changes the crossing tensor in
place (an in-place ReLU on the received activation would write into a leaf that needs a
gradient). The graph is then cut at every candidate into consecutive `GraphModule` segments,
which share the network's own modules and parameters, so their composition is the network.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import fx, nn

from jetsplit.errors import ModelError

_COMPUTE = ("call_module", "call_function", "call_method")
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.setitem}


def trace(module: nn.Module, where: str) -> fx.GraphModule:
    """Symbolically trace `module`; an untraceable one says why and how to declare blocks."""
    try:
        return fx.symbolic_trace(module)
    except Exception as exc:  # noqa: BLE001 (fx raises many kinds; each becomes one line)
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ModelError(
            f"{where}: torch.fx cannot trace {type(module).__name__} ({type(exc).__name__}: "
            f"{reason}); declare its blocks instead: give the model a `jetsplit_blocks` "
            "attribute listing its submodule names in order, or a `jetsplit_blocks()` method "
            "returning the ordered modules"
        ) from None


class _Recorder(fx.Interpreter):
    """Runs the traced graph once and keeps every node's value (to tell tensors apart)."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.values: Dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _is_inplace(node: fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function":
        return node.target in _INPLACE_FUNCTIONS or bool(node.kwargs.get("inplace", False))
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    return False


def candidate_cuts(graph: fx.GraphModule, probe: torch.Tensor, where: str
                   ) -> Tuple[List[fx.Node], List[Tuple[int, fx.Node]]]:
    """(compute nodes in order, the cuts as (i, crossing node) — a cut after nodes[i]).
    Requires one input and one tensor output."""
    nodes = list(graph.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ModelError(f"{where}: the model takes {len(inputs)} inputs; jetsplit splits "
                         "models with one input tensor")
    compute = [n for n in nodes if n.op in _COMPUTE]
    if not compute:
        raise ModelError(f"{where}: the traced model computes nothing")
    recorder = _Recorder(graph)
    recorder.run(probe)
    output = next(n for n in nodes if n.op == "output")
    if not isinstance(output.args[0], fx.Node) or \
            not isinstance(recorder.values.get(output.args[0]), torch.Tensor):
        raise ModelError(f"{where}: the model must return one tensor (the logits)")
    position = {n: i for i, n in enumerate(compute)}
    position[inputs[0]] = -1
    last_use = {}
    for n in [inputs[0], *compute]:
        uses = [position.get(u, len(compute)) for u in n.users]
        last_use[n] = max(uses) if uses else position[n]
    cuts = []
    for i in range(len(compute) - 1):
        crossing = [n for n in [inputs[0], *compute[: i + 1]] if last_use[n] > i]
        if len(crossing) != 1:
            continue
        value = recorder.values.get(crossing[0])
        if crossing[0] is inputs[0] or not isinstance(value, torch.Tensor) \
                or not value.is_floating_point():
            continue
        if any(_is_inplace(u, graph) for u in crossing[0].users):
            continue
        cuts.append((i, crossing[0]))
    return compute, cuts


def _segment_graph(root: fx.GraphModule, nodes: Sequence[fx.Node], entry: fx.Node,
                   exit_node: fx.Node) -> fx.GraphModule:
    """One segment: `entry`'s value in, `nodes` (with the attributes they read), `exit` out."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {entry: graph.placeholder("x")}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg, lambda n: env[n])
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[exit_node])
    return fx.GraphModule(root, graph)


def _segment_name(segment: fx.GraphModule, nodes: Sequence[fx.Node], taken: set) -> str:
    """The owner of a segment's modules (`layer1.0` → `layer1_0`), else its first op's name."""
    targets = [str(n.target).split(".") for n in nodes if n.op in ("call_module", "get_attr")]
    common: List[str] = []
    if targets:
        for parts in zip(*targets):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        if not common:
            common = [targets[0][0], targets[-1][0]] if targets[0][0] != targets[-1][0] \
                else [targets[0][0]]
    base = "_".join(common) if common else nodes[0].name
    base = base if base.isidentifier() or base.isdigit() else f"block{len(taken)}"
    name, count = base, 1
    while name in taken or hasattr(nn.Sequential, name):
        count += 1
        name = f"{base}_{count}"
    taken.add(name)
    return name


def segment(module: nn.Module, input_shape: Tuple[int, ...], where: str
            ) -> OrderedDict[str, nn.Module]:
    """`module` cut at every candidate cut into named `GraphModule` blocks, in order."""
    graph = trace(module, where)
    probe = torch.zeros(2, *input_shape)
    modes = [(m, m.training) for m in graph.modules()]
    graph.eval()
    try:
        with torch.no_grad():
            compute, cuts = candidate_cuts(graph, probe, where)
    finally:
        for m, mode in modes:
            m.training = mode
    output = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    entry = next(n for n in graph.graph.nodes if n.op == "placeholder")
    bounds = [(-1, entry), *cuts, (len(compute) - 1, output)]
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    taken: set = set()
    owners: Dict[int, str] = {}
    for (start, _), (stop, exit_node) in zip(bounds, bounds[1:]):
        nodes = compute[start + 1: stop + 1]
        part = _segment_graph(graph, nodes, entry, exit_node)
        name = _segment_name(part, nodes, taken)
        for tensor in [*part.parameters(), *part.buffers()]:
            if owners.setdefault(id(tensor), name) != name:
                raise ModelError(f"{where}: a tensor is used by blocks {owners[id(tensor)]} and "
                                 f"{name} (tied weights); declare blocks that keep it in one")
        layers[name] = part.train(module.training)
        entry = exit_node
    return layers

"""FedAvg: the sample-weighted mean of model states (McMahan et al.; SplitFed's Fed server)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

Arrays = dict[str, np.ndarray]


def fedavg(states: Mapping[str, Arrays], weights: Mapping[str, float]) -> Arrays:
    """Weighted mean per tensor over agents (in id order, so the sum is reproducible).

    Float tensors are averaged in float64 and cast back; integer buffers (BatchNorm's
    `num_batches_tracked`) take the maximum, which is what a single model would have seen.
    """
    agents = sorted(states)
    if not agents:
        raise ValueError("fedavg of no models")
    total = float(sum(weights[a] for a in agents))
    names = list(states[agents[0]])
    for agent in agents[1:]:
        if list(states[agent]) != names:
            raise ValueError(f"agent {agent} sent tensors that differ from {agents[0]}'s")
    out: Arrays = {}
    for name in names:
        first = states[agents[0]][name]
        if np.issubdtype(first.dtype, np.floating):
            acc = np.zeros(first.shape, np.float64)
            for agent in agents:
                acc += states[agent][name].astype(np.float64) * (weights[agent] / total)
            out[name] = acc.astype(first.dtype)
        else:
            out[name] = np.max(np.stack([states[a][name] for a in agents]), axis=0)
    return out


def layerwise(states: Mapping[str, Arrays], weights: Mapping[str, float],
              combine: Callable[[Mapping[str, Arrays], Mapping[str, float]], Arrays]) -> Arrays:
    """`combine` of each tensor over the agents that hold it: devices at different cuts hold
    different layers (server/completions.py), so layer l combines the devices with c_k ≥ l.
    Tensors held by the same agents are combined together, in first-seen order."""
    agents = sorted(states)
    names: dict[str, None] = {}  # first-seen order, agents in id order
    for agent in agents:
        names.update(dict.fromkeys(states[agent]))
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        groups.setdefault(tuple(a for a in agents if name in states[a]), []).append(name)
    out: Arrays = {}
    for holders, group in groups.items():
        out.update(combine({a: {n: states[a][n] for n in group} for a in holders}, weights))
    return {n: out[n] for n in names}


def layerwise_fedavg(states: Mapping[str, Arrays], weights: Mapping[str, float]) -> Arrays:
    """FedAvg layer by layer over each layer's holders (weights renormalised over them).
    Where every agent holds every tensor this is `fedavg`, bit for bit."""
    return layerwise(states, weights, fedavg)

"""The edge tier of SHeRL-FL, on an agent with role `edge` (e.g. an Orin NX serving Nanos).

Its clients send their smashed data straight to it (`smashed` messages on the edge's peer
topic, through the broker but never through the coordinator); `edge_load` names the clients
it may accept them from. On `edge_step` the edge concatenates the step's smashed data in the
order the command lists the clients, runs its block, trains that block on the
cosine-distance contrastive loss of the batch's pairs and sends each client its slice of
the activation gradients directly (`gradient` messages). Its reply to the coordinator
carries the detached embeddings and labels for the cloud; nothing ever comes back from the
cloud but aggregated models (`edge_load`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from jetsplit.bundle import Bundle
from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.emulation import DeviceClock
from jetsplit.edge_agent.peers import PeerInbox, PeerSend
from jetsplit.edge_agent.result import Result, Tensors
from jetsplit.models.weights import from_arrays, load_strict
from jetsplit.optimizers import build_optimizer
from jetsplit.protocol import (
    EdgeLoadArgs,
    EdgeStepArgs,
    Kind,
    OptimizerArgs,
    ProtocolError,
)
from jetsplit.tiers import contrastive_loss

MAX_EDGE_BATCH = 1 << 16  # samples per edge step (the sum of its clients' batches)


def no_data() -> ArrayDataset:
    """What an edge holds of the training data: nothing (it trains on its clients'
    activations), so it never loads or partitions a dataset."""
    return ArrayDataset(np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64), "none", 1)


class EdgeTier:
    """The edge block this agent trains and its optimizer."""

    def __init__(self, block: nn.Sequential, input_shape: tuple[int, ...],
                 optimizer: OptimizerArgs, device: torch.device) -> None:
        self.block = block.to(device)
        self.input_shape = input_shape
        self.device = device
        # An edge tier of parameter-free blocks (a ReLU, a pooling, a flatten of a user's
        # network) has nothing to step; it still computes the contrastive loss and returns
        # its gradient to the clients (docs/methods.md#auxiliary-heads-and-edge-tiers-at-any-cut).
        params = list(self.block.parameters())
        self.optimizer: Optional[torch.optim.Optimizer] = build_optimizer(
            params, optimizer.name, optimizer.lr, optimizer.momentum,
            optimizer.weight_decay) if params else None

    def inputs(self, smashed: Dict[str, Tensors]) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """Each client's activations and labels, checked (peers are untrusted), then
        concatenated in the given order; also each client's sample count."""
        acts: List[np.ndarray] = []
        labels: List[np.ndarray] = []
        for client, tensors in smashed.items():
            a, y = tensors.get("activations"), tensors.get("labels")
            if a is None or y is None:
                raise ProtocolError(f"smashed data from {client} lacks activations or labels")
            if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or len(y) == 0:
                raise ProtocolError(f"smashed data from {client}: labels must be 1-D integers")
            if a.dtype != np.float32 or tuple(a.shape) != (len(y), *self.input_shape):
                raise ProtocolError(f"smashed data from {client}: activations are {a.dtype} "
                                    f"{list(a.shape)}, expected float32 "
                                    f"{[len(y), *self.input_shape]}")
            if not np.isfinite(a).all():
                raise ProtocolError(f"smashed data from {client} contains NaN or infinity")
            acts.append(a)
            labels.append(y.astype(np.int64))
        sizes = [len(y) for y in labels]
        if sum(sizes) > MAX_EDGE_BATCH:
            raise ProtocolError(f"edge_step: {sum(sizes)} samples, at most {MAX_EDGE_BATCH}")
        return (torch.from_numpy(np.concatenate(acts)).to(self.device),
                torch.from_numpy(np.concatenate(labels)).to(self.device), sizes)

    def step(self, acts: torch.Tensor, labels: torch.Tensor, margin: float
             ) -> tuple[np.ndarray, float, np.ndarray]:
        """One contrastive update; returns ∂L/∂activations for the clients, the loss, and
        the embeddings before the update (as the loss saw them) for the cloud."""
        leaf = acts.requires_grad_(True)
        self.block.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        z = self.block(leaf)
        loss = contrastive_loss(z, labels, margin)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        assert leaf.grad is not None
        return (leaf.grad.cpu().numpy(), float(loss.detach()),
                np.ascontiguousarray(z.detach().cpu().numpy(), np.float32))


class EdgeRole:
    """The edge commands of `AgentWorker` (mixed in; the worker supplies bundle, device,
    role and optimizer settings). Only agents with role `edge` accept them."""

    agent_id: str
    role: str
    run: str
    bundle: Optional[Bundle]
    device: torch.device
    optimizer_args: OptimizerArgs
    edge_tier: Optional[EdgeTier]
    peers: PeerInbox
    clock: DeviceClock

    def _edge_bundle(self) -> Bundle:
        if self.role != "edge":
            raise ProtocolError(f"agent {self.agent_id} has role {self.role}; edge commands "
                                f"need role edge")
        if self.bundle is None:
            raise ProtocolError(f"agent {self.agent_id}: no bundle installed yet")
        return self.bundle

    def _edge(self) -> EdgeTier:
        self._edge_bundle()
        if self.edge_tier is None:
            raise ProtocolError(f"agent {self.agent_id}: no edge block loaded (edge_load "
                                f"first)")
        return self.edge_tier

    def _do_edge_load(self, args: EdgeLoadArgs, round_: int, step: int, tensors: Tensors
                      ) -> Result:
        """Install the cloud's edge-tier model: the edge bundle's middle block (server
        layers [:layers]; the edge never holds the classifier) with the weights sent
        (edge/… names), and a fresh optimizer; from now on take smashed data from the
        clients named, for this run and round only."""
        bundle = self._edge_bundle()
        if any(not name.startswith("edge/") for name in tensors):
            raise ProtocolError("edge_load: tensors must all be named edge/…")
        if args.layers != bundle.manifest.edge_layers:
            raise ProtocolError(f"edge_load: {args.layers} layers, but the edge bundle holds "
                                f"{bundle.manifest.edge_layers}")
        block = bundle.edge_module()
        load_strict(block, from_arrays(tensors, "edge"), "edge_load", ProtocolError)
        shape = tuple(bundle.manifest.activation_shape)
        self.edge_tier = EdgeTier(block, shape, args.optimizer or self.optimizer_args,
                                  self.device)
        self.peers.expect(Kind.SMASHED.value, args.clients, self.run, round_)
        return Result(meta={"layers": args.layers})

    def _do_edge_step(self, args: EdgeStepArgs, round_: int, step: int, tensors: Tensors
                      ) -> Result:
        """Train on what the listed clients sent for this step (those in within `wait_s`),
        send each its gradient slice, and answer with who was served and the embeddings."""
        tier = self._edge()
        if len(set(args.clients)) != len(args.clients):
            raise ProtocolError("edge_step: a client is listed twice")
        got = self.peers.take(Kind.SMASHED.value, args.clients, self.run, round_, step,
                              args.wait_s)
        served = [c for c in args.clients if c in got]
        if not served:
            raise ProtocolError(f"edge_step round {round_} step {step}: no smashed data from "
                                f"{', '.join(args.clients)} within {args.wait_s:g}s")
        self.clock.transfer(sum(got[c][1] for c in served), "down")
        acts, labels, sizes = tier.inputs({c: got[c][0].tensors for c in served})
        grad, loss, embeddings = tier.step(acts, labels, args.margin)
        parts = np.split(np.ascontiguousarray(grad, np.float32), np.cumsum(sizes)[:-1])
        return Result(meta={"loss": loss, "samples": int(len(labels)), "clients": served,
                            "sizes": sizes},
                      tensors={"embeddings": embeddings, "labels": labels.cpu().numpy()},
                      codec=args.codec, compression=args.compression,
                      peers=[PeerSend(c, Kind.GRADIENT.value, {"grad": g})
                             for c, g in zip(served, parts)])

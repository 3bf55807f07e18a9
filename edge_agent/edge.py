"""The edge tier of SHeRL-FL, on an agent with role `edge` (e.g. an Orin NX serving Nanos).

The coordinator relays its clients' smashed data to the edge (agents only talk to the
coordinator). The edge runs its block on them, trains that block on the cosine-distance
contrastive loss of the batch's pairs, and answers with the activation gradients for its
clients. Its detached embeddings and labels wait for the cloud's `edge_upload`; nothing
ever comes back from the cloud but aggregated models (`edge_load`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

import numpy as np
import torch
from torch import nn

from jetsplit.bundle import Bundle
from jetsplit.data import ArrayDataset
from jetsplit.models.weights import from_arrays, load_strict
from jetsplit.protocol import (
    EdgeLoadArgs,
    EdgeStepArgs,
    EdgeUploadArgs,
    OptimizerArgs,
    ProtocolError,
)
from jetsplit.tiers import contrastive_loss

if TYPE_CHECKING:
    from jetsplit.edge_agent.worker import Result

Tensors = Dict[str, np.ndarray]
MAX_EDGE_BATCH = 1 << 16  # samples per relayed batch (the sum of its clients' batches)


def no_data() -> ArrayDataset:
    """What an edge holds of the training data: nothing (it trains on its clients'
    activations), so it never loads or partitions a dataset."""
    return ArrayDataset(np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64), "none", 1)


class EdgeTier:
    """The edge block this agent trains, its optimizer, and the embeddings of its last
    step until the cloud collects them."""

    def __init__(self, block: nn.Sequential, input_shape: tuple[int, ...],
                 optimizer: OptimizerArgs, device: torch.device) -> None:
        self.block = block.to(device)
        self.input_shape = input_shape
        self.device = device
        from jetsplit.edge_agent.worker import make_optimizer

        self.optimizer = make_optimizer(list(self.block.parameters()), optimizer)
        self.pending: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None

    def inputs(self, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """The relayed activations and labels, checked (commands are untrusted)."""
        acts, labels = tensors.get("activations"), tensors.get("labels")
        if acts is None or labels is None:
            raise ProtocolError("edge_step needs 'activations' and 'labels'")
        n = len(labels)
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) \
                or not 0 < n <= MAX_EDGE_BATCH:
            raise ProtocolError(f"edge_step labels must be 1..{MAX_EDGE_BATCH} integers")
        if acts.dtype != np.float32 or tuple(acts.shape) != (n, *self.input_shape):
            raise ProtocolError(f"edge_step activations are {acts.dtype} {list(acts.shape)}, "
                                f"expected float32 {[n, *self.input_shape]}")
        if not np.isfinite(acts).all():
            raise ProtocolError("edge_step activations contain NaN or infinity")
        return (torch.from_numpy(np.array(acts)).to(self.device),
                torch.from_numpy(labels.astype(np.int64)).to(self.device))

    def step(self, key: tuple[int, int], acts: torch.Tensor, labels: torch.Tensor,
             margin: float) -> tuple[np.ndarray, float]:
        """One contrastive update; returns ∂L/∂activations for the clients and the loss.
        The embeddings (before the update, as the loss saw them) wait for the upload."""
        leaf = acts.requires_grad_(True)
        self.block.train()
        self.optimizer.zero_grad(set_to_none=True)
        z = self.block(leaf)
        loss = contrastive_loss(z, labels, margin)
        loss.backward()
        self.optimizer.step()
        assert leaf.grad is not None
        self.pending = (key, z.detach().cpu().numpy(), labels.cpu().numpy())
        return leaf.grad.cpu().numpy(), float(loss.detach())

    def upload(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The embeddings and labels of step `key`, once."""
        if self.pending is None or self.pending[0] != key:
            raise ProtocolError(f"edge_upload for round {key[0]} step {key[1]}: no such "
                                f"edge step")
        _, embeddings, labels = self.pending
        self.pending = None
        return np.ascontiguousarray(embeddings, np.float32), labels


class EdgeRole:
    """The edge commands of `AgentWorker` (mixed in; the worker supplies bundle, device,
    role and optimizer settings). Only agents with role `edge` accept them."""

    agent_id: str
    role: str
    bundle: Optional[Bundle]
    device: torch.device
    optimizer_args: OptimizerArgs
    edge_tier: Optional[EdgeTier]

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
        (edge/… names), and a fresh optimizer."""
        from jetsplit.edge_agent.worker import Result

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
        return Result(meta={"layers": args.layers})

    def _do_edge_step(self, args: EdgeStepArgs, round_: int, step: int, tensors: Tensors
                      ) -> Result:
        from jetsplit.edge_agent.worker import Result

        tier = self._edge()
        acts, labels = tier.inputs(tensors)
        grad, loss = tier.step((round_, step), acts, labels, args.margin)
        return Result(meta={"loss": loss, "samples": int(len(labels))},
                      tensors={"grad": np.ascontiguousarray(grad, np.float32)},
                      codec=args.codec, compression=args.compression)

    def _do_edge_upload(self, args: EdgeUploadArgs, round_: int, step: int, tensors: Tensors
                        ) -> Result:
        from jetsplit.edge_agent.worker import Result

        embeddings, labels = self._edge().upload((round_, step))
        return Result(meta={"samples": int(len(labels))},
                      tensors={"embeddings": embeddings, "labels": labels},
                      codec=args.codec, compression=args.compression)

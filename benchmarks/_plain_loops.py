"""Plain PyTorch loops that `bench_overhead.py` holds `simulate` against: the plain training
loop (the issue's limit), and for the methods whose own work is more than that loop's, the
same method written as a plain loop (its limit without the framework).

SplitFed V1 trains a server-block copy per client and FedAvg a whole model per client: K
models stepping on B/K samples each do the plain loop's FLOPs, but K optimiser steps and K
weight-gradient writes, which are memory-bound on the fully connected layers. SCALA and PSL
step one server block on the concatenated batch with two backward passes (∇ of the
activations with the graph kept, then ∇ of the weights: the client gradients come from
each client's own loss), and PSL reports the mean accuracy of its K never-averaged client
blocks, so it evaluates the test split K times a round. No jetsplit code runs here but the
model (`build_model`, `split`) and the data loader, so what `simulate` costs over a
reference is the framework's, and what a reference costs over the plain loop is the
method's.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Shape:
    """What a method's own work holds: a model per client, or one server block shared by
    per-client client blocks (averaged at round end or never); evaluations per round."""

    name: str
    model_per_client: bool
    average_clients: bool = True
    evals_per_client: bool = False


COPIES = Shape("per-client models", model_per_client=True)
SHARED = Shape("shared server, two backwards", model_per_client=False)
SHARED_OWN = Shape("shared server, two backwards, own client blocks", model_per_client=False,
                   average_clients=False, evals_per_client=True)
PLAIN = "plain"
SHAPES = {f"{PLAIN}:copies": COPIES, f"{PLAIN}:shared": SHARED, f"{PLAIN}:shared-own": SHARED_OWN}
REFERENCES = {"splitfed-v1": f"{PLAIN}:copies", "fedavg": f"{PLAIN}:copies",
              "scala": f"{PLAIN}:shared", "psl": f"{PLAIN}:shared-own"}  # method → its loop
LOOPS = (PLAIN, *SHAPES)  # what `run_reference` runs


def shares(batch: int, clients: int) -> list[int]:
    """`batch` split over `clients` as evenly as integers allow (the first get the rest)."""
    base, rest = divmod(batch, clients)
    return [base + (k < rest) for k in range(clients)]


def run_reference(args: argparse.Namespace, run: str) -> dict[str, Any]:
    """`run` is PLAIN or a `SHAPES` key: rounds × local steps of `batch` samples drawn
    (seeded) from the training split, the test split evaluated once a round (PSL: once per
    client block)."""
    from jetsplit.data import load_dataset_split
    from jetsplit.models import ModelSpec, build_model

    train, test = load_dataset_split(args.dataset, 0.2, args.seed)
    model = build_model(ModelSpec(args.model, train.input_shape, train.num_classes),
                        seed=args.seed)
    loop = _Plain(model) if run == PLAIN else _Method(model, SHAPES[run], args)
    rng = np.random.default_rng(args.seed)
    losses, accuracy = [], 0.0
    for _ in range(args.rounds):
        loop.begin_round()
        for _ in range(args.local_steps):
            idx = rng.choice(len(train), size=args.batch, replace=False)
            x, y = torch.from_numpy(train.x[idx]), torch.from_numpy(train.y[idx])
            losses.append(loop.step(x, y))
        loop.end_round()
        accuracy = float(np.mean([_accuracy(m, test) for m in loop.evaluated()]))
    return {"final_accuracy": accuracy, "train_loss": float(np.mean(losses))}


def _accuracy(model: nn.Module, test: Any) -> float:  # noqa: ANN401 (a jetsplit Dataset)
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(test), 512):
            x = torch.from_numpy(test.x[start:start + 512])
            y = torch.from_numpy(test.y[start:start + 512])
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(test)


class _Plain:
    """One model, SGD, the whole batch: the plain training loop."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def begin_round(self) -> None:
        self.model.train()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def end_round(self) -> None:
        pass

    def evaluated(self) -> list[nn.Module]:
        return [self.model]


class _Method:
    """A method's own work as a plain loop: K client blocks (and, with `model_per_client`,
    K server blocks), each client on its share of the batch; copies start each round from
    the global blocks and are averaged into them at its end."""

    def __init__(self, model: nn.Module, shape: Shape, args: argparse.Namespace) -> None:
        from jetsplit.models.split import split

        self.shape, self.sizes = shape, shares(args.batch, args.agents)
        self.client, self.server = split(model, args.split)
        k = len(self.sizes)
        self.clients = [copy.deepcopy(self.client) for _ in range(k)]
        self.servers = [copy.deepcopy(self.server) for _ in range(k)] \
            if shape.model_per_client else [self.server]
        self.client_opts = [torch.optim.SGD(c.parameters(), lr=0.01) for c in self.clients]
        self.server_opts = [torch.optim.SGD(s.parameters(), lr=0.01) for s in self.servers]

    def begin_round(self) -> None:
        with torch.no_grad():
            if self.shape.average_clients:
                _load_each(self.clients, self.client)
            if self.shape.model_per_client:
                _load_each(self.servers, self.server)
        for module in (*self.clients, *self.servers):
            module.train()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        xs, ys = x.split(self.sizes), y.split(self.sizes)
        if self.shape.model_per_client:
            return float(np.mean([self._own_step(k, xk, yk)
                                  for k, (xk, yk) in enumerate(zip(xs, ys, strict=True))]))
        return self._shared_step(xs, ys)

    def _own_step(self, k: int, x: torch.Tensor, y: torch.Tensor) -> float:
        for opt in (self.client_opts[k], self.server_opts[k]):
            opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.servers[k](self.clients[k](x)), y)
        loss.backward()
        for opt in (self.client_opts[k], self.server_opts[k]):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _shared_step(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]
                     ) -> float:
        acts = [c(x) for c, x in zip(self.clients, xs, strict=True)]
        leaves = [a.detach().requires_grad_(True) for a in acts]
        logits = self.server(torch.cat(leaves)).split(self.sizes)
        losses = [nn.functional.cross_entropy(lg, y) for lg, y in zip(logits, ys, strict=True)]
        total = torch.stack(losses).sum()
        grads = torch.autograd.grad(total, leaves, retain_graph=True)
        opt = self.server_opts[0]
        opt.zero_grad(set_to_none=True)
        params = list(self.server.parameters())
        torch.autograd.backward(total / len(losses), inputs=params)
        opt.step()
        for act, grad, client_opt in zip(acts, grads, self.client_opts, strict=True):
            client_opt.zero_grad(set_to_none=True)
            act.backward(grad)
            client_opt.step()
        return float(torch.stack(losses).detach().mean())

    def end_round(self) -> None:
        with torch.no_grad():
            if self.shape.average_clients:
                _average_into(self.client, self.clients)
            if self.shape.model_per_client:
                _average_into(self.server, self.servers)

    def evaluated(self) -> list[nn.Module]:
        if self.shape.evals_per_client:
            return [nn.Sequential(c, self.server) for c in self.clients]
        return [nn.Sequential(self.client, self.server)]


def _state(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers (batch-norm statistics are averaged like weights)."""
    return [*module.parameters(), *module.buffers()]


def _load_each(copies: list[nn.Module], source: nn.Module) -> None:
    for module in copies:
        for dst, src in zip(_state(module), _state(source), strict=True):
            dst.copy_(src)


def _average_into(target: nn.Module, copies: list[nn.Module]) -> None:
    """The plain mean, summed in place (no stacked copy of every copy); a counter (an
    integer buffer) is the first copy's."""
    for value, *each in zip(_state(target), *(_state(c) for c in copies), strict=True):
        value.copy_(each[0])
        if value.is_floating_point():
            for other in each[1:]:
                value.add_(other)
            value.div_(len(each))

"""SplitFed V1 and V2, and V2 with clients interleaved per iteration."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jetsplit.models.weights import load_strict, to_load
from jetsplit.server.methods.base import SplitMethod
from jetsplit.server.methods.server_copies import ServerCopies, array_views


class SplitFedV1(SplitMethod):
    """SplitFed V1: a server-block copy per client, trained in parallel; copies and client
    blocks are FedAvg-ed (weights |D_k|) at round end, or combined by the robust rule
    `[train] aggregator` names (a device's copy trained on poisoned data is one more upload
    to bound)."""

    name = "splitfed-v1"
    pool: ServerCopies | None = None  # the copies' storage, made on the first round

    def begin_round(self, selected: list[str]) -> None:
        """Each selected client's copy starts from the global block with a fresh optimiser
        (slots reused across rounds: server/methods/server_copies.py)."""
        t = self.trainer
        if self.pool is None:
            self.pool = ServerCopies(t.server_optimizer.for_module)
        self.copies, self.optimizers = self.pool.checkout(t.server, selected)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        grads, losses = {}, []
        for agent, x, y in zip(agents, acts, labels, strict=True):
            server, optimizer = self.copies[agent], self.optimizers[agent]
            leaf = x.clone().requires_grad_(True)
            server.train()
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(server(leaf), y)
            loss.backward()
            optimizer.step()
            # its gradients freed now, not at its next step: one copy's alive at a time
            optimizer.zero_grad(set_to_none=True)
            grads[agent] = leaf.grad
            losses.append(loss.detach())
        # the losses read back once per step, not once per client (a host sync each on a GPU)
        return float(np.mean(torch.stack(losses).tolist())), grads

    def end_round(self, participants: list[str]) -> None:
        t = self.trainer
        if participants:
            # the copies and the global block read in place: nothing here writes to them
            # before the average is loaded (which copies it)
            states = {a: array_views(self.copies[a], "server") for a in participants}
            with t.books.timed("aggregate"):  # under [train] aggregator, like client blocks
                merged = t.defences.aggregate(
                    states, t.defences.sizes(participants),
                    reference=array_views(t.server, "server"), block="server copy",
                    uploaded=False)
            # the average is this round's own: loaded without another copy of it first
            load_strict(t.server, to_load(merged, "server"), "server average")
        self.copies, self.optimizers = {}, {}


class SplitFedV2(SplitMethod):
    """SplitFed V2 as the SplitFed reference implementation runs it: one server block; the
    selected clients, in a random order, each run their WHOLE local pass (T iterations:
    forward, server update, backward) before the next client starts; client blocks are
    FedAvg-ed (weights |D_k|) at round end. This sequential pass is what lets the server
    block drift towards the last clients' labels under skew (SCALA's V2 tables)."""

    name = "splitfed-v2"

    def local_pass(self, selected: list[str], participants: set[str]) -> list[float]:
        t, losses = self.trainer, []
        batches = t.defences.batches(t.live(selected))  # B_k over the round's clients, as V1
        for agent in [str(a) for a in t.rng.permutation(sorted(batches))]:
            for step in range(t.settings.local_steps):
                if not t.live([agent]):
                    break
                loss = self._serve(agent, batches[agent], step)
                if loss is None:
                    break
                losses.append(loss)
                participants.add(agent)
        return losses

    def _serve(self, agent: str, batch: int, step: int) -> float | None:
        """One client's iteration: its forward, the server's update, its backward."""
        return self.split_step({agent: batch}, step)

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t = self.trainer
        leaf = acts[0].clone().requires_grad_(True)
        t.server.train()
        t.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(t.server(leaf), labels[0])
        loss.backward()
        value = float(loss.detach())
        d = t.defences  # bounded influence against the recent devices' losses
        weights = d.loss_weights(agents, [value]) if d.weighs_losses else None
        grads = [p.grad for p in t.server.parameters() if p.grad is not None]
        if weights is not None:  # the server's step only; the client's gradient stays
            for g in grads:
                g.mul_(weights[0])
        share = d.step_gradient_weight(agents[0], grads)  # its whole share, bounded
        if share is not None:
            for g in grads:
                g.mul_(share)
        t.optimizer.step()
        return value, {agents[0]: leaf.grad}


class SplitFedV2Interleaved(SplitFedV2):
    """Variant: within each iteration the clients are served one after another in a fresh
    random order, so every client advances one step per iteration (less drift than the
    reference's client-after-client pass; kept to compare the two schedules)."""

    name = "splitfed-v2-interleaved"

    def local_pass(self, selected: list[str], participants: set[str]) -> list[float]:
        return SplitMethod.local_pass(self, selected, participants)

    def iterate(self, live: list[str], step: int) -> float | None:
        t = self.trainer
        losses = []
        batches = t.defences.batches(live)
        for agent in [str(a) for a in t.rng.permutation(live)]:
            loss = self._serve(agent, batches[agent], step)
            if loss is not None:
                losses.append(loss)
        return float(np.mean(losses)) if losses else None

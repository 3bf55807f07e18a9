"""PSL: parallel split learning with one server block stepped on the clients' losses
(the GAPSL paper's §II-A baseline); client blocks are never aggregated. Its server step is
shared with GAPSL."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jetsplit.models.weights import to_arrays
from jetsplit.server.defences.defences import Defences
from jetsplit.server.defences.step_bounds import share_norms
from jetsplit.server.methods.base import SplitMethod
from jetsplit.server.training.checkpoints import (
    CheckpointError,
    save_arrays,
    subset,
)
from jetsplit.server.training.optimisers import reduction
from jetsplit.server.training.trainer import Arrays, Trainer


def sum_of_client_losses(server: nn.Module, optimizer: torch.optim.Optimizer,
                          acts: list[torch.Tensor], labels: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One server forward over the concatenation; returns (Σ_i L_i, leaves, per-client
    losses) with L_i each client's mean cross-entropy (PSL/GAPSL's L = Σ_i L_i)."""
    leaves = [a.clone().requires_grad_(True) for a in acts]
    server.train()
    optimizer.zero_grad(set_to_none=True)
    logits = server(torch.cat(leaves)).split([len(a) for a in acts])
    losses = [nn.functional.cross_entropy(lg, y) for lg, y in zip(logits, labels, strict=True)]
    return torch.stack(losses).sum(), leaves, losses


def step_averaged(server: nn.Module, optimizer: torch.optim.Optimizer,
                   losses: list[torch.Tensor], chosen: list[int], leaves: list[torch.Tensor],
                   server_loss: torch.Tensor) -> list[torch.Tensor]:
    """Client i gets ∂L_i/∂A_i (its own mean loss, like SCALA's G_k); the server steps on
    `server_loss` (a sum over clients as the GAPSL paper's eq. 8, or their mean: see `reduced`).

    With the sum the server's step grows with the number of clients, enough to diverge PSL
    at plain SGD's default rate (docs/results.md#measurements-behind-the-defaults). The mean
    variant keeps the step size independent of |S|; selection and directions are the
    same either way."""
    grads = torch.autograd.grad(torch.stack([losses[i] for i in chosen]).sum(),
                                [leaves[i] for i in chosen], retain_graph=True)
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in server.parameters() if p.requires_grad]
    torch.autograd.backward(server_loss, inputs=params)
    optimizer.step()
    return [g.detach() for g in grads]


def weighted(losses: list[torch.Tensor], weights: list[float] | None
             ) -> list[torch.Tensor] | None:
    """Each client's loss times its weight (bounded influence: a client far above the
    fleet's loss counts less in the server's step, server/defences/step_bounds.LossBound),
    or None where nothing is weighted (the unweighted step, bit for bit)."""
    return None if weights is None else [x * w for x, w in zip(losses, weights, strict=True)]


def loss_weights(defences: Defences, agents: list[str], values: list[float]
                 ) -> list[float] | None:
    """The loss bound's weights of these clients' losses, None where it is off."""
    return defences.loss_weights(agents, values) if defences.weighs_losses else None


def read(losses: list[torch.Tensor]) -> list[float]:
    """The clients' losses on the host, in one read: the loss bound's input and the step's
    reported mean."""
    return torch.stack(losses).detach().tolist()


def reduced(total: torch.Tensor, count: int, settings: Any) -> torch.Tensor:
    """PSL's L = Σ_i L_i and GAPSL's L_g = Σ_{Ŝ} L̃_i are sums (the GAPSL paper eq. 8, the
    `paper` preset); by default they are divided by the number of summed clients, which
    keeps the server's step independent of how many clients are selected."""
    return total / count if reduction(settings) == "mean" else total


class PSL(SplitMethod):
    """Parallel split learning: one server block trained on the clients' mean loss; client
    blocks are never aggregated, each stays with its agent (the GAPSL paper §II-A)."""

    name = "psl"
    aggregate_clients = False

    def server_update(self, agents, acts, labels):  # noqa: ANN001, ANN201
        t, d = self.trainer, self.trainer.defences
        total, leaves, losses = sum_of_client_losses(t.server, t.optimizer, acts, labels)
        values = read(losses)
        scaled = weighted(losses, loss_weights(d, agents, values))
        if d.measures_shares:  # each device's share of ∇w_s, bounded
            clipped = d.share_weights(agents, share_norms(
                scaled or losses, [p for p in t.server.parameters() if p.requires_grad]))
            if clipped is not None:
                scaled = [x * w for x, w in zip(scaled or losses, clipped, strict=True)]
        if scaled is not None:
            total = torch.stack(scaled).sum()
        grads = step_averaged(t.server, t.optimizer, losses, list(range(len(losses))),
                               leaves, reduced(total, len(losses), t.settings))
        return sum(values) / len(values), dict(zip(agents, grads, strict=True))

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.agent_blocks: dict[str, Arrays] = {}  # each agent's block as last evaluated
        self.to_restore: dict[str, Arrays] = {}  # blocks to reinstall after a resume

    def begin_round(self, selected: list[str]) -> None:
        """After a resume, every agent gets its own checkpointed block back first (fresh
        agents start from the bundle's; survivors may have trained past the checkpoint)."""
        t = self.trainer
        if self.to_restore:
            for agent in t.live(sorted(self.to_restore)):
                block = self.to_restore[agent]
                if t.push([agent], t.device_part(agent, block)):
                    t.completions.load(agent, block)
                    del self.to_restore[agent]

    def switch_cuts(self, cuts: Mapping[str, int]) -> list[str]:
        """An agent's block is its own here, split between its device and its completion
        copy, so a move re-splits it: the whole block as last evaluated (or still waiting
        to be reinstalled) is reinstalled at the new cut by `begin_round` (device part
        pushed, completion copy loaded). An agent that never trained still holds the
        bundle's initial block, which the new cut's bundle and the global block give it."""
        t = self.trainer
        for agent, cut in cuts.items():
            whole = self.to_restore.get(agent) or self.agent_blocks.get(agent)
            if t.cut(agent) != cut and whole is not None:
                self.to_restore[agent] = whole
        return super().switch_cuts(cuts)

    def evaluate(self) -> dict[str, Any]:
        """Each agent's own client block with the shared server block, mean and spread."""
        t = self.trainer
        agents = t.engine.registry.eligible()
        states = t.pull([a for a in agents if not t.needs_bundle(a)])
        t.completions.begin_round(sorted(states), t.global_client, fresh=False)
        self.agent_blocks = {a: t.completions.whole(
            a, {k: v for k, v in s.items() if k.startswith("client/")})
            for a, s in states.items()}
        return t.evaluate_each(self.agent_blocks)

    def checkpoint(self) -> tuple[Arrays, dict[str, Any]]:
        arrays, meta = super().checkpoint()
        blocks = {**self.agent_blocks, **self.to_restore}
        for agent, state in blocks.items():
            arrays.update({f"agents/{agent}/{k}": v for k, v in state.items()})
        return arrays, {**meta, "agents": sorted(blocks)}

    def restore(self, arrays: Arrays, meta: dict[str, Any]) -> None:
        super().restore(arrays, meta)
        t = self.trainer
        for agent in meta.get("agents", []):
            state = {k.split("/", 2)[2]: v for k, v in subset(arrays, f"agents/{agent}").items()}
            problem = t.weights_problem(state, ("client",))
            if problem is not None:
                raise CheckpointError(f"checkpoint block of agent {agent}: {problem}")
            self.to_restore[str(agent)] = state

    def save(self, out_dir: Path) -> None:
        save_arrays(to_arrays(self.trainer.server, "server"), out_dir / "server.safetensors")
        (out_dir / "clients").mkdir(exist_ok=True)
        t = self.trainer  # a client never selected holds no bundle, so no block to save
        held = [a for a in t.engine.registry.eligible() if not t.needs_bundle(a)]
        for agent, state in t.pull(held).items():
            save_arrays(t.completions.whole(agent, state),
                         out_dir / "clients" / f"{agent}.safetensors")

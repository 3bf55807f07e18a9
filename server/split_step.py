"""One parallel split-learning step over any engine: agents run their client blocks, the
server trains its block on the concatenated activations and returns each agent its slice of
the activation gradient (the step PSL, SplitFed V2 and SCALA are built from)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from jetsplit.protocol import Kind
from server.engine import Command, Engine


@dataclass
class StepReport:
    """What one step did: its loss, who took part, and who was dropped and why."""

    round: int
    step: int
    loss: float
    agents: list[str]
    samples: int
    missed: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"round": self.round, "step": self.step,
                "loss": None if math.isnan(self.loss) else self.loss,
                "agents": self.agents, "samples": self.samples, "missed": self.missed}


def split_step(
    engine: Engine,
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Mapping[str, int],
    *,
    round: int,
    step: int,
    deadline_s: float,
    codec: str = "fp32",
    compression: str = "none",
) -> StepReport:
    """Forward on every agent in `batches`, one server update, backward to those that
    answered; an agent missing the forward is left out of the update."""
    forward = {agent: Command(Kind.FORWARD.value,
                              {"batch": batch, "codec": codec, "compression": compression})
               for agent, batch in batches.items()}
    out = engine.send_and_receive(forward, round=round, step=step, deadline_s=deadline_s)
    agents = out.agents
    if not agents:
        return StepReport(round, step, math.nan, [], 0, out.missed)
    acts = [torch.from_numpy(np.array(out[a].tensors["activations"], dtype=np.float32))
            for a in agents]
    labels = torch.cat([torch.from_numpy(np.array(out[a].tensors["labels"], dtype=np.int64))
                        for a in agents])
    stacked = torch.cat(acts).requires_grad_(True)
    server.train()
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(server(stacked), labels)
    loss.backward()
    optimizer.step()
    assert stacked.grad is not None
    grads = stacked.grad.split([len(a) for a in acts])
    backward = {agent: Command(Kind.BACKWARD.value, {}, {"grad": grad.numpy()}, codec=codec,
                               compression=compression)
                for agent, grad in zip(agents, grads, strict=True)}
    back = engine.send_and_receive(backward, round=round, step=step, deadline_s=deadline_s)
    return StepReport(round, step, float(loss.detach()), agents, int(len(labels)),
                      {**out.missed, **back.missed})

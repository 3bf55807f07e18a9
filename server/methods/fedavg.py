"""FedAvg: the whole model trains on each device; the baseline without a split."""

from __future__ import annotations

import math

import numpy as np

from jetsplit.models.weights import from_arrays, load_strict, to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.engines.seam import Command
from jetsplit.server.methods.base import Method


class FedAvg(Method):
    """FedAvg: the whole model trains on each device for T local steps; client and server
    parts are averaged (weights |D_k|) at round end."""

    name = "fedavg"
    loss_tier = "device"

    def run_round(self, selected: list[str]) -> float | None:
        t = self.trainer
        live = t.live(selected)
        global_state = {**t.global_client, **to_arrays(t.server, "server")}
        if t.round > 0:
            live = t.push(live, global_state)
        # a device whose uploads the direction check or the outlier bound leaves out only
        # probes (it is judged on its next upload): its share of B goes to the devices whose
        # work counts
        batches = t.defences.batches(live, t.defences.left_out("model", live))
        commands = {a: Command(Kind.TRAIN.value, {"target": "full", "batch": batches[a],
                                                  "steps": t.settings.local_steps,
                                                  "lr": t.client_optimizer.lr},
                            work=batches[a] * t.settings.local_steps)  # cutoff: its share
                    for a in live}
        with t.books.timed("local_train"):
            out = t.books.note(t.engine.send_and_receive(
                commands, round=t.round, deadline_s=t.step_deadline(Kind.TRAIN.value)))
        losses = []
        for agent, reply in out.replies.items():
            samples, loss = reply.meta.get("samples"), reply.meta.get("loss")
            if isinstance(samples, int) and isinstance(loss, float) and math.isfinite(loss):
                t.books.full_samples[agent] += samples
                losses.append(loss)
        # each device drops its model as it uploads it (a simulation then holds one copy
        # of each, not the device's and the upload's)
        states = t.pull(out.agents, ("client", "server"), release=True)
        t.require_update(selected, states)
        if states:
            with t.books.timed("aggregate"):
                merged = t.defences.aggregate(states, t.defences.sizes(sorted(states)),
                                              reference=global_state, block="model")
            t.global_client = {k: v for k, v in merged.items() if k.startswith("client/")}
            load_strict(t.server, from_arrays(merged, "server"), "server average")
        return float(np.mean(losses)) if losses else None

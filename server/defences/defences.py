"""`Defences`: the one owner of every defence's state, on the data path of a round.

Like a filter chained on the data going in and out, never wired into the controller: a
method hands it a step's replies to screen, a step's per-device numbers (losses, gradient
norms) to weigh, and a round's uploads to combine; it caps the size claims every weight and
batch share rests on. The trainer keeps the exchanges, cuts and books and holds one
`Defences` (`trainer.defences`), built from the run's settings; what it remembers across a
resume is read and written by server/defences/memory.py.

Everything here takes plain values (agent names, tensors, floats): the math modules of the
methods never see a closure into the coordinator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jetsplit.server.defences.aggregators import Arrays, aggregate
from jetsplit.server.defences.label_check import PROBE_BATCH, LabelConsistency
from jetsplit.server.defences.sitting_out import Bench
from jetsplit.server.defences.size_claims import ClaimBooks, LabelTally, registered_size
from jetsplit.server.defences.step_bounds import (
    LOSS_FLOOR,
    ActivationBound,
    LossBound,
    StepGradientBound,
    gradient_norm,
    gradient_shares,
)
from jetsplit.server.defences.update_direction import UpdateDirection

if TYPE_CHECKING:  # torch loads with the first step, not with the settings
    import torch

MIN_CLIENT_BATCH = 2  # BatchNorm in training mode needs more than one value per channel


class Registrations(Protocol):
    """What the defences read of the fleet's registry (server/engines/registry.py)."""

    def registration(self, agent: str) -> dict[str, Any]: ...

    def client_claims(self) -> dict[str, int]: ...


class Defences:
    """Every defence's state, and the operations a method calls on the data path."""

    def __init__(self, settings: Any, classes: int, registry: Registrations, books: Any, *,
                 fixed_batch: int | None = None) -> None:
        """`settings`: the run's settings record (server/training/settings.py; the defences
        read its `[train]` fields by name, declared there once); `books`: the round's books
        (server/training/round_books.py), where every verdict is noted, cleared by the
        round loop, never replaced; `fixed_batch`: a fixed per-client batch, where one is
        set (server/training/optimisers.client_batch)."""
        self.settings, self.registry, self.books = settings, registry, books
        self.fixed_batch = fixed_batch
        self.bench = Bench(settings.max_misses)  # who keeps missing deadlines sits out
        self.activation_bound = ActivationBound(settings.activation_bound)
        self.loss_bound = LossBound(  # a fitted device is no outlier, however small the median
            settings.loss_bound, floor=LOSS_FLOOR * math.log(classes))
        self.step_gradient_bound = StepGradientBound(settings.gradient_bound)  # SplitFed V2
        self.claims = ClaimBooks(settings.provisioned_sizes)  # |D_k| as weights, capped
        # the labels each device sent, against the histogram it registered
        self.labels = LabelTally(classes, settings.histogram_check == "on")
        # whose labels do not fit their activations (server/defences/label_check.py)
        self.consistency = LabelConsistency(classes, settings.label_check == "on", settings.seed)
        # whose uploads pull against the fleet's (server/defences/update_direction.py)
        self.direction = UpdateDirection(settings.direction_check == "on")
        # block → the devices the outlier bound left out of its latest average
        self.outliers: dict[str, frozenset[str]] = {}

    # ------------------------------------------------------------------ a step

    def screen(self, agents: list[str], acts: list[torch.Tensor], labels: list[torch.Tensor]
               ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """A step's inputs as the server update may use them: each sample's activation norm
        bounded against the fleet's (server/defences/step_bounds.py), the label check shown
        them, and then only the `trusted` ones."""
        acts = self.activation_bound.apply(agents, acts, self.books.bounded,
                                           self.books.activation_scale)
        self.consistency.observe(agents, acts, labels)
        return self.trusted(agents, acts, labels)

    def trusted(self, agents: list[str], acts: list[torch.Tensor], labels: list[torch.Tensor]
                ) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """This step's inputs without the devices whose labels do not fit their activations
        (server/defences/label_check.py): they sit out the server update and get no
        gradient (their forwards still come, so they are judged again each step); noted
        per round."""
        excluded = self.consistency.excluded(agents)
        if not excluded:
            return agents, acts, labels
        books = self.books
        for agent in excluded:
            books.excluded_steps[agent] = books.excluded_steps.get(agent, 0) + 1
            books.excluded[agent] = (f"{books.excluded_steps[agent]} steps left out of the "
                                     f"server update, last: {self.consistency.inconsistent[agent]}")
        kept = [i for i, a in enumerate(agents) if a not in excluded]
        return [agents[i] for i in kept], [acts[i] for i in kept], [labels[i] for i in kept]

    @property
    def weighs_losses(self) -> bool:
        """Whether the loss bound is on (`loss_bound = 0`: nothing is even measured)."""
        return self.loss_bound.factor > 0

    def loss_weights(self, agents: list[str], losses: Sequence[float]) -> list[float] | None:
        """For a shared server block's step over `agents`, given each device's loss: the
        weights of their terms, a device far above the fleet's loss down-weighted and noted
        (step_bounds.LossBound); None: all 1, the unweighted step."""
        if not self.weighs_losses:
            return None
        return self.loss_bound.weights(agents, list(losses), self.books.down_weighted,
                                       self.books.down_weighted_steps)

    @property
    def measures_shares(self) -> bool:
        """Whether a shared step whose per-device gradients are not otherwise computed
        (SCALA's family, PSL) measures each device's share of the server gradient: only
        under `[train] gradient_shares = "all"`, since that costs one backward per device."""
        return self.settings.gradient_bound > 0 and self.settings.gradient_shares == "all"

    def share_weights(self, agents: list[str], norms: torch.Tensor | Sequence[float]
                      ) -> list[float] | None:
        """Per device, the weight that keeps its share of the server gradient (`norms`, its
        own term's gradient norm) within `gradient_bound` × the step's median; None: all 1
        (step_bounds.gradient_shares). One host read of the norms."""
        if self.settings.gradient_bound <= 0:
            return None
        values = norms.detach().tolist() if hasattr(norms, "detach") else list(norms)
        return gradient_shares(agents, values, self.settings.gradient_bound,
                               self.books.gradient_clipped, self.books.gradient_clipped_steps)

    def step_gradient_weight(self, agent: str, grads: list[torch.Tensor]) -> float | None:
        """SplitFed V2 (one device per step): the weight that keeps this step's server
        gradient norm (over `grads`) within `gradient_bound` × the recent steps' median
        (step_bounds.StepGradientBound); None: 1. One host read. Only under
        `[train] gradient_shares = "all"` (docs/results.md: under the default it would clip
        honest devices' first steps after the block fitted the one before)."""
        if (self.step_gradient_bound.factor <= 0 or not grads
                or self.settings.gradient_shares != "all"):
            return None
        weights = self.step_gradient_bound.weights(
            [agent], [gradient_norm(grads)], self.books.gradient_clipped,
            self.books.gradient_clipped_steps)
        return None if weights is None else weights[0]

    def prior_counts(self, agent: str) -> Any:
        """The label counts behind agent's P_k (SCALA eq. 15): the histogram it registered,
        or the labels it sent once those show the claim wrong (size_claims.LabelTally)."""
        dataset = self.registry.registration(agent).get("dataset") or {}
        return self.labels.prior_counts(agent, dataset.get("label_histogram"))

    # ------------------------------------------------------------------ sizes

    def claimed_sizes(self, agents: list[str]) -> dict[str, int]:
        """|D_k| as each agent registered it, uncapped: for its own work only (an Ampere
        epoch's steps, the rows of its upload), where a lie costs nobody but the liar."""
        return {a: registered_size(self.registry.registration(a)) or 0 for a in agents}

    def sizes(self, agents: list[str]) -> dict[str, int]:
        """|D_k| as weights (every average, batch shares): each registered claim at most
        its provisioned size and at most `size_cap` × the median claim of the fleet's
        clients (server/defences/size_claims.py)."""
        return self.claims.weights(self.claimed_sizes(agents), self.registry.client_claims(),
                                   self.settings.size_cap)

    def batches(self, agents: list[str], left_out: set[str] | frozenset[str] = frozenset()
                ) -> dict[str, int]:
        """B_k = B·|D_k| / Σ_j |D_j| over the capped sizes (at least 2: BatchNorm in
        training mode needs more than one value per channel, and SplitFed V2 serves one
        client's batch alone): SCALA's size-proportional batches; or the fixed per-client
        batch where one is set. A device whose labels do not fit its activations takes no
        share of B, only a probe of PROBE_BATCH samples (server/defences/label_check.py):
        its share goes to the devices whose work counts, and it is judged again. So does a
        device in `left_out`: one whose work this round cannot count (FedAvg: its model
        uploads are left out by the direction check or the outlier bound, `left_out()`,
        and its upload is all it contributes; in a split method its activations still
        train the server block)."""
        if self.fixed_batch is not None:
            return dict.fromkeys(agents, self.fixed_batch)
        sizes = self.sizes(agents)
        probing = self.consistency.excluded(agents) | (set(left_out) & set(agents))
        if len(probing) == len(agents):  # never all of them
            probing = set()
        total = sum(n for a, n in sizes.items() if a not in probing) or 1
        return {a: PROBE_BATCH if a in probing
                else max(MIN_CLIENT_BATCH, round(self.settings.batch * sizes[a] / total))
                for a in agents}

    # ------------------------------------------------------------------ uploads

    def aggregate(self, states: Mapping[str, Arrays], weights: Mapping[str, float], *,
                  reference: Arrays | None = None, block: str = "client",
                  uploaded: bool = True) -> Arrays:
        """The blocks devices uploaded, combined by `[train] aggregator`
        (server/defences/aggregators.py) layer by layer; `reference` is the block they
        started from. What the rule did to a device (clipped, left out) goes into this
        round's books, named by `block` (a round may combine several: client blocks, server
        copies, aux heads). `uploaded` False: the coordinator trained these blocks itself
        (SplitFed V1's and Ampere's server copies), so no device can have reversed them,
        and the direction check skips them (a label-skewed device's copy honestly points
        away from the median: docs/results-robustness.md#reversed-updates-the-direction-check)."""
        s, notes = self.settings, {}
        excluded = self.consistency.excluded(sorted(states))
        for agent in excluded:  # labels that do not fit its activations: so may its upload
            notes[agent] = f"left out: {self.consistency.inconsistent[agent]}"
        if uploaded:
            self.direction.observe(block, states, reference)
        opposed = self.direction.excluded(block, sorted(set(states) - excluded))
        for agent in opposed:  # an update reversed against the fleet's
            notes[agent] = f"left out: {self.direction.opposed[block, agent]}"
        excluded |= opposed
        for agent in excluded:  # a share of 0 over every float parameter it uploaded
            self.books.influence.add({agent: 0.0}, sum(
                int(v.size) for v in states[agent].values() if v.dtype.kind == "f"))
        states = {a: v for a, v in states.items() if a not in excluded}
        outliers: set[str] = set()
        merged = aggregate(states, weights, s.aggregator, reference=reference, notes=notes,
                           shares=self.books.influence, clip_factor=s.clip_factor,
                           robust_fraction=s.robust_fraction, outlier_bound=s.outlier_bound,
                           outliers=outliers)
        self.outliers[block] = frozenset(outliers)
        books = self.books.aggregation
        for agent, note in sorted(notes.items()):
            books[agent] = "; ".join(filter(None, (books.get(agent), f"{block}: {note}")))
        return merged

    def left_out(self, block: str, agents: list[str]) -> set[str]:
        """Those of `agents` whose next upload of `block` is not expected to count: opposed
        by the direction check, or left out of the block's latest average by the outlier
        bound (a verdict each upload renews: one back under the bound counts again)."""
        return self.direction.excluded(block, agents) | (
            set(self.outliers.get(block, ())) & set(agents))

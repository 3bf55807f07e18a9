"""The method catalog: what each training method is, in one place.

Config validation, the CLI's choices, the split planner, the bundle roles, the optimiser
presets and the coordinator's method factory all read this table; nothing else names a
method. It imports neither torch nor the coordinator, so the planner (``jetsplit export
plan``) and the device side can read it. Adding a method is one file under
``server/methods/`` plus one entry here.

A method's implementation is named as ``"module:Class"`` under ``jetsplit.server.methods``
and loaded only by the coordinator (``jetsplit.server.methods.build_method``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Tuple

from jetsplit.errors import ConfigError

# What a client device runs (the bundle role it is shipped).
CLIENT_BLOCK = "client"  # the client block alone
CLIENT_AND_AUX = "aux"  # the client block with its auxiliary head (Ampere)
WHOLE_MODEL = "full"  # the whole model (FedAvg)
CLIENT_CONTENTS = (CLIENT_BLOCK, CLIENT_AND_AUX, WHOLE_MODEL)

PRESETS = ("default", "paper")


@dataclass(frozen=True)
class PslOptions:
    """PSL and GAPSL: their server loss over the clients, ``"mean"`` or the papers' ``"sum"``
    (GAPSL eq. 8); None: the preset's."""

    psl_reduction: Optional[str] = None


@dataclass(frozen=True)
class GapslOptions(PslOptions):
    """GAPSL (§III): selection-ratio bounds, alignment weight λ, threshold width η."""

    k_min: float = 0.2
    k_max: float = 0.8
    lam: float = 5e-4
    eta: float = 1.0


@dataclass(frozen=True)
class AmpereOptions:
    """Ampere (§3.3): phase 1 ends after ``patience`` epochs without a better validation
    accuracy or after N_d = ``device_epochs`` (None: half the rounds, so that the server
    block gets the other half); phase 2 uploads activations in replies of at most
    ``upload_mb`` into a store of at most ``activation_gb`` in ``activation_dir``; the
    server trains N_s = ``server_epochs`` epochs at batch B(s) = ``server_batch``."""

    patience: int = 5
    device_epochs: Optional[int] = None
    validation_fraction: float = 0.2
    upload_mb: float = 8.0
    activation_dir: Optional[str] = None
    activation_gb: float = 64.0
    server_batch: Optional[int] = None
    server_epochs: Optional[int] = None


@dataclass(frozen=True)
class SherlOptions:
    """SHeRL-FL: edge aggregation every ``tau1`` iterations, cloud every ``tau2`` (None: once
    per round), the edge's contrastive ``margin``, the edge and cloud tiers' learning rates,
    which clients each edge serves and k2 = ``edge_split``, the first cloud layer."""

    tau1: Optional[int] = None
    tau2: Optional[int] = None
    margin: float = 0.5
    edge_lr: Optional[float] = None
    cloud_lr: Optional[float] = None
    edges: Mapping[str, Any] = field(default_factory=dict)
    edge_split: Optional[int] = None


@dataclass(frozen=True)
class NoOptions:
    """A method with no options of its own."""


@dataclass(frozen=True)
class MethodEntry:
    """One training method: its name, what it moves and trains, and its defaults."""

    name: str
    summary: str
    implementation: str  # "module:Class" under jetsplit.server.methods
    splits: bool = True  # False: the whole model trains on the device (FedAvg)
    tiers: int = 2  # 3: client, edge and cloud (SHeRL-FL)
    client_content: str = CLIENT_BLOCK  # what a client device runs (CLIENT_CONTENTS)
    common_cut: bool = False  # every device must train at one common cut
    # The two-tier planner costs it as this sibling with the same traffic (None: itself;
    # three-tier methods are planned by the coordinator from its agents' profiles).
    planner_proxy: Optional[str] = None
    # What it moves, as far as the planner's cost model is concerned.
    per_iteration_exchange: bool = True  # activations up, gradients down every iteration
    aggregates_clients: bool = True  # client blocks FedAvg-ed: model exchange every round
    shares_server_block: bool = True  # one server block trained on every device's activations
    aux_head: bool = False  # client block trained with a local auxiliary head
    one_shot_activations: bool = False  # every activation uploaded once (Ampere phase 2)
    options: type = NoOptions  # the method's own [train] options
    # Per preset ("default": trains the shipped models on the shipped data; "paper": the
    # paper's own settings, where it states them): general settings this method overrides.
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def planned_as(self) -> str:
        """The catalog entry the two-tier planner costs this method as."""
        return self.planner_proxy or self.name

    @property
    def replans(self) -> bool:
        """Whether live re-planning may move its devices' cuts between rounds
        (server/cuts/replanning.py): split methods with per-device cuts (Ampere in its device
        phase only, its method says when). FedAvg and SHeRL-FL train one common cut."""
        return self.splits and not self.common_cut

    @property
    def replan_note(self) -> str:
        """Why a method keeps its cuts (empty where it re-plans)."""
        return "" if self.replans else "one common cut for every device"

    @property
    def reduces_server_loss(self) -> bool:
        """Whether its server loss combines the clients' losses by ``psl_reduction``."""
        return issubclass(self.options, PslOptions)

    def option_names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(self.options))

    def options_from(self, settings: Any) -> Any:
        """This method's own options, as its dataclass, read from a run's settings (which
        carry every method's options flat, as server.toml's [train] does)."""
        return self.options(**{n: getattr(settings, n) for n in self.option_names()
                               if hasattr(settings, n)})

    def preset(self, name: str) -> Mapping[str, Any]:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return self.presets.get(name, {})


_SHERL_PAPER = {"optimizer": "adam", "momentum": 0.0, "client_lr": 1e-3, "edge_lr": 1e-3,
                "cloud_lr": 1e-3}
_GAPSL_PAPER = {"optimizer": "sgd", "momentum": 0.9, "client_lr": 0.005, "server_lr": 0.01,
                "client_batch": 128, "psl_reduction": "sum"}
#: PSL's and GAPSL's default rate, where the others take `lr`'s 0.01: their client blocks
#: are never averaged, so each steps on one device's data alone. A sweep on a validation
#: split (benchmarks/gapsl_vs_psl.py) found it GAPSL's best and close to PSL's, and one rate
#: keeps the two differing in the method alone
#: (docs/results.md#gapsl-vs-psl-each-at-its-swept-learning-rate).
_PSL_LR = 0.003
#: SplitFed V2's default rate (both variants). Its one server block steps on each client in
#: turn; under dirichlet:0.1 a client holds about one class, and at 0.01 one step on it can
#: send the next client's loss up by orders of magnitude, which the divergence guard stops.
#: The same sweep found it V2-interleaved's best and as good as V2's, and no run at it
#: diverged (docs/results.md#splitfed-v2s-rate-sweep).
_SPLITFED_V2_LR = 0.003

#: Every method, in the order the CLI lists them. Presets: GAPSL's paper (§IV-A, VGG-16 on
#: CIFAR-10) trains with SGD, momentum 0.9, client lr 0.005, server lr 0.01, 128 samples per
#: client and L_g a sum over clients (eq. 8), as PSL's L. SHeRL-FL's paper trains every tier
#: with Adam; its learning-rate value is lost in the text, 1e-3 is Adam's customary default.
#: By default PSL and GAPSL step their server block on the clients' mean loss, so the step
#: does not grow with the number of clients (the paper's sum with momentum 0.9 diverged on
#: AlexNet/MNIST: docs/results.md), and GAPSL trains like PSL (plain SGD at
#: _PSL_LR, B_k ∝ |D_k|) so the two differ in the method alone. The other papers' settings
#: are for their own models and data and are left to the general settings.
METHODS: Dict[str, MethodEntry] = {e.name: e for e in (
    MethodEntry("fedavg", "whole model on the device; model exchange only",
                "fedavg:FedAvg", splits=False, client_content=WHOLE_MODEL, common_cut=True,
                per_iteration_exchange=False, shares_server_block=False),
    MethodEntry("splitfed-v1", "per-client server copies; client+server FedAvg each round",
                "splitfed:SplitFedV1"),
    MethodEntry("splitfed-v2", "one server block, clients in turn; client FedAvg each round",
                "splitfed:SplitFedV2", presets={"default": {"lr": _SPLITFED_V2_LR}}),
    MethodEntry("splitfed-v2-interleaved", "SplitFed V2 with clients interleaved per "
                "iteration", "splitfed:SplitFedV2Interleaved", planner_proxy="splitfed-v2",
                presets={"default": {"lr": _SPLITFED_V2_LR}}),
    MethodEntry("psl", "one server block; client blocks never aggregated", "psl:PSL",
                aggregates_clients=False, options=PslOptions,
                presets={"default": {"psl_reduction": "mean", "lr": _PSL_LR},
                         "paper": {"psl_reduction": "sum"}}),
    MethodEntry("scala", "concatenated activations, logit adjustment; client FedAvg",
                "scala:SCALA"),
    MethodEntry("ca-sfl", "SCALA without logit adjustment", "scala:CASFL",
                planner_proxy="scala"),
    MethodEntry("lla-sfl", "SplitFed V1 with local logit adjustment", "scala:LLASFL",
                planner_proxy="splitfed-v1"),
    MethodEntry("lla-sfl-shared", "LLA-SFL's loss on one shared server block",
                "scala:LLASFLShared", planner_proxy="scala"),
    MethodEntry("gapsl", "PSL with gradient-agreement selection; no client aggregation",
                "gapsl:GAPSL", aggregates_clients=False, options=GapslOptions,
                presets={"default": {"psl_reduction": "mean", "lr": _PSL_LR},
                         "paper": _GAPSL_PAPER}),
    MethodEntry("ampere", "client block + aux head trained locally, FedAvg per epoch; "
                "activations uploaded once", "ampere:Ampere", client_content=CLIENT_AND_AUX,
                per_iteration_exchange=False, aux_head=True, one_shot_activations=True,
                options=AmpereOptions),
    MethodEntry("ampere-noconsolidation", "Ampere without the consolidation step",
                "ampere:AmpereNoConsolidation", client_content=CLIENT_AND_AUX,
                planner_proxy="ampere", options=AmpereOptions),
    MethodEntry("sherl", "three tiers: client, edge (contrastive loss), cloud head",
                "sherl:SHeRL", tiers=3, common_cut=True, options=SherlOptions,
                presets={"default": _SHERL_PAPER, "paper": _SHERL_PAPER}),
)}

#: What `jetsplit trial`, `simulate` and `server.toml` train when no method is named.
DEFAULT_METHOD = "scala"
#: The SplitFed family's reference: what the planner costs a fleet as when asked for none.
REFERENCE_SPLIT_METHOD = "splitfed-v1"
NAMES: Tuple[str, ...] = tuple(METHODS)
CHOICES = ", ".join(NAMES)


def method(name: str) -> MethodEntry:
    """The catalog entry called `name`, or a one-line error listing the choices."""
    entry = METHODS.get(name)
    if entry is None:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {CHOICES}")
    return entry


def three_tier(name: str) -> bool:
    """Whether `name` trains over client, edge and cloud tiers (edge agents needed)."""
    return method(name).tiers == 3


def foreign_options(name: str, given: Mapping[str, Any]) -> Tuple[str, ...]:
    """The options in `given` that belong to some method other than `name` (a config that
    sets GAPSL's `k_min` while training SCALA is a mistake worth one line)."""
    own = set(method(name).option_names())
    everyone: Dict[str, None] = {}
    for entry in METHODS.values():
        everyone.update(dict.fromkeys(entry.option_names()))
    return tuple(o for o in given if o in everyone and o not in own)


def owners(option: str) -> Tuple[str, ...]:
    """The methods that take `option` as their own (empty for a general option)."""
    return tuple(n for n, e in METHODS.items() if option in e.option_names())

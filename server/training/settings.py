"""How a run trains: one frozen record the round loop, the trainer and the methods read.

Built by every launcher (server.toml's [train] via `ServerConfig.settings()`, `jetsplit
simulate`'s flags, a trial's spec); names as in docs/methods.md. The options that belong to
one method alone are declared with that method in the catalog (jetsplit/catalog.py), which
also rejects them in a config that trains another method.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jetsplit.catalog import DEFAULT_METHOD
from jetsplit.server.defences.aggregators import (
    DEFAULT_CLIP_FACTOR,
    DEFAULT_OUTLIER_BOUND,
    DEFAULT_ROBUST_FRACTION,
)
from jetsplit.server.defences.size_claims import DEFAULT_SIZE_CAP
from jetsplit.server.defences.step_bounds import (
    DEFAULT_ACTIVATION_BOUND,
    DEFAULT_GRADIENT_BOUND,
    DEFAULT_LOSS_BOUND,
)


@dataclass(frozen=True)
class Settings:
    """How to train; names as in docs/methods.md (T local steps, fraction r, total batch B)."""

    algorithm: str = DEFAULT_METHOD  # a name in the method catalog
    rounds: int = 10
    local_steps: int = 10
    fraction: float = 1.0
    batch: int = 64  # B: per iteration over all selected agents, B_k ∝ |D_k|
    lr: float | None = None  # None: the method's preset rate (server/training/optimisers.py)
    seed: int = 0
    deadline_s: float = 60.0
    bundle_deadline_s: float = 300.0
    retry_s: float = 30.0  # MQTT: silence before a command is re-sent (then backs off)
    # How device uploads are combined (server/defences/aggregators.py): mean | clipped | median |
    # trimmed-mean | multi-krum; `clip_factor` (clipped), `robust_fraction` β (trimmed
    # share at each end, multi-krum's assumed attackers).
    aggregator: str = "mean"
    clip_factor: float = DEFAULT_CLIP_FACTOR
    robust_fraction: float = DEFAULT_ROBUST_FRACTION
    outlier_bound: float = DEFAULT_OUTLIER_BOUND  # × the median update norm: left out; 0 off
    activation_bound: float = DEFAULT_ACTIVATION_BOUND  # × the fleet's median norm; 0 off
    loss_bound: float = DEFAULT_LOSS_BOUND  # × the fleet's median device loss; 0 off
    gradient_bound: float = DEFAULT_GRADIENT_BOUND  # × the median gradient share; 0 off
    gradient_shares: str = "free"  # all: SCALA/PSL (a backward per device), SplitFed V2
    max_misses: int = 3  # deadline misses in a row before an agent sits out (0: never)
    size_cap: float = DEFAULT_SIZE_CAP  # |D_k| weighs at most this × the median claim
    # |D_k| weighs at most the size provisioned for that device (`jetsplit provision --size`)
    provisioned_sizes: dict[str, int] = field(default_factory=dict)
    histogram_check: str = "on"  # a label histogram the labels sent disprove is replaced
    label_check: str = "on"  # a device whose labels do not fit its activations weighs 0
    direction_check: str = "on"  # a device whose updates oppose the fleet's weighs 0
    codec: str = "fp32"
    compression: str = "none"
    # GAPSL (the GAPSL paper §III): selection-ratio bounds, alignment weight λ, threshold width η.
    k_min: float = 0.2
    k_max: float = 0.8
    lam: float = 5e-4
    eta: float = 1.0
    # PSL's L and GAPSL's L_g: "mean" over the clients or their "sum" (eq. 8); unset: the
    # preset's (server/training/optimisers.py). `preset`: "default" (what trains the shipped
    # models) or
    # "paper" (the papers' own settings, for their models).
    psl_reduction: str | None = None
    preset: str = "default"
    # Ampere (the Ampere paper §3.3): phase 1 ends after `patience` epochs without a better
    # validation accuracy of client+aux, or after N_d = `device_epochs`; the validation part
    # is carved from the coordinator's held-out split. Phase 2 uploads activations in
    # replies of at most `upload_mb` into a store bounded by `activation_gb`, kept in
    # `activation_dir` (default: a folder per run in the system temp dir, removed at the end).
    patience: int = 5
    device_epochs: int | None = None  # None: half the rounds
    validation_fraction: float = 0.2
    upload_mb: float = 8.0
    activation_dir: str | None = None
    activation_gb: float = 64.0
    # SHeRL-FL (the SHeRL-FL paper): edges FedAvg their clients every `tau1` iterations and the
    # cloud FedAvg-s the edge tier every `tau2` (None: once per round, after iteration T);
    # `margin` m of the edge's contrastive loss; `edges` maps edge → clients (empty:
    # round-robin over the registered edges); `edge_split` k2 is the first cloud layer
    # (None: the planner picks it from the agents' profiles).
    tau1: int | None = None
    tau2: int | None = None
    margin: float = 0.5
    cloud_lr: float | None = None  # SHeRL-FL's cloud head (paper: Adam, 1e-3)
    # Per-tier training (server/training/optimisers.py): unset = the method's paper default, else
    # the
    # general `lr` / plain SGD. `client_batch` fixes every client's batch (GAPSL's 128,
    # Ampere's B(d)) instead of B_k ∝ |D_k|; `server_batch` is Ampere's B(s) (default B);
    # `server_epochs` is Ampere's N_s (default: every round left after phase 1).
    optimizer: str | None = None
    momentum: float | None = None
    weight_decay: float = 0.0
    client_lr: float | None = None
    server_lr: float | None = None
    edge_lr: float | None = None
    client_batch: int | None = None
    server_batch: int | None = None
    server_epochs: int | None = None
    edges: dict[str, list[str]] = field(default_factory=dict)
    edge_split: int | None = None
    # Live re-planning (server/cuts/replanning.py): "on" moves devices' cuts between rounds when
    # the planner, fed the live estimates, predicts a round `replan_threshold` shorter.
    replan: str = "off"
    replan_threshold: float = 0.2
    replan_clock: str = "measured"  # or "model": emulated agents' stated conditions
    # Where the coordinator computes ([server] in server.toml): device auto|cpu|cuda for the
    # server blocks and evaluation; autocast off|bf16|fp16 on the server block's steps;
    # intra-op torch threads for the coordinator's compute (0: the process's setting).
    device: str = "auto"
    autocast: str = "off"
    threads: int = 0

"""server.toml: the fleet to drive, the model and split, and how to train; validated with
one-line errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetsplit import catalog
from jetsplit.config_io import load_toml_model
from jetsplit.protocol import MAX_SAMPLES
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
from jetsplit.server.training.settings import Settings
from jetsplit.transport.settings import MqttSection

_Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = "alexnet"
    input_shape: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [1, 28, 28], min_length=3, max_length=3)
    classes: Annotated[int, Field(ge=2, le=100_000)] = 10
    # A common cut, or "auto": the fleet planner picks a cut per device from the profiles
    # the agents registered with (the split methods; see server/cuts/planning.py).
    split: Annotated[int, Field(ge=1)] | Literal["auto"] = 2
    # Per-device cuts by agent id or by profile name (agent ids first), e.g.
    # [model.cuts] jetson-nano-4gb = 2, a3 = 5.
    cuts: dict[_Id, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    aux_ratio: Annotated[float, Field(gt=0, le=1)] | None = 0.5
    bundle: str | None = None  # a bundle .tar.gz to ship instead of exporting one


class TrainSection(BaseModel):
    """How to train (names as in docs/methods.md: T local iterations, fraction r, total batch B)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    algorithm: str = catalog.DEFAULT_METHOD  # a name in jetsplit/catalog.py
    rounds: Annotated[int, Field(ge=1, le=100_000)] = 10
    local_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 10
    batch: Annotated[int, Field(ge=1, le=1 << 20)] = 64  # B over all selected agents
    # unset: the method's rate in its preset, else 0.01 (server/training/optimisers.py)
    lr: Annotated[float, Field(gt=0, le=10)] | None = None
    fraction: Annotated[float, Field(gt=0, le=1)] = 1.0
    deadline_s: Annotated[float, Field(gt=0, le=86400)] = 60.0
    bundle_deadline_s: Annotated[float, Field(gt=0, le=86400)] = 300.0
    retry_s: Annotated[float, Field(gt=0, le=86400)] = 30.0  # re-send after silence, backs off
    # A device's registered |D_k| weighs at most size_cap × the fleet's median claim
    # (server/defences/size_claims.py); 0 turns the cap off.
    size_cap: Annotated[float, Field(ge=0, le=1e6)] = DEFAULT_SIZE_CAP
    # [train.provisioned_sizes] a3 = 265: the most samples a device's claim weighs as, as
    # `jetsplit provision --size` wrote them (server/defences/size_claims.py); a device not named
    # keeps
    # only the size cap.
    provisioned_sizes: dict[_Id, Annotated[int, Field(ge=1, le=MAX_SAMPLES)]] = Field(
        default_factory=dict)
    # A registered label histogram the labels the device sends disprove is replaced by
    # those labels' tally (server/claims.LabelTally: SCALA's P_k); "off": always believed.
    histogram_check: Literal["on", "off"] = "on"
    # A device whose labels do not fit its activations (its label-c samples sit nearest the
    # fleet's class c' ≠ c) weighs 0 in the server update and the averages
    # (server/defences/label_check.py); "off": never judged.
    label_check: Literal["on", "off"] = "on"
    # A device whose uploaded updates point away from the fleet's median update (running
    # mean cosine below 0) is left out of the averages (server/defences/update_direction.py).
    direction_check: Literal["on", "off"] = "on"
    # How the blocks devices upload are combined (server/defences/aggregators.py): `clip_factor` ×
    # the median update norm bounds each update under `clipped`; `robust_fraction` β is
    # the share trimmed at each end (`trimmed-mean`) and the assumed attackers
    # (`multi-krum`'s f = ⌊β·n⌋).
    aggregator: Literal["mean", "clipped", "median", "trimmed-mean", "multi-krum"] = "mean"
    # Live re-planning (server/cuts/replanning.py): move cuts between rounds when the planner,
    # fed what the run measures of each device, predicts a round this much shorter.
    replan: Literal["off", "on"] = "off"
    replan_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.2
    # What the re-planner reads: "measured" times, or "model": what each emulated agent
    # states of its conditions (trials; the same switches however busy the machine is).
    replan_clock: Literal["measured", "model"] = "measured"
    clip_factor: Annotated[float, Field(gt=0, le=1000)] = DEFAULT_CLIP_FACTOR
    robust_fraction: Annotated[float, Field(ge=0, lt=0.5)] = DEFAULT_ROBUST_FRACTION
    # A device whose update is over this × the median update norm is left out of that
    # average, whatever the aggregator (server/defences/aggregators.py); 0: never.
    outlier_bound: Annotated[float, Field(ge=0, le=1e6)] = DEFAULT_OUTLIER_BOUND
    # After this many deadline misses in a row an agent sits out 1, 2, 4 … rounds
    # (server/defences/sitting_out.py); 0: never.
    max_misses: Annotated[int, Field(ge=0, le=1_000_000)] = 3
    # Each sample's activation norm at most this × the fleet's median
    # (server/defences/step_bounds.py);
    # 0: no bound.
    activation_bound: Annotated[float, Field(ge=0, le=1e6)] = DEFAULT_ACTIVATION_BOUND
    # A device whose server-block loss is over this × the fleet's median is down-weighted
    # in that step's shared server update (server/defences/step_bounds.py); 0: never.
    loss_bound: Annotated[float, Field(ge=0, le=1e6)] = DEFAULT_LOSS_BOUND
    # Each device's share of the server block's gradient at most this × the step's median
    # share (GAPSL, which computes per-device gradients anyway; the others under
    # `gradient_shares`; server/defences/step_bounds.py); 0: off.
    gradient_bound: Annotated[float, Field(ge=0, le=1e6)] = DEFAULT_GRADIENT_BOUND
    # "all": SCALA's family and PSL measure each device's share too (one backward per device
    # per step), SplitFed V2 bounds each step against the recent steps' (it clips honest
    # devices' first steps under its client-after-client schedule); "free": only where the
    # shares come free (GAPSL computes each device's gradient for its selection).
    gradient_shares: Literal["free", "all"] = "free"
    codec: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    compression: Literal["none", "lz4", "zstd"] = "none"
    k_min: Annotated[float, Field(ge=0, le=1)] = 0.2  # GAPSL
    k_max: Annotated[float, Field(ge=0, le=1)] = 0.8
    lam: Annotated[float, Field(ge=0)] = 5e-4
    eta: Annotated[float, Field(ge=0)] = 1.0
    # PSL/GAPSL server loss (unset: the preset's; default mean, paper the sum of eq. 8)
    psl_reduction: Literal["sum", "mean"] | None = None
    # per-method defaults (server/training/optimisers.py)
    preset: Literal["default", "paper"] = "default"
    patience: Annotated[int, Field(ge=1, le=100_000)] = 5  # Ampere
    device_epochs: Annotated[int, Field(ge=1, le=100_000)] | None = None  # None: rounds // 2
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.2
    upload_mb: Annotated[float, Field(gt=0, le=4096)] = 8.0
    activation_dir: str | None = None
    activation_gb: Annotated[float, Field(gt=0, le=1 << 20)] = 64.0
    tau1: Annotated[int, Field(ge=1, le=1_000_000)] | None = None  # SHeRL-FL
    tau2: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    margin: Annotated[float, Field(gt=0, le=2)] = 0.5
    # Per-tier training (unset: the method's value in the chosen preset, its `default` preset
    # in jetsplit/catalog.py unless `preset = "paper"` selects the papers' settings; else the
    # general lr / optimizer / momentum, plain SGD by default; see docs/methods.md and
    # server/training/optimisers.py).
    cloud_lr: Annotated[float, Field(gt=0, le=10)] | None = None
    optimizer: Literal["sgd", "adam"] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    client_lr: Annotated[float, Field(gt=0, le=10)] | None = None
    server_lr: Annotated[float, Field(gt=0, le=10)] | None = None
    edge_lr: Annotated[float, Field(gt=0, le=10)] | None = None
    client_batch: Annotated[int, Field(ge=1, le=65536)] | None = None  # B(d); GAPSL 128
    server_batch: Annotated[int, Field(ge=2, le=1 << 20)] | None = None  # Ampere's B(s)
    server_epochs: Annotated[int, Field(ge=1, le=100_000)] | None = None  # Ampere's N_s

    @field_validator("algorithm")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in catalog.METHODS:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {catalog.CHOICES}")
        return name

    @model_validator(mode="after")
    def _method(self) -> TrainSection:
        """None of another method's own options set to anything but
        its default (a config written out whole, as a run's config.toml, sets them all)."""
        changed = {name for name in self.model_fields_set
                   if getattr(self, name) != type(self).model_fields[name].default}
        foreign = catalog.foreign_options(self.algorithm, sorted(changed))
        if foreign:
            owners = catalog.owners(foreign[0])
            raise ValueError(f"{foreign[0]} is an option of {' and '.join(owners)}, not of "
                             f"{self.algorithm}")
        return self


class DataSection(BaseModel):
    """The held-out test split the coordinator evaluates on (agents hold the training part
    of the same spec and seed; the test part never leaves the coordinator)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: str = "mnist"
    test_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.2
    seed: Annotated[int, Field(ge=0)] = 0


class TopologySection(BaseModel):
    """SHeRL-FL's tiers: which clients each edge agent serves (empty: round-robin over the
    registered edges) and k2, the first layer the cloud keeps (unset: the planner's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    edges: dict[_Id, list[_Id]] = Field(default_factory=dict)
    edge_split: Annotated[int, Field(ge=2)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> TopologySection:
        from jetsplit.server.fleet.topology import check_shape

        check_shape(self.edges)
        return self


class ServerSection(BaseModel):
    """Where the coordinator computes: its server blocks and evaluation
    (`auto`: CUDA when torch sees a GPU), optional mixed precision on the server block, and
    the intra-op torch threads its compute runs with (0: torch's default for this machine;
    set it to compare runs bit for bit across machines or engines)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    device: Literal["auto", "cpu", "cuda"] = "auto"
    autocast: Literal["off", "bf16", "fp16"] = "off"
    threads: Annotated[int, Field(ge=0, le=1024)] = 0


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    fleet: _Id = "default"
    run: _Id | None = None  # default: run-<UTC timestamp>
    out: str = "runs"
    agents: Annotated[int, Field(ge=1, le=100_000)] = 1  # wait for this many to register
    wait_s: Annotated[float, Field(gt=0, le=86400)] = 120.0
    seed: Annotated[int, Field(ge=0)] = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    mqtt: MqttSection = MqttSection()
    server: ServerSection = ServerSection()
    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    topology: TopologySection = TopologySection()

    def settings(self) -> Settings:
        """The engine-neutral training settings this config describes."""
        return Settings(seed=self.seed, edges=self.topology.edges,
                        edge_split=self.topology.edge_split, **self.server.model_dump(),
                        **self.train.model_dump())


def load_server_config(path: str | Path) -> ServerConfig:
    return load_toml_model(ServerConfig, path, "server config")

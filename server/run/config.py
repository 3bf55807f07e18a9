"""server.toml: the fleet to drive, the model and split, and how to train; validated with
one-line errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetsplit import catalog
from jetsplit.config_io import load_toml_model
from jetsplit.data.image_keys import ImageKeys
from jetsplit.server.training.settings import AgentId, ComputeFields, Settings, TrainFields
from jetsplit.transport.settings import MqttSection

_Id = AgentId


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
    # The network: a zoo name, `module.path:factory`, `torchvision:NAME` or `timm:NAME`
    # (jetsplit/model_source.py); `name` says the same and stays for older configs.
    source: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    # Initial weights (safetensors, or a state dict read with weights_only), by name.
    weights: Annotated[str, Field(min_length=1, max_length=4096)] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        """`source` wins over the default `name`; both given and different is a mistake."""
        if self.source is not None:
            if "name" in self.model_fields_set and self.name != self.source:
                raise ValueError(f"name {self.name!r} and source {self.source!r} differ: "
                                 f"give one")
            self.name = self.source
        return self


class TrainSection(TrainFields):
    """[train]: how to train. The keys are declared once, in server/training/settings.py
    (`TrainFields`); this section reads them strictly and checks them against each other."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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


class DataSection(ImageKeys):
    """What the coordinator evaluates on. In a trial, the held-out split of the public
    dataset the agents hold the rest of (same spec and seed; the test part never leaves the
    coordinator). In a field run (`own = true`), the coordinator's own held-out folder or
    manifest, whole: its class names (or `classes`) are the run's, which devices' own
    folders agree with by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: str = "mnist"
    own: bool = False  # the whole dataset is the held-out set (no split)
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


class ServerSection(ComputeFields):
    """Where the coordinator computes: its server blocks and evaluation
    (`auto`: CUDA when torch sees a GPU), optional mixed precision on the server block, and
    the intra-op torch threads its compute runs with (0: torch's default for this machine;
    set it to compare runs bit for bit across machines or engines)."""

    model_config = ConfigDict(extra="forbid", strict=True)


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

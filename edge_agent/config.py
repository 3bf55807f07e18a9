"""agent.toml: who the agent is, where its broker and data are; validated with one-line
errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Annotated

from jetsplit.config_io import load_toml_model
from jetsplit.edge_agent.attacks import AttackSection
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.transport.settings import MqttSection

_Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class DataSection(BaseModel):
    """Local data: a dataset spec and, for emulated fleets, which shard of it is ours.

    On a real device the dataset is the device's own (`own = true`: a `folder:` or `csv:` of
    its camera's images, all of it trained on). In a trial every agent loads the same public
    dataset and keeps only its partition; the held-out test split (same seed) never reaches
    agents. The image keys say how `folder:`/`csv:` images become model inputs.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    dataset: str = "mnist"
    own: bool = False  # the device's own data: no test split, no partition
    partition: str = "iid"
    clients: Annotated[int, Field(ge=1, le=100_000)] = 1
    index: Annotated[int, Field(ge=0)] = 0
    seed: Annotated[int, Field(ge=0)] = 0
    test_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2
    # The run's class names, in its order: local labels are mapped to them by name.
    classes: Optional[List[Annotated[str, Field(min_length=1, max_length=200)]]] = Field(
        None, min_length=1, max_length=100_000)
    image_size: Optional[Annotated[int, Field(ge=4, le=4096)]] = None
    channels: Optional[Literal[1, 3]] = None
    random_crop: bool = True
    flip: bool = True
    centre_crop: bool = True
    mean: Optional[List[float]] = Field(None, min_length=1, max_length=3)
    std: Optional[List[Annotated[float, Field(gt=0.0)]]] = Field(
        None, min_length=1, max_length=3)
    stats_sample: Annotated[int, Field(ge=1, le=100_000)] = 256
    workers: Optional[Annotated[int, Field(ge=0, le=32)]] = None  # None: from the cores

    @model_validator(mode="after")
    def _own_is_whole(self) -> DataSection:
        if self.own and self.clients > 1:
            raise ValueError("own = true is the device's own data: clients must be 1")
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise ValueError("classes must not repeat a name")
        return self


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    fleet: _Id = "default"
    agent: _Id
    role: Literal["client", "edge"] = "client"
    profile: Optional[str] = None  # bundled profile name or a TOML path
    state_dir: str = "~/.local/state/jetsplit"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: Annotated[int, Field(ge=0, le=256)] = 0  # torch threads; 0 keeps torch's default
    seed: Annotated[int, Field(ge=0)] = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    mqtt: MqttSection = MqttSection()
    data: DataSection = DataSection()
    emulation: Optional[EmulationSection] = None  # trials only: act like a profiled device
    attack: Optional[AttackSection] = None  # tests and benchmarks only: misbehave

    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser() / self.fleet / self.agent


def load_agent_config(path: str | Path) -> AgentConfig:
    return load_toml_model(AgentConfig, path, "agent config")

"""agent.toml: who the agent is, where its broker and data are; validated with one-line
errors naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Annotated

from jetsplit.config_io import load_toml_model
from jetsplit.data.image_keys import ImageKeys
from jetsplit.edge_agent.attacks import AttackSection
from jetsplit.edge_agent.emulation import EmulationSection
from jetsplit.transport.settings import MqttSection

_Id = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class DataSection(ImageKeys):
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
    workers: Optional[Annotated[int, Field(ge=0, le=32)]] = None  # None: from the cores

    @model_validator(mode="after")
    def _own_is_whole(self) -> DataSection:
        if self.own and self.clients > 1:
            raise ValueError("own = true is the device's own data: clients must be 1")
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

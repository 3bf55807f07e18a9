"""What agents and the coordinator say to each other: command kinds and their argument
schemas, shared by both sides so neither can drift.

Command arguments travel in the envelope header's ``meta``; they are untrusted on arrival
and validated against these strict models (bounded numbers, known names only).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from typing_extensions import Annotated

from jetsplit.config_io import validation_message
from jetsplit.errors import JetsplitError

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8")
CodecName = Literal["fp32", "fp16", "bf16", "int8"]
CompressionName = Literal["none", "lz4", "zstd"]
Batch = Annotated[int, Field(ge=1, le=65536)]
AgentId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
# How long a command waits for a peer's direct message that has not arrived yet.
WaitSeconds = Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]
MAX_EDGE_CLIENTS = 4096
LearningRate = Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]


class Kind(str, Enum):
    """Message kinds (the header's `kind`); byte counters are kept per kind."""

    DISCOVER = "discover"  # coordinator → all: please (re-)register
    REGISTER = "register"  # agent → coordinator: who I am, what I have
    PRESENCE = "presence"  # agent, retained: online / offline (last will)
    # Offer a bundle (its manifest): the agent installs it from its file cache, or answers
    # which files (and how many of their bytes) it still lacks; `bundle_part` sends those.
    BUNDLE = "bundle"
    BUNDLE_PART = "bundle_part"
    # A bundle that carries trained weights (Ampere's phase 2): the same handling as
    # `bundle`, but counted as training traffic, not setup.
    TRAINED_BUNDLE = "trained_bundle"
    TRAINED_BUNDLE_PART = "trained_bundle_part"
    FORWARD = "forward"  # run the client block on a local batch, return activations
    BACKWARD = "backward"  # apply the returned gradient to the last forward, step
    TRAIN = "train"  # local training (client block + aux head, or the full model)
    EVAL = "eval"  # accuracy of client+aux or the full model on local data
    GET_WEIGHTS = "get_weights"  # upload block weights
    SET_WEIGHTS = "set_weights"  # replace block weights
    GENERATE = "generate"  # forward-only over local data (ONNX Runtime/TensorRT)
    STATUS = "status"  # health and counters (answered at any time, also when idle)
    SHUTDOWN = "shutdown"  # `jetsplit fleet stop`: reply, then the daemon exits cleanly
    RELEASE = "release"  # free blocks and optimizer state until needed again
    # SHeRL-FL's edge tier (role `edge`): install the edge block (and learn its clients),
    # train it on its clients' smashed data with the contrastive loss; the reply carries the
    # detached embeddings and labels for the cloud.
    EDGE_LOAD = "edge_load"
    EDGE_STEP = "edge_step"
    # Direct agent-to-agent messages (MessageType.PEER on peer/<to>/<from>), never via the
    # coordinator: a client's smashed data (activations + labels) to its edge, and the
    # edge's activation gradients back to each client.
    SMASHED = "smashed"
    GRADIENT = "gradient"


PEER_KINDS = (Kind.SMASHED.value, Kind.GRADIENT.value)


class ProtocolError(JetsplitError):
    """A command's arguments fail their schema (sent back as an ERROR reply)."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class OptimizerArgs(_Args):
    """The client (or edge) optimiser: SGD with optional momentum and weight decay, or Adam
    (SHeRL-FL trains every tier with Adam); momentum is SGD's only."""

    name: Literal["sgd", "adam"] = "sgd"
    lr: LearningRate = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class BundleArgs(_Args):
    """Offer of a bundle: the sha256 of its manifest (sent as tensor `manifest`) and the
    role it is for; the agent refuses a role it does not run."""

    sha256: Sha256
    role: Literal["full", "client", "edge"] = "client"
    optimizer: OptimizerArgs = OptimizerArgs()


class BundlePartArgs(_Args):
    """Bytes [offset, offset+len(data)) of the file with this sha256 and size."""

    sha256: Sha256
    size: Annotated[int, Field(ge=1, le=1 << 40)]
    offset: Annotated[int, Field(ge=0, le=1 << 40)]


class ForwardArgs(_Args):
    """With `edge`, the activations and labels go straight to that edge (a `smashed`
    message on its peer topic) and the reply carries only the sample count."""

    batch: Batch
    codec: CodecName = "fp32"
    compression: CompressionName = "none"
    edge: Optional[AgentId] = None


class BackwardArgs(_Args):
    """With `direct`, the gradient is the one the forward's edge sent on its own (a
    `gradient` message), waited for up to `wait_s`; else it is this command's tensor."""

    forward_step: Optional[Annotated[int, Field(ge=0)]] = None  # default: this message's step
    direct: bool = False
    wait_s: WaitSeconds = 0.0


class TrainArgs(_Args):
    target: Literal["aux", "full"] = "aux"
    steps: Annotated[int, Field(ge=1, le=1_000_000)]
    batch: Batch
    lr: Optional[LearningRate] = None


class EvalArgs(_Args):
    target: Literal["aux", "full"] = "aux"
    batch: Batch = 256


class WeightsArgs(_Args):
    """`release`: drop the blocks once read, as `release` does (the coordinator is about to
    average them away): one exchange instead of two, and the reply's arrays are the blocks'
    own memory rather than copies."""

    blocks: List[Literal["client", "aux", "server", "edge"]] = Field(
        default_factory=lambda: ["client"], min_length=1, max_length=4)
    release: bool = False


class GenerateArgs(_Args):
    """Rows offset…offset+limit of the local data (all of it by default): a big upload goes
    as several replies, so a device never holds the whole encoding at once."""

    batch: Batch = 256
    codec: CodecName = "fp32"
    compression: CompressionName = "none"
    allow_torch: bool = False
    offset: Annotated[int, Field(ge=0)] = 0
    limit: Optional[Annotated[int, Field(ge=1)]] = None


class EdgeLoadArgs(_Args):
    """The edge block is the first `layers` layers of the bundle's server block."""

    layers: Annotated[int, Field(ge=1, le=4096)]
    optimizer: Optional[OptimizerArgs] = None  # the edge tier's (default: the bundle's)
    # The clients assigned to this edge for the round: the only senders of smashed data it
    # accepts (for this run and round).
    clients: List[AgentId] = Field(default_factory=list, max_length=MAX_EDGE_CLIENTS)


class EdgeStepArgs(_Args):
    """Train the edge block on the smashed data `clients` sent this step (in that order,
    waiting up to `wait_s` for late ones); `margin` of the cosine-distance contrastive loss
    (distances lie in [0, 2]). The codec applies to the gradients and the embeddings."""

    clients: List[AgentId] = Field(min_length=1, max_length=MAX_EDGE_CLIENTS)
    margin: Annotated[float, Field(gt=0, le=2, allow_inf_nan=False)] = 0.5
    codec: CodecName = "fp32"
    compression: CompressionName = "none"
    wait_s: WaitSeconds = 0.0


class StatusArgs(_Args):
    logs: Annotated[int, Field(ge=0, le=500)] = 0  # last log lines to include (fleet logs)



_ARGS: dict[str, type[_Args]] = {
    Kind.BUNDLE.value: BundleArgs,
    Kind.TRAINED_BUNDLE.value: BundleArgs,
    Kind.BUNDLE_PART.value: BundlePartArgs,
    Kind.TRAINED_BUNDLE_PART.value: BundlePartArgs,
    Kind.FORWARD.value: ForwardArgs,
    Kind.BACKWARD.value: BackwardArgs,
    Kind.TRAIN.value: TrainArgs,
    Kind.EVAL.value: EvalArgs,
    Kind.GET_WEIGHTS.value: WeightsArgs,
    Kind.SET_WEIGHTS.value: _Args,
    Kind.GENERATE.value: GenerateArgs,
    Kind.STATUS.value: StatusArgs,
    Kind.SHUTDOWN.value: _Args,
    Kind.RELEASE.value: _Args,
    Kind.EDGE_LOAD.value: EdgeLoadArgs,
    Kind.EDGE_STEP.value: EdgeStepArgs,
}

COMMAND_KINDS = tuple(_ARGS)
# Envelope meta keys that route a command rather than parameterise it: `to` lists a
# broadcast's recipients, `cmd` is the command id kept across retransmissions, `re` the
# command id a reply answers.
ROUTING_KEYS = ("to", "cmd", "re")


def parse_args(kind: str, meta: dict[str, Any]) -> _Args:
    """Validate a command's arguments (routing keys excluded); one-line errors."""
    schema = _ARGS.get(kind)
    if schema is None:
        raise ProtocolError(f"unknown command {kind!r}; known: {', '.join(COMMAND_KINDS)}")
    args = {k: v for k, v in meta.items() if k not in ROUTING_KEYS}
    try:
        return schema.model_validate(args)
    except ValidationError as exc:
        raise ProtocolError(validation_message("command", kind, exc)) from None


# The most samples one device may claim: far above any Jetson's local data, and small enough
# that every sum and float conversion of claims stays exact (a claim of 10^400 once stopped
# the coordinator with an OverflowError in the FedAvg weights).
MAX_SAMPLES = 2**31 - 1
Samples = Annotated[int, Field(ge=0, le=MAX_SAMPLES, strict=True)]


class DatasetSummary(BaseModel):
    """What a device says about its data. Every number is bounded, and the histogram must
    add up to the size it claims, over exactly `num_classes` classes: an implausible claim
    costs the device its registration, not the coordinator its run."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=200)]
    size: Samples
    num_classes: Annotated[int, Field(ge=1, le=100_000, strict=True)]
    input_shape: List[Annotated[int, Field(ge=1, le=1 << 16, strict=True)]] = Field(
        max_length=4)
    label_histogram: List[Samples] = Field(max_length=100_000)
    # Image folders and manifests name their classes (in label order): what a run agrees
    # classes by. Array datasets send none.
    classes: Optional[List[Annotated[str, Field(min_length=1, max_length=200)]]] = Field(
        None, max_length=100_000)

    @model_validator(mode="after")
    def _histogram_adds_up(self) -> DatasetSummary:
        if self.classes is not None and (len(self.classes) != self.num_classes
                                         or len(set(self.classes)) != len(self.classes)):
            raise ValueError(f"classes must name each of the {self.num_classes} classes once")
        if len(self.label_histogram) != self.num_classes:
            raise ValueError(f"label_histogram has {len(self.label_histogram)} classes, "
                             f"num_classes says {self.num_classes}")
        total = sum(self.label_histogram)
        if total != self.size:
            raise ValueError(f"label_histogram adds up to {total}, size says {self.size}")
        return self


class Registration(BaseModel):
    """What an agent announces about itself; validated by the coordinator (untrusted)."""

    model_config = ConfigDict(extra="forbid")

    agent: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    role: Literal["client", "edge"]
    version: Annotated[str, Field(max_length=64)]
    zoo_version: Annotated[int, Field(ge=0, le=1_000_000, strict=True)]
    profile: Optional[Dict[str, Any]] = None
    dataset: DatasetSummary
    backends: Dict[str, Any] = Field(default_factory=dict)
    device: Annotated[str, Field(max_length=64)] = "cpu"
    bundle: Optional[Annotated[str, Field(pattern="^[0-9a-f]{64}$")]] = None

    @field_validator("profile")
    @classmethod
    def _profile_is_a_profile(cls, value: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """A profile the planner and the books will read must be a valid, bounded one."""
        if value is not None:
            from jetsplit.profiles import profile_from_dict

            try:
                profile_from_dict(value, source="registration")
            except JetsplitError as exc:
                raise ValueError(str(exc)) from None
        return value


def parse_registration(meta: dict[str, Any]) -> Registration:
    try:
        return Registration.model_validate(meta)
    except ValidationError as exc:
        raise ProtocolError(validation_message("registration", str(meta.get("agent")), exc)
                            ) from None

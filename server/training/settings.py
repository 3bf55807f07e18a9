"""How a run trains: the [train] fields, declared once, and the frozen record built from them.

`TrainFields` is the one declaration of every [train] key: its type, bounds, default and
the help line its command-line flag shows (`Field(description=...)`; the flag itself is
spelled like the key, `local_steps` is `--local-steps`). Everything else derives from it:
server.toml's `[train]` section (server/run/config.py `TrainSection`, which adds the
checks across keys), the flags table (server/run/flags.py), a trial's spec (which keeps
only the keys it was given) and `Settings`, the record the round loop, the trainer and the
methods read. `ComputeFields` does the same for where the coordinator computes ([server]).

Names as in docs/methods.md. The options that belong to one method alone are also named
with that method in the catalog (jetsplit/catalog.py), which rejects them in a config that
trains another method.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jetsplit.catalog import CHOICES, DEFAULT_METHOD
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
from jetsplit.server.defences.step_deadlines import DEFAULT_FLOOR_S, DEFAULT_K, DEFAULT_WINDOW

#: An agent id, as the wire and the fleet books spell it.
AgentId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
_Rate = Annotated[float, Field(gt=0, le=10)]
_Factor = Annotated[float, Field(ge=0, le=1e6)]  # × a fleet median; 0: off
_Seconds = Annotated[float, Field(gt=0, le=86400)]
_Epochs = Annotated[int, Field(ge=1, le=100_000)]
_Switch = Literal["on", "off"]


def _help(default: Any, line: str) -> Any:
    """A field's default and the one help line its flag (and the docs' table) shows."""
    return Field(default, description=line)


class TrainFields(BaseModel):
    """Every [train] key: type, bounds, default and help (T local iterations, fraction r,
    total batch B)."""

    algorithm: str = _help(DEFAULT_METHOD, f"Training method: {CHOICES}.")
    rounds: _Epochs = _help(10, "Training rounds.")
    local_steps: Annotated[int, Field(ge=1, le=1_000_000)] = _help(
        10, "T: iterations per round.")
    batch: Annotated[int, Field(ge=1, le=1 << 20)] = _help(
        64, "B: samples per iteration over all selected agents (B_k ∝ |D_k|).")
    # unset: the method's rate in its preset, else 0.01 (server/training/optimisers.py)
    lr: _Rate | None = _help(None, "Learning rate of every tier without its own (default: "
                                   "the method's, 0.01 for most; docs/methods.md).")
    fraction: Annotated[float, Field(gt=0, le=1)] = _help(
        1.0, "Share of the eligible agents selected per round.")
    deadline_s: _Seconds = _help(60.0, "Seconds an agent has to answer a step.")
    bundle_deadline_s: _Seconds = _help(300.0, "Seconds an agent has to install a bundle.")
    retry_s: _Seconds = _help(30.0, "Seconds of silence before a command is re-sent (then "
                                    "backs off).")
    # A device's registered |D_k| weighs at most size_cap × the fleet's median claim
    # (server/defences/size_claims.py).
    size_cap: _Factor = _help(DEFAULT_SIZE_CAP, "A device's registered sample count weighs at "
                              "most this many times the fleet's median claim (0: no cap).")
    # [train.provisioned_sizes] a3 = 265, as `jetsplit provision --size` writes it
    # (server/defences/size_claims.py); a device not named keeps only the size cap.
    provisioned_sizes: dict[AgentId, Annotated[int, Field(ge=1, le=MAX_SAMPLES)]] = Field(
        default_factory=dict, description="The most samples each named device's claim "
        "weighs as.")
    # A disproved histogram is replaced by the tally of the labels sent (SCALA's P_k).
    histogram_check: _Switch = _help(
        "on", "on | off: a device whose registered label histogram the labels it sends "
              "disprove gets its prior from those labels.")
    # Judged against the fleet's per-class activations (server/defences/label_check.py).
    label_check: _Switch = _help(
        "on", "on | off: a device whose labels do not fit its activations (its samples "
              "labelled c sit nearest the fleet's other classes) weighs 0.")
    # Running mean cosine against the median update (server/defences/update_direction.py).
    direction_check: _Switch = _help(
        "on", "on | off: a device whose uploaded updates point away from the fleet's "
              "median update (running mean cosine below 0) weighs 0 in the averages.")
    # How device uploads are combined (server/defences/aggregators.py); `clip_factor` and
    # `robust_fraction` β (multi-krum's f = ⌊β·n⌋) tune the rules.
    aggregator: Literal["mean", "clipped", "median", "trimmed-mean", "multi-krum"] = _help(
        "mean", "How device uploads are combined: mean (FedAvg's) | clipped | median | "
                "trimmed-mean | multi-krum.")
    # Live re-planning (server/cuts/replanning.py).
    replan: Literal["off", "on"] = _help(
        "off", "on | off: move devices' cuts between rounds when the live estimates predict "
               "a shorter round (trials: on).")
    replan_threshold: Annotated[float, Field(gt=0, lt=1)] = _help(
        0.2, "Re-plan only for a predicted round at least this share shorter.")
    replan_clock: Literal["measured", "model"] = _help(
        "measured", "measured | model: re-plan on measured times, or on what emulated agents "
                    "state of their conditions (same switches on a busy machine).")
    clip_factor: Annotated[float, Field(gt=0, le=1000)] = _help(
        DEFAULT_CLIP_FACTOR, "clipped: each update's norm bounded at this many times the "
                             "median.")
    robust_fraction: Annotated[float, Field(ge=0, lt=0.5)] = _help(
        DEFAULT_ROBUST_FRACTION, "trimmed-mean: share trimmed at each end; multi-krum: "
                                 "assumed attackers' share.")
    # Whatever the aggregator (server/defences/aggregators.py).
    outlier_bound: _Factor = _help(
        DEFAULT_OUTLIER_BOUND, "A device whose update norm is over this many times the "
                               "median is left out of that average (0: never).")
    # Then 1, 2, 4 … rounds out (server/defences/sitting_out.py).
    max_misses: Annotated[int, Field(ge=0, le=1_000_000)] = _help(
        3, "Deadline misses in a row before an agent sits out 1, 2, 4 ... rounds (0: never).")
    # The step deadline follows the fleet: k × the 95th percentile of the last `window` step
    # times of each exchange kind, within [floor, deadline_s] (server/defences/step_deadlines.py).
    deadline_k: Annotated[float, Field(ge=0, le=1000)] = _help(
        DEFAULT_K, "The step deadline is this many times the 95th percentile of the fleet's "
                   "recent step times of that kind, at most --deadline-s (0: always "
                   "--deadline-s).")
    deadline_window: Annotated[int, Field(ge=1, le=100_000)] = _help(
        DEFAULT_WINDOW, "How many recent step times of each kind the deadline follows.")
    deadline_floor_s: _Seconds = _help(
        DEFAULT_FLOOR_S, "The least step deadline (raised to cover the slowest profiled "
                         "device's predicted step and link).")
    # An agent that sat out or missed its last exchange answers a `status` first
    # (server/defences/sitting_out.py).
    probe_deadline_s: _Seconds = _help(
        5.0, "Seconds an agent that sat out or missed its last exchange has to answer the "
             "round-start probe before it is selectable again (in one process; over MQTT "
             "the probe never blocks: it has until the next round's start).")
    # Per-step bounds (server/defences/step_bounds.py).
    activation_bound: _Factor = _help(
        DEFAULT_ACTIVATION_BOUND, "Each sample's activation norm at most this many times the "
                                  "fleet's median (0: no bound).")
    loss_bound: _Factor = _help(
        DEFAULT_LOSS_BOUND, "A device whose server loss is over this many times the fleet's "
                            "median is down-weighted in that step's server update (0: never).")
    gradient_bound: _Factor = _help(
        DEFAULT_GRADIENT_BOUND, "Each device's share of the server gradient at most this many "
        "times the median share (gapsl; the others under --gradient-shares; 0: no bound).")
    # "all" costs one backward per device per step; SplitFed V2 bounds each step against
    # the recent steps' (it clips honest devices' first steps under its schedule).
    gradient_shares: Literal["free", "all"] = _help(
        "free", "free | all: free bounds only gapsl's shares (computed anyway); all also "
                "scala's family and psl (one extra backward per device per step) and "
                "splitfed-v2 (each step against the recent steps').")
    codec: Literal["fp32", "fp16", "bf16", "int8"] = _help(
        "fp32", "Activation/gradient codec: fp32 | fp16 | bf16 | int8.")
    compression: Literal["none", "lz4", "zstd"] = _help(
        "none", "Payload compression: none | lz4 | zstd.")
    # GAPSL (the GAPSL paper §III).
    k_min: Annotated[float, Field(ge=0, le=1)] = _help(
        0.2, "gapsl: lower bound of the selection ratio.")
    k_max: Annotated[float, Field(ge=0, le=1)] = _help(
        0.8, "gapsl: upper bound of the selection ratio.")
    lam: Annotated[float, Field(ge=0)] = _help(5e-4, "gapsl: alignment weight λ.")
    eta: Annotated[float, Field(ge=0)] = _help(1.0, "gapsl: threshold width η.")
    # PSL's L and GAPSL's L_g (eq. 8); unset: the preset's (server/training/optimisers.py).
    psl_reduction: Literal["sum", "mean"] | None = _help(
        None, "psl/gapsl server loss over the clients: mean | sum (the papers').")
    # "default" trains the shipped models; "paper": the papers' settings, for their models.
    preset: Literal["default", "paper"] = _help(
        "default", "Per-method defaults: default | paper (the papers' own settings).")
    # Ampere (the Ampere paper §3.3): phase 1 ends after `patience` epochs without a better
    # validation accuracy of client+aux (carved from the coordinator's held-out split), or
    # after N_d; phase 2 uploads activations into a bounded store (default folder: one per
    # run in the system temp dir, removed at the end).
    patience: _Epochs = _help(5, "ampere: device epochs without a better validation accuracy "
                                 "before phase 2.")
    device_epochs: _Epochs | None = _help(
        None, "ampere: at most this many device epochs (N_d; default: half the rounds).")
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = _help(
        0.2, "ampere: share of the held-out split phase 1 validates on.")
    upload_mb: Annotated[float, Field(gt=0, le=4096)] = _help(
        8.0, "ampere: phase 2's activation replies at most this many MB.")
    activation_dir: str | None = _help(None, "ampere: where phase 2's activations are kept.")
    activation_gb: Annotated[float, Field(gt=0, le=1 << 20)] = _help(
        64.0, "ampere: phase 2's activation store at most this many GB.")
    # SHeRL-FL (the SHeRL-FL paper): edges FedAvg their clients every `tau1` iterations and
    # the cloud FedAvg-s the edge tier every `tau2`.
    tau1: Annotated[int, Field(ge=1, le=1_000_000)] | None = _help(
        None, "sherl: iterations between edge aggregations (default tau2).")
    tau2: Annotated[int, Field(ge=1, le=1_000_000)] | None = _help(
        None, "sherl: iterations between cloud aggregations (default T).")
    margin: Annotated[float, Field(gt=0, le=2)] = _help(
        0.5, "sherl: contrastive margin m on the cosine distance.")
    # Per-tier training (server/training/optimisers.py): unset = the method's value in the
    # chosen preset (jetsplit/catalog.py), else the general lr / optimizer / momentum.
    cloud_lr: _Rate | None = _help(
        None, "sherl: the cloud head's learning rate (default: the preset's).")
    optimizer: Literal["sgd", "adam"] | None = _help(
        None, "sgd | adam (default: the method's preset, else sgd).")
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = _help(
        None, "SGD momentum (default: the method's preset, else 0).")
    weight_decay: Annotated[float, Field(ge=0, le=1)] = _help(0.0, "Weight decay on every tier.")
    client_lr: _Rate | None = _help(
        None, "Client tier learning rate (default: the preset's, else --lr).")
    server_lr: _Rate | None = _help(
        None, "Server tier learning rate (default: the preset's, else --lr).")
    edge_lr: _Rate | None = _help(
        None, "sherl: edge tier learning rate (default: the preset's).")
    client_batch: Annotated[int, Field(ge=1, le=65536)] | None = _help(
        None, "Fixed batch per client (ampere's B(d); gapsl's paper preset 128) instead of "
              "B_k ∝ |D_k|.")
    server_batch: Annotated[int, Field(ge=2, le=1 << 20)] | None = _help(
        None, "ampere: server batch B(s) (default --batch).")
    server_epochs: _Epochs | None = _help(
        None, "ampere: at most this many server epochs (N_s).")


class ComputeFields(BaseModel):
    """Where the coordinator computes ([server] in server.toml)."""

    device: Literal["auto", "cpu", "cuda"] = _help(
        "auto", "auto | cpu | cuda: where the server blocks and evaluation run.")
    autocast: Literal["off", "bf16", "fp16"] = _help(
        "off", "off | bf16 | fp16: mixed precision on the server block.")
    threads: Annotated[int, Field(ge=0, le=1024)] = _help(
        0, "Intra-op torch threads of the coordinator's compute (0: the process's setting).")


class Settings(ComputeFields, TrainFields):
    """How to train, as one frozen record: the [train] and [server] fields, the seed, and
    SHeRL-FL's tiers ([topology]: edge → its clients, empty: round-robin over the registered
    edges; `edge_split` k2, the first cloud layer, None: the planner's)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    seed: Annotated[int, Field(ge=0)] = 0
    edges: dict[AgentId, list[AgentId]] = Field(default_factory=dict)
    edge_split: Annotated[int, Field(ge=2)] | None = None

"""Split planner: the cost of every split candidate on every device, and the choice.

The planner enumerates every candidate k, costs it, drops those that do not fit in device
memory and takes the argmin of the objective, ties broken by the smaller k. Nothing is
pruned or searched cleverly: models have tens of layers, and a plan anyone can check by
hand beats a fast one. Torch-free: it works on cached ``ModelCosts``.

Cost model per device and split k, for batch B, T iterations per round, R rounds:
  device compute  client block fwd+bwd (+ aux head for Ampere), at the device's measured
                  per-layer times or FLOPs / (peak × efficiency)
  per iteration   SplitFed family: activations up (+ labels) and their gradients down,
                  B × activation bytes each way at the codec, plus one RTT
  per round       model exchange (down + up) of what the algorithm aggregates
  once            Ampere: the whole local dataset's activations + labels (eq. 27)
  server compute  server block fwd+bwd of the batch on the server profile (SplitFed family)
Memory always comes from the cost model (measured saved-tensor bytes, see cost_model); a
measured profile changes times only. Time per iteration amortises per-round and one-shot
transfers over the T (and R × T) iterations they serve; the ``bytes`` objective is bytes
per round with one-shot bytes amortised over R rounds (Ampere eq. 27 divided by N = R).
Ampere's server trains on stored activations off the devices' critical path: no server
time per iteration. Fleet rule for common splits: see ``requires_common_split``; the split
methods get a cut per device (``plan_fleet``), the coordinator completing shallow devices up
to the deepest cut (SplitFed family: its completion work is in each device's server time;
Ampere: one forward pass of the uploaded activations, off the devices' critical path). For
Ampere that is §3.2.1 per device: p_k trades on-device compute of block + aux head over the
epochs and the 2·N model exchanges (both grow with p) against the one-shot upload
s^o_p·|D_k| over the device's own uplink, and the fleet waits for its slowest device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from jetsplit.catalog import METHODS, REFERENCE_SPLIT_METHOD
from jetsplit.catalog import MethodEntry as Algorithm
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.export.cost_model import (
    CODEC_BYTES,
    OPTIMIZER_STATE,
    BlockCost,
    LayerCost,
    LayerTime,
    MemoryEstimate,
    ModelCosts,
    activation_bytes,
    aux_block,
    block_ms,
    client_block,
    edge_block,
    flops_ms,
    predict_layer_times,
    runtime_context_bytes,
    server_block,
    training_memory,
)
from jetsplit.profiles import DeviceProfile

Objective = Literal["time", "bytes", "device-flops"]
OBJECTIVES: tuple[str, ...] = ("time", "bytes", "device-flops")
TIE_REL = 1e-9  # relative difference below which two objective values are a tie
LABEL_BYTES = 8  # int64 label per sample, sent raw with activations (labels are never coded)


class InfeasiblePlan(JetsplitError):
    """No split candidate fits in the memory of every device that needs it."""


#: What the two-tier planner costs: every catalog method that is not costed as a sibling
#: (`planner_proxy`) and trains over two tiers. A method's traffic facts live in its catalog
#: entry (jetsplit/catalog.py): `splits`, `per_iteration_exchange`, `aggregates_clients`,
#: `shares_server_block`, `aux_head`, `one_shot_activations`.
ALGORITHMS: dict[str, Algorithm] = {e.name: e for e in METHODS.values()
                                    if e.planner_proxy is None and e.tiers == 2}
NOT_PLANNED = {e.name: f"{e.name} is planned over three tiers (client, edge, cloud) by the "
                       f"coordinator, from its agents' profiles; this plans two"
               for e in METHODS.values() if e.tiers == 3}


def requires_common_split(algorithm: Algorithm) -> bool:
    """THE rule for fleets: every device cuts at the same k only when there is no split
    (FedAvg trains the whole model everywhere). Every split method trains per-device cuts:
    the SplitFed family's coordinator completes a shallow device's activations up to the
    server cut with its own copies of the missing layers and averages every copy of a layer
    (server/cuts/completions.py); Ampere's device k trains layers 1..p_k with an aux head built for
    p_k, layers are averaged over the devices that hold them, and the coordinator carries a
    shallow device's one-shot upload to the deepest cut through the global layers."""
    return algorithm.common_cut


def get_algorithm(name: str) -> Algorithm:
    if name in NOT_PLANNED:
        raise ConfigError(NOT_PLANNED[name])
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


@dataclass(frozen=True)
class PlanSettings:
    """Everything a plan depends on besides the model costs and the profiles."""

    algorithm: str = REFERENCE_SPLIT_METHOD
    batch: int = 32
    local_steps: int = 10  # T: iterations per round (Ampere: per epoch, unless dataset_size)
    dataset_size: int | None = None  # samples per device; Ampere's epoch and one-shot upload
    rounds: int = 100  # R: rounds one-shot transfers are amortised over
    bandwidth_mbps: float | None = None  # overrides both directions of every device's link
    objective: str = "time"
    optimizer: str = "sgd"
    codec: str = "fp32"
    context_mb: float | None = None  # runtime context override (see cost_model)
    common_split: bool = False  # one cut for the whole fleet even where per-device cuts run

    def validate(self) -> Algorithm:
        """Check every field users set; one ConfigError line naming the flag."""
        self.check_fields()
        return get_algorithm(self.algorithm)

    def check_fields(self) -> None:
        """Every field but the algorithm (the three-tier planner has its own)."""
        for flag, value in (("--batch", self.batch), ("--local-steps", self.local_steps),
                            ("--rounds", self.rounds)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {value}")
        if self.dataset_size is not None and self.dataset_size < 1:
            raise ConfigError(f"--dataset-size must be a positive integer, got "
                              f"{self.dataset_size}")
        bw = self.bandwidth_mbps
        if bw is not None and not (math.isfinite(bw) and bw > 0):
            raise ConfigError(f"--bandwidth must be a positive number of Mbit/s, got {bw}")
        if self.context_mb is not None and not (math.isfinite(self.context_mb)
                                                and self.context_mb >= 0):
            raise ConfigError(f"--context-mb must be ≥ 0, got {self.context_mb}")
        for flag, value, allowed in (("--objective", self.objective, OBJECTIVES),
                                     ("--optimizer", self.optimizer, tuple(OPTIMIZER_STATE)),
                                     ("--codec", self.codec, tuple(CODEC_BYTES))):
            if value not in allowed:
                raise ConfigError(f"{flag} {value!r} is not one of {', '.join(allowed)}")

    def iterations_per_round(self, algorithm: Algorithm) -> int:
        if algorithm.one_shot_activations and self.dataset_size is not None:
            return math.ceil(self.dataset_size / self.batch)  # an Ampere round is an epoch
        return self.local_steps

    def samples(self) -> int:
        """Samples per device (Ampere's one-shot upload): given, or one round's worth."""
        return self.dataset_size if self.dataset_size is not None else (
            self.local_steps * self.batch)


@dataclass(frozen=True)
class SplitRow:
    """One device, one split k: what it costs."""

    k: int
    cut: str  # the last layer on the device
    device_gflops: float  # fwd+bwd per iteration (batch B), aux head included
    server_gflops: float  # server fwd+bwd per iteration for this device's batch
    memory: MemoryEstimate
    budget_bytes: int
    activation_bytes_per_sample: float  # at the codec; int8 range overhead spread over B
    bytes_iter: float
    bytes_round: float
    bytes_once: float
    compute_ms: float
    transfer_ms: float  # amortised per iteration
    server_ms: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.budget_bytes

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.transfer_ms + self.server_ms

    def bytes_amortised(self, rounds: int) -> float:
        """Bytes per round, one-shot bytes spread over ``rounds``."""
        return self.bytes_round + self.bytes_once / rounds


@dataclass(frozen=True)
class DevicePlan:
    profile: str
    rows: list[SplitRow]
    best_k: int | None  # this device's own argmin (what it would pick alone)
    time_source: str  # "measured" or "peak"


@dataclass(frozen=True)
class FleetPlan:
    """The plan: per-device rows, and the split(s) chosen."""

    model: str
    algorithm: str
    objective: str
    settings: PlanSettings
    common: bool
    devices: list[DevicePlan]
    fleet_values: dict[int, float] = field(default_factory=dict)  # common split: k → value
    fleet_fits: dict[int, bool] = field(default_factory=dict)
    chosen: dict[str, int | None] = field(default_factory=dict)  # profile name → k
    value: float | None = None  # the chosen cuts' fleet objective value (time: ms/iteration)

    @property
    def common_k(self) -> int | None:
        values = set(self.chosen.values())
        return values.pop() if len(values) == 1 else None

    @property
    def best_common_k(self) -> int | None:
        """The best one cut for the whole fleet (what `--common-split` would choose)."""
        return _argmin(self.fleet_values, self.fleet_fits) if self.fleet_values else None

    @property
    def server_cut(self) -> int | None:
        """c*: the deepest chosen cut, where the server block starts."""
        cuts = [k for k in self.chosen.values() if k is not None]
        return max(cuts) if cuts and len(cuts) == len(self.chosen) else None

    def row(self, profile: str, k: int) -> SplitRow:
        device = next(d for d in self.devices if d.profile == profile)
        return next(r for r in device.rows if r.k == k)


def _link(profile: DeviceProfile, bandwidth_mbps: float | None) -> tuple[float, float]:
    """(uplink, downlink) bytes per second."""
    if bandwidth_mbps is not None:
        rate = bandwidth_mbps * 1e6 / 8
        return rate, rate
    return profile.uplink_bytes_per_s, profile.downlink_bytes_per_s


def _candidates(costs: ModelCosts, algorithm: Algorithm) -> list[int]:
    return costs.split_candidates() if algorithm.splits else [costs.num_layers]


def device_rows(costs: ModelCosts, profile: DeviceProfile, server: DeviceProfile,
                settings: PlanSettings) -> tuple[list[SplitRow], str]:
    """Every candidate's row on one device, and where its times come from."""
    algorithm = settings.validate()
    batch, codec = settings.batch, settings.codec
    times: list[LayerTime] = predict_layer_times(costs, profile, batch)
    server_times = predict_layer_times(costs, server, batch)
    up, down = _link(profile, settings.bandwidth_mbps)
    rtt_ms = profile.network.rtt_ms
    iters = settings.iterations_per_round(algorithm)
    context = runtime_context_bytes(profile, settings.context_mb)
    budget = profile.usable_memory_bytes
    rows = []
    for k in _candidates(costs, algorithm):
        block: BlockCost = client_block(costs, k)
        compute_ms = block_ms(times, 0, k, input_grad=False)
        if algorithm.aux_head:
            aux = aux_block(costs, k)
            block = block + aux
            compute_ms += flops_ms(batch * aux.train_flops, profile)
        memory = training_memory(block, batch, settings.optimizer, context)
        whole = k == costs.num_layers
        msg = 0.0 if whole else activation_bytes(costs, k, codec, batch)
        bytes_iter = bytes_round = bytes_once = 0.0
        transfer_ms = server_ms = server_gflops = 0.0
        if algorithm.per_iteration_exchange:
            act_up, grad_down = msg + batch * LABEL_BYTES, msg
            bytes_iter = act_up + grad_down
            transfer_ms += (act_up / up + grad_down / down) * 1e3 + rtt_ms
            server_ms = block_ms(server_times, k, costs.num_layers, input_grad=True)
            server_gflops = batch * server_block(costs, k).train_flops / 1e9
        exchange = 0.0
        if algorithm.aggregates_clients or not algorithm.splits:
            exchange = block.state_bytes  # down and up once per round
            round_ms = (exchange / down + exchange / up) * 1e3 + rtt_ms
            transfer_ms += round_ms / iters
        bytes_round = iters * bytes_iter + 2 * exchange
        if algorithm.one_shot_activations:
            samples = settings.samples()
            bytes_once = (activation_bytes(costs, k, codec, samples)
                          + samples * LABEL_BYTES)
            transfer_ms += (bytes_once / up * 1e3) / (settings.rounds * iters)
        rows.append(SplitRow(
            k=k, cut=costs.layers[k - 1].name, device_gflops=batch * block.train_flops / 1e9,
            server_gflops=server_gflops, memory=memory, budget_bytes=budget,
            activation_bytes_per_sample=(msg / batch if not whole else 0.0),
            bytes_iter=bytes_iter, bytes_round=bytes_round, bytes_once=bytes_once,
            compute_ms=compute_ms, transfer_ms=transfer_ms, server_ms=server_ms,
        ))
    return rows, times[0].source if times else "peak"


def row_value(row: SplitRow, objective: str, rounds: int) -> float:
    """One device's objective value for one split."""
    if objective == "time":
        return row.total_ms
    if objective == "bytes":
        return row.bytes_amortised(rounds)
    return row.device_gflops


def fleet_value(rows: list[SplitRow], objective: str, rounds: int) -> float:
    """A common split's objective over the fleet: stragglers set the pace — the slowest
    device's compute + transfer, plus the server's work for every device's batch (one server
    machine); bytes add up over devices; device FLOPs are the largest device's."""
    if objective == "time":
        return (max(r.compute_ms + r.transfer_ms for r in rows)
                + sum(r.server_ms for r in rows))
    if objective == "bytes":
        return sum(r.bytes_amortised(rounds) for r in rows)
    return max(r.device_gflops for r in rows)


def _argmin(values: dict[int, float], feasible: dict[int, bool]) -> int | None:
    """Smallest value among feasible k; ties go to the smaller k. Values within TIE_REL of
    the minimum are ties: summing per-layer times in another order must not flip a choice
    (a device and server of equal speed make neighbouring splits cost the same)."""
    best = [(v, k) for k, v in values.items() if feasible[k]]
    if not best:
        return None
    low = min(v for v, _ in best)
    return min(k for v, k in best if v <= low + abs(low) * TIE_REL)


def per_device_time(devices: list[DevicePlan]) -> tuple[dict[str, int], float] | None:
    """Cuts per device minimising the fleet's time per iteration, max over devices of
    compute + transfer plus the server's work for every device (completion layers
    included), over rows that fit; None when some device fits nowhere. Exact: for every
    candidate bound τ on the slowest device, each device takes the fitting cut within τ
    with the least server time (ties: smaller k); the best τ wins (ties: smaller τ)."""
    fitting = {d.profile: [r for r in d.rows if r.fits] for d in devices}
    if any(not rows for rows in fitting.values()):
        return None
    count = {name: sum(d.profile == name for d in devices) for name in fitting}
    best: tuple[dict[str, int], float] | None = None
    for tau in sorted({r.compute_ms + r.transfer_ms for rows in fitting.values() for r in rows}):
        picks = {}
        for name, rows in fitting.items():
            within = [r for r in rows if r.compute_ms + r.transfer_ms <= tau]
            if not within:
                break
            picks[name] = min(within, key=lambda r: (r.server_ms, r.k))
        else:
            value = (max(r.compute_ms + r.transfer_ms for r in picks.values())
                     + sum(count[n] * r.server_ms for n, r in picks.items()))
            if best is None or value < best[1] - abs(best[1]) * TIE_REL:
                best = ({n: r.k for n, r in picks.items()}, value)
    return best


def plan_fleet(costs: ModelCosts, profiles: list[DeviceProfile], server: DeviceProfile,
               settings: PlanSettings) -> FleetPlan:
    """Cost every split on every device and choose: one common split (argmin of the fleet
    value over splits that fit on every device) or, where the algorithm trains per-device
    cuts and `settings.common_split` is off, a cut per device minimising the same fleet
    value (time: see `per_device_time`; bytes and device FLOPs: each device's own argmin).
    A per-device plan that is no better than the best common cut keeps the common cut."""
    algorithm = settings.validate()
    if not profiles:
        raise ConfigError("give at least one --profile")
    names = [p.name for p in profiles]
    devices = []
    for profile in profiles:
        rows, source = device_rows(costs, profile, server, settings)
        values = {r.k: row_value(r, settings.objective, settings.rounds) for r in rows}
        best = _argmin(values, {r.k: r.fits for r in rows})
        devices.append(DevicePlan(profile.name, rows, best, source))
    common = requires_common_split(algorithm) or settings.common_split
    fleet_values: dict[int, float] = {}
    fleet_fits: dict[int, bool] = {}
    for i, k in enumerate(r.k for r in devices[0].rows):
        per_device = [d.rows[i] for d in devices]
        fleet_values[k] = fleet_value(per_device, settings.objective, settings.rounds)
        fleet_fits[k] = all(r.fits for r in per_device)
    k_common = _argmin(fleet_values, fleet_fits)
    chosen: dict[str, int | None] = dict.fromkeys(names, k_common)
    value = None if k_common is None else fleet_values[k_common]
    cuts: dict[str, int | None] | None = None
    if not common and settings.objective == "time":
        found = per_device_time(devices)
        cuts = None if found is None else dict(found[0])
    elif not common:
        cuts = {d.profile: d.best_k for d in devices}
    if cuts is not None and all(k is not None for k in cuts.values()):
        rows = [next(r for r in d.rows if r.k == cuts[d.profile]) for d in devices]
        per_device_value = fleet_value(rows, settings.objective, settings.rounds)
        if value is None or per_device_value < value - abs(value) * TIE_REL:
            chosen, value = dict(cuts), per_device_value  # else the common cut is as good
    return FleetPlan(costs.name, algorithm.name, settings.objective, settings, common, devices,
                     fleet_values, fleet_fits, chosen, value)


def check_feasible(plan: FleetPlan) -> None:
    """Raise InfeasiblePlan, naming the tightest device, when no split was chosen."""
    for device in plan.devices:
        if plan.chosen.get(device.profile) is not None:
            continue
        smallest = min(device.rows, key=lambda r: r.memory.total)
        if not smallest.fits:
            raise InfeasiblePlan(
                f"no split of {plan.model} fits on {device.profile}: the smallest needs "
                f"{smallest.memory.total / 2**20:.0f} MiB of "
                f"{smallest.budget_bytes / 2**20:.0f} MiB usable at batch "
                f"{plan.settings.batch}; try a smaller --batch or --optimizer sgd")
    if any(k is None for k in plan.chosen.values()):
        raise InfeasiblePlan(f"no single split of {plan.model} fits on every device of the "
                             f"fleet; plan the devices in separate fleets")


# --------------------------------------------------------------------------- three tiers

CLASSIFIER_PREFIXES = ("fc", "head")  # zoo names of the task-head layers


@dataclass(frozen=True)
class TierRow:
    """One SHeRL-FL candidate: clients train [:k1], edges [k1:k2], the cloud [k2:].

    Times are per iteration of one edge group: the slowest client's compute, smashed-data
    upload and gradient download, then the slowest edge's contrastive step on the group's
    batch and its embedding upload; model exchanges (client blocks every τ1 iterations,
    edge blocks every τ2) amortised over the iterations they serve. The cloud's head
    training is off the critical path: nothing waits for it (no gradient comes back)."""

    k1: int
    k2: int
    client_memory: MemoryEstimate  # the tightest client's
    edge_memory: MemoryEstimate  # the tightest edge's
    client_fits: bool
    edge_fits: bool
    client_ms: float
    edge_ms: float
    bytes_iter: float  # one edge group, all links, exchanges amortised
    device_gflops: float  # one client, fwd+bwd of its batch
    edge_gflops: float  # one edge, fwd+bwd of its group's batch
    cloud_gflops: float  # the head on one group's embeddings

    @property
    def fits(self) -> bool:
        return self.client_fits and self.edge_fits

    @property
    def total_ms(self) -> float:
        return self.client_ms + self.edge_ms

    def value(self, objective: str) -> float:
        if objective == "time":
            return self.total_ms
        if objective == "bytes":
            return self.bytes_iter
        return self.device_gflops


@dataclass(frozen=True)
class ThreeTierPlan:
    """Every costed (k1, k2) and the choice (None when nothing fits)."""

    model: str
    objective: str
    rows: list[TierRow]
    chosen: tuple[int, int] | None

    @property
    def k2(self) -> int | None:
        return None if self.chosen is None else self.chosen[1]


def classifier_start(costs: ModelCosts) -> int:
    """Index of the first layer of the model's trailing classifier: the role-aware cloud
    tier holds only task-head layers (the SHeRL-FL paper, "Model Partitioning").

    The head is the trailing layers named fc…/head (the zoo's names) or fed one vector per
    sample (what follows a network's last pooling or flatten, whatever its blocks are
    called: a user's network names them itself), and at least the last layer. On the zoo
    the shape adds nothing to the names, so a factory returning a zoo model plans alike."""
    start = costs.num_layers - 1
    while start > 0 and _is_head(costs.layers[start - 1]):
        start -= 1
    return start


def _is_head(layer: LayerCost) -> bool:
    return layer.name.startswith(CLASSIFIER_PREFIXES) or len(layer.in_shape) == 1


def _tightest(block: BlockCost, batch: int, profiles: list[DeviceProfile],
              settings: PlanSettings) -> tuple[MemoryEstimate, bool]:
    """The training memory of `block` on the profile with the least headroom, and whether
    it fits on every profile."""
    shortfall = []  # (bytes over the usable memory, estimate) per profile
    for profile in profiles:
        memory = training_memory(block, batch, settings.optimizer,
                                 runtime_context_bytes(profile, settings.context_mb))
        shortfall.append((memory.total - profile.usable_memory_bytes, memory))
    worst = max(shortfall, key=lambda m: m[0])
    return worst[1], all(over <= 0 for over, _ in shortfall)


def _tier_client(costs: ModelCosts, profiles: list[DeviceProfile], k1: int,
                 settings: PlanSettings, tau1: int) -> tuple[MemoryEstimate, bool, float]:
    """(tightest memory, all fit, slowest ms per iteration) of the clients at k1."""
    block, batch = client_block(costs, k1), settings.batch
    act = activation_bytes(costs, k1, settings.codec, batch)
    times = []
    for profile in profiles:
        up, down = _link(profile, settings.bandwidth_mbps)
        compute = block_ms(predict_layer_times(costs, profile, batch), 0, k1, input_grad=False)
        transfer = ((act + batch * LABEL_BYTES) / up + act / down) * 1e3
        exchange = ((block.state_bytes / up + block.state_bytes / down) * 1e3
                    + profile.network.rtt_ms) / tau1
        times.append(compute + transfer + profile.network.rtt_ms + exchange)
    return (*_tightest(block, batch, profiles, settings), max(times))


def _tier_edge(costs: ModelCosts, profiles: list[DeviceProfile], k1: int, k2: int,
               batch: int, settings: PlanSettings, tau2: int
               ) -> tuple[MemoryEstimate, bool, float]:
    """(tightest memory, all fit, slowest ms per iteration) of the edges for [k1:k2]."""
    block = edge_block(costs, k1, k2)
    upload = activation_bytes(costs, k2, settings.codec, batch) + batch * LABEL_BYTES
    times = []
    for profile in profiles:
        up, down = _link(profile, settings.bandwidth_mbps)
        compute = block_ms(predict_layer_times(costs, profile, batch), k1, k2, input_grad=True)
        exchange = ((block.state_bytes / up + block.state_bytes / down) * 1e3
                    + profile.network.rtt_ms) / tau2
        times.append(compute + upload / up * 1e3 + exchange)
    return (*_tightest(block, batch, profiles, settings), max(times))


def tier_row(costs: ModelCosts, clients: list[DeviceProfile], edges: list[DeviceProfile],
             k1: int, k2: int, settings: PlanSettings, *, clients_per_edge: int,
             tau1: int, tau2: int) -> TierRow:
    """Cost one (k1, k2) for edge groups of `clients_per_edge` clients of batch B each."""
    batch, group = settings.batch, settings.batch * clients_per_edge
    c_mem, c_fits, c_ms = _tier_client(costs, clients, k1, settings, tau1)
    e_mem, e_fits, e_ms = _tier_edge(costs, edges, k1, k2, group, settings, tau2)
    act = activation_bytes(costs, k1, settings.codec, batch)
    client, edge = client_block(costs, k1), edge_block(costs, k1, k2)
    bytes_iter = (clients_per_edge * (2 * act + batch * LABEL_BYTES
                                      + 2 * client.state_bytes / tau1)
                  + activation_bytes(costs, k2, settings.codec, group) + group * LABEL_BYTES
                  + 2 * edge.state_bytes / tau2)
    return TierRow(
        k1=k1, k2=k2, client_memory=c_mem, edge_memory=e_mem, client_fits=c_fits,
        edge_fits=e_fits, client_ms=c_ms, edge_ms=e_ms, bytes_iter=bytes_iter,
        device_gflops=batch * client.train_flops / 1e9,
        edge_gflops=group * edge.train_flops / 1e9,
        cloud_gflops=group * server_block(costs, k2, input_grad=False).train_flops / 1e9)


def plan_three_tier(costs: ModelCosts, clients: list[DeviceProfile],
                    edges: list[DeviceProfile], settings: PlanSettings, *,
                    clients_per_edge: int = 1, k1: int | None = None,
                    tau1: int | None = None, tau2: int | None = None) -> ThreeTierPlan:
    """Role-aware SHeRL-FL split: clients keep shallow layers, edges the deeper feature
    layers, the cloud (part of) the classifier. Every k1 (or the given one, e.g. the
    bundle's) and every k2 from the classifier's start to n-1 is costed; the argmin of the
    objective over the pairs that fit on every client and edge wins, ties to smaller k."""
    settings.check_fields()
    if not clients or not edges:
        raise ConfigError("a three-tier plan needs at least one client and one edge profile")
    if clients_per_edge < 1:
        raise ConfigError(f"clients per edge must be at least 1, got {clients_per_edge}")
    n = costs.num_layers
    if n < 3:
        raise ConfigError(f"{costs.name} has {n} layers; three tiers need at least 3")
    if k1 is not None and not 1 <= k1 <= n - 2:
        raise ConfigError(f"client split {k1} leaves no edge and cloud layers of {costs.name}:"
                          f" choose 1..{n - 2}")
    tau1 = tau1 or settings.local_steps
    tau2 = tau2 or settings.local_steps
    rows = [tier_row(costs, clients, edges, a, b, settings, clients_per_edge=clients_per_edge,
                     tau1=tau1, tau2=tau2)
            for a in ([k1] if k1 is not None else range(1, n - 1))
            for b in range(max(a + 1, classifier_start(costs)), n)]
    feasible = [r for r in rows if r.fits]
    chosen = None
    if feasible:
        low = min(r.value(settings.objective) for r in feasible)
        chosen = min((r.k1, r.k2) for r in feasible
                     if r.value(settings.objective) <= low + abs(low) * TIE_REL)
    return ThreeTierPlan(costs.name, settings.objective, rows, chosen)


def check_three_tier(plan: ThreeTierPlan) -> tuple[int, int]:
    """The chosen (k1, k2), or InfeasiblePlan naming the tier that does not fit."""
    if plan.chosen is not None:
        return plan.chosen
    client_ok = [r for r in plan.rows if r.client_fits]
    tier, need = (("edge", min(r.edge_memory.total for r in client_ok)) if client_ok
                  else ("client", min(r.client_memory.total for r in plan.rows)))
    raise InfeasiblePlan(f"no three-tier split of {plan.model} fits: the {tier} needs at "
                         f"least {need / 2**20:.0f} MiB; try a smaller batch")

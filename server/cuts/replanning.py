"""Live re-planning: between rounds, move a device's cut to where the split planner, fed
what the run has measured of each device, predicts the round to be shortest.

A Jetson in the field does not keep the speed and link its profile describes (power mode,
throttling, a degrading uplink), so a cut planned once can leave the whole fleet waiting on
one device. After every round the `Replanner` re-costs every cut of every device with the
planner's own rows (export/planner.py: compute, transfer and server milliseconds per
iteration at the device's batch B_k), corrected by the live measurements:

- **links**: the device's profile with its up- and downlink replaced by the live estimates
  (server/fleet/live_estimates.py: median of the last rounds' measured rates);
- **compute**: every row's compute time times the device's *compute factor*: how much
  slower the device computes now than when it started, the median over the last `window`
  rounds. Each round's ratio r = measured compute seconds ÷ the planner's seconds for the
  GFLOPs the device computed at its cut; the first ratio seen at a cut is that cut's base
  (divided by the factor in force then, so a move does not reset the factor), and the
  factor is r ÷ base. Why relative: a device's fixed per-step costs (Python, the runtime,
  an emulated agent's stretched overheads) make r at a tiny block many times r at a large
  one, so r itself cannot be carried to another cut; the planner's shape across cuts is
  trusted, as the plan made before round 1 trusted it, and what the run measures is how
  the device changed since.

The round's predicted time is the planner's fleet objective (`per_device_time`: the slowest
device's compute + transfer plus the server's work for every device) × T iterations.

**When to switch.** Only when the best cuts' predicted round, plus what the switch costs
amortised over `horizon` rounds, is more than `threshold` shorter than the current cuts'
prediction: the threshold is the hysteresis that keeps a fleet from flapping between two
near-equal plans. A switch costs each moving device the bytes of its new cut's bundle at
its live downlink, unless it already holds that cut (bundles are content-addressed and
cached on the device, so returning to an earlier cut is free); devices move in parallel,
so the cost is the slowest device's. Cuts move within 1..c*: the server block starts at c*
for the whole run, and a cut is a candidate only where the device can send its client block
(the coordinator pulls it to aggregate or, for PSL and GAPSL, to score it) in at most half
the step deadline at its live uplink: a deeper block over a collapsed link would miss every
pull. Devices without a measurement yet keep their cut.

**Which clock.** Measured (the default): the fleet books' times and rates, as on real
devices. Model: each emulated agent's stated conditions (its profile and trace row in
force: `edge_agent.emulation.DeviceClock.emulated`): the compute ratio is 1 ÷ its speed
fraction and its links are the stated rates, so an emulated fleet's switches depend on its
traces alone, not on how busy the machine emulating it is, and the MQTT and in-process
engines make the same ones.

Device numbers are untrusted: `LiveEstimates` range-checks them, and a compute factor
outside [FACTOR_MIN, FACTOR_MAX] is not a measurement.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jetsplit.server.defences.untrusted_numbers import finite

CLOCKS = ("measured", "model")  # what the estimates are read from (see `Replanner`)
THRESHOLD = 0.2  # switch when the predicted round is this much shorter (share of now)
HORIZON = 5  # rounds a switch's shipping cost is amortised over
WINDOW = 3  # rounds of compute factors per estimate (median)
FACTOR_MIN, FACTOR_MAX = 1e-3, 1e4  # measured ÷ predicted compute; outside: no measurement
BUNDLE_HEADER_BYTES = 4096  # a device bundle beyond its two copies of the weights


@dataclass(frozen=True)
class Switch:
    """One re-plan: the cuts before and after, why, and what it was predicted to do."""

    round: int  # decided after this round; the new cuts train from the next one
    before: dict[str, int]
    after: dict[str, int]
    predicted_before_s: float  # round time at the old cuts, under the live estimates
    predicted_after_s: float  # at the new cuts (shipping not included)
    switch_s: float  # the slowest moving device's shipping time
    switch_bytes: dict[str, int]  # per moving device: the bundle bytes it lacks
    reason: str

    def row(self) -> dict[str, Any]:
        """As the metrics row's `replan` field."""
        return {"before": self.before, "after": self.after,
                "moved": {a: [self.before[a], k] for a, k in self.after.items()
                          if self.before.get(a) != k},
                "predicted_before_s": round(self.predicted_before_s, 4),
                "predicted_after_s": round(self.predicted_after_s, 4),
                "switch_s": round(self.switch_s, 4), "switch_bytes": self.switch_bytes,
                "reason": self.reason}


class Replanner:
    """Per device: its profile, its recent compute factors; decides switches (see above)."""

    def __init__(self, costs: Any, profiles: Mapping[str, Any], server: Any, settings: Any,
                 server_cut: int, *, threshold: float = THRESHOLD, horizon: int = HORIZON,
                 window: int = WINDOW, deadline_s: float | None = None,
                 clock: str = "measured") -> None:
        """`costs`: the model's `ModelCosts`; `profiles`: agent → `DeviceProfile` (as
        planned: a trial's emulated ones); `server`: the coordinator's profile; `settings`:
        the `PlanSettings` the run was planned with; `deadline_s`: the step deadline a
        block pull must fit in twice over (None: no bound); `clock`: "measured" (the fleet
        books' times) or "model" (each emulated agent's stated conditions: the same
        decisions however busy the machine emulating the fleet is)."""
        if not 0 < threshold < 1:
            raise ValueError(f"replan threshold must be in (0, 1), got {threshold}")
        if clock not in CLOCKS:
            raise ValueError(f"replan clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        self.clock = clock
        self.costs, self.server, self.settings = costs, server, settings
        self.profiles = dict(profiles)
        self.server_cut, self.threshold, self.horizon = server_cut, threshold, max(1, horizon)
        self.window, self.deadline_s = window, deadline_s
        self._factors: dict[str, deque[float]] = {}
        self._bases: dict[str, dict[int, float]] = {}  # agent → cut → its first ratio
        self._links: dict[str, dict[str, float]] = {}
        self.held: dict[str, set[int]] = {}  # cuts each agent has had installed
        self.switches: list[Switch] = []

    # ------------------------------------------------------------------ measurements

    def observe(self, row: Mapping[str, Any], batches: Mapping[str, int]) -> None:
        """Read one metrics row: each measured agent's compute factor at the cut it had
        (`cuts`, `device_gflops`, the fleet books' `compute_s`) and its link estimates; on
        the model clock, the conditions an emulated agent states instead (`emulated`)."""
        cuts, gflops = row.get("cuts") or {}, row.get("device_gflops") or {}
        for agent, info in (row.get("agents") or {}).items():
            if agent not in self.profiles or not isinstance(info, dict):
                continue
            self._read_links(agent, info)
            cut, work = cuts.get(agent), finite(gflops.get(agent), 0.0, 1e12)
            if not isinstance(cut, int) or not work or agent not in batches:
                continue
            self.held.setdefault(agent, set()).add(cut)
            ratio = self._ratio(agent, info, cut, work, batches[agent])
            if ratio is None or not FACTOR_MIN <= ratio <= FACTOR_MAX:
                continue
            bases = self._bases.setdefault(agent, {})
            if cut not in bases:
                bases[cut] = ratio / (self.factor(agent) or 1.0)
            self._factors.setdefault(agent, deque(maxlen=self.window)).append(
                ratio / bases[cut])

    def _read_links(self, agent: str, info: Mapping[str, Any]) -> None:
        """The agent's link rates: the fleet books' live estimates, or on the model clock
        the rates its emulation states."""
        source = info.get("emulated" if self.clock == "model" else "estimate")
        if isinstance(source, dict):
            self._links[agent] = {k: float(v) for k, v in source.items()
                                  if k in ("uplink_mbps", "downlink_mbps")}

    def _ratio(self, agent: str, info: Mapping[str, Any], cut: int, work: float,
               batch: int) -> float | None:
        """This round's compute seconds ÷ the planner's for `work` GFLOPs at `cut`; on the
        model clock, 1 ÷ the speed fraction the agent's emulation states (what the ratio
        is when the emulation is exact)."""
        if self.clock == "model":
            emulated = info.get("emulated")
            speed = finite(emulated.get("compute"), 0.0) if isinstance(emulated, dict) else None
            return None if not speed else 1.0 / speed  # its range: the caller's factor bounds
        seconds = finite(info.get("compute_s"), 0.0, 1e9)
        row_k = self._rows(agent, batch, 1.0).get(cut)
        if not seconds or row_k is None or not row_k.device_gflops or not row_k.compute_ms:
            return None
        return seconds / (row_k.compute_ms / 1e3 * work / row_k.device_gflops)

    def factor(self, agent: str) -> float | None:
        """How much slower the agent computes than at its start (see the module docstring),
        or None before a measurement."""
        seen = self._factors.get(agent)
        return statistics.median(seen) if seen else None

    # ------------------------------------------------------------------ prediction

    def _profile(self, agent: str) -> Any:
        """The agent's profile with its links replaced by the live estimates."""
        from jetsplit.profiles import profile_from_dict

        profile, links = self.profiles[agent], self._links.get(agent) or {}
        if not links:
            return profile
        data = profile.model_dump(mode="python", exclude_none=True)
        data["network"].update({k: v for k, v in links.items() if v > 0})
        return profile_from_dict(data, f"{profile.name} (live)")

    def _rows(self, agent: str, batch: int, factor: float) -> dict[int, Any]:
        """The planner's rows for `agent` at batch `batch`, cuts 1..c* that fit, compute
        scaled by `factor`."""
        from jetsplit.export.planner import device_rows

        settings = dataclasses.replace(self.settings, batch=batch)
        rows, _ = device_rows(self.costs, self._profile(agent), self.server, settings)
        return {r.k: dataclasses.replace(r, compute_ms=r.compute_ms * factor)
                for r in rows if r.k <= self.server_cut and r.fits}

    def _pullable(self, agent: str, cut: int) -> bool:
        """Whether agent's client block at `cut` uploads within half the step deadline at
        its live uplink (where to move: a cut it could never send is no candidate)."""
        if self.deadline_s is None:
            return True
        from jetsplit.export.cost_model import client_block

        uplink = (self._links.get(agent) or {}).get("uplink_mbps") \
            or float(self.profiles[agent].network.uplink_mbps)
        seconds = client_block(self.costs, cut).state_bytes * 8 / (uplink * 1e6)
        return seconds <= self.deadline_s / 2

    def predict(self, cuts: Mapping[str, int], batches: Mapping[str, int]
                ) -> tuple[float, dict[str, int], float] | None:
        """(seconds per round at `cuts`, the best cuts, seconds per round at those) under
        the live estimates, over the agents measured so far; None when none is."""
        from jetsplit.export.planner import DevicePlan, fleet_value, per_device_time

        devices, now = [], []
        for agent in sorted(cuts):
            factor = self.factor(agent)
            if factor is None or agent not in batches:
                continue
            rows = self._rows(agent, batches[agent], factor)
            candidates = [r for k, r in sorted(rows.items()) if self._pullable(agent, k)]
            if cuts[agent] not in rows or not candidates:
                continue
            devices.append(DevicePlan(agent, candidates, None, "live"))
            now.append(rows[cuts[agent]])
        if not devices:
            return None
        best = per_device_time(devices)
        if best is None:
            return None
        per_round = self.settings.local_steps / 1e3  # ms per iteration → s per round
        return (fleet_value(now, "time", self.settings.rounds) * per_round, {**best[0]},
                best[1] * per_round)

    def predicted_s(self, cuts: Mapping[str, int], batches: Mapping[str, int]) -> float | None:
        """Seconds per round at exactly these cuts (every agent measured), or None."""
        from jetsplit.export.planner import fleet_value

        rows = []
        for agent, cut in sorted(cuts.items()):
            factor = self.factor(agent)
            row = None if factor is None else self._rows(agent, batches[agent], factor).get(cut)
            if row is None:
                return None
            rows.append(row)
        return fleet_value(rows, "time", self.settings.rounds) * self.settings.local_steps / 1e3

    # ------------------------------------------------------------------ decision

    def consider(self, round_: int, cuts: Mapping[str, int], batches: Mapping[str, int]
                 ) -> Switch | None:
        """The switch to make before the next round, or None (see the module docstring)."""
        for agent, cut in cuts.items():
            self.held.setdefault(agent, set()).add(cut)
        found = self.predict(cuts, batches)
        if found is None:
            return None
        before_s, best, after_s = found
        after = {**cuts, **best}
        if after == dict(cuts):
            return None
        lacking = {a: self._bytes(k) for a, k in best.items()
                   if k != cuts[a] and k not in self.held.get(a, set())}
        switch_s = max((n * 8 / (self._downlink_mbps(a) * 1e6) for a, n in lacking.items()),
                       default=0.0)
        if after_s + switch_s / self.horizon >= (1 - self.threshold) * before_s:
            return None
        moved = ", ".join(f"{a} {cuts[a]}→{k}" for a, k in sorted(best.items())
                          if k != cuts[a])
        switch = Switch(round_, dict(cuts), after, before_s, after_s, switch_s, lacking,
                        f"{moved}: predicted {before_s:.2f} s → {after_s:.2f} s per round "
                        f"(shipping {switch_s:.2f} s over {self.horizon} rounds)")
        for agent, cut in best.items():
            self.held.setdefault(agent, set()).add(cut)
        self.switches.append(switch)
        return switch

    def _bytes(self, cut: int) -> int:
        """A device bundle's bytes at `cut`: its ONNX graph and its weights file, each about
        the block's fp32 parameters (AlexNet/MNIST cut 2: 893,745 bytes shipped for 445,696
        of parameters), plus their headers."""
        from jetsplit.export.cost_model import client_block

        return 2 * int(client_block(self.costs, cut).state_bytes) + BUNDLE_HEADER_BYTES

    def _downlink_mbps(self, agent: str) -> float:
        live = (self._links.get(agent) or {}).get("downlink_mbps")
        return live if live else float(self.profiles[agent].network.downlink_mbps)

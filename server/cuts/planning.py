"""The cuts a fleet trains at: the one planner every launcher asks (`plan_cuts` for agents
known by profile before they start, as a trial or a simulation; `fleet_cuts` for agents that
registered with `jetsplit server run`), on top of the split planner (export/planner.py).
How a fleet of cuts then trains is server/cuts/completions.py's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jetsplit import catalog
from jetsplit.errors import ConfigError
from jetsplit.server.defences.size_claims import DEFAULT_SIZE_CAP, claim_weights, registered_size

# What `jetsplit server run` costs the coordinator's server block on when planning.
SERVER_PROFILE = "x86-cpu"


def _planned_as(algorithm: str) -> tuple[str, bool]:
    """What the two-tier planner costs `algorithm` as, and whether it trains three tiers
    (SHeRL-FL: one common client cut, costed as the SplitFed reference)."""
    entry = catalog.method(algorithm)
    if entry.tiers == 3:
        return catalog.REFERENCE_SPLIT_METHOD, True
    return entry.planned_as, False


def plan_cuts(algorithm: str, model: str, input_shape: tuple[int, int, int], classes: int,
              agent_profiles: Mapping[str, Any], *, batch: int, local_steps: int, rounds: int,
              dataset_size: int | None, codec: str, server_profile: str,
              common_split: bool = False, split: int | None = None,
              compute_dilation: float = 1.0) -> tuple[int, dict[str, int], dict[str, Any]]:
    """The fleet planner's cuts for agents with these profiles (a bundled name or a path,
    or a `DeviceProfile` an agent registered with): (server cut c*, cut per agent, the plan
    as JSON with per-agent predictions). `split` forces one common cut;
    `common_split` asks the planner for one. A trial plans the fleet it emulates: every
    device's compute `compute_dilation` times slower than its profile (links unchanged)."""
    from jetsplit.export.plan_json import per_device, plan_to_dict
    from jetsplit.export.planner import ALGORITHMS, check_feasible, plan_fleet
    from jetsplit.profiles import resolve_profile

    planned, _ = _planned_as(algorithm)
    costs, resolved, settings = _planning_inputs(
        algorithm, model, input_shape, classes, agent_profiles, batch=batch,
        local_steps=local_steps, rounds=rounds, dataset_size=dataset_size, codec=codec,
        common_split=common_split or split is not None, compute_dilation=compute_dilation)
    label = {a: p if isinstance(p, str) else p.name for a, p in agent_profiles.items()}
    name = {a: r.name for a, r in resolved.items()}  # a path's profile goes by its name
    devices = list({r.name: r for r in resolved.values()}.values())
    plan = plan_fleet(costs, devices, resolve_profile(server_profile), settings)
    check_feasible(plan)
    if not ALGORITHMS[planned].splits:  # the whole model trains on the device
        by_profile = dict.fromkeys(plan.chosen, 1)
    elif split is not None:
        by_profile = dict.fromkeys(plan.chosen, split)
    else:
        by_profile = {p: int(k) for p, k in plan.chosen.items()}  # type: ignore[arg-type]
    cuts = {a: by_profile[name[a]] for a in sorted(agent_profiles)}
    server_cut = max(cuts.values())
    predicted = per_device(plan)
    iters = settings.iterations_per_round(ALGORITHMS[planned])  # Ampere: an epoch
    agents = {}
    for agent in sorted(agent_profiles):
        k = cuts[agent]
        info: dict[str, Any] = {"profile": label[agent], "cut": k}
        if ALGORITHMS[planned].splits and k in {r.k for r in plan.devices[0].rows}:
            row = plan.row(name[agent], k)
            info.update(predicted_compute_s=row.compute_ms * iters / 1e3,
                        predicted_transfer_s=row.transfer_ms * iters / 1e3,
                        predicted_memory_mb=row.memory.total / 2**20,
                        budget_mb=row.budget_bytes / 2**20,
                        predicted_step_s=longest_exchange_s(row, resolved[agent], iters))
        agents[agent] = info
    return server_cut, cuts, {**plan_to_dict(plan), "planned_as": planned,
                              "used_split": server_cut, "per_device": predicted,
                              "agents": agents}


def longest_exchange_s(row: Any, profile: Any, iters: int) -> float:
    """The planner's seconds for one device's longest exchange at its cut: an iteration
    (compute and activation/gradient transfer, the round's weight exchange amortised), or
    its block's weights once over its slower link, whichever is longer. What the step
    deadlines' floor covers (server/defences/step_deadlines.py)."""
    step_s = (row.compute_ms + row.transfer_ms) / 1e3
    weights = max(0.0, (row.bytes_round - iters * row.bytes_iter) / 2)
    rate = min(profile.uplink_bytes_per_s, profile.downlink_bytes_per_s)
    weights_s = weights / rate + profile.network.rtt_ms / 1e3 if rate > 0 else 0.0
    return max(step_s, weights_s)


def _planning_inputs(algorithm: str, model: str, input_shape: tuple[int, int, int],
                     classes: int, agent_profiles: Mapping[str, Any], *, batch: int,
                     local_steps: int, rounds: int, dataset_size: int | None, codec: str,
                     common_split: bool, compute_dilation: float
                     ) -> tuple[Any, dict[str, Any], Any]:
    """What the planner costs a fleet with: (the model's costs, each agent's profile as
    planned — resolved, compute dilated as a trial emulates it —, the PlanSettings)."""
    from jetsplit.export.cost_model import get_costs
    from jetsplit.export.planner import PlanSettings
    from jetsplit.profiles import resolve_profile

    planned, three_tiers = _planned_as(algorithm)
    settings = PlanSettings(algorithm=planned, batch=batch, local_steps=local_steps,
                            rounds=rounds, dataset_size=dataset_size, codec=codec,
                            common_split=common_split or three_tiers)
    resolved = {a: dilated(resolve_profile(p) if isinstance(p, str) else p, compute_dilation)
                for a, p in sorted(agent_profiles.items())}
    return get_costs(model, input_shape, classes), resolved, settings


def replanner_for(algorithm: str, model: str, input_shape: tuple[int, int, int],
                  classes: int, agent_profiles: Mapping[str, Any], *, batch: int,
                  local_steps: int, rounds: int, dataset_size: int | None, codec: str,
                  server_profile: str, server_cut: int, threshold: float,
                  deadline_s: float | None = None, compute_dilation: float = 1.0,
                  clock: str = "measured") -> Any:
    """The live re-planner (server/cuts/replanning.py) for a fleet planned by `plan_cuts` with
    these same inputs, or None with one log line where the method keeps its cuts."""
    import logging

    from jetsplit.profiles import resolve_profile
    from jetsplit.server.cuts.replanning import Replanner

    entry = catalog.method(algorithm)
    if not entry.replans:
        logging.getLogger("jetsplit.coordinator").info(
            "replan: %s keeps its cuts (%s)", algorithm, entry.replan_note)
        return None
    costs, resolved, settings = _planning_inputs(
        algorithm, model, input_shape, classes, agent_profiles, batch=batch,
        local_steps=local_steps, rounds=rounds, dataset_size=dataset_size, codec=codec,
        common_split=False, compute_dilation=compute_dilation)
    return Replanner(costs, resolved, resolve_profile(server_profile), settings, server_cut,
                     threshold=threshold, deadline_s=deadline_s, clock=clock)


def fleet_replanner(cfg: Any, registrations: Mapping[str, Mapping[str, Any]],
                    server_cut: int) -> Any:
    """`jetsplit server run`'s live re-planner: the registered agents' profiles, planned as
    `fleet_cuts` plans them; None where the method keeps its cuts."""
    model, t = cfg.model, cfg.train
    profiles = {a: registered_profile(r) for a, r in sorted(registrations.items())}
    return replanner_for(
        t.algorithm, model.name, tuple(model.input_shape), model.classes, profiles,
        batch=max(1, t.batch // max(1, len(profiles))), local_steps=t.local_steps,
        rounds=t.rounds, dataset_size=mean_dataset_size(registrations, t.size_cap,
                                                      t.provisioned_sizes),
        codec=t.codec, server_profile=SERVER_PROFILE, server_cut=server_cut,
        threshold=t.replan_threshold, deadline_s=t.deadline_s, clock=t.replan_clock)


def dilated(profile: Any, factor: float) -> Any:
    """`profile` with compute `factor` times slower (peaks divided; measured layer times
    dropped), as a trial emulates it; the same profile when factor is 1."""
    from jetsplit.profiles import profile_from_dict

    if factor == 1.0:
        return profile
    data = profile.model_dump(mode="python", exclude_none=True)
    compute = data["compute"]
    for key in ("peak_fp32_gflops", "peak_fp16_gflops"):
        if key in compute:
            compute[key] = compute[key] / factor
    compute.pop("gpu_clock_mhz", None)  # the peak no longer matches cores x clock
    data.pop("measured", None)
    return profile_from_dict(data, f"{profile.name} (emulated)")


def check_cut_fits(agent: str, profile: str, cut: int, plan: Mapping[str, Any]) -> None:
    """A per-device cut the user named must fit the device's memory budget (one line)."""
    for device in plan.get("devices", []):
        if device["profile"] != profile:
            continue
        for row in device["rows"]:
            if row["k"] == cut and not row["fits"]:
                raise ConfigError(
                    f"agent {agent} ({profile}): cut {cut} needs "
                    f"{row['memory']['total'] / 2**20:.0f} MiB to train, more than its "
                    f"{row['budget_bytes'] / 2**20:.0f} MiB usable; choose a smaller cut")


def registered_profile(registration: Mapping[str, Any]) -> Any:
    """The DeviceProfile an agent registered with (validated: it is untrusted), or None."""
    from jetsplit.errors import JetsplitError
    from jetsplit.profiles import profile_from_dict

    data = registration.get("profile")
    if not isinstance(data, dict):
        return None
    try:
        return profile_from_dict(data)
    except (JetsplitError, ValueError, TypeError):
        return None


def mean_dataset_size(registrations: Mapping[str, Mapping[str, Any]],
                      cap_factor: float = DEFAULT_SIZE_CAP,
                      provisioned_sizes: Mapping[str, int] | None = None) -> int | None:
    """The mean |D_k| the agents registered, each claim bounded as in every average
    (server/defences/size_claims.py), for Ampere's epoch and one-shot upload; None when none says
    (the
    planner then assumes one round's worth)."""
    claims = {a: n for a, r in registrations.items() if (n := registered_size(r)) is not None}
    sizes = list(claim_weights(claims, claims, cap_factor, provisioned_sizes or {}).values())
    return max(1, round(sum(sizes) / len(sizes))) if sizes else None


def registered_steps(cfg: Any, registrations: Mapping[str, Mapping[str, Any]],
                     cuts: Mapping[str, int], *, batch: int, local_steps: int, rounds: int,
                     codec: str) -> dict[str, float]:
    """`jetsplit server run`'s predictions for the step deadlines' floor: agent → the
    planner's seconds for its longest exchange at its cut (`cuts`, else the config's
    split), from the profile it registered with; agents without one, or a method that
    trains the whole model on the device, predict nothing. A registered profile is the
    agent's claim: the most a slow claim can do is keep the deadline at `deadline_s`."""
    from jetsplit.export.cost_model import get_costs
    from jetsplit.export.planner import ALGORITHMS, PlanSettings, device_rows
    from jetsplit.profiles import resolve_profile

    model = cfg.model
    planned, three_tiers = _planned_as(cfg.train.algorithm)
    if not ALGORITHMS[planned].splits:
        return {}
    costs = get_costs(model.name, tuple(model.input_shape), model.classes)
    settings = PlanSettings(algorithm=planned, batch=batch, local_steps=local_steps,
                            rounds=rounds, codec=codec, common_split=three_tiers)
    iters = settings.iterations_per_round(ALGORITHMS[planned])
    server = resolve_profile(SERVER_PROFILE)
    out: dict[str, float] = {}
    for agent, registration in sorted(registrations.items()):
        profile = registered_profile(registration)
        cut = cuts.get(agent, model.split)
        if profile is None or not isinstance(cut, int):
            continue
        rows = {r.k: r for r in device_rows(costs, profile, server, settings)[0]}
        if cut in rows:
            out[agent] = longest_exchange_s(rows[cut], profile, iters)
    return out


def fleet_cuts(cfg: Any, registrations: Mapping[str, Mapping[str, Any]], *, batch: int,
               local_steps: int, rounds: int, codec: str) -> tuple[int, dict[str, int]]:
    """`jetsplit server run`'s cuts for the registered agents: (server cut, cut per agent).

    `[model] split` is a common cut or "auto" (the fleet planner, from the profiles the
    agents registered with); `[model.cuts]` then names cuts by agent id or profile name
    (agent ids first). Every cut is checked against the model's range and, where the agent
    sent a profile, its memory; errors are one line naming the agent."""
    from jetsplit.export.cost_model import get_costs
    from jetsplit.export.planner import (
        ALGORITHMS,
        PlanSettings,
        device_rows,
    )
    from jetsplit.profiles import resolve_profile

    model, algorithm = cfg.model, cfg.train.algorithm
    costs = get_costs(model.name, tuple(model.input_shape), model.classes)
    n = costs.num_layers
    profiles = {a: registered_profile(r) for a, r in sorted(registrations.items())}
    names = {a: (p.name if p is not None else None) for a, p in profiles.items()}
    planned, three_tiers = _planned_as(algorithm)
    settings = PlanSettings(algorithm=planned,
                            batch=batch, local_steps=local_steps, rounds=rounds, codec=codec,
                            common_split=three_tiers,
                            dataset_size=mean_dataset_size(registrations, cfg.train.size_cap,
                                                            cfg.train.provisioned_sizes))
    server = resolve_profile(SERVER_PROFILE)
    if model.split == "auto":
        missing = [a for a, p in profiles.items() if p is None]
        if missing:
            raise ConfigError(f"agent {missing[0]}: registered without a device profile; "
                              f'split = "auto" plans from profiles (give the agent a '
                              f"profile, or [model] split a number)")
        _, cuts, _ = plan_cuts(algorithm, model.name, tuple(model.input_shape), model.classes,
                               profiles, batch=batch, local_steps=local_steps, rounds=rounds,
                               dataset_size=settings.dataset_size, codec=codec,
                               server_profile=SERVER_PROFILE)
    else:
        cuts = dict.fromkeys(profiles, int(model.split))
    for agent in profiles:
        if agent in model.cuts:
            cuts[agent] = model.cuts[agent]
        elif names[agent] in model.cuts:
            cuts[agent] = model.cuts[names[agent]]
    for agent, cut in cuts.items():
        if not 1 <= cut <= n - 1:
            raise ConfigError(f"agent {agent}: cut {cut} is out of range for {model.name}: "
                              f"choose 1..{n - 1}")
        profile = profiles[agent]
        if profile is None or not ALGORITHMS[settings.algorithm].splits:
            continue
        row = device_rows(costs, profile, server, settings)[0][cut - 1]
        if not row.fits:
            raise ConfigError(
                f"agent {agent} ({profile.name}): cut {cut} needs "
                f"{row.memory.total / 2**20:.0f} MiB to train, more than its "
                f"{row.budget_bytes / 2**20:.0f} MiB usable; choose a smaller cut")
    return max(cuts.values()), cuts

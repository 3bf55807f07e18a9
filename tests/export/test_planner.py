"""Split planner: its choice equals brute force for every zoo model × every profile, memory
feasibility is respected, objectives differ, and the CLI ends user errors in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.errors import ConfigError
from jetsplit.export.cost_model import ModelCosts, get_costs
from jetsplit.export.planner import (
    ALGORITHMS,
    InfeasiblePlan,
    PlanSettings,
    check_feasible,
    plan_fleet,
    requires_common_split,
)
from jetsplit.models import MODEL_NAMES
from jetsplit.profiles import DeviceProfile, list_profiles, load_profile, profile_from_dict

REPO = Path(__file__).resolve().parents[2]
PROFILES = list_profiles(REPO / "profiles")
OPT_STATE = {"sgd": 0, "momentum": 1, "adam": 2}
CONTEXT_MB = {"jetson": 300, "gpu": 300, "cpu": 250}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "jetsplit-cache" / "costs"


@pytest.fixture(scope="session")
def all_costs(cache_dir: Path) -> dict[str, ModelCosts]:
    return {name: get_costs(name, (3, 32, 32), 10, cache_dir=cache_dir) for name in MODEL_NAMES}


@pytest.fixture()
def cli_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETSPLIT_CACHE_DIR", str(cache_dir.parent))


def tiny(profile: DeviceProfile, total_mb: float) -> DeviceProfile:
    data = profile.model_dump(mode="python", exclude_none=True)
    data["device"]["name"] = f"tiny-{int(total_mb)}"
    data["memory"]["total_mb"] = total_mb
    return profile_from_dict(data)


# --------------------------------------------------------------------------- brute force
# Written from the documented cost formulas directly on raw layer data, independent of the
# planner's helpers: enumerate every k, cost it from scratch, take the argmin.


def brute_row(c: ModelCosts, p: DeviceProfile, server: DeviceProfile, s: PlanSettings,
              k: int) -> dict[str, float]:
    algo = ALGORITHMS[s.algorithm]
    b, n = s.batch, len(c.layers)
    dev = c.layers[:k]
    flops = sum(la.fwd_flops + la.bwd_flops for la in dev[1:])
    flops += dev[0].fwd_flops + dev[0].bwd_flops_no_input_grad
    params = sum(la.param_bytes for la in dev)
    state = params + sum(la.buffer_bytes for la in dev)
    saved = b * sum(la.saved_first_bytes for la in dev) + sum(la.saved_first_const for la in dev)
    work = max(la.out_numel + (la.in_numel if i else 0) for i, la in enumerate(dev))
    if algo.aux_head:
        aux = c.aux[k - 1]
        flops += aux.fwd_flops + aux.bwd_flops
        params += aux.param_bytes
        state += aux.param_bytes + aux.buffer_bytes
        saved += b * aux.saved_bytes + aux.saved_const
        work = max(work, aux.max_numel + c.layers[k - 1].out_numel)
    context = (s.context_mb if s.context_mb is not None else CONTEXT_MB[p.device.kind]) * 2**20
    memory = (state + params * (1 + OPT_STATE[s.optimizer]) + math.ceil(saved)
              + b * work * 4 + int(context))
    rate = p.compute.peak_fp32_gflops * p.compute.efficiency * 1e9
    compute_ms = b * flops / rate * 1e3
    up = (s.bandwidth_mbps or p.network.uplink_mbps) * 1e6 / 8
    down = (s.bandwidth_mbps or p.network.downlink_mbps) * 1e6 / 8
    iters = s.local_steps
    if algo.one_shot_activations and s.dataset_size:
        iters = math.ceil(s.dataset_size / b)
    act = 0 if k == n else c.layers[k - 1].out_numel * b * 4
    transfer_ms = server_ms = 0.0
    bytes_round = 0.0
    if algo.per_iteration_exchange:
        transfer_ms = ((act + 8 * b) / up + act / down) * 1e3 + p.network.rtt_ms
        bytes_round = iters * (2 * act + 8 * b)
        srv = c.layers[k:]
        sflops = sum(la.fwd_flops + la.bwd_flops for la in srv)
        server_ms = b * sflops / (server.compute.peak_fp32_gflops
                                  * server.compute.efficiency * 1e9) * 1e3
    if algo.aggregates_clients or not algo.splits:
        transfer_ms += ((state / down + state / up) * 1e3 + p.network.rtt_ms) / iters
        bytes_round += 2 * state
    once = 0.0
    if algo.one_shot_activations:
        samples = s.dataset_size or s.local_steps * b
        once = samples * (c.layers[k - 1].out_numel * 4 + 8)
        transfer_ms += once / up * 1e3 / (s.rounds * iters)
    return {"fits": memory <= p.usable_memory_bytes, "dev_ms": compute_ms + transfer_ms,
            "server_ms": server_ms, "bytes": bytes_round + once / s.rounds,
            "flops": b * flops}


def brute_force(c: ModelCosts, fleet: list[DeviceProfile], server: DeviceProfile,
                s: PlanSettings) -> int | None:
    algo = ALGORITHMS[s.algorithm]
    ks = range(1, len(c.layers)) if algo.splits else [len(c.layers)]
    values: dict[int, float] = {}
    for k in ks:
        rows = [brute_row(c, p, server, s, k) for p in fleet]
        if all(r["fits"] for r in rows):
            values[k] = {"time": max(r["dev_ms"] for r in rows)
                         + sum(r["server_ms"] for r in rows),
                         "bytes": sum(r["bytes"] for r in rows),
                         "device-flops": max(r["flops"] for r in rows)}[s.objective]
    if not values:
        return None
    low = min(values.values())
    return next(k for k in sorted(values) if values[k] <= low * (1 + 1e-9))


SERVER = load_profile(PROFILES[[p.stem for p in PROFILES].index("x86-cpu")])
SETTINGS = [
    PlanSettings(),  # the default: splitfed-v1, time
    PlanSettings(objective="bytes"),
    PlanSettings(objective="device-flops"),
    PlanSettings(algorithm="ampere", dataset_size=500, rounds=20),
    PlanSettings(algorithm="fedavg", batch=64, optimizer="adam"),
    PlanSettings(algorithm="psl", batch=256, optimizer="adam", bandwidth_mbps=10),
    PlanSettings(algorithm="splitfed-v2", batch=1024, optimizer="momentum"),  # memory binds
]


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_planner_equals_brute_force_on_every_model_and_profile(
        all_costs: dict[str, ModelCosts], path: Path) -> None:
    profile = load_profile(path)
    for name, costs in all_costs.items():
        for settings in SETTINGS:
            plan = plan_fleet(costs, [profile], SERVER, settings)
            expected = brute_force(costs, [profile], SERVER, settings)
            assert plan.chosen[profile.name] == expected, (name, settings)


def test_fleet_common_split_equals_brute_force(all_costs: dict[str, ModelCosts]) -> None:
    by_name = {p.stem: load_profile(p) for p in PROFILES}
    fleet = [by_name["jetson-nano-4gb"], by_name["orin-nano-8gb"], by_name["agx-orin-64gb"]]
    for name, costs in all_costs.items():
        for settings in (PlanSettings(common_split=True),
                         PlanSettings(algorithm="scala", objective="bytes", common_split=True),
                         PlanSettings(algorithm="ampere", batch=128, optimizer="adam",
                                      common_split=True)):
            plan = plan_fleet(costs, fleet, SERVER, settings)
            assert plan.common and len(set(plan.chosen.values())) == 1
            assert plan.common_k == brute_force(costs, fleet, SERVER, settings), name
    # a tight device drags the common split to where it fits
    small = tiny(by_name["jetson-nano-4gb"], 620)
    costs = all_costs["vgg16"]
    settings = PlanSettings(objective="device-flops", batch=8, common_split=True)
    settings_time = PlanSettings(batch=8, common_split=True)
    for s in (settings, settings_time):
        plan = plan_fleet(costs, [by_name["agx-orin-64gb"], small], SERVER, s)
        assert plan.common_k == brute_force(costs, [by_name["agx-orin-64gb"], small], SERVER, s)
        assert all(plan.fleet_fits[k] == all(d.rows[k - 1].fits for d in plan.devices)
                   for k in plan.fleet_values)


def test_split_methods_plan_per_device_cuts_the_rest_one_cut() -> None:
    common = {n for n, a in ALGORITHMS.items() if requires_common_split(a)}
    assert common == {"fedavg"}


def brute_force_per_device(c: ModelCosts, fleet: list[DeviceProfile], server: DeviceProfile,
                           s: PlanSettings) -> float | None:
    """The least fleet time over every assignment of fitting cuts to the distinct
    profiles (max device ms + Σ server ms, completion layers in each device's server ms)."""
    import itertools

    names = sorted({p.device.name for p in fleet})
    by_name = {p.device.name: p for p in fleet}
    rows = {n: {k: brute_row(c, by_name[n], server, s, k) for k in range(1, len(c.layers))}
            for n in names}
    best = None
    for combo in itertools.product(*[[k for k, r in rows[n].items() if r["fits"]]
                                     for n in names]):
        pick = dict(zip(names, combo, strict=True))
        value = (max(rows[p.device.name][pick[p.device.name]]["dev_ms"] for p in fleet)
                 + sum(rows[p.device.name][pick[p.device.name]]["server_ms"] for p in fleet))
        best = value if best is None else min(best, value)
    return best


def test_per_device_cuts_equal_brute_force_and_never_lose_to_a_common_cut(
        all_costs: dict[str, ModelCosts]) -> None:
    by_name = {p.stem: load_profile(p) for p in PROFILES}
    fleets = [[by_name["jetson-nano-4gb"], by_name["jetson-nano-4gb"],
               by_name["orin-nx-16gb"], by_name["orin-nx-16gb"]],
              [by_name[f"jetson-nano-4gb-{m}mhz"] for m in (921, 640, 320)],
              [tiny(by_name["jetson-nano-4gb"], 900), by_name["agx-orin-64gb"]]]
    for name in ("alexnet", "resnet18", "vgg16", "mobilenetv3-small"):
        costs = all_costs[name]
        for fleet in fleets:
            for settings in (PlanSettings(algorithm="scala", batch=16),
                             PlanSettings(algorithm="psl", bandwidth_mbps=10),
                             PlanSettings(algorithm="ampere", dataset_size=400, rounds=5)):
                plan = plan_fleet(costs, fleet, SERVER, settings)
                want = brute_force_per_device(costs, fleet, SERVER, settings)
                if want is None:
                    assert any(k is None for k in plan.chosen.values())
                    continue
                assert plan.value == pytest.approx(want, rel=1e-9), (name, settings)
                assert all(plan.row(p, k).fits for p, k in plan.chosen.items())  # type: ignore[arg-type]
                common = plan.best_common_k
                assert common is None or plan.value <= plan.fleet_values[common]
                forced = plan_fleet(costs, fleet, SERVER,
                                    PlanSettings(**{**settings.__dict__, "common_split": True}))
                assert forced.common and forced.common_k == common


def with_link(profile: DeviceProfile, name: str, *, up: float, down: float) -> DeviceProfile:
    data = profile.model_dump(mode="python", exclude_none=True)
    data["device"]["name"] = name
    data["network"].update(uplink_mbps=up, downlink_mbps=down)
    return profile_from_dict(data)


def test_ampere_puts_a_slow_uplink_deep_and_a_slow_device_at_p1(
        all_costs: dict[str, ModelCosts]) -> None:
    """§3.2.1 per device: the one-shot upload |D_k|·s^o_p shrinks with p while the compute
    of block + aux and the 2N model exchanges grow. The expectations come from `brute_row`
    (the formula written on raw layer data), not from the planner."""
    by_name = {p.stem: load_profile(p) for p in PROFILES}
    costs = all_costs["resnet18"]
    settings = PlanSettings(algorithm="ampere", batch=32, dataset_size=600, rounds=5)
    lte = with_link(by_name["agx-orin-64gb"], "orin-lte", up=20, down=50)
    wired = with_link(by_name["jetson-nano-4gb-320mhz"], "nano-wired", up=1000, down=1000)
    ks = range(1, costs.num_layers)

    def own_best(profile: DeviceProfile) -> int:
        rows = {k: brute_row(costs, profile, SERVER, settings, k) for k in ks}
        return min((r["dev_ms"], k) for k, r in rows.items() if r["fits"])[1]

    # orin-lte: the upload at k=1 costs more than all its compute at k=1 and k=2 together
    one = brute_row(costs, lte, SERVER, settings, 1)
    iters = math.ceil(600 / 32)
    upload_ms = 600 * (costs.layers[0].out_numel * 4 + 8) / (20e6 / 8) * 1e3
    assert upload_ms / (settings.rounds * iters) > one["dev_ms"] / 2
    deep, shallow = own_best(lte), own_best(wired)
    assert deep > 1 and shallow == 1
    for profile, want in ((lte, deep), (wired, shallow)):
        assert plan_fleet(costs, [profile], SERVER, settings).chosen == {profile.name: want}
    # together: each keeps its own p, and that beats every common cut
    plan = plan_fleet(costs, [wired, lte], SERVER, settings)
    assert plan.chosen == {"nano-wired": 1, "orin-lte": deep} and not plan.common
    assert plan.value == pytest.approx(brute_force_per_device(costs, [wired, lte], SERVER,
                                                              settings), rel=1e-9)
    assert plan.best_common_k is not None
    assert plan.value < plan.fleet_values[plan.best_common_k]
    forced = plan_fleet(costs, [wired, lte], SERVER,
                        PlanSettings(**{**settings.__dict__, "common_split": True}))
    assert forced.common and forced.common_k == plan.best_common_k


@pytest.mark.usefixtures("cli_cache")
def test_cli_plan_prints_amperes_per_device_choice(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    import tomli_w

    by_name = {p.stem: load_profile(p) for p in PROFILES}
    args = ["export", "plan", "--model", "resnet18", "--algorithm", "ampere", "--batch", "32",
            "--dataset-size", "600", "--rounds", "5"]
    for profile in (with_link(by_name["jetson-nano-4gb-320mhz"], "nano-wired", up=1000,
                              down=1000),
                    with_link(by_name["agx-orin-64gb"], "orin-lte", up=20, down=50)):
        path = tmp_path / f"{profile.name}.toml"
        path.write_bytes(tomli_w.dumps(profile.model_dump(mode="json",
                                                          exclude_none=True)).encode())
        args += ["--profile", str(path)]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cuts = {p: d["cut"] for p, d in data["per_device"].items()}
    assert cuts["nano-wired"] == 1 < cuts["orin-lte"] == data["server_cut"]
    assert data["value"] < data["best_common_value"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per-device cuts" in out and "at the best common cut" in out and "(T=19)" in out


def test_infeasible_splits_are_marked_and_never_chosen(all_costs: dict[str, ModelCosts]
                                                       ) -> None:
    nano = load_profile(PROFILES[[p.stem for p in PROFILES].index("jetson-nano-4gb")])
    costs = all_costs["resnet18"]
    squeezed = tiny(nano, 700)  # 420 MiB usable: only the first blocks fit at batch 32
    plan = plan_fleet(costs, [squeezed], SERVER, PlanSettings())
    rows = plan.devices[0].rows
    fits = [r.fits for r in rows]
    assert fits[0] and not fits[-1]
    assert fits == sorted(fits, reverse=True)  # memory grows with k
    assert rows[plan.chosen[squeezed.name] - 1].fits
    none = tiny(nano, 100)
    plan = plan_fleet(costs, [none], SERVER, PlanSettings())
    assert plan.chosen[none.name] is None
    with pytest.raises(InfeasiblePlan, match="no split of resnet18 fits on tiny-100"):
        check_feasible(plan)


def test_objectives_choose_differently(all_costs: dict[str, ModelCosts]) -> None:
    nano = load_profile(PROFILES[[p.stem for p in PROFILES].index("jetson-nano-4gb")])
    costs = all_costs["vgg16"]
    chosen = {o: plan_fleet(costs, [nano], SERVER, PlanSettings(objective=o)).chosen[nano.name]
              for o in ("time", "bytes", "device-flops")}
    assert chosen["device-flops"] == 1  # the smallest client block
    plan = plan_fleet(costs, [nano], SERVER, PlanSettings(objective="bytes"))
    rows = plan.devices[0].rows
    assert rows[chosen["bytes"] - 1].bytes_round == min(r.bytes_round for r in rows)
    assert len(set(chosen.values())) >= 2


def test_algorithms_move_what_they_should(all_costs: dict[str, ModelCosts]) -> None:
    nano = load_profile(PROFILES[[p.stem for p in PROFILES].index("jetson-nano-4gb")])
    costs = all_costs["resnet18"]
    rows = {a: plan_fleet(costs, [nano], SERVER, PlanSettings(algorithm=a)).devices[0].rows
            for a in ("splitfed-v1", "psl", "ampere", "fedavg")}
    k = 3
    sfl, psl, amp = rows["splitfed-v1"][k - 1], rows["psl"][k - 1], rows["ampere"][k - 1]
    assert sfl.bytes_round > psl.bytes_round  # psl never exchanges client blocks
    assert amp.bytes_iter == 0 and amp.bytes_once > 0 and amp.server_ms == 0
    assert amp.device_gflops > sfl.device_gflops  # the aux head trains on the device
    assert amp.memory.total > sfl.memory.total
    assert [r.k for r in rows["fedavg"]] == [costs.num_layers]
    with pytest.raises(ConfigError, match="sherl is planned over three tiers"):
        PlanSettings(algorithm="sherl").validate()


# --------------------------------------------------------------------------- CLI


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


@pytest.mark.usefixtures("cli_cache")
def test_cli_plan_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "plan", "--model", "resnet18", "--profile",
                 str(REPO / "profiles/jetson-nano-4gb.toml")]) == 0
    out = capsys.readouterr().out
    assert "layer4_1" in out and "chosen split: k=" in out
    assert main(["export", "plan", "--model", "resnet18", "--profile", "jetson-nano-4gb",
                 "--profile", "orin-nx-16gb", "--algorithm", "ampere", "--json",
                 "--codec", "int8", "--batch", "16", "--common-split"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["common_split"] and data["chosen_k"] in range(1, 10)
    assert [d["profile"] for d in data["devices"]] == ["jetson-nano-4gb", "orin-nx-16gb"]
    assert len(data["fleet"]) == 9 and data["settings"]["codec"] == "int8"


@pytest.mark.usefixtures("cli_cache")
def test_cli_plan_prints_per_device_cuts_against_the_best_common_cut(
        capsys: pytest.CaptureFixture[str]) -> None:
    fleet = ["--profile", "jetson-nano-4gb-320mhz", "--profile", "jetson-nano-4gb-921mhz",
             "--profile", "agx-orin-64gb"]
    args = ["export", "plan", "--model", "alexnet", "--input-shape", "1,28,28",
            "--algorithm", "scala", "--batch", "16", *fleet]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not data["common_split"]
    cuts = {p: d["cut"] for p, d in data["per_device"].items()}
    assert len(set(cuts.values())) > 1  # a slow Nano cuts shallower than the AGX Orin
    assert cuts["jetson-nano-4gb-320mhz"] < cuts["agx-orin-64gb"]
    assert data["server_cut"] == max(cuts.values())
    assert data["value"] < data["best_common_value"]
    for d in data["per_device"].values():
        assert d["memory_bytes"] <= d["budget_bytes"] and d["compute_ms"] > 0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per-device cuts" in out and "at the best common cut" in out
    assert main([*args, "--common-split", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["common_split"] and data["chosen_k"] == data["best_common_k"]


@pytest.mark.usefixtures("cli_cache")
def test_cli_plan_user_errors_are_one_line(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    nano = ["--profile", "jetson-nano-4gb"]
    _one_line_error(capsys, ["export", "plan", "--model", "resnet99", *nano], "unknown model")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", "--input-shape", "3,32",
                             *nano], "--input-shape")
    bad = tmp_path / "bad.toml"
    bad.write_text("[device]\nname = 'x'\n")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", "--profile", str(bad)],
                    "profile")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", "--profile",
                             str(tmp_path / "missing.toml")], "not found")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", *nano, "--algorithm",
                             "magic"], "unknown algorithm")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", *nano, "--objective",
                             "beauty"], "--objective")
    _one_line_error(capsys, ["export", "plan", "--model", "resnet18", *nano, "--batch", "0"],
                    "--batch")
    small = tmp_path / "small.toml"
    small.write_text((REPO / "profiles/jetson-nano-4gb.toml").read_text().replace(
        "total_mb = 4096", "total_mb = 64"))
    assert main(["export", "plan", "--model", "resnet18", "--profile", str(small)]) == 2
    captured = capsys.readouterr()
    assert "no split of resnet18 fits" in captured.err and "Traceback" not in captured.err

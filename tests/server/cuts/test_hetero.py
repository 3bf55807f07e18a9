"""Per-device cuts (server/cuts/completions.py): equal cuts are the common-cut code bit for bit, a
shallow device plus its completion copy is one SGD step of the whole model, and round-end
aggregation averages every copy of every layer with |D_k| weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker, BatchSampler
from jetsplit.errors import ConfigError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec, build_model
from jetsplit.models.weights import to_arrays
from jetsplit.server.cuts.completions import check_cuts
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.methods import build_method
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SERVER_CUT = 3
SEED = 3


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The coordinator's bundle at the server cut (devices get their cut's block from it)."""
    root = tmp_path_factory.mktemp("cuts")
    report = write_bundle(SPEC, SERVER_CUT, root / "k", seed=SEED, tar=True, aux_ratio=None)
    assert report.tar_path is not None
    return {SERVER_CUT: report.tar_path}


def make_engine(sizes: list[int]) -> InProcessEngine:
    """Agents a0… with shards of the given sizes (so |D_k| weights differ)."""
    train, _ = load_dataset_split("digits", 0.2, 0)
    order = np.random.default_rng(0).permutation(len(train))
    workers, start = {}, 0
    for i, size in enumerate(sizes):
        workers[f"a{i}"] = AgentWorker(f"a{i}", train.subset(order[start:start + size]),
                                       seed=i)
        start += size
    return InProcessEngine(workers)


def trainer_for(archives: dict[int, Path], algorithm: str, cuts: dict[str, int] | None,
                sizes: list[int], *, local_steps: int = 2, batch: int = 24,
                preset: str = "default") -> Trainer:
    _, test = load_dataset_split("digits", 0.2, 0)
    torch.manual_seed(0)
    settings = Settings(algorithm=algorithm, rounds=2, local_steps=local_steps, batch=batch,
                        lr=0.05, seed=0, preset=preset)
    return Trainer(make_engine(sizes), archives[SERVER_CUT], settings, test, cuts=cuts)


def run(trainer: Trainer, rounds: int = 2) -> dict[str, np.ndarray]:
    method = build_method(trainer.settings.algorithm, trainer)
    agents = trainer.engine.registry.eligible()
    for r in range(rounds):
        trainer.round = r
        method.run_round(sorted(agents))
    method.evaluate()
    states = trainer.pull(sorted(agents))
    out = {**to_arrays(trainer.server, "server"), **trainer.global_client}
    for agent, state in states.items():
        out.update({f"{agent}/{k}": v for k, v in trainer.completions.whole(agent, state).items()})
    return out


@pytest.mark.parametrize("algorithm", ["splitfed-v1", "splitfed-v2", "psl", "scala", "gapsl"])
def test_equal_cuts_are_the_common_cut_code_bit_for_bit(archives: dict[int, Path],
                                                        algorithm: str) -> None:
    sizes = [120, 80, 100]
    common = run(trainer_for(archives, algorithm, None, sizes))
    equal = run(trainer_for(archives, algorithm, dict.fromkeys(["a0", "a1", "a2"], SERVER_CUT),
                            sizes))
    assert common.keys() == equal.keys()
    for name, value in common.items():
        assert np.array_equal(value, equal[name]), name


def test_shallow_device_plus_completion_is_one_sgd_step_of_the_whole_model(
        archives: dict[int, Path]) -> None:
    """One agent at cut 1 under a server cut of 3, one SplitFed V1 iteration: the device's
    layer, the coordinator's completion copy of layers 2–3 and the server block move exactly
    as the whole model does under one SGD step on the same batch (same backward pass)."""
    trainer = trainer_for(archives, "splitfed-v1", {"a0": 1}, [150], local_steps=1, batch=16)
    reference = build_model(SPEC, seed=SEED)
    method = build_method("splitfed-v1", trainer)
    method.run_round(["a0"])
    worker = trainer.engine.workers["a0"]
    idx = BatchSampler(len(worker.data), worker.seed).next(16)
    x, y = torch.from_numpy(worker.data.x[idx]), torch.from_numpy(worker.data.y[idx])
    reference.train()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    optimizer.step()
    got = {**{k.split("/", 1)[1]: v for k, v in trainer.global_client.items()},
           **{k.split("/", 1)[1]: v for k, v in to_arrays(trainer.server, "server").items()}}
    want = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    device = trainer.engine.workers["a0"].bundle
    assert trainer.cut("a0") == 1 and device is not None
    assert list(device.manifest.client_layers) == ["stem"]


def test_layerwise_aggregation_by_hand_on_cuts_1_2_3(archives: dict[int, Path]) -> None:
    """Three devices at cuts 1, 2, 3: layer l of the new global block is the |D_k|-weighted
    mean of its three copies — devices with c_k ≥ l and completion copies for the rest."""
    sizes = [60, 90, 150]
    trainer = trainer_for(archives, "scala", {"a0": 1, "a1": 2, "a2": 3}, sizes)
    method = build_method("scala", trainer)
    pulled: dict[str, dict[str, np.ndarray]] = {}
    copies: dict[str, dict[str, np.ndarray]] = {}
    real_pull = trainer.pull

    def spy_pull(agents: list[str], blocks: tuple[str, ...] = ("client",)) -> dict:
        states = real_pull(agents, blocks)
        pulled.update(states)
        copies.update({a: trainer.completions.state(a) for a in agents})
        return states

    trainer.pull = spy_pull  # type: ignore[method-assign]
    method.run_round(["a0", "a1", "a2"])
    layers = ["stem", "bneck0", "bneck1"]
    holders = {  # layer → (agent, where its copy of the layer lives)
        "stem": [("a0", pulled), ("a1", pulled), ("a2", pulled)],
        "bneck0": [("a0", copies), ("a1", pulled), ("a2", pulled)],
        "bneck1": [("a0", copies), ("a1", copies), ("a2", pulled)],
    }
    assert set(pulled["a0"]) == {k for k in pulled["a2"] if k.startswith("client/stem.")}
    assert not any(k.startswith("client/bneck1.") for k in pulled["a1"])
    total = sum(sizes)
    checked = 0
    for name, value in trainer.global_client.items():
        layer = name.split("/", 1)[1].split(".", 1)[0]
        assert layer in layers
        copies_of = [(src[agent][name], sizes[int(agent[1])]) for agent, src in holders[layer]]
        if value.dtype.kind != "f":
            assert np.array_equal(value, np.max([c for c, _ in copies_of], axis=0))
            continue
        expected = sum(c.astype(np.float64) * (w / total) for c, w in copies_of)
        np.testing.assert_allclose(value, expected.astype(value.dtype), rtol=0, atol=1e-7)
        checked += 1
        # the three copies really differ (each trained on its own data), so the test can fail
        assert not np.array_equal(copies_of[0][0], copies_of[2][0]), name
    assert checked > 10


def test_cut_out_of_range_is_one_line_naming_the_agent(archives: dict[int, Path]) -> None:
    with pytest.raises(ConfigError, match=r"^agent nano-2: cut 5 is out of range for "
                                          r"mobilenetv3-small: choose 1\.\.3"):
        check_cuts({"a0": 1, "nano-2": 5}, SERVER_CUT, SPEC.name)
    with pytest.raises(ConfigError, match="agent a1: cut 0"):
        trainer_for(archives, "scala", {"a0": 1, "a1": 0}, [50, 50])


def test_fedavg_refuses_per_device_cuts(archives: dict[int, Path]) -> None:
    trainer = trainer_for(archives, "fedavg", {"a0": 1}, [50, 50])
    with pytest.raises(ConfigError, match="fedavg trains every device at one common cut"):
        build_method("fedavg", trainer)


def test_server_cuts_out_of_range_or_memory_are_one_line_naming_the_device() -> None:
    """`[model.cuts]` by agent id or profile name: a cut outside the model, or one that does
    not fit the device's memory budget, is one ConfigError line naming the agent."""
    from jetsplit.profiles import profile_from_dict, resolve_profile
    from jetsplit.server.cuts.planning import fleet_cuts
    from jetsplit.server.run.config import ServerConfig

    nano = resolve_profile("jetson-nano-4gb").model_dump(mode="json", exclude_none=True)
    small = {**nano, "device": {**nano["device"], "name": "nano-small"},
             "memory": {**nano["memory"], "total_mb": 480}}
    profile_from_dict(small)  # a valid profile: only its budget is tight
    regs = {"a0": {"profile": nano}, "a1": {"profile": small}}

    def cfg(cuts: dict[str, int], split: int | str = 3) -> ServerConfig:
        return ServerConfig.model_validate({"model": {
            "name": "mobilenetv3-small", "input_shape": [1, 8, 8], "split": split,
            "cuts": cuts}})

    kw = {"batch": 32, "local_steps": 2, "rounds": 2, "codec": "fp32"}
    assert fleet_cuts(cfg({"jetson-nano-4gb": 1}), {"a0": regs["a0"]}, **kw) == (1, {"a0": 1})
    assert fleet_cuts(cfg({"a1": 5}), {"a0": {}, "a1": {}}, **kw) == (5, {"a0": 3, "a1": 5})
    with pytest.raises(ConfigError, match=r"^agent a0: cut 14 is out of range for "
                                          r"mobilenetv3-small: choose 1\.\.13$"):
        fleet_cuts(cfg({"a0": 14}), {"a0": {}}, **kw)
    with pytest.raises(ConfigError, match=r"^agent a1 \(nano-small\): cut 3 needs \d+ MiB to "
                                          r"train, more than its \d+ MiB usable"):
        fleet_cuts(cfg({"a0": 3}), regs, **kw)
    with pytest.raises(ConfigError, match='^agent a0: registered without a device profile; '
                                          'split = "auto"'):
        fleet_cuts(cfg({}, "auto"), {"a0": {}}, **kw)


def test_completion_copies_step_with_the_client_tiers_optimiser(archives: dict[int, Path]
                                                                 ) -> None:
    """The copies train client layers: GAPSL's client tier (SGD, momentum 0.9, lr 0.005 by
    its paper) applies to them as to the devices' blocks."""
    trainer = trainer_for(archives, "gapsl", {"a0": 1}, [50, 50], preset="paper")
    trainer.completions.begin_round(["a0", "a1"], trainer.global_client, fresh=False)
    assert set(trainer.completions.copies) == {"a0"}
    group = trainer.completions.optimizers["a0"].param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.005, 0.9)


def test_ampere_fleet_plans_a_block_per_device_from_profile_files(tmp_path: Path) -> None:
    """`trial` and `simulate --profile` plan through `plan_cuts`: Ampere gets a block per
    device (a slow device on a fast link at 1, a fast one on a slow uplink deeper), also
    from profile files (named by their profile), and one cut with `common_split`."""
    import tomli_w

    from jetsplit.profiles import resolve_profile
    from jetsplit.server.cuts.planning import plan_cuts

    paths = {}
    for name, base, compute, up in (("nano-slow", "jetson-nano-4gb-320mhz", 50.0, 1000.0),
                                    ("orin-thin", "agx-orin-64gb", 1.0, 1.0)):
        data = resolve_profile(base).model_dump(mode="json", exclude_none=True)
        data["device"]["name"] = name
        data["compute"]["peak_fp32_gflops"] /= compute
        for key in ("peak_fp16_gflops", "gpu_clock_mhz"):
            data["compute"].pop(key, None)
        data.pop("measured", None)
        data["network"].update(uplink_mbps=up, downlink_mbps=max(up, 50.0))
        paths[name] = tmp_path / f"{name}.toml"
        paths[name].write_bytes(tomli_w.dumps(data).encode())
    fleet = {"a0": str(paths["nano-slow"]), "a1": str(paths["orin-thin"])}
    kw = {"batch": 16, "local_steps": 10, "rounds": 3, "dataset_size": 718, "codec": "fp32",
          "server_profile": "x86-cpu"}
    server_cut, cuts, plan = plan_cuts("ampere", "resnet18", (1, 8, 8), 10, fleet, **kw)
    assert cuts["a0"] == 1 < cuts["a1"] == server_cut
    assert plan["agents"]["a1"]["predicted_transfer_s"] > 0
    assert plan["value"] < plan["best_common_value"]
    _, common, _ = plan_cuts("ampere", "resnet18", (1, 8, 8), 10, fleet, common_split=True,
                             **kw)
    assert len(set(common.values())) == 1


# ---------------------------------------------------------------- live re-planning switches


def _bundle_part_bytes(trainer: Trainer) -> int:
    return int(trainer.engine.counters.by_kind()["down"].get("bundle_part", 0))


@pytest.mark.parametrize("algorithm", ["scala", "splitfed-v1"])
def test_a_switch_restarts_the_device_and_its_copy_from_the_global_layers(
        archives: dict[int, Path], algorithm: str) -> None:
    """Averaging methods, a0 moved 3 → 1 after round 0: round 1 starts a0's device with
    exactly the global layer 1 (in its new cut's bundle, shipped) and its completion copy
    with exactly the global layers 2–3; moved back 1 → 3 after round 1, no bundle byte is
    shipped again (the device's cache holds its old cut)."""
    trainer = trainer_for(archives, algorithm, {"a0": 3, "a1": 2}, [120, 80])
    method = build_method(algorithm, trainer)
    seen: dict[str, dict[str, np.ndarray]] = {}
    real_begin = method.begin_round

    def spy_begin(selected: list[str]) -> None:  # after the push and the copies' rebuild
        if trainer.round == 1:
            seen["device"] = trainer.pull(["a0"])["a0"]
            seen["copy"] = trainer.completions.state("a0")
            seen["global"] = dict(trainer.global_client)
        real_begin(selected)

    method.begin_round = spy_begin  # type: ignore[method-assign]
    trainer.round = 0
    method.run_round(["a0", "a1"])
    assert method.switch_cuts({"a0": 1, "a1": 2}) == ["a0"]
    assert trainer.cut("a0") == 1
    shipped = _bundle_part_bytes(trainer)
    trainer.round = 1
    method.run_round(["a0", "a1"])
    assert _bundle_part_bytes(trainer) > shipped  # cut 1's bundle was new to a0
    g = seen["global"]
    device = {k: v for k, v in seen["device"].items() if k.startswith("client/")}
    assert sorted(device) == sorted(k for k in g if k.startswith("client/stem."))
    assert sorted(seen["copy"]) == sorted(k for k in g if not k.startswith("client/stem."))
    for name, value in {**device, **seen["copy"]}.items():
        assert np.array_equal(value, g[name]), name
    assert list(trainer.engine.workers["a0"].bundle.manifest.client_layers) == ["stem"]

    assert method.switch_cuts({"a0": 3}) == ["a0"]
    shipped = _bundle_part_bytes(trainer)
    trainer.round = 2
    method.run_round(["a0", "a1"])
    assert _bundle_part_bytes(trainer) == shipped
    assert trainer.completions.state("a0") == {}
    assert list(trainer.engine.workers["a0"].bundle.manifest.client_layers) == [
        "stem", "bneck0", "bneck1"]


@pytest.mark.parametrize("algorithm", ["psl", "gapsl"])
def test_a_switch_moves_an_agents_own_block_between_device_and_copy_losslessly(
        archives: dict[int, Path], algorithm: str) -> None:
    """PSL/GAPSL: an agent's block is its own. Moved 3 → 1 and back, its whole block (device
    layers ∪ completion copy) is bit for bit the block it had trained, each time."""
    trainer = trainer_for(archives, algorithm, {"a0": 3, "a1": 2}, [120, 80])
    method = build_method(algorithm, trainer)
    trainer.round = 0
    method.run_round(["a0", "a1"])
    method.evaluate()
    trained = dict(method.agent_blocks["a0"])

    def reinstall(cut: int, layers: list[str]) -> dict[str, np.ndarray]:
        assert method.switch_cuts({"a0": cut}) == ["a0"]
        trainer.round += 1
        trainer.completions.begin_round(["a0", "a1"], trainer.global_client, fresh=False)
        method.begin_round(["a0", "a1"])  # what run_round does before training
        assert list(trainer.engine.workers["a0"].bundle.manifest.client_layers) == layers
        state = {k: v for k, v in trainer.pull(["a0"])["a0"].items()
                 if k.startswith("client/")}
        assert {k.split("/", 1)[1].split(".", 1)[0] for k in state} == set(layers)
        return trainer.completions.whole("a0", state)

    for cut, layers in ((1, ["stem"]), (3, ["stem", "bneck0", "bneck1"])):
        whole = reinstall(cut, layers)
        assert whole.keys() == trained.keys()
        for name, value in trained.items():
            assert np.array_equal(whole[name], value), (cut, name)
        method.evaluate()
    assert not method.to_restore

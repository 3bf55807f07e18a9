"""The coordinator's defences against an enrolled device that lies, end to end in one
process (the attacker is the real agent worker under `edge_agent.attacks`): SplitFed V1,
VGG-11 (batch norm: it learns within a few steps, as in the method matrix), 5 agents on
digits (iid), 3 rounds × 8 steps of 16 samples each, lr 0.1, one attacker a4.

- The defences cost a clean run nothing: with the activation bound on (the default) and
  off, a clean run ends bit for bit the same, and nothing is bounded.
- Client weights × 1000: with the default outlier bound a4's client block is left out of
  every round's mean (nobody else's), the accuracy stays within 0.1 of clean and the
  block's norm near the clean one; without it (`outlier_bound = 0`), under the plain mean
  the client block grows ~200-fold and the accuracy falls (or the run stops as
  diverged); Multi-Krum (bound off) leaves a4's client block out every
  round (and one server copy per round, as it always drops f = 1 of five), keeps the clean
  accuracy within 0.1 and the block's norm near the clean one. Under FedAvg (direction
  check off) a4 then only probes and the others take its share of the batch.
- Activations × 10^6: with the bound, a4's samples are scaled down every round and the
  accuracy stays within 0.1 of clean."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.divergence import Diverged
from jetsplit.server.training.settings import Settings


@pytest.fixture(autouse=True)
def _setup(one_torch_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")


def _run(out: Path, attack: str | None = None, **settings: Any) -> tuple[dict, list[dict]]:
    base: dict[str, Any] = dict(algorithm="splitfed-v1", rounds=3, local_steps=8, batch=80,
                                lr=0.1, seed=0, threads=1, device="cpu")
    summary = simulate(Settings(**{**base, **settings}), model="vgg11", split=2,
                       dataset="digits", clients=5, partition_scheme="iid", out_dir=out,
                       attacks={"a4": attack} if attack else None, checkpoint=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return summary, rows


def _weights(run: Path) -> dict[str, np.ndarray]:
    return {f"{p.name}:{k}": v for p in sorted(run.glob("*.safetensors"))
            for k, v in load_file(str(p)).items()}


def _assert_same_weights(a: Path, b: Path) -> None:
    """Two runs' saved weights, bit for bit (a check that judged nobody changed nothing)."""
    first, second = _weights(a), _weights(b)
    assert first and first.keys() == second.keys()
    for name, value in first.items():
        np.testing.assert_array_equal(value, second[name], err_msg=name)


def test_the_defences_cost_a_clean_run_nothing_and_contain_an_attacker(tmp_path: Path) -> None:
    clean, rows = _run(tmp_path / "clean")
    unbounded, _ = _run(tmp_path / "unbounded", activation_bound=0.0)
    assert all(r["bounded"] == {} and r["aggregation"] == {} for r in rows)
    assert all(r["activation_scale"] == {} for r in rows)
    for r in rows:  # every device's share of the client average, by its size (iid shards)
        assert sorted(r["influence"]) == ["a0", "a1", "a2", "a3", "a4"]
        assert sum(r["influence"].values()) == pytest.approx(1.0, abs=1e-5)
        assert min(r["influence"].values()) > 0.15
    assert clean["final_accuracy"] == unbounded["final_accuracy"]
    a, b = _weights(tmp_path / "clean"), _weights(tmp_path / "unbounded")
    assert a and all(a[k].tobytes() == b[k].tobytes() for k in a)
    accuracy = clean["final_accuracy"]
    assert accuracy > 0.3

    def client_norm(run: Path) -> float:
        weights = load_file(str(run / "client.safetensors"))
        return float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for k, v in weights.items()
                                 if v.dtype.kind == "f")))

    clean_norm = client_norm(tmp_path / "clean")
    guarded, rows = _run(tmp_path / "guarded", "scale:1000")  # the defaults
    assert [sorted(r["aggregation"]) for r in rows] == [["a4"]] * 3
    assert all(r["aggregation"]["a4"].startswith("client: left out: update norm ")
               and "over 10× the median" in r["aggregation"]["a4"] for r in rows)
    assert all(r["influence"]["a4"] < 0.2 for r in rows)  # its server copy still counts
    # within 0.1, as below: leaving a4's client block out changes the trajectory, and how far
    # 24 steps of VGG-11 then drift depends on the CPU's float kernels (0.075 on one host)
    assert guarded["final_accuracy"] >= accuracy - 0.1
    assert 0.5 * clean_norm < client_norm(tmp_path / "guarded") < 2 * clean_norm
    try:  # undefended: the scaled upload owns the average (~1000/5 times the honest block)
        wrecked = _run(tmp_path / "fedavg", "scale:1000",
                       outlier_bound=0.0)[0]["final_accuracy"]
        assert client_norm(tmp_path / "fedavg") > 50 * clean_norm
    except Diverged:
        wrecked = 0.0
    assert wrecked < accuracy - 0.1
    krum, rows = _run(tmp_path / "krum", "scale:1000", aggregator="multi-krum",
                      outlier_bound=0.0)
    # a4's client block is left out every round; Multi-Krum also leaves out f = 1 of the
    # five server copies each round (whichever scores worst: a4's is honest under this attack)
    assert all("client: left out by multi-krum" in r["aggregation"]["a4"] for r in rows)
    assert all(sum("client: left out" in n for n in r["aggregation"].values()) == 1
               for r in rows)
    assert all(sum("server copy: left out" in n for n in r["aggregation"].values()) == 1
               for r in rows)
    for r in rows:  # a device left out of both blocks has no say; a4 never more than any
        notes, share = r["aggregation"], r["influence"]
        for agent, note in notes.items():
            if "client: left out" in note and "server copy: left out" in note:
                assert share[agent] == 0.0
        assert share["a4"] <= max(v for a, v in share.items() if a != "a4")
    assert all(sum(r["influence"].values()) == pytest.approx(1.0, abs=1e-5) for r in rows)
    assert krum["final_accuracy"] >= accuracy - 0.1
    assert 0.5 * clean_norm < client_norm(tmp_path / "krum") < 2 * clean_norm

    bounded, rows = _run(tmp_path / "bounded", "activation-scale:1000000")
    assert [sorted(r["bounded"]) for r in rows] == [["a4"]] * 3
    assert [sorted(r["activation_scale"]) for r in rows] == [["a4"]] * 3
    assert all(1e-8 < r["activation_scale"]["a4"] < 1e-4 for r in rows)  # ~ × 10^-6 back
    assert bounded["final_accuracy"] >= accuracy - 0.1


def test_fedavg_gives_an_outliers_batch_share_to_the_others(tmp_path: Path) -> None:
    """FedAvg, a4 scaling its model ×1000, the direction check off (it catches this
    upload too): the outlier bound leaves its upload out of every round's average, and
    from round 1 on it only probes (PROBE_BATCH samples a step, to be
    judged again) while the others split its share of B: round 0's work is equal (iid
    shards of equal size, 16 samples each), later a4 does 8/20 of an honest device's."""
    from jetsplit.server.defences.label_check import PROBE_BATCH

    _, rows = _run(tmp_path / "scaled", "scale:1000", algorithm="fedavg",
                   direction_check="off")
    assert [sorted(r["aggregation"]) for r in rows] == [["a4"]] * 3
    assert all("model: left out: update norm " in r["aggregation"]["a4"] for r in rows)
    work = [r["device_gflops"] for r in rows]
    assert work[0]["a4"] == pytest.approx(work[0]["a0"])
    for w in work[1:]:
        assert w["a4"] == pytest.approx(w["a0"] * PROBE_BATCH / 20)
        assert w["a1"] == pytest.approx(w["a0"])


NONE = dict(aggregator="mean", activation_bound=0.0, size_cap=0.0, loss_bound=0.0,
            outlier_bound=0.0, histogram_check="off", label_check="off",
            direction_check="off", gradient_bound=0.0)  # bench_robust's `none`


@pytest.mark.parametrize(("algorithm", "shares"), [("scala", "free"),
                                                   ("scala", "all"),
                                                   ("psl", "all"),
                                                   ("splitfed-v2", "free")])
def test_the_default_defence_leaves_a_clean_shared_step_run_bit_for_bit(
        tmp_path: Path, algorithm: str, shares: str) -> None:
    """One server block stepped on every device (SCALA's and PSL's slices, each device's
    gradient share measured under `all`; SplitFed V2's one device per step): a clean run
    under the defaults names nobody and ends with the weights of a run with every defence
    off, bit for bit. Before the loss bound's floor
    (chance level, ln C), late steps' tiny median loss down-weighted honest hard batches
    (SCALA), and SplitFed V2's next device after the server block fitted the last one."""
    _, rows = _run(tmp_path / "default", algorithm=algorithm, gradient_shares=shares)
    for r in rows:
        assert r["down_weighted"] == {} and r["gradient_clipped"] == {}, r["round"]
        assert r["bounded"] == {} and r["aggregation"] == {} and r["excluded"] == {}
    _run(tmp_path / "none", algorithm=algorithm, **NONE)
    _assert_same_weights(tmp_path / "default", tmp_path / "none")


def test_splitfed_v1_combines_its_server_copies_under_the_robust_rule(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SplitFed V1's per-device server copies are uploads too (a device's copy trained on
    its own, possibly flipped, labels): under `median` the round's server block is the
    coordinate-wise median of the copies (integer buffers too), not their mean."""
    import torch

    from jetsplit.models.weights import to_arrays
    from jetsplit.server.methods.splitfed import SplitFedV1

    seen: dict[str, Any] = {}
    real_end = SplitFedV1.end_round

    def spy(self: SplitFedV1, participants: list[str]) -> None:
        seen["copies"] = {a: to_arrays(self.copies[a], "server") for a in participants}
        real_end(self, participants)
        seen["server"] = to_arrays(self.trainer.server, "server")

    monkeypatch.setattr(SplitFedV1, "end_round", spy)
    _run(tmp_path / "median", "labelflip", rounds=1, aggregator="median", local_steps=2,
         label_check="off")  # a4 stays in: its copy is one of the five
    copies, server = seen["copies"], seen["server"]
    assert sorted(copies) == ["a0", "a1", "a2", "a3", "a4"]
    floats = [n for n, v in server.items() if v.dtype.kind == "f" and v.size > 1]
    assert len(floats) >= 4
    for name, value in server.items():
        stacked = np.stack([copies[a][name] for a in sorted(copies)])
        want = torch.from_numpy(stacked).median(dim=0).values.numpy() \
            if value.dtype.kind != "f" else np.median(stacked, axis=0)
        np.testing.assert_allclose(value, want.astype(value.dtype), rtol=0, atol=1e-6)
        if name in floats:
            assert not np.allclose(value, stacked.mean(axis=0), rtol=0, atol=1e-7), name


def test_all_gradient_shares_reach_scalas_server_step_only_when_asked(tmp_path: Path) -> None:
    """The wiring from `[train] gradient_shares` to SCALA's step (the arithmetic is pinned by
    hand in test_methods_fast.py): at a tight gradient bound of 1.2× the median share,
    `all` clips some honest slices (a bound that tight cuts the larger ordinary
    shares), notes them and changes the weights; `free` measures nothing, notes
    nobody and gives the run with the bound off, bit for bit. A label flipper's share did
    not reach 5× the others' in three rounds (the loss bound and the label check are what
    catch it); scaled activations are the activation bound's: under BatchNorm they spoil
    every slice's statistics, which no weight on one slice's term undoes."""
    tight = dict(algorithm="scala", gradient_bound=1.2)
    _, rows = _run(tmp_path / "every", gradient_shares="all", **tight)
    assert any(r["gradient_clipped"] for r in rows)
    assert all("with its server-gradient share clipped, last: " in note
               for r in rows for note in r["gradient_clipped"].values())
    _, rows = _run(tmp_path / "free", **tight)
    assert all(r["gradient_clipped"] == {} for r in rows)
    _run(tmp_path / "off", algorithm="scala", gradient_bound=0.0)
    _assert_same_weights(tmp_path / "free", tmp_path / "off")
    with pytest.raises(AssertionError):
        _assert_same_weights(tmp_path / "every", tmp_path / "off")


def test_a_label_flipper_is_down_weighted_in_scalas_server_step(tmp_path: Path) -> None:
    """SCALA (one server step over every device's slice), a4 flips its labels, the label
    check off (it would leave a4 out first, below): once the honest devices have learned,
    its loss stays several times theirs and the loss bound down-weights its term in more
    steps than any honest device's (an honest device's small batch can cross the bound now
    and then); with the bound off nothing is noted."""
    def steps(note: str) -> int:
        return int(note.split(" ", 1)[0])

    _, rows = _run(tmp_path / "bounded", "labelflip", algorithm="scala", label_check="off")
    counted: dict[str, int] = {}
    for r in rows:
        for agent, note in r["down_weighted"].items():
            assert "down-weighted, last: loss" in note
            counted[agent] = counted.get(agent, 0) + steps(note)
    assert counted.get("a4", 0) > max([n for a, n in counted.items() if a != "a4"] or [0])
    _, rows = _run(tmp_path / "off", "labelflip", algorithm="scala", loss_bound=0.0,
                   label_check="off")
    assert all(r["down_weighted"] == {} for r in rows)


@pytest.mark.parametrize("algorithm", ["scala", "splitfed-v1"])
def test_a_label_flipper_is_left_out_by_the_label_check(tmp_path: Path, algorithm: str) -> None:
    """With the defaults, a4 (labels c → c + 1) sits out the server update from its second
    judged step (two in a row make a verdict) and its uploads are left out of every round's
    averages (client block, and SplitFed V1's server copy); nobody else is ever judged
    inconsistent. A clean run gives the same bits with the check on and off, and notes
    nothing."""
    _, rows = _run(tmp_path / "flip", "labelflip", algorithm=algorithm)
    for r in rows:
        assert sorted(r["excluded"]) == ["a4"], r["excluded"]
        assert "labels inconsistent with its activations" in r["excluded"]["a4"]
        assert sorted(r["aggregation"]) == ["a4"]
        assert "client: left out: labels inconsistent" in r["aggregation"]["a4"]
        assert r["influence"]["a4"] == 0.0
    assert int(rows[1]["excluded"]["a4"].split(" ", 1)[0]) == 8  # every step of round 1
    if algorithm == "splitfed-v1":
        assert "server copy: left out: labels inconsistent" in rows[0]["aggregation"]["a4"]
    clean, rows = _run(tmp_path / "clean", algorithm=algorithm)
    off, _ = _run(tmp_path / "clean-off", algorithm=algorithm, label_check="off")
    assert all(r["excluded"] == {} for r in rows)
    assert clean["final_accuracy"] == off["final_accuracy"]
    _assert_same_weights(tmp_path / "clean", tmp_path / "clean-off")


@pytest.mark.parametrize(("algorithm", "block"), [("fedavg", "model"),
                                                ("splitfed-v1", "client")])
def test_a_reverser_is_left_out_by_the_direction_check(tmp_path: Path, algorithm: str,
                                                       block: str) -> None:
    """With the defaults, a4 uploading its updates reversed (g − (w − g): an honest norm,
    so the outlier bound passes it) is left out of every round's averages for pointing away
    from the fleet's median update, and nobody else is. A clean run gives the same bits
    with the check on and off, and notes nothing."""
    _, rows = _run(tmp_path / "flip", "signflip", algorithm=algorithm)
    for r in rows:
        assert sorted(r["aggregation"]) == ["a4"], r["aggregation"]
        assert f"{block}: left out: update opposed to the fleet's" in r["aggregation"]["a4"]
        honest = min(v for a, v in r["influence"].items() if a != "a4")
        if algorithm == "fedavg":  # its one upload is left out
            assert r["influence"]["a4"] == 0.0
        else:  # its server copy (trained by the coordinator) still counts
            assert 0.0 < r["influence"]["a4"] < honest
    clean, rows = _run(tmp_path / "clean", algorithm=algorithm)
    off, _ = _run(tmp_path / "clean-off", algorithm=algorithm, direction_check="off")
    assert all(r["aggregation"] == {} for r in rows)
    assert clean["final_accuracy"] == off["final_accuracy"]
    _assert_same_weights(tmp_path / "clean", tmp_path / "clean-off")


def test_absent_clients_keep_their_shard_but_never_join(tmp_path: Path) -> None:
    """`simulate(absent=...)` (bench_robust's `without` row): the partition of 4 clients
    is the same, a3's shard simply never trains, so a0..a2 hold exactly the samples they
    hold in the full fleet; naming a stranger, or every client, is one ConfigError."""
    from jetsplit.errors import ConfigError

    base = dict(model="alexnet", split=2, dataset="digits", clients=4,
                partition_scheme="dirichlet:0.5", checkpoint=False)
    settings = Settings(algorithm="splitfed-v1", rounds=1, local_steps=1, batch=16, seed=3)
    full = simulate(settings, out_dir=tmp_path / "full", **base)
    less = simulate(settings, out_dir=tmp_path / "less", absent=["a3"], **base)
    sizes = {v["agent"]: v["dataset_size"] for v in full["agents"]}
    assert sorted(sizes) == ["a0", "a1", "a2", "a3"]
    assert {v["agent"]: v["dataset_size"] for v in less["agents"]} == {
        a: sizes[a] for a in ("a0", "a1", "a2")}
    saved = json.loads((tmp_path / "less" / "simulation.json").read_text())
    assert saved["absent"] == ["a3"]
    for absent in (["a9"], ["a0", "a1", "a2", "a3"]):
        with pytest.raises(ConfigError, match="absent clients"):
            simulate(settings, out_dir=tmp_path / "bad", absent=absent, **base)


@pytest.mark.parametrize("algorithm", ["fedavg", "splitfed-v1"])
def test_a_size_liar_weighs_as_its_provisioned_truth(tmp_path: Path, algorithm: str) -> None:
    """a3 registers 10^9 samples. With each client's shard size provisioned
    (`provision_sizes`, as `jetsplit provision --size` writes them), its claim weighs as its
    true size in every average and batch share: the run ends with the clean run's bits, and
    the summary names a3 and the bound. Under the median cap alone the lie still moves the
    weights (it weighs 5× the median, over its truth on this unequal partition)."""
    base = dict(model="alexnet", split=2, dataset="digits", clients=4,
                partition_scheme="dirichlet:0.5", checkpoint=False)
    settings = Settings(algorithm=algorithm, rounds=2, local_steps=2, batch=32, seed=3,
                        threads=1, device="cpu")
    lie = {"a3": "size-lie:1000000000"}
    clean = simulate(settings, out_dir=tmp_path / "clean", **base)
    truth = {v["agent"]: v["dataset_size"] for v in clean["agents"]}
    assert len(set(truth.values())) == 4  # unequal: a wrong weight shows
    told = simulate(settings, out_dir=tmp_path / "told", attacks=lie, provision_sizes=True,
                    **base)
    assert told["capped_claims"] == {"a3": {"claimed": 10**9, "weight": truth["a3"],
                                            "by": "provisioned size"}}
    _assert_same_weights(tmp_path / "clean", tmp_path / "told")
    saved = json.loads((tmp_path / "told" / "simulation.json").read_text())
    assert saved["provision_sizes"] and saved["settings"]["provisioned_sizes"] == truth
    capped = simulate(settings, out_dir=tmp_path / "capped", attacks=lie, **base)
    assert capped["capped_claims"]["a3"]["by"] == "size cap"
    assert capped["capped_claims"]["a3"]["weight"] > truth["a3"]
    assert _weights(tmp_path / "capped")  # and they differ from the clean run's
    with pytest.raises(AssertionError):
        _assert_same_weights(tmp_path / "clean", tmp_path / "capped")

"""Each method wired as its paper runs it: tests that a plausible wrong wiring makes fail.

The core math has its own tests (test_algorithm_math); these pin what surrounds it: who is
averaged with which weights, in which order clients are served, which iteration counter
drives GAPSL's K^t, who gets gradients, which label distribution SCALA adjusts with, and
that Ampere's ablation really trains per-agent copies. The engine is the real in-process
one; the tests only watch the messages it carries (a recording wrapper, no stand-in).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jetsplit.data import ArrayDataset, load_dataset_split
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.defences.aggregators import fedavg
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.methods import build_method, gapsl_math, scala_math
from jetsplit.server.methods.splitfed import SplitFedV1
from jetsplit.server.run.simulate import simulate
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)
SIZES = (60, 240, 30)  # unequal |D_k|: |D_k| weights and uniform ones differ


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("b") / "bundle", seed=3, tar=True)
    assert report.tar_path is not None
    return report.tar_path


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset_split("digits", 0.2, 0)


class Recorder:
    """Wraps a real engine's send_and_receive and keeps (kind, agents, step, outcome)."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.log: list[tuple[str, list[str], int, Any, Any]] = []
        inner = engine.send_and_receive

        def recording(commands: Any, **kw: Any) -> Any:
            out = inner(commands, **kw)
            kind = next(iter(commands.values())).kind if commands else ""
            self.log.append((kind, sorted(commands), kw.get("step", 0), commands, out))
            return out

        engine.send_and_receive = recording  # type: ignore[method-assign]

    def of(self, kind: str) -> list[tuple[str, list[str], int, Any, Any]]:
        return [e for e in self.log if e[0] == kind]


def skewed_engine(digits: tuple[ArrayDataset, ArrayDataset], sizes: tuple[int, ...] = SIZES,
                  classes_per_agent: int = 3) -> InProcessEngine:
    """Agents with the given sizes, each holding a few classes (label skew)."""
    train, _ = digits
    rng = np.random.default_rng(0)
    workers = {}
    for i, n in enumerate(sizes):
        held = [(3 * i + j) % 10 for j in range(classes_per_agent)]
        pool = np.flatnonzero(np.isin(train.y, held))
        idx = np.sort(rng.choice(pool, size=n, replace=False))
        workers[f"a{i}"] = AgentWorker(f"a{i}", train.subset(idx), seed=i)
    return InProcessEngine(workers)


def trainer_for(engine: InProcessEngine, archive: Path, test: ArrayDataset, **kw: Any
                ) -> Trainer:
    # The mean rule's weights, without the outlier bound: in this fixture a2 (30 samples,
    # BatchNorm on batches of 3) returns an update ~1000× the others' norm, which the
    # default bound would leave out (server/defences/aggregators.py; tested in test_aggregators).
    base = dict(rounds=1, local_steps=2, batch=33, lr=0.05, outlier_bound=0.0)
    return Trainer(engine, archive, Settings(**{**base, **kw}), test)


def weights_of(record: Recorder) -> dict[str, dict[str, np.ndarray]]:
    """The client blocks the agents returned for aggregation (last get_weights)."""
    entries = record.of(Kind.GET_WEIGHTS.value)
    assert entries, "no block was collected"
    return {a: r.tensors for a, r in entries[-1][4].replies.items()}


def close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = 1e-6) -> bool:
    return set(a) == set(b) and all(
        np.allclose(np.asarray(a[k], np.float64), np.asarray(b[k], np.float64), atol=tol)
        for k in a)


def assert_size_weighted(trainer: Trainer, states: dict[str, dict[str, np.ndarray]]) -> None:
    sizes = trainer.defences.sizes(sorted(states))
    assert close(trainer.global_client, fedavg(states, sizes))
    uniform = fedavg(states, dict.fromkeys(states, 1))
    assert not close(uniform, fedavg(states, sizes))  # the check can tell them apart


# ---------------------------------------------------------------- FedAvg, SplitFed V1/V2


def test_fedavg_weighs_each_agent_by_its_dataset_size(archive: Path, digits: Any) -> None:
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="fedavg")
    build_method("fedavg", trainer).run_round(engine.online())
    states = weights_of(record)
    clients = {a: {k: v for k, v in s.items() if k.startswith("client/")}
               for a, s in states.items()}
    assert_size_weighted(trainer, clients)


def test_splitfed_v1_averages_client_blocks_and_server_copies_by_size(archive: Path,
                                                                      digits: Any) -> None:
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="splitfed-v1")
    method = build_method("splitfed-v1", trainer)
    copies: dict[str, Any] = {}
    end_round = method.end_round

    def keep_copies(participants: list[str]) -> None:
        copies.update({a: to_arrays(m, "server") for a, m in method.copies.items()})
        end_round(participants)

    method.end_round = keep_copies  # type: ignore[method-assign]
    method.run_round(engine.online())
    assert_size_weighted(trainer, weights_of(record))
    sizes = trainer.defences.sizes(sorted(copies))
    assert close(to_arrays(trainer.server, "server"), fedavg(copies, sizes))


def test_splitfed_v2_runs_each_clients_whole_pass_before_the_next(archive: Path,
                                                                  digits: Any) -> None:
    """The reference implementation's schedule: a,a,a,b,b,b,… (not a,b,a,b,…), client
    blocks averaged by size at round end, one server block throughout."""
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="splitfed-v2", local_steps=3)
    build_method("splitfed-v2", trainer).run_round(engine.online())
    forwards = [(e[1][0], e[2]) for e in record.of(Kind.FORWARD.value)]
    assert all(len(e[1]) == 1 for e in record.of(Kind.FORWARD.value))
    agents = [a for a, _ in forwards]
    runs = [agents[i] for i in range(len(agents)) if i == 0 or agents[i] != agents[i - 1]]
    assert sorted(runs) == sorted(engine.online())  # each client's steps are contiguous
    assert [s for _, s in forwards] == [0, 1, 2] * 3
    assert_size_weighted(trainer, weights_of(record))


def test_splitfed_v2_interleaved_variant_serves_one_step_per_client(archive: Path,
                                                                    digits: Any) -> None:
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], local_steps=2)
    build_method("splitfed-v2-interleaved", trainer).run_round(engine.online())
    steps = [e[2] for e in record.of(Kind.FORWARD.value)]
    assert steps == [0, 0, 0, 1, 1, 1]


# ---------------------------------------------------------------- SCALA family


def test_scala_adjusts_client_gradients_with_the_registered_label_distribution(
        archive: Path, digits: Any) -> None:
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="scala", local_steps=1,
                          batch=12)
    server0 = copy.deepcopy(trainer.server)
    build_method("scala", trainer).run_round(engine.online())
    fwd = record.of(Kind.FORWARD.value)[0][4]
    agents = fwd.agents
    acts = [torch.from_numpy(np.array(fwd[a].tensors["activations"])) for a in agents]
    labels = [torch.from_numpy(np.array(fwd[a].tensors["labels"], np.int64)) for a in agents]
    hist = [engine.registry.registration(a)["dataset"]["label_histogram"] for a in agents]
    priors = [scala_math.prior_from_counts(h, 10) for h in hist]
    expected_server = copy.deepcopy(server0)
    _, expected = scala_math.scala_server_step(
        expected_server, acts, labels, 10,
        torch.optim.SGD(expected_server.parameters(), lr=0.05), client_priors=priors)
    _, batch_prior = scala_math.scala_server_step(
        copy.deepcopy(server0), acts, labels, 10,
        torch.optim.SGD(copy.deepcopy(server0).parameters(), lr=0.05))
    sent = record.of(Kind.BACKWARD.value)[0][3]
    for a, want in zip(agents, expected, strict=True):
        got = torch.from_numpy(np.array(sent[a].tensors["grad"]))
        assert torch.allclose(got, want, atol=1e-6)
    assert any(not torch.allclose(w, o, atol=1e-6)
               for w, o in zip(expected, batch_prior, strict=True))


def test_lla_sfl_is_splitfed_v1_with_local_adjustment_averaged_every_t(
        archive: Path, digits: Any) -> None:
    """LLA-SFL differs from SplitFed V1 in the loss only: per-client server copies, FedAvg-ed
    once per round. With the same seed both see the same batches; their servers differ (the
    loss), and LLA-SFL's server is the size-weighted average of its copies."""
    results = {}
    for name in ("splitfed-v1", "lla-sfl", "lla-sfl-shared"):
        engine = skewed_engine(digits)
        trainer = trainer_for(engine, archive, digits[1], algorithm=name, local_steps=2)
        method = build_method(name, trainer)
        copies: dict[str, Any] = {}
        if isinstance(method, SplitFedV1):
            end_round = method.end_round

            def keep(participants: list[str], m: Any = method, e: Any = end_round,
                     kept: dict[str, Any] = copies) -> None:
                kept.update({a: to_arrays(c, "server") for a, c in m.copies.items()})
                e(participants)

            method.end_round = keep  # type: ignore[method-assign]
        method.run_round(engine.online())
        results[name] = (to_arrays(trainer.server, "server"), copies, trainer)
    server, copies, trainer = results["lla-sfl"]
    assert len(copies) == 3
    assert close(server, fedavg(copies, trainer.defences.sizes(sorted(copies))))
    assert not close(server, results["splitfed-v1"][0], 1e-5)
    assert not close(server, results["lla-sfl-shared"][0], 1e-5)


# ---------------------------------------------------------------- PSL and GAPSL


@pytest.mark.parametrize("preset", ["default", "paper"])
def test_psl_server_steps_on_the_mean_or_the_papers_sum(archive: Path, digits: Any,
                                                        preset: str) -> None:
    """The GAPSL paper's L = Σ_i L_i (the paper preset): one SGD step moves the server by
    lr·Σ∇L_i; by default by lr·mean ∇L_i, a third of that here."""
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="psl", local_steps=1,
                          preset=preset)
    server0 = copy.deepcopy(trainer.server)
    build_method("psl", trainer).run_round(engine.online())
    fwd = record.of(Kind.FORWARD.value)[0][4]
    acts = [torch.from_numpy(np.array(fwd[a].tensors["activations"])) for a in fwd.agents]
    labels = [torch.from_numpy(np.array(fwd[a].tensors["labels"], np.int64))
              for a in fwd.agents]
    reference = copy.deepcopy(server0)
    reference.train()
    logits = reference(torch.cat(acts)).split([len(a) for a in acts])
    total = sum(torch.nn.functional.cross_entropy(s, y) for s, y in
                zip(logits, labels, strict=True))
    (total if preset == "paper" else total / len(acts)).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.05 * p.grad
    assert close(to_arrays(trainer.server, "server"), to_arrays(reference, "server"), 1e-5)


def test_gapsl_k_advances_per_iteration_and_selection_withholds_gradients(
        archive: Path, digits: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. 2's t counts iterations over T = rounds × local steps, starting at 1; clients
    outside Ŝ^t get no gradient that iteration (GAPSL is not PSL)."""
    seen: list[tuple[int, int, Any]] = []
    real = gapsl_math.select_clients

    def spy(grads: Any, t: int, total: int, *args: Any) -> Any:
        selection = real(grads, t, total, *args)
        seen.append((t, total, selection))
        return selection

    monkeypatch.setattr(gapsl_math, "select_clients", spy)
    engine = skewed_engine(digits, sizes=(60, 60, 60, 60, 60), classes_per_agent=2)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="gapsl", rounds=2,
                          local_steps=3)
    method = build_method("gapsl", trainer)
    for r in range(2):
        trainer.round = r
        method.run_round(engine.online())
    assert [(t, total) for t, total, _ in seen] == [(i, 6) for i in range(1, 7)]
    first = seen[0][2]  # ν_max = ν_min at the first iteration: the stability ratio is 1
    assert first.k_t == pytest.approx(0.2 + (1 / 6) * 0.6)
    backwards = record.of(Kind.BACKWARD.value)
    assert [len(e[1]) for e in backwards] == [len(s.selected) for _, _, s in seen]
    assert any(len(s.selected) < 5 for _, _, s in seen)


# ---------------------------------------------------------------- Ampere


def test_ampere_ablation_trains_per_agent_copies_not_the_consolidated_set(
        tmp_path: Path) -> None:
    """Same phase 1 (same seed, same client block), different phase 2: the ablation's
    server is the |A_k|-weighted FedAvg of per-agent copies, not one block on the
    shuffled union."""
    finals = {}
    for name in ("ampere", "ampere-noconsolidation"):
        settings = Settings(algorithm=name, rounds=2, batch=32, lr=0.05, device_epochs=1)
        out = tmp_path / name
        # VGG-11: phase 2's server steps take a third of MobileNetV3-small's time at 8×8
        simulate(settings, model="vgg11", split=2, dataset="digits",
                 clients=3, partition_scheme="quantity:4", out_dir=out)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        assert [r["phase"] for r in rows] == [1, 2]
        from safetensors.numpy import load_file

        finals[name] = (load_file(out / "client.safetensors"), load_file(out /
                                                                         "server.safetensors"))
    (c1, s1), (c2, s2) = finals["ampere"], finals["ampere-noconsolidation"]
    assert close(c1, c2)  # phase 1 is shared
    assert not close(s1, s2, 1e-5)  # phase 2 is not


def test_ampere_device_epoch_is_one_pass_over_each_agents_data(archive: Path,
                                                                digits: Any) -> None:
    """Phase 1's round is ⌈|D_k|/B_k⌉ local steps of B_k: one epoch per device."""
    engine = skewed_engine(digits)
    record = Recorder(engine)
    trainer = trainer_for(engine, archive, digits[1], algorithm="ampere", rounds=3)
    build_method("ampere", trainer).run_round(engine.online())
    train = record.of(Kind.TRAIN.value)[0][3]
    sizes = trainer.defences.sizes(sorted(train))
    for agent, command in train.items():
        steps, batch = command.meta["steps"], command.meta["batch"]
        assert (steps - 1) * batch < sizes[agent] <= steps * batch


# ---------------------------------------------------------------- per-tier training


def test_tier_settings_resolve_own_then_paper_then_general() -> None:
    from jetsplit.server.training.optimisers import client_batch, tier_optimizer

    gapsl = Settings(algorithm="gapsl", lr=0.3, preset="paper")
    assert tier_optimizer(gapsl, "client") == tier_optimizer(
        Settings(algorithm="psl", lr=0.005, momentum=0.9), "client")
    assert tier_optimizer(gapsl, "server").lr == 0.01 and client_batch(gapsl) == 128
    own = Settings(algorithm="gapsl", server_lr=0.2, momentum=0.5, client_batch=16,
                   preset="paper")
    assert (tier_optimizer(own, "server").lr, tier_optimizer(own, "server").momentum,
            client_batch(own)) == (0.2, 0.5, 16)
    sherl = Settings(algorithm="sherl", lr=0.3)
    assert {tier_optimizer(sherl, t).name for t in ("client", "edge", "cloud")} == {"adam"}
    plain = Settings(algorithm="splitfed-v1", lr=0.3)
    assert tier_optimizer(plain, "client").wire() == {"name": "sgd", "lr": 0.3,
                                                      "momentum": 0.0, "weight_decay": 0.0}
    assert client_batch(plain) is None


def test_an_unset_lr_is_the_methods_own_default() -> None:
    """PSL and GAPSL default to their preset's rate (jetsplit/catalog.py: why), every other
    method to DEFAULT_LR; a given lr beats the preset's rate, a tier's own beats both."""
    from jetsplit.server.training.optimisers import DEFAULT_LR, tier_optimizer

    assert DEFAULT_LR == 0.01
    for name in ("psl", "gapsl"):
        for tier in ("client", "server"):
            assert tier_optimizer(Settings(algorithm=name), tier).lr == 0.003
            assert tier_optimizer(Settings(algorithm=name, lr=0.02), tier).lr == 0.02
        assert tier_optimizer(Settings(algorithm=name, server_lr=0.2), "server").lr == 0.2
    for name in ("splitfed-v1", "scala", "ampere", "fedavg"):
        assert tier_optimizer(Settings(algorithm=name), "client").lr == DEFAULT_LR
    paper = Settings(algorithm="gapsl", preset="paper")  # its tier rates, not 0.003
    assert (tier_optimizer(paper, "client").lr, tier_optimizer(paper, "server").lr) == (
        0.005, 0.01)
    assert tier_optimizer(Settings(algorithm="psl", preset="paper"), "server").lr == DEFAULT_LR


def test_agents_train_with_the_client_optimiser_the_coordinator_sends(
        archive: Path, digits: Any) -> None:
    engine = skewed_engine(digits, sizes=(40, 40))
    trainer_for(engine, archive, digits[1], algorithm="sherl-never-run", optimizer="adam",
                client_lr=0.002).shipper.ensure(engine.online())
    worker = engine.workers["a0"]
    assert (worker.optimizer_args.name, worker.optimizer_args.lr) == ("adam", 0.002)
    assert isinstance(worker._optimizer("client"), torch.optim.Adam)
    engine = skewed_engine(digits, sizes=(40, 40))
    trainer_for(engine, archive, digits[1], algorithm="gapsl",
                preset="paper").shipper.ensure(engine.online())
    opt = engine.workers["a1"]._optimizer("client")
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"]) == (0.005, 0.9)

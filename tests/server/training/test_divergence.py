"""Divergence ends a run in one line naming the method, round, tier and likely cause,
instead of training on at chance."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.server.engines.seam import InProcessEngine
from jetsplit.server.run.assembly import RunSpec, execute
from jetsplit.server.training.divergence import Diverged, DivergenceGuard
from jetsplit.server.training.settings import Settings

SPEC = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(SPEC, 2, tmp_path_factory.mktemp("b") / "bundle", seed=3, tar=True,
                          aux_ratio=None)
    assert report.tar_path is not None
    return report.tar_path


def _run(archive: Path, out: Path, **settings: object) -> None:
    train, test = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, 4, "iid", 0, train.num_classes)
    workers = {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i)
               for i, s in enumerate(shards)}
    settings = {"rounds": 3, "local_steps": 3, "batch": 32, **settings}
    # Built unchecked: the rates that make a run diverge lie beyond [train]'s bounds.
    execute(InProcessEngine(workers), RunSpec(Settings.model_construct(**settings), archive,
                                              test, out, checkpoint=False))


def test_guard_lets_a_learning_loss_pass_and_stops_growth_and_nan() -> None:
    guard = DivergenceGuard(Settings(algorithm="scala"), classes=10)
    for loss in (2.4, 2.0, 9.0, 1.2, None):  # noisy but within an order of magnitude
        guard.check(loss, 0, "server")
    # SplitFed V1's first steps on AlexNet/MNIST at its defaults: one spike, then it learns
    for loss in (41.1, 7.2, 3.6, 30.0, 25.0, 2.5, 25.0, 2.4):
        guard.check(loss, 0, "server")
    guard.check(24.1, 1, "device")  # another tier's count is its own
    guard.check(24.1, 1, "server")
    guard.check(24.1, 1, "server")
    with pytest.raises(Diverged, match="over 10x the first loss .2.4. for 3 checks in a row"):
        guard.check(24.1, 1, "server")
    with pytest.raises(Diverged, match="training loss is nan"):
        guard.check(math.nan, 2, "server")
    with pytest.raises(Diverged, match="over 100x the first loss"):
        DivergenceGuard(Settings(algorithm="scala"), 10, first=2.4).check(241.0, 0, "server")
    DivergenceGuard(Settings(algorithm="scala"), 10, first=2.4).check(239.0, 0, "server")
    first = DivergenceGuard(Settings(algorithm="fedavg"), classes=10)
    first.check(26.9, 0, "device")  # before any loss was seen: against the chance level
    first.check(26.9, 1, "device")
    with pytest.raises(Diverged, match="over 10x the chance level"):
        first.check(26.9, 2, "device")


def test_summed_server_loss_blamed_on_its_reduction(archive: Path, tmp_path: Path) -> None:
    """PSL with the summed loss at an absurd server lr: stopped in round 0, one line that
    names the method, the round, the tier and the reduction."""
    with pytest.raises(Diverged) as stopped:
        _run(archive, tmp_path / "psl", algorithm="psl", psl_reduction="sum", server_lr=1e3)
    text = str(stopped.value)
    assert "\n" not in text
    assert text.startswith("psl diverged in round 0 at the server tier")
    assert "psl_reduction 'sum'" in text and "lr 1000" in text


def test_a_learning_rate_too_high_is_named(archive: Path, tmp_path: Path) -> None:
    with pytest.raises(Diverged) as stopped:
        _run(archive, tmp_path / "v1", algorithm="splitfed-v1", server_lr=1e3)
    assert "server learning rate 1000 is too high" in str(stopped.value)


def test_fedavg_devices_that_diverge_end_the_run(archive: Path, tmp_path: Path) -> None:
    """The devices' local losses explode: the run stops at the device tier."""
    with pytest.raises(Diverged) as stopped:
        _run(archive, tmp_path / "fedavg", algorithm="fedavg", lr=10.0)
    text = str(stopped.value)
    assert text.startswith("fedavg diverged in round 0 at the device tier")
    assert "device learning rate 10 is too high" in text


def test_an_outsized_upload_is_named_after_round_0_under_the_plain_mean() -> None:
    """A blow-up after an aggregation of unbounded uploads names the aggregator as well; not
    in round 0 (nothing was averaged yet), not under a bounding rule, not for a method that
    averages no uploads (PSL)."""
    upload = "aggregator 'mean' averages every update as sent"
    for algorithm, aggregator, round_, named in (
            ("splitfed-v1", "mean", 2, True), ("splitfed-v1", "mean", 0, False),
            ("splitfed-v1", "clipped", 2, False), ("psl", "mean", 2, False)):
        guard = DivergenceGuard(Settings(algorithm=algorithm, aggregator=aggregator), 10)
        guard.check(2.3, 0, "server")
        with pytest.raises(Diverged) as stopped:
            guard.check(1e6, round_, "server")  # a hundred times over: at once
        assert (upload in str(stopped.value)) is named, (algorithm, aggregator, round_)
        assert "server learning rate" in str(stopped.value)

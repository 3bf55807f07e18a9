"""bench_overhead's plain loops: a method's own loop with one client is the plain loop bit
for bit (so the extra work a reference shows is the method's, not a different loop's), with
several clients it is not, and its pieces (batch shares, the in-place mean) by hand."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def refs(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the module, from benchmarks/)
    import jetsplit.data

    load = jetsplit.data.load_dataset_split

    def small_test(*args: object, **kwargs: object):  # noqa: ANN202
        train, test = load(*args, **kwargs)
        return train, test.subset(np.arange(48))  # the evaluations are not what is tested

    monkeypatch.setattr(jetsplit.data, "load_dataset_split", small_test)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _plain_loops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark's children run (and far faster on a busy host)
    yield _plain_loops
    torch.set_num_threads(threads)


def _args(**over: object) -> argparse.Namespace:
    shape = {"dataset": "digits", "model": "mobilenetv3-small", "split": 2, "agents": 1,
             "rounds": 2, "local_steps": 2, "batch": 12, "seed": 0}
    return argparse.Namespace(**(shape | over))


SHAPES = ("plain:copies", "plain:shared", "plain:shared-own")


def test_one_client_is_the_plain_loop(refs) -> None:  # noqa: ANN001
    plain = refs.run_reference(_args(), refs.PLAIN)
    assert {s: refs.run_reference(_args(), s) for s in SHAPES} == dict.fromkeys(SHAPES, plain)


def test_several_clients_are_not(refs) -> None:  # noqa: ANN001
    plain = refs.run_reference(_args(agents=3), refs.PLAIN)["train_loss"]
    for shape in SHAPES:
        assert refs.run_reference(_args(agents=3), shape)["train_loss"] != plain, shape


def test_every_goal_method_has_its_loop(refs) -> None:  # noqa: ANN001
    assert set(refs.REFERENCES) == {"splitfed-v1", "fedavg", "scala", "psl"}
    assert set(refs.REFERENCES.values()) <= set(refs.SHAPES)
    assert refs.SHAPES[refs.REFERENCES["psl"]].evals_per_client
    assert not refs.SHAPES[refs.REFERENCES["psl"]].average_clients
    assert refs.SHAPES[refs.REFERENCES["fedavg"]].model_per_client


def test_shares_and_mean_by_hand(refs) -> None:  # noqa: ANN001
    assert refs.shares(10, 4) == [3, 3, 2, 2]
    assert refs.shares(64, 4) == [16] * 4
    copies = [nn.Linear(2, 1) for _ in range(3)]
    with torch.no_grad():
        for value, layer in zip((1.0, 2.0, 6.0), copies, strict=True):
            layer.weight.fill_(value)
            layer.bias.fill_(-value)
        target = nn.Linear(2, 1)
        refs._average_into(target, copies)
    assert target.weight.tolist() == [[3.0, 3.0]]
    assert target.bias.tolist() == [-3.0]

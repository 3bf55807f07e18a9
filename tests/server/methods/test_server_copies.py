"""Fast tier: SplitFed V1's server copies in reused slots (server/methods/server_copies.py)
train bit for bit like a fresh deepcopy with a fresh optimiser, round after round, and the
pool holds as many slots as the most clients one round selected, not one per client."""

from __future__ import annotations

import copy
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit.server.methods.server_copies import ServerCopies, array_views

pytestmark = pytest.mark.fast


def _block() -> nn.Sequential:
    """Parameters, BatchNorm buffers (running stats, an integer counter), a dropout-free
    head: everything a deepcopy carries and a reset must restore."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), relu=nn.ReLU(), flat=nn.Flatten(),
        fc=nn.Linear(4 * 4 * 4, 5)))


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def _adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=0.01)


def _train(module: nn.Module, optimizer: torch.optim.Optimizer, seed: int, steps: int) -> None:
    """`steps` SGD steps on batches of 3 (seeded): moves weights, BN stats and momentum."""
    gen = torch.Generator().manual_seed(seed)
    module.train()
    for _ in range(steps):
        x = torch.randn(3, 3, 6, 6, generator=gen)
        y = torch.randint(0, 5, (3,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def _assert_same_bits(got: nn.Module, want: nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


@pytest.mark.parametrize("build", [_sgd, _adam], ids=["sgd-momentum", "adam"])
def test_reused_slots_train_bit_for_bit_like_fresh_deepcopies(build) -> None:  # noqa: ANN001
    """Three rounds, selections of 2, 3 and 2 clients of unequal training lengths; the
    global block moves between rounds (as the average does). Each round every slot must
    train exactly as `copy.deepcopy(global)` with a fresh optimiser would: a leftover
    momentum/Adam moment, BN running statistic, counter or gradient changes the bits."""
    server = _block()
    pool = ServerCopies(build)
    rounds = [["a0", "a1"], ["a2", "a3", "a4"], ["a5", "a1"]]
    for r, selected in enumerate(rounds):
        copies, optimizers = pool.checkout(server, selected)
        assert list(copies) == selected
        for i, agent in enumerate(selected):
            fresh = copy.deepcopy(server)
            _train(copies[agent], optimizers[agent], seed=10 * r + i, steps=2 + i)
            _train(fresh, build(fresh), seed=10 * r + i, steps=2 + i)
            _assert_same_bits(copies[agent], fresh)
            assert optimizers[agent].state  # it did accumulate state to be cleared
        # the global block moves (an average of the copies, here the last one's weights)
        server.load_state_dict(_state(copies[selected[-1]]))
    assert len(pool) == 3  # the largest selection, not the six clients seen


def test_checkout_resets_weights_buffers_grads_modes_and_optimiser_state() -> None:
    server = _block()
    server.bn.eval()  # a mixed-mode block: each submodule's flag is what a deepcopy keeps
    pool = ServerCopies(_sgd)
    copies, optimizers = pool.checkout(server, ["a0"])
    first = copies["a0"]
    _train(first, optimizers["a0"], seed=1, steps=3)
    assert not torch.equal(first.fc.weight, server.fc.weight)
    assert first.bn.num_batches_tracked.item() == 3
    first.eval()
    copies, optimizers = pool.checkout(server, ["a7"])
    assert copies["a7"] is first  # the same storage, reused
    _assert_same_bits(first, server)
    assert all(p.grad is None for p in first.parameters())
    assert optimizers["a7"].state_dict()["state"] == {}
    assert [m.training for m in first.modules()] == [m.training for m in server.modules()]
    assert first.bn.training is False and first.fc.training is True


def test_a_changed_block_gets_new_slots() -> None:
    """A server block of another shape (or another module) is never copied into old slots."""
    pool = ServerCopies(_sgd)
    old, _ = pool.checkout(_block(), ["a0", "a1"])
    other = nn.Sequential(nn.Linear(4, 2))
    copies, _ = pool.checkout(other, ["a0"])
    assert len(pool) == 1 and copies["a0"] is not old["a0"]
    _assert_same_bits(copies["a0"], other)


def test_array_views_share_the_modules_memory_and_values() -> None:
    block = _block()
    views = array_views(block, "server")
    assert sorted(views) == sorted(f"server/{k}" for k in block.state_dict())
    assert np.shares_memory(views["server/fc.weight"], block.fc.weight.detach().numpy())
    for name, value in block.state_dict().items():
        np.testing.assert_array_equal(views[f"server/{name}"], value.numpy())

"""Fast tier (`-m fast`): per-device completions (server/cuts/completions.py) on a four-layer
toy block (Linear 2→3, Linear 3→2, BatchNorm1d(2), Linear 2→2), every number worked out
here in NumPy or with plain tensor ops: the cut checks, the block names, Ampere's carried
uploads (eval mode, chunked, through the *global* layers after the device's cut, rebuilt
when the global block changes), a completion copy's forward and SGD step (train mode, its
own optimiser, the gradient chained back to the cut), and the per-round reset of copies
and their optimiser state (fresh for averaging methods, kept for PSL/GAPSL)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from jetsplit.errors import ConfigError
from jetsplit.server.cuts.completions import (
    Completions,
    block_names,
    check_cuts,
    layer_names,
    subset,
)

pytestmark = pytest.mark.fast

Arrays = dict[str, np.ndarray]
EPS = 1e-5  # BatchNorm1d's default
LR = 0.1


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _template(train: bool) -> nn.Sequential:
    """Carried uploads: in train mode, so `carry` must switch to eval itself; completion
    copies: in eval mode, so a copy that trains must be put in train mode itself."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(l1=nn.Linear(2, 3), l2=nn.Linear(3, 2),
                                     l3=nn.BatchNorm1d(2), l4=nn.Linear(2, 2))).train(train)


def _global(shift: float = 0.0) -> Arrays:
    """A global client block unlike the template's initial weights; BN running stats far
    from 0 and 1, so eval mode (running stats) and train mode (batch stats) differ."""
    rng = np.random.default_rng(7)
    f = np.float32
    return {
        "client/l1.weight": rng.standard_normal((3, 2)).astype(f),
        "client/l1.bias": rng.standard_normal(3).astype(f),
        "client/l2.weight": (rng.standard_normal((2, 3)) + shift).astype(f),
        "client/l2.bias": rng.standard_normal(2).astype(f),
        "client/l3.weight": np.array([1.5, 0.5], f),
        "client/l3.bias": np.array([0.2, -0.3], f),
        "client/l3.running_mean": np.array([0.7, -1.2], f),
        "client/l3.running_var": np.array([2.0, 0.25], f),
        "client/l3.num_batches_tracked": np.array(5, np.int64),
        "client/l4.weight": rng.standard_normal((2, 2)).astype(f),
        "client/l4.bias": rng.standard_normal(2).astype(f),
    }


def _completions(cuts: dict[str, int], momentum: float = 0.0, *, train: bool = False
                 ) -> Completions:
    return Completions(_template(train), cuts,
                       lambda params: torch.optim.SGD(params, lr=LR, momentum=momentum),
                       (2,))


def _linear(g: Arrays, name: str, x: np.ndarray) -> np.ndarray:
    return x @ g[f"client/{name}.weight"].astype(np.float64).T + g[f"client/{name}.bias"]


def _bn_eval(g: Arrays, x: np.ndarray) -> np.ndarray:
    mean, var = g["client/l3.running_mean"], g["client/l3.running_var"]
    return (x - mean) / np.sqrt(var.astype(np.float64) + EPS) * g["client/l3.weight"] \
        + g["client/l3.bias"]


# ------------------------------------------------------------------------ cuts and names


def test_check_cuts_keeps_1_to_c_star_and_names_the_agent() -> None:
    assert check_cuts({"b": 4, "a": 1}, 4, "toy") == {"a": 1, "b": 4}
    assert list(check_cuts({"b": 4, "a": 1}, 4, "toy")) == ["a", "b"]
    for bad in (0, 5, True, 2.0, "2", None):
        with pytest.raises(ConfigError) as exc:
            check_cuts({"a": 1, "nano": bad}, 4, "toy")
        assert str(exc.value) == (f"agent nano: cut {bad!r} is out of range for toy: "
                                  "choose 1..4 (the server cut)")


def test_block_names_are_the_tensors_of_layers_1_to_cut() -> None:
    t = _template(False)
    assert layer_names(t) == ["l1", "l2", "l3", "l4"]
    assert block_names(t, 1) == ["client/l1.weight", "client/l1.bias"]
    assert block_names(t, 3, "x") == [
        "x/l1.weight", "x/l1.bias", "x/l2.weight", "x/l2.bias", "x/l3.weight", "x/l3.bias",
        "x/l3.running_mean", "x/l3.running_var", "x/l3.num_batches_tracked"]
    g = _global()
    assert list(subset(g, block_names(t, 1))) == ["client/l1.weight", "client/l1.bias"]


def test_cut_shallow_heterogeneous_and_activation_shapes() -> None:
    c = _completions({"a0": 1, "a1": 4}, train=True)
    assert c.server_cut == 4 and (c.cut("a0"), c.cut("a1"), c.cut("unknown")) == (1, 4, 4)
    assert (c.shallow("a0"), c.shallow("a1"), c.shallow("unknown")) == (True, False, False)
    assert c.heterogeneous and not _completions({"a0": 4, "a1": 4}).heterogeneous
    assert not _completions({}).heterogeneous
    assert [c.activation_shape(k) for k in (1, 2, 3, 4)] == [(3,), (2,), (2,), (2,)]
    t = c.template
    assert t.training and t.l3.training  # the probe leaves the template's modes


# ------------------------------------------------------------------------ carried uploads


def test_carry_runs_the_global_layers_after_the_cut_in_eval_mode_in_chunks() -> None:
    """A cut-1 upload (3 features) goes through the global l2, l3 with its running stats
    (eval), l4; a cut-3 upload through l4 alone; a cut-4 upload is stored as it is. Five
    rows in chunks of 2 give the rows one by one would (no batch statistics)."""
    c = _completions({"a0": 1}, train=True)
    g = _global()
    acts = np.random.default_rng(1).standard_normal((5, 3))  # float64 on purpose
    want = _linear(g, "l4", _bn_eval(g, _linear(g, "l2", acts)))
    got = c.carry(1, g, acts, chunk=2)
    assert got.dtype == np.float32 and got.shape == (5, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(c.carry(1, g, acts), got)  # one chunk of 256: the same rows
    at3 = np.random.default_rng(2).standard_normal((4, 2)).astype(np.float32)
    np.testing.assert_allclose(c.carry(3, g, at3, chunk=3), _linear(g, "l4", at3),
                               rtol=1e-5, atol=1e-6)
    assert c.carry(4, g, at3) is at3 and c.carry(5, g, at3) is at3
    assert c.carry(1, g, np.zeros((0, 3), np.float32)).shape[0] == 0
    tail = c._tail
    assert tail is not None and tail[2].l3.training  # eval only while carrying
    assert np.array_equal(tail[2].l3.running_mean.numpy(), g["client/l3.running_mean"])
    assert c.copies == {}  # carrying builds no completion copy


def test_carry_follows_the_global_block_it_is_given() -> None:
    """The carried layers are rebuilt when the global block (a new dict after each
    aggregation) or the cut changes: never a stale tail."""
    c = _completions({"a0": 1}, train=True)
    g, h = _global(), _global(shift=1.0)
    acts = np.random.default_rng(3).standard_normal((3, 3)).astype(np.float32)
    first = c.carry(1, g, acts)
    second = c.carry(1, h, acts)
    np.testing.assert_allclose(second, _linear(h, "l4", _bn_eval(h, _linear(h, "l2", acts))),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(first, second)
    at2 = acts[:, :2]
    np.testing.assert_allclose(c.carry(2, h, at2), _linear(h, "l4", _bn_eval(h, at2)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.carry(1, g, acts), first, rtol=0, atol=0)
    tail = c._tail  # the same block and cut: slices reuse one tail, built once
    c.carry(1, g, acts[:1])
    assert c._tail is tail


# ------------------------------------------------------------------------ completion copies


def _reference_step(g: Arrays, x: torch.Tensor, grad_out: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor],
                               dict[str, torch.Tensor]]:
    """l2, l3 in train mode (batch mean, biased variance), l4 by hand: output, dL/dx for
    L = Σ out·grad_out, the SGD-stepped parameters and the updated running stats."""
    p = {k.split("/", 1)[1]: torch.tensor(v, dtype=torch.float64, requires_grad=v.dtype.kind == "f")
         for k, v in g.items() if k.split("/")[1][:2] in ("l2", "l3", "l4")
         and "running" not in k and "tracked" not in k}
    leaf = x.double().clone().requires_grad_(True)
    a = leaf @ p["l2.weight"].T + p["l2.bias"]
    mean, var = a.mean(0), a.var(0, unbiased=False)
    b = (a - mean) / torch.sqrt(var + EPS) * p["l3.weight"] + p["l3.bias"]
    out = b @ p["l4.weight"].T + p["l4.bias"]
    grads = torch.autograd.grad((out * grad_out.double()).sum(), [leaf, *p.values()])
    stepped = {k: (v - LR * gr).detach() for (k, v), gr in zip(p.items(), grads[1:],
                                                                  strict=True)}
    running = {"l3.running_mean": 0.9 * torch.tensor(g["client/l3.running_mean"]).double()
               + 0.1 * mean.detach(),  # PyTorch: momentum 0.1, the unbiased variance
               "l3.running_var": 0.9 * torch.tensor(g["client/l3.running_var"]).double()
               + 0.1 * a.var(0, unbiased=True).detach()}
    return out.detach(), grads[0], stepped, running


def test_copy_forward_and_backward_step_its_layers_and_chain_the_gradient() -> None:
    """a0 at cut 1 (copy of l2..l4), a1 at cut 3 (copy of l4), a2 at c* (no copy). The
    copies run in train mode (batch statistics); backward steps each selected copy once
    with plain SGD and returns ∂L/∂A at the device's cut; c*'s gradient passes as is."""
    c = _completions({"a0": 1, "a1": 3, "a2": 4})
    g = _global()
    c.begin_round(["a0", "a1", "a2"], g, fresh=True)
    assert set(c.copies) == {"a0", "a1"} and set(c.optimizers) == {"a0", "a1"}
    assert layer_names(c.copies["a0"]) == ["l2", "l3", "l4"]
    assert layer_names(c.copies["a1"]) == ["l4"]
    assert c.state("a2") == {}
    rng = np.random.default_rng(4)
    x0 = torch.tensor(rng.standard_normal((4, 3)), dtype=torch.float32)
    x1 = torch.tensor(rng.standard_normal((3, 2)), dtype=torch.float32)
    x2 = torch.tensor(rng.standard_normal((2, 2)), dtype=torch.float32)
    out = c.forward(["a0", "a1", "a2"], [x0, x1, x2])
    assert out[2] is x2 and not out[0].requires_grad
    grad0 = torch.tensor(rng.standard_normal((4, 2)), dtype=torch.float32)
    grad1 = torch.tensor(rng.standard_normal((3, 2)), dtype=torch.float32)
    grad2 = torch.tensor(rng.standard_normal((2, 2)), dtype=torch.float32)
    want_out, want_dx, stepped, running = _reference_step(g, x0, grad0)
    torch.testing.assert_close(out[0].double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1].double(), torch.tensor(_linear(g, "l4", x1.numpy())),
                               rtol=1e-5, atol=1e-5)
    back = c.backward({"a0": grad0, "a1": grad1, "a2": grad2})
    assert list(back) == ["a0", "a1", "a2"] and back["a2"] is grad2
    torch.testing.assert_close(back["a0"].double(), want_dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(back["a1"], grad1 @ torch.tensor(g["client/l4.weight"]),
                               rtol=1e-5, atol=1e-6)
    state = c.state("a0")
    for name, value in stepped.items():
        np.testing.assert_allclose(state[f"client/{name}"], value.numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    for name, value in running.items():
        np.testing.assert_allclose(state[f"client/{name}"], value.numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert int(state["client/l3.num_batches_tracked"]) == 6
    l4 = c.state("a1")
    np.testing.assert_allclose(l4["client/l4.bias"], g["client/l4.bias"] - LR * grad1.sum(0)
                               .numpy(), rtol=1e-5, atol=1e-6)
    assert c._pending == {}


def test_an_agent_without_a_gradient_keeps_its_copy() -> None:
    """GAPSL's unselected agents: a0's forward ran, no gradient came back for it, its copy
    is as loaded and it is not in the returned gradients; a1 after it still steps."""
    c = _completions({"a0": 1, "a1": 1})
    g = _global()
    c.begin_round(["a0", "a1"], g, fresh=True)
    xs = [torch.ones(3, 3), torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])]
    c.forward(["a0", "a1"], xs)
    grad = torch.ones(2, 2)
    back = c.backward({"a1": grad})
    assert list(back) == ["a1"] and back["a1"].shape == (2, 3)
    untouched = c.state("a0")  # (its forward in train mode did move BN's running stats)
    assert all(np.array_equal(untouched[k], g[k]) for k in untouched
               if k.endswith(("weight", "bias")))
    moved = c.state("a1")
    assert not np.array_equal(moved["client/l4.weight"], g["client/l4.weight"])
    assert c._pending == {}


def test_fresh_rounds_reload_copies_and_optimisers_kept_rounds_do_not() -> None:
    """SGD momentum 0.9 over two rounds. fresh=True (SplitFed, SCALA): every shallow copy
    restarts from the global block with an empty optimiser, so round 2's step from the
    same input equals round 1's. fresh=False (PSL, GAPSL): an existing copy and its
    momentum are kept, and only a missing copy (a new agent) is built."""
    g = _global()
    x, grad = torch.full((3, 3), 0.3), torch.ones(3, 2)

    def step(c: Completions) -> Arrays:
        c.forward(["a0"], [x])
        c.backward({"a0": grad})
        return c.state("a0")

    fresh = _completions({"a0": 1, "a1": 1}, momentum=0.9)
    fresh.begin_round(["a0"], g, fresh=True)
    first = step(fresh)
    fresh.begin_round(["a0"], g, fresh=True)
    assert all(np.array_equal(fresh.state("a0")[k], g[k]) for k in first)
    assert fresh.optimizers["a0"].state_dict()["state"] == {}
    again = step(fresh)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert "a1" not in fresh.copies  # only the round's agents are loaded

    kept = _completions({"a0": 1, "a1": 1}, momentum=0.9)
    kept.begin_round(["a0"], g, fresh=False)
    stepped = step(kept)
    assert all(np.array_equal(stepped[k], first[k]) for k in first)
    optimizer = kept.optimizers["a0"]
    kept.begin_round(["a0", "a1"], g, fresh=False)
    assert kept.optimizers["a0"] is optimizer and optimizer.state_dict()["state"] != {}
    assert all(np.array_equal(kept.state("a0")[k], first[k]) for k in first)
    second = step(kept)
    plain = _completions({"a0": 1}, momentum=0.9)  # the same weights, no momentum yet
    plain.begin_round(["a0"], {**g, **first}, fresh=True)
    assert not np.allclose(second["client/l4.weight"], step(plain)["client/l4.weight"])
    assert "a1" in kept.copies and all(
        np.array_equal(kept.state("a1")[k], g[k]) for k in kept.state("a1"))


def test_whole_is_the_device_block_plus_the_copy() -> None:
    c = _completions({"a0": 1, "a1": 4})
    g = _global()
    c.begin_round(["a0", "a1"], g, fresh=True)
    device0 = subset(g, block_names(c.template, 1))
    whole = c.whole("a0", device0)
    assert list(whole) == list(g) and all(np.array_equal(whole[k], g[k]) for k in g)
    assert c.whole("a1", g) is g
    c.load("a1", g)  # a device at c* has nothing to complete
    assert set(c.copies) == {"a0"}
    assert c.state("nobody") == {}


def test_forward_passes_deep_agents_in_any_order_and_checks_lengths() -> None:
    """A device at c* ahead of a shallow one: both outputs come back, in order; agents and
    activations must pair up; `fresh` is a keyword (a bare True is refused)."""
    c = _completions({"a0": 1, "a1": 4})
    g = _global()
    c.begin_round(["a0", "a1"], g, fresh=True)
    deep, shallow = torch.ones(2, 2), torch.ones(2, 3)
    out = c.forward(["a1", "a0"], [deep, shallow])
    assert len(out) == 2 and out[0] is deep and out[1].shape == (2, 2)
    assert set(c._pending) == {"a0"}
    c.backward({})
    with pytest.raises(ValueError):
        c.forward(["a1", "a0"], [deep])
    with pytest.raises(TypeError):
        c.begin_round(["a0"], g, True)  # type: ignore[misc]

"""Fast tier: PSL's and GAPSL's bookkeeping around the server step (server/methods/psl.py,
gapsl.py): which blocks a cut move re-splits, the final per-device blocks on disk, the
`mean` reduction read from a config file, GAPSL's eq. 2 clock (t and T over several
rounds and steps), its reported loss and its ν range through a checkpoint. Written for
survivors of `make mutation MUTATION=methods_psl` (docs/testing.md)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch import nn
from toy_server import toy_step  # testing/, on the path in tests

from jetsplit.server.methods import gapsl_math
from jetsplit.server.methods.gapsl import GAPSL
from jetsplit.server.methods.psl import PSL

pytestmark = pytest.mark.fast

AGENTS = ["a0", "a1", "a2"]


def _block(value: float) -> dict[str, np.ndarray]:
    return {"client/0.weight": np.full((2, 2), value, np.float32)}


def _method(cls: type, server: nn.Module, *, reduction: str = "mean", local_steps: int = 1,
            rounds: int = 1, **trainer: Any) -> Any:
    """`cls` over a fake trainer: plain SGD at 0.1 on `server`, no defences, the loss
    reduction and the schedule as given; `trainer` adds or replaces attributes."""
    method = cls.__new__(cls)
    defences = SimpleNamespace(weighs_losses=False, measures_shares=False,
                               share_weights=lambda agents, norms: None)
    method.trainer = SimpleNamespace(
        server=server, optimizer=torch.optim.SGD(server.parameters(), lr=0.1), round=0,
        device=torch.device("cpu"), defences=defences, global_client={},
        weights_problem=lambda state, prefixes: None,
        settings=SimpleNamespace(psl_reduction=reduction, local_steps=local_steps,
                                 rounds=rounds, k_min=0.2, k_max=0.8, eta=1.0, lam=5e-4),
        **trainer)
    method.agent_blocks, method.to_restore = {}, {}
    if cls is GAPSL:
        method.tracker, method.step, method.last_selection = gapsl_math.NuTracker(), 0, None
    return method


# ---------------------------------------------------------------- PSL: cut moves, save


def test_psl_cut_move_reinstalls_only_moved_devices_that_hold_a_block() -> None:
    """Cuts a0 1, a1 3, a2 1, a3 3, a4 1, a5 3. Moves to a0 3 (up), a3 1 and a5 2 (down),
    a4 2 (never trained: no block); a1 and a2 stay. Only a0, a3 and a5 are queued for
    reinstalling, a0 and a5 with their blocks as last evaluated, a3 with the block still
    waiting from a resume (not its older evaluated one); every mover is moved."""
    cuts = {"a0": 1, "a1": 3, "a2": 1, "a3": 3, "a4": 1, "a5": 3}

    def set_cut(agent: str, cut: int) -> None:
        cuts[agent] = cut

    method = _method(PSL, nn.Linear(2, 2), cut=lambda a: cuts[a], set_cut=set_cut)
    method.agent_blocks = {a: _block(float(i)) for i, a in enumerate(AGENTS + ["a3"])}
    method.agent_blocks["a5"] = _block(5.0)
    method.to_restore = {"a3": _block(30.0)}
    moved = method.switch_cuts({"a0": 3, "a1": 3, "a2": 1, "a3": 1, "a4": 2, "a5": 2})
    assert moved == ["a0", "a3", "a4", "a5"]
    assert cuts == {"a0": 3, "a1": 3, "a2": 1, "a3": 1, "a4": 2, "a5": 2}
    assert {a: float(b["client/0.weight"][0, 0]) for a, b in method.to_restore.items()} == {
        "a0": 0.0, "a3": 30.0, "a5": 5.0}


def test_psl_saves_each_held_devices_whole_block_and_can_save_again(tmp_path: Path) -> None:
    """Four eligible devices at cuts 1, 3, 1 and one never selected (no bundle): the run's
    folder gets the server block and clients/a0..a2, each that device's pulled layers
    plus, for the cut-1 devices, their completion copy's layers; a3 gets no file. A second
    save into the same folder (a resumed run ending where it started) overwrites."""
    server = nn.Linear(2, 2)
    pulled = {"a0": _block(0.0), "a1": {**_block(1.0), "client/2.weight": np.ones(2, np.float32)},
              "a2": _block(2.0)}
    copies = {"a0": {"client/2.weight": np.full(2, 10.0, np.float32)},
              "a2": {"client/2.weight": np.full(2, 12.0, np.float32)}}
    asked: list[list[str]] = []

    def pull(agents: list[str]) -> dict[str, Any]:
        asked.append(list(agents))
        return {a: pulled[a] for a in agents}

    method = _method(
        PSL, server, engine=SimpleNamespace(registry=SimpleNamespace(
            eligible=lambda: ["a0", "a1", "a2", "a3"])),
        needs_bundle=lambda a: a == "a3", pull=pull,
        completions=SimpleNamespace(whole=lambda a, s: {**s, **copies.get(a, {})}))
    for _ in range(2):
        method.save(tmp_path)
    assert asked == [["a0", "a1", "a2"]] * 2
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == [
        "a0.safetensors", "a1.safetensors", "a2.safetensors"]
    for agent, first in [("a0", 0.0), ("a1", 1.0), ("a2", 2.0)]:
        got = load_file(str(tmp_path / "clients" / f"{agent}.safetensors"))
        assert sorted(got) == ["client/0.weight", "client/2.weight"]
        assert got["client/0.weight"].tolist() == [[first] * 2] * 2
        assert got["client/2.weight"].tolist() == [{"a0": 10.0, "a1": 1.0, "a2": 12.0}[agent]] * 2
    saved = load_file(str(tmp_path / "server.safetensors"))
    assert np.array_equal(saved["server/weight"], server.weight.detach().numpy())


def test_psl_mean_reduction_read_from_a_config_file_divides_by_the_clients() -> None:
    """`psl_reduction = "mean"` as a config file gives it: an equal string that is not the
    interned literal. Three clients, plain SGD at 0.1: the server steps on (L_0+L_1+L_2)/3,
    by hand."""
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    params = list(server.parameters())
    total = sum(ce(server(x), y) for x, y in zip(acts, labels, strict=True)) / 3
    want = [(p - 0.1 * g).detach() for p, g in zip(params, torch.autograd.grad(total, params),
                                                   strict=True)]
    read = "".join(["me", "an"])
    assert read == "mean" and read is not "mean"  # noqa: F632 (the point of the test)
    _method(PSL, server, reduction=read).server_update(AGENTS, acts, labels)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- GAPSL: eq. 2's clock


def test_gapsl_clock_counts_iterations_over_rounds_and_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. 2's t is the 1-based iteration r·E + s + 1 and T = R·E: with R = 4 rounds of
    E = 3 local steps, rounds 0..2 and steps 0..2 give t = 1..9, T = 12 every time. A
    method built fresh (no `iterate` yet) is at step 0: round 2 gives t = 7."""
    seen: list[tuple[int, int]] = []

    def spy(grads: torch.Tensor, t: int, total: int, *args: Any) -> Any:
        seen.append((t, total))
        return SimpleNamespace(selected=torch.arange(len(grads)), scores=torch.zeros(len(grads)),
                               alignment_penalty=torch.zeros(len(grads)))

    monkeypatch.setattr(gapsl_math, "select_clients", spy)
    server, acts, labels = toy_step()
    method = _method(GAPSL, server, local_steps=3, rounds=4)
    for r in range(3):
        for s in range(3):
            method.trainer.round, method.step = r, s
            method.server_update(AGENTS, acts, labels)
    assert seen == [(t, 12) for t in range(1, 10)]

    # GAPSL's own initial state, past the base classes (which read a whole trainer).
    monkeypatch.setattr(PSL, "__init__", lambda self, trainer: setattr(self, "trainer", trainer))
    fresh = GAPSL(method.trainer)
    assert fresh.step == 0
    fresh.trainer.round = 2
    fresh.server_update(AGENTS, acts, labels)
    assert seen[-1] == (7, 12)


def test_gapsl_reports_the_mean_loss_of_every_client_not_only_the_selected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ŝ = {0, 2} of three: the round's reported loss is (L_0 + L_1 + L_2) / 3 of the
    pre-step block, by hand, over several steps (each from the block the last left)."""
    selection = SimpleNamespace(selected=torch.tensor([0, 2]), scores=torch.zeros(3),
                                alignment_penalty=torch.tensor([0.3, 0.7]))
    monkeypatch.setattr(gapsl_math, "select_clients", lambda *a, **k: selection)
    server, acts, labels = toy_step()
    ce = nn.functional.cross_entropy
    method = _method(GAPSL, server, local_steps=2, rounds=2)
    for step in range(3):
        with torch.no_grad():
            want = sum(float(ce(server(x), y)) for x, y in zip(acts, labels, strict=True)) / 3
        method.step = step % 2
        loss, grads = method.server_update(AGENTS, acts, labels)
        assert loss == pytest.approx(want, abs=1e-6)
        assert list(grads) == ["a0", "a2"]


@pytest.mark.parametrize("nu", [(0.25, 1.5), (math.inf, -math.inf)])
def test_gapsl_checkpoint_keeps_its_nu_range(nu: tuple[float, float]) -> None:
    """ν_min, ν_max go into the checkpoint's metadata (None for a range never folded, the
    infinities JSON cannot hold) and come back from it; a checkpoint without them (from
    before they were kept) restores the empty range."""
    method = _method(GAPSL, nn.Linear(2, 2))
    method.tracker.nu_min, method.tracker.nu_max = nu
    arrays, meta = method.checkpoint()
    assert meta["nu"] == [v if math.isfinite(v) else None for v in nu]
    assert meta["agents"] == []
    back = _method(GAPSL, nn.Linear(2, 2))
    back.tracker.nu_min, back.tracker.nu_max = 9.0, 9.0
    back.restore(arrays, meta)
    assert (back.tracker.nu_min, back.tracker.nu_max) == nu
    old = {k: v for k, v in meta.items() if k != "nu"}
    back.restore(arrays, old)
    assert (back.tracker.nu_min, back.tracker.nu_max) == (math.inf, -math.inf)


class _WithSpare(nn.Module):
    """A server block with a trainable layer its forward never uses (a head kept for
    later, say): no client's loss reaches it."""

    def __init__(self, used: nn.Linear) -> None:
        super().__init__()
        self.used, self.spare = used, nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_gapsl_steps_a_server_block_with_a_parameter_no_loss_reaches() -> None:
    """Two steps with SGD momentum 0.9: the unreached layer counts as a zero gradient in
    each g_i (eq. 1), so the selection, the reported losses and the used layer end as for
    the bare block, by GAPSL on the same seeded data; the spare layer is never moved."""
    runs = []
    for spare in (False, True):
        used, acts, labels = toy_step()
        server = _WithSpare(used) if spare else used
        method = _method(GAPSL, server, local_steps=2, rounds=1)
        method.trainer.optimizer = torch.optim.SGD(server.parameters(), lr=0.1, momentum=0.9)
        before = server.spare.weight.detach().clone() if spare else None
        out = []
        for step in range(2):
            method.step = step
            loss, grads = method.server_update(AGENTS, acts, labels)
            out.append((loss, method.last_selection.selected.tolist(), sorted(grads)))
        if spare:
            assert torch.equal(server.spare.weight, before)
        runs.append((out, used.weight.detach().clone()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])

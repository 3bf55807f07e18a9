"""SHeRL-FL: the edge's contrastive loss by hand, the three-tier carving of every zoo model,
topology checks, the three-tier planner, the edge commands, and whole runs in process and
over MQTT (client, edge and coordinator processes behind a real Mosquitto)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.errors import ConfigError, JetsplitError
from jetsplit.models import MODEL_NAMES, activation_shape, build_aux_head, build_model, split
from jetsplit.protocol import Kind
from jetsplit.server.engines.registry import FleetRegistry
from jetsplit.server.fleet.topology import check_shape, resolve, round_robin
from jetsplit.server.run.simulate import sherl_topology, simulate
from jetsplit.server.training.settings import Settings
from jetsplit.tiers import carve, contrastive_loss, pair_distances

# ---------------------------------------------------------------- contrastive loss

D_45 = 1 - 1 / math.sqrt(2)  # cosine distance of two vectors 45° apart


def _loss(z: list[list[float]], labels: list[int], margin: float = 0.5) -> torch.Tensor:
    return contrastive_loss(torch.tensor(z, dtype=torch.float32), torch.tensor(labels), margin)


def test_same_class_pair_costs_d_squared() -> None:
    assert _loss([[1, 0], [1, 1]], [3, 3]).item() == pytest.approx(D_45 ** 2)
    assert _loss([[2, 0], [5, 0]], [1, 1]).item() == pytest.approx(0.0, abs=1e-7)  # scale-free


def test_different_class_pair_inside_the_margin_costs_the_shortfall_squared() -> None:
    assert _loss([[1, 0], [1, 1]], [0, 1]).item() == pytest.approx((0.5 - D_45) ** 2)
    assert _loss([[1, 0], [1, 1]], [0, 1], margin=1.0).item() == pytest.approx((1 - D_45) ** 2)


def test_different_class_pair_outside_the_margin_costs_nothing() -> None:
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)  # d = 1 > m
    loss = contrastive_loss(z, torch.tensor([0, 1]), 0.5)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros(2, 2))


def test_loss_is_the_mean_over_unordered_pairs() -> None:
    z, labels = [[1, 0], [1, 1], [0, 1]], [0, 0, 1]
    pairs = [D_45 ** 2,  # (0, 1) same class, 45°
             0.0,  # (0, 2) different, 90°: d = 1 beyond the margin
             (0.5 - D_45) ** 2]  # (1, 2) different, 45°: inside the margin
    assert _loss(z, labels).item() == pytest.approx(sum(pairs) / 3)
    d = pair_distances(torch.tensor(z, dtype=torch.float32))
    assert d[0, 2].item() == pytest.approx(1.0) and d[1, 0].item() == pytest.approx(D_45)


@pytest.mark.parametrize(("labels", "closer"), [([4, 4], True), ([4, 7], False)])
def test_gradient_pulls_same_class_together_and_pushes_others_apart(
        labels: list[int], closer: bool) -> None:
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]], requires_grad=True)
    contrastive_loss(z, torch.tensor(labels), 0.5).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    stepped = (z - 0.1 * z.grad).detach()
    before, after = pair_distances(z.detach())[0, 1], pair_distances(stepped)[0, 1]
    assert (after < before) if closer else (after > before)


def test_degenerate_batches() -> None:
    z = torch.ones(1, 3, requires_grad=True)
    loss = contrastive_loss(z, torch.tensor([0]))
    loss.backward()  # one sample: no pairs, zero loss, zero gradient
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros(1, 3))
    zero = torch.zeros(2, 4)  # a dead map has distance 1 to anything, and stays finite
    assert _loss(zero.tolist(), [0, 0]).item() == pytest.approx(1.0)


# ---------------------------------------------------------------- zoo: tiers, aux heads

SHAPES = [(1, 28, 28), (1, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_aux_head_fits_every_split_candidate(name: str, shape: tuple[int, int, int]) -> None:
    """Ampere's auxiliary head takes the activation at every candidate split of every zoo
    model and gives (N, num_classes) logits (3×32×32 is in test_models.py)."""
    model = build_model(name, shape, 10, seed=0)
    for k in model.split_candidates():
        head = build_aux_head(model, k, 0.5, seed=0).eval()
        with torch.no_grad():
            out = head(torch.randn(2, *activation_shape(model, k)))
        assert out.shape == (2, 10), f"{name} split {k}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_three_tiers_compose_to_the_full_model(name: str) -> None:
    model = build_model(name, (1, 8, 8), 10, seed=0).eval()
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        full = model(x)
        for k1 in (1, len(model) - 2):
            client, server = split(model, k1)
            for m in (1, len(server) - 1):
                edge, head = carve(server, m)
                assert len(edge) == m and len(edge) + len(head) == len(server)
                torch.testing.assert_close(head(edge(client(x))), full, atol=1e-5, rtol=0)
    with pytest.raises(JetsplitError, match="edge tier must host"):
        carve(server, len(server))


# ---------------------------------------------------------------- topology


@pytest.mark.parametrize(("edges", "message"), [
    ({"e0": []}, "edge e0 has no clients"),
    ({"e0": ["a0"], "e1": ["a0"]}, "client a0 is listed under two edges (e0 and e1)"),
    ({"e0": ["a0", "a0"]}, "client a0 is listed twice under edge e0"),
    ({"e0": ["e1"], "e1": ["a1"]}, "e1 is an edge and also a client of edge e0"),
])
def test_topology_shape_errors(tmp_path: Path, edges: dict[str, list[str]], message: str
                               ) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_shape(edges)
    from jetsplit.server.run.config import load_server_config

    path = tmp_path / "server.toml"
    path.write_text('[train]\nalgorithm = "sherl"\n[topology]\n' + "".join(
        f'edges.{e} = [{", ".join(repr(c).replace(chr(39), chr(34)) for c in cs)}]\n'
        for e, cs in edges.items()))
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    assert str(info.value) == f"server config {path}: topology: {message}"


def _registry(roles: dict[str, str]) -> FleetRegistry:
    registry = FleetRegistry()
    for agent, role in roles.items():
        registry.register(agent, {"agent": agent, "role": role})
    return registry


def test_topology_against_the_registrations() -> None:
    registry = _registry({"a0": "client", "a1": "client", "a2": "client", "e0": "edge",
                          "e1": "edge"})
    assert resolve({}, registry).edges == {"e0": ("a0", "a2"), "e1": ("a1",)}
    configured = resolve({"e1": ["a2", "a0"]}, registry)  # a1 sits out (logged)
    assert configured.edges == {"e1": ("a0", "a2")}
    assert configured.groups(["a2", "a1", "a0"]) == {"e1": ["a0", "a2"]}
    for edges, message in [({"e9": ["a0"]}, "topology: edge e9 is not a registered agent"),
                           ({"e0": ["a7"]}, "topology: client a7 is not a registered agent"),
                           ({"a0": ["a1"]}, "topology: a0 is listed as an edge but "
                                            "registered with role client"),
                           ({"e0": ["e1"]}, "topology: e1 is listed as a client but "
                                            "registered with role edge")]:
        with pytest.raises(ConfigError, match=message):
            resolve(edges, registry)
    with pytest.raises(ConfigError, match='at least one agent with role = "edge"'):
        resolve({}, _registry({"a0": "client"}))
    assert round_robin(["e1", "e0"], ["a3", "a1", "a2"]) == {"e0": ["a1", "a3"], "e1": ["a2"]}


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(algorithm="psl", edges=2), "--edges is for --algorithm sherl"),
    (dict(algorithm="sherl", edges=0), "needs 1..4 --edges"),
    (dict(algorithm="sherl", edges=5), "needs 1..4 --edges"),
])
def test_simulate_edge_option_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sherl_topology(kwargs["algorithm"], kwargs["edges"], 4)


# ---------------------------------------------------------------- planner


def test_three_tier_planner_is_role_aware_and_memory_bound() -> None:
    from jetsplit.export.cost_model import edge_block, get_costs, server_block
    from jetsplit.export.planner import (
        InfeasiblePlan,
        PlanSettings,
        check_three_tier,
        classifier_start,
        plan_three_tier,
    )
    from jetsplit.profiles import resolve_profile

    costs = get_costs("alexnet", (1, 28, 28), 10)
    assert classifier_start(costs) == 5  # fc1..fc3
    nano, orin = resolve_profile("jetson-nano-4gb"), resolve_profile("orin-nx-16gb")
    plan = plan_three_tier(costs, [nano], [orin], PlanSettings(batch=32), clients_per_edge=4)
    assert {(r.k1, r.k2) for r in plan.rows} == {(a, b) for a in range(1, 7)
                                                 for b in range(max(a + 1, 5), 8)}
    best = min((r for r in plan.rows if r.fits), key=lambda r: (r.total_ms, r.k1, r.k2))
    assert check_three_tier(plan) == (best.k1, best.k2)
    fixed = plan_three_tier(costs, [nano], [orin], PlanSettings(batch=32), k1=2)
    assert {r.k1 for r in fixed.rows} == {2} and fixed.k2 in (5, 6, 7)
    # The edge block's FLOPs are the server block's at k1 minus those at k2.
    edge = edge_block(costs, 2, 5)
    assert edge.fwd_flops == pytest.approx(server_block(costs, 2).fwd_flops
                                           - server_block(costs, 5).fwd_flops)
    with pytest.raises(InfeasiblePlan, match="the edge needs at least"):
        check_three_tier(plan_three_tier(costs, [orin], [nano], PlanSettings(batch=8192),
                                         clients_per_edge=64, k1=1))
    with pytest.raises(ConfigError, match="choose 1..6"):
        plan_three_tier(costs, [nano], [orin], PlanSettings(), k1=7)


# ---------------------------------------------------------------- edge commands


@pytest.fixture(scope="module")
def bundle_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from jetsplit.export.bundle_writer import write_bundle
    from jetsplit.models import ModelSpec

    report = write_bundle(ModelSpec("alexnet", (1, 8, 8), 10), 2,
                          tmp_path_factory.mktemp("bundle") / "b", aux_ratio=None, seed=0,
                          tar=True)
    assert report.tar_path is not None
    return report.tar_path


def _install(workers: list[AgentWorker], archive: Path, edge_layers: int) -> None:
    from jetsplit.server.cuts.shipping import BundleShipper
    from jetsplit.server.engines.seam import InProcessEngine

    engine = InProcessEngine({w.agent_id: w for w in workers})
    shipper = BundleShipper(engine, archive, lr=0.01, deadline_s=60)
    shipper.edge_layers = edge_layers
    assert shipper.ensure(engine.online()) == engine.online()


def test_edge_commands_exchange_smashed_data_and_gradients_directly(bundle_archive: Path
                                                                    ) -> None:
    """Through the in-process engine: clients send their smashed data straight to their
    edge, which trains on it, answers the cloud with embeddings + labels, and sends each
    client its gradient slice; the edge refuses smashed data from a client it was not
    assigned, and that client gets no gradient."""
    from jetsplit.bundle import load_bundle
    from jetsplit.models.weights import to_arrays
    from jetsplit.protocol import ProtocolError
    from jetsplit.server.engines.seam import Command, InProcessEngine

    bundle = load_bundle(bundle_archive)
    edge_block, _ = carve(bundle.server_module(), 3)
    weights = to_arrays(edge_block, "edge")
    train = load_dataset_split("digits", 0.2, 0)[0]
    edge = AgentWorker("e0", no_data(), role="edge")
    clients = [AgentWorker(f"a{i}", train, role="client", seed=i) for i in range(3)]
    _install([edge, *clients], bundle_archive, 3)
    # Role-true: the edge holds its middle block only (no classifier, no client block).
    assert edge.bundle is not None and edge.bundle.role == "edge"
    assert {p.name for p in edge.bundle.root.iterdir()} == {"manifest.json", "edge.safetensors"}
    assert edge.server is None and edge.client is None
    assert clients[0].bundle is not None and not clients[0].bundle.has_block("server")
    with pytest.raises(ProtocolError, match="has role client"):
        clients[0].handle(Kind.EDGE_LOAD.value, 0, 0, {"layers": 3}, weights)
    with pytest.raises(ProtocolError, match="no edge block loaded"):
        edge.handle(Kind.EDGE_STEP.value, 0, 0, {"clients": ["a0"]}, {})
    with pytest.raises(ProtocolError, match="margin"):
        edge.handle(Kind.EDGE_STEP.value, 0, 0, {"clients": ["a0"], "margin": 3.0}, {})
    with pytest.raises(ProtocolError, match="clients"):
        edge.handle(Kind.EDGE_STEP.value, 0, 0, {"clients": []}, {})

    engine = InProcessEngine({w.agent_id: w for w in [edge, *clients]}, run_id="r")
    out = engine.send_and_receive({"e0": Command(Kind.EDGE_LOAD.value, {
        "layers": 3, "clients": ["a0", "a1"]}, weights)})
    assert out.agents == ["e0"]
    # a2 was not assigned to e0: its smashed data is refused (typed, counted).
    fwd = engine.send_and_receive({c.agent_id: Command(Kind.FORWARD.value,
                                                       {"batch": 8 + i, "edge": "e0"})
                                   for i, c in enumerate(clients)})
    assert {a: r.meta["samples"] for a, r in fwd.replies.items()} == {"a0": 8, "a1": 9, "a2": 10}
    assert all(not r.tensors for r in fwd.replies.values())  # nothing up to the coordinator
    assert engine.peer_rejected == {"UnexpectedPeer": 1}
    assert [k[:2] for k in edge.peers.held()] == [("smashed", "a0"), ("smashed", "a1")]
    sent = engine.counters.snapshot()
    assert all(sent[c]["up"]["smashed"] > 8 * 64 * 4 for c in ("a0", "a1", "a2"))
    step = engine.send_and_receive({"e0": Command(Kind.EDGE_STEP.value,
                                                  {"clients": ["a0", "a1"], "margin": 0.5})})
    reply = step["e0"]
    assert reply.meta["clients"] == ["a0", "a1"] and reply.meta["sizes"] == [8, 9]
    assert reply.meta["loss"] > 0 and reply.meta["samples"] == 17
    embeddings = reply.tensors["embeddings"]
    assert embeddings.shape[0] == 17 and embeddings.dtype == np.float32
    assert reply.tensors["labels"].shape == (17,)
    assert engine.counters.snapshot()["e0"]["up"]["gradient"] > 17 * 64 * 4
    back = engine.send_and_receive({c.agent_id: Command(Kind.BACKWARD.value, {"direct": True})
                                    for c in clients})
    assert back.agents == ["a0", "a1"]
    assert back.missed == {"a2": "error: backward for round 0 step 0: no gradient from edge "
                                 "e0 within 0s"}
    trained = edge.handle(Kind.GET_WEIGHTS.value, 0, 0, {"blocks": ["edge"]}, {}).tensors
    assert set(trained) == set(weights)
    assert any(not np.array_equal(trained[k], weights[k]) for k in weights)  # it stepped
    # Malformed smashed data from an assigned client is the edge step's error.
    from jetsplit.wire import Message, MessageType

    bad = Message(MessageType.PEER, run="r", sender="a0", seq=1, step=1, kind="smashed",
                  tensors={"activations": np.zeros((4, 5), np.float32),
                           "labels": np.zeros(4, np.int64)})
    edge.peers.accept(bad, 100)
    with pytest.raises(ProtocolError, match="activations are float32"):
        edge.handle(Kind.EDGE_STEP.value, 0, 1, {"clients": ["a0"]}, {}, run="r")


# ---------------------------------------------------------------- whole runs

EDGE_KINDS = {Kind.EDGE_LOAD.value, Kind.EDGE_STEP.value, Kind.GET_WEIGHTS.value}
SETUP_KINDS = {Kind.BUNDLE.value, Kind.BUNDLE_PART.value, Kind.STATUS.value,
               Kind.REGISTER.value}


def _sherl_settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = dict(algorithm="sherl", rounds=2, local_steps=10, batch=64,
                                lr=0.05, edges=sherl_topology("sherl", 2, 4))
    return Settings(**{**base, **overrides})


def _simulate(settings: Settings, out: Path, model: str = "alexnet", **kwargs: Any
              ) -> dict[str, Any]:
    return simulate(settings, model=model, split=2, dataset="digits", clients=4,
                    partition_scheme="iid", out_dir=out, **kwargs)


def test_in_process_sherl_learns_digits_and_books_bytes_per_tier(tmp_path: Path) -> None:
    summary = _simulate(_sherl_settings(), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert summary["final_accuracy"] > 0.5  # 10 classes: chance is 0.1
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    for row in rows:
        tiers = row["tier_bytes"]
        assert sum(tiers.values()) == row["bytes_up"] + row["bytes_down"]
        assert set(tiers) == {"client_to_edge", "edge_to_client", "edge_to_cloud",
                              "model_client_edge", "model_edge_cloud", "control"}
        assert min(tiers.values()) > 0
        # Direct messages are booked once, on their sender: what the clients sent their
        # edges and what the edges sent back.
        by_kind = row["bytes_by_kind"]["up"]
        assert tiers["client_to_edge"] == by_kind["smashed"]
        assert tiers["edge_to_client"] == by_kind["gradient"]
        assert row["edge_split"] == 5 and row["edge_loss"] is not None
        assert set(row["edge_gflops"]) == {"e0", "e1"}
    edges = {a: summary["bytes"][a] for a in ("e0", "e1")}
    for counters in edges.values():  # edges get commands and models, never smashed data
        assert set(counters["down"]) - SETUP_KINDS == EDGE_KINDS
        assert set(counters["up"]) - SETUP_KINDS == EDGE_KINDS | {Kind.GRADIENT.value}


def test_sherl_resumes_bit_identically(tmp_path: Path) -> None:
    """A round, then a resumed second, equal two uninterrupted rounds (a small model: the
    checkpoints hold the cloud head's Adam state)."""

    settings = _sherl_settings(rounds=2, local_steps=2, tau1=1, tau2=2, batch=16)
    model = "mobilenetv3-small"
    _simulate(settings, tmp_path / "whole", model)
    _simulate(settings.model_copy(update={"rounds": 1}), tmp_path / "cut", model)
    _simulate(settings, tmp_path / "cut", model, resume=True)
    from safetensors.numpy import load_file

    for name in ("server.safetensors", "client.safetensors"):
        a, b = (load_file(str(tmp_path / run / name)) for run in ("whole", "cut"))
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a), name
    rows = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]
            for run in ("whole", "cut")]
    assert [r["accuracy"] for r in rows[0]] == [r["accuracy"] for r in rows[1]]
    assert rows[1][-1]["aggregations"] == {"edge": 4, "cloud": 2}



@pytest.mark.parametrize(("taus", "message"), [
    (dict(tau1=3, tau2=4), r"train.tau2 \(4\) must be a multiple of train.tau1 \(3\)"),
    (dict(tau2=3), r"train.local_steps \(4\) must be a multiple of train.tau2 \(3\)"),
])
def test_aggregation_periods_must_nest(taus: dict[str, int], message: str) -> None:
    from jetsplit.server.methods.sherl import periods

    with pytest.raises(ConfigError, match=message):
        periods(Settings(local_steps=4, **taus))
    assert periods(Settings(local_steps=4)) == (4, 4)
    assert periods(Settings(local_steps=4, tau2=2)) == (2, 2)


class _LyingEdge(AgentWorker):
    """An edge whose gradients (sent straight to its client) or embeddings (for the cloud)
    are NaN: the client, or the coordinator, must refuse them."""

    poison = "grad"

    def _do_edge_step(self, args: Any, round_: int, step: int, tensors: Any) -> Any:
        result = super()._do_edge_step(args, round_, step, tensors)
        if self.poison == "grad":
            for peer in result.peers:
                peer.tensors["grad"][:] = np.nan
        else:
            result.tensors["embeddings"][:] = np.nan
        return result


@pytest.mark.parametrize(("poison", "missed"), [
    ("grad", {"a1": "error: backward: edge e1's gradient is not finite float32"}),
    ("embeddings", {"e1": "error: bad reply: embeddings contain NaN or infinity"}),
])
def test_a_bad_edge_is_a_recorded_miss_and_training_goes_on(
        tmp_path: Path, poison: str, missed: dict[str, str]) -> None:
    from jetsplit.data import partition
    from jetsplit.export.bundle_writer import write_bundle
    from jetsplit.models import ModelSpec
    from jetsplit.server.engines.seam import InProcessEngine
    from jetsplit.server.run.assembly import RunSpec, execute

    train, test = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, 2, "iid", 0, 10)
    workers: dict[str, AgentWorker] = {
        f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i) for i, s in enumerate(shards)}
    workers["e0"] = AgentWorker("e0", no_data(), role="edge")
    workers["e1"] = liar = _LyingEdge("e1", no_data(), role="edge")
    liar.poison = poison
    archive = write_bundle(ModelSpec("mobilenetv3-small", (1, 8, 8), 10), 2, tmp_path / "b",
                           aux_ratio=None, tar=True).tar_path
    assert archive is not None
    settings = Settings(algorithm="sherl", rounds=1, local_steps=2, batch=16,
                        edges={"e0": ["a0"], "e1": ["a1"]})
    engine = InProcessEngine(workers)
    execute(engine, RunSpec(settings, archive, test, tmp_path / "run", checkpoint=False))
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row["missed"] == missed
    assert row["train_loss"] is not None and row["accuracy"] is not None
    trained = [a for a in ("a0", "a1")
               if engine.counters.snapshot()[a]["down"].get(Kind.BACKWARD.value)]
    # A NaN gradient reaches a1 (it comes from its edge) but is never applied; after a
    # NaN upload the coordinator drops e1 for the round, so a1 is not even asked.
    assert trained == (["a0", "a1"] if poison == "grad" else ["a0"])

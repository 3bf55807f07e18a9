"""An agent daemon and the MQTT engine across a broker: the embedded 3.1.1 broker runs a
fleet; a peer with the wrong fleet key is rejected both ways and the daemon keeps serving; a
slow agent misses the step at its deadline; a broadcast to some agents reaches only them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.daemon import AgentDaemon
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.engines.seam import Command
from jetsplit.server.ops.brokers import EmbeddedBroker, MosquittoProcess
from jetsplit.server.run.assembly import prepare_bundle
from jetsplit.server.run.config import ServerConfig
from jetsplit.transport.mqtt import EndpointOptions
from jetsplit.wire import Message, MessageType


@pytest.fixture()
def worker() -> AgentWorker:
    train, _ = load_dataset_split("digits", 0.2, 0)
    return AgentWorker("solo", train.subset(range(64)))


def _serve(daemon: AgentDaemon) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def test_embedded_broker_speaks_311_and_runs_a_fleet(worker: AgentWorker, tmp_path: Path
                                                      ) -> None:
    with EmbeddedBroker() as broker:
        daemon = AgentDaemon(worker, broker.address, "emb")
        for _ in _serve(daemon):
            engine = MqttEngine(broker.address, "emb", run_id="emb").start(wait_s=20)
            try:
                assert engine.wait_for_agents(1, 120) == ["solo"]
                assert engine.endpoint.protocol == "3.1.1"
                cfg = ServerConfig(model={"name": "mobilenetv3-small", "input_shape": [1, 8, 8]})
                archive = prepare_bundle(cfg, tmp_path)
                assert BundleShipper(engine, archive, lr=0.01, deadline_s=60).ensure(["solo"]) == [
                    "solo"]
                out = engine.send_and_receive({"solo": Command("forward", {"batch": 4})})
                assert out["solo"].tensors["activations"].shape[0] == 4
            finally:
                engine.close()


def test_wrong_fleet_key_is_rejected_both_ways(worker: AgentWorker,
                                               mosquitto: MosquittoProcess) -> None:
    right, wrong = b"k" * 32, b"w" * 32
    daemon = AgentDaemon(worker, mosquitto.address, "keys", EndpointOptions(fleet_key=right))
    for _ in _serve(daemon):
        assert daemon.endpoint.subscribed.wait(10)  # before the intruder speaks
        intruder = MqttEngine(mosquitto.address, "keys", run_id="x",
                              options=EndpointOptions(fleet_key=wrong)).start()
        try:
            assert intruder.wait_for_agents(1, 3) == []
            assert intruder.endpoint.rejected["BadSignature"] >= 1
            status = Message(MessageType.COMMAND, run="x", sender="coordinator",
                             seq=intruder.endpoint.next_seq(), kind="status")
            intruder.endpoint.send(intruder.topics.down("solo"), status)
            deadline = time.monotonic() + 60
            while daemon.endpoint.rejected["BadSignature"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            intruder.close()
        assert daemon.endpoint.rejected["BadSignature"] >= 1
        engine = MqttEngine(mosquitto.address, "keys", run_id="y",
                            options=EndpointOptions(fleet_key=right)).start()
        try:
            assert engine.wait_for_agents(1, 120) == ["solo"]
            out = engine.send_and_receive({"solo": Command("status")}, deadline_s=120)
            assert out.agents == ["solo"]
        finally:
            engine.close()


def test_a_slow_agent_misses_the_step_at_its_deadline(worker: AgentWorker,
                                                       mosquitto: MosquittoProcess) -> None:
    """Alive but too slow: dropped from that step as `deadline`, recorded; its late answer
    is counted and ignored; the next step it answers in time is used again."""
    handle = worker.handle
    delays = iter([6.0])

    def slow(*args: object, **kwargs: object):  # noqa: ANN202
        time.sleep(next(delays, 0.0))
        return handle(*args, **kwargs)

    worker.handle = slow  # type: ignore[method-assign]
    daemon = AgentDaemon(worker, mosquitto.address, "slow")
    for _ in _serve(daemon):
        engine = MqttEngine(mosquitto.address, "slow", run_id="slow").start()
        try:
            assert engine.wait_for_agents(1, 120) == ["solo"]
            started = time.monotonic()
            out = engine.send_and_receive({"solo": Command("status")}, round=1, step=4,
                                          deadline_s=1.0)
            # Dropped at its 1 s deadline, not when the 6 s reply lands (margin for load).
            assert time.monotonic() - started < 6.0
            assert out.replies == {} and out.missed == {"solo": "deadline"}
            missed = engine.registry.missed[-1]
            assert (missed.agent, missed.round, missed.step, missed.reason) == (
                "solo", 1, 4, "deadline")
            assert engine.registry.snapshot()[0]["stragglers"] == 1
            out = engine.send_and_receive({"solo": Command("status")}, deadline_s=120)
            assert out.agents == ["solo"]
            # Its late answer was counted (and ignored, above). On a busy machine the engine
            # may also have re-sent the pending command, answered from the agent's reply
            # cache: one more late reply to the same command.
            assert engine.late_replies >= 1
        finally:
            engine.close()


def test_a_broadcast_to_some_agents_reaches_only_them(mosquitto: MosquittoProcess) -> None:
    """down/all is used only when every online agent is a recipient; otherwise each one gets
    its own copy, so devices outside the selection download nothing."""
    train, _ = load_dataset_split("digits", 0.2, 0)
    daemons = [AgentDaemon(AgentWorker(f"b{i}", train.subset(range(32))), mosquitto.address,
                           "bcast") for i in range(3)]
    seen: dict[str, list[str]] = {d.agent: [] for d in daemons}
    for daemon in daemons:
        def record(inbound, daemon=daemon, handle=daemon.handle):  # noqa: ANN001, ANN202
            seen[daemon.agent].append(inbound.topic.rsplit("/", 1)[-1])
            return handle(inbound)
        daemon.handle = record  # type: ignore[method-assign]
    serving = [_serve(d) for d in daemons]
    for gen in serving:
        next(gen)
    engine = MqttEngine(mosquitto.address, "bcast", run_id="b").start()
    try:
        assert engine.wait_for_agents(3, 120) == ["b0", "b1", "b2"]
        for log in seen.values():
            log.clear()
        assert engine.broadcast(Command("status"), ["b0", "b1"], deadline_s=120).agents == [
            "b0", "b1"]
        assert engine.broadcast(Command("status"), ["b0", "b1", "b2"],
                                deadline_s=120).agents == ["b0", "b1", "b2"]
    finally:
        engine.close()
        for gen in serving:
            next(gen, None)
    # (a retransmission could repeat a topic, so compare which topics reached whom)
    assert {a: set(topics) for a, topics in seen.items()} == {
        "b0": {"b0", "all"}, "b1": {"b1", "all"}, "b2": {"all"}}

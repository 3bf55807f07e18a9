"""`jetsplit agent run` / `jetsplit server run` user errors, the embedded 3.1.1 broker, and
fleet keys: a peer with the wrong key is rejected and the process keeps running."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.data import load_dataset_split
from jetsplit.edge_agent.daemon import AgentDaemon
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.server.brokers import EmbeddedBroker, MosquittoProcess, free_port
from jetsplit.server.config import ServerConfig
from jetsplit.server.coordinator import BundleShipper, prepare_bundle
from jetsplit.server.engine import Command
from jetsplit.server.mqtt_engine import MqttEngine
from jetsplit.transport.mqtt import EndpointOptions
from jetsplit.wire import Message, MessageType


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_config_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_error_line(capsys, ["server", "run", "--config", str(tmp_path / "nope.toml")])
    assert "server config" in err and "file not found" in err
    agent = tmp_path / "agent.toml"
    agent.write_text('agent = "bad id!"\n')
    assert "agent:" in _one_error_line(capsys, ["agent", "run", "--config", str(agent)])
    agent.write_text('agent = "a0"\n[mqtt]\nbroker = "http://x"\n')
    assert "mqtt://" in _one_error_line(capsys, ["agent", "run", "--config", str(agent)])
    agent.write_text('agent = "a0"\n[data]\nclients = 2\nindex = 2\n')
    assert "data.index" in _one_error_line(capsys, ["agent", "run", "--config", str(agent)])
    agent.write_text('agent = "a0"\n[mqtt]\nkeepalive = 5\n')
    assert "keepalive_s" in _one_error_line(capsys, ["agent", "run", "--config", str(agent)])


def test_server_reports_unreachable_broker_and_missing_agents(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mosquitto: MosquittoProcess) -> None:
    config = tmp_path / "server.toml"
    config.write_text("agents = 2\nwait_s = 1\n[mqtt]\nconnect_wait_s = 2\n")
    dead = f"mqtt://127.0.0.1:{free_port()}"
    err = _one_error_line(capsys, ["server", "run", "--config", str(config), "--broker", dead])
    assert "unreachable" in err
    live = f"mqtt://127.0.0.1:{mosquitto.port}"
    err = _one_error_line(capsys, ["server", "run", "--config", str(config), "--broker", live])
    assert "only 0 of 2 agents registered" in err


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
        assert daemon.endpoint.connected.wait(10)  # subscribed before the intruder speaks
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


def test_example_configs_stay_valid() -> None:
    from jetsplit.edge_agent.config import load_agent_config
    from jetsplit.server.config import load_server_config

    root = Path(__file__).resolve().parents[2] / "systemd"
    agent = load_agent_config(root / "agent.toml")
    server = load_server_config(root / "server.toml")
    assert agent.mqtt.address().tls and agent.mqtt.address().username == "nano-01"
    assert server.fleet == agent.fleet and server.train.deadline_s == 60


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


def test_reply_cache_is_bounded_by_entries_and_bytes() -> None:
    import numpy as np

    from jetsplit.edge_agent.daemon import ReplyCache

    def reply(n: int) -> Message:
        return Message(MessageType.REPLY, run="r", sender="a", seq=n,
                       tensors={"x": np.zeros(n, np.uint8)})

    cache = ReplyCache(entries=3, max_bytes=100)
    for i in range(5):
        cache.put(("r", i), reply(10), "fp32", "none")
    assert [cache.get(("r", i)) is not None for i in range(5)] == [False, False, True, True,
                                                                     True]
    cache.put(("r", 9), reply(90), "fp32", "none")  # 10 + 10 + 90 > 100: oldest go first
    assert cache.get(("r", 3)) is None and cache.get(("r", 4)) is not None
    cache.put(("r", 9), reply(5), "fp32", "none")  # replacing an entry frees its bytes
    cache.put(("r", 10), reply(80), "fp32", "none")
    assert cache.get(("r", 4)) is not None and cache.get(("r", 10)) is not None

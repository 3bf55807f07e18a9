"""Weights messages are bounded by what the run ships, not by the wire's 64 MiB cap: the
default AlexNet on MNIST (~80 MB) travels whole, a byte beyond the accounted bound does
not, everything unaccounted keeps the cap; and a round in which no agent delivers its
update fails in one line instead of completing on the untrained model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jetsplit.bundle import Bundle, load_bundle
from jetsplit.data import load_dataset_split, partition
from jetsplit.edge_agent.worker import AgentWorker, respond
from jetsplit.errors import JetsplitError
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import Kind
from jetsplit.server.engines.seam import Command, InProcessEngine, command_message
from jetsplit.server.run.assembly import RunSpec, execute
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import RoundFailed, Trainer
from jetsplit.wire import (
    Limits,
    Message,
    MessageType,
    Reassembler,
    chunk_message,
    decode_message,
    encode_message,
)
from jetsplit.wire.envelope import DEFAULT_MAX_MESSAGE_BYTES
from jetsplit.wire.errors import OversizedMessage

ALEXNET = ModelSpec("alexnet", (1, 28, 28), 10)  # the defaults' model on MNIST's shape
TINY = ModelSpec("mobilenetv3-small", (1, 8, 8), 10)


@pytest.fixture(scope="module")
def alexnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(ALEXNET, 2, tmp_path_factory.mktemp("alex") / "bundle",
                          aux_ratio=None, tar=True)
    assert report.tar_path is not None
    return report.tar_path


def _workers(agents: int) -> dict[str, AgentWorker]:
    train, _ = load_dataset_split("digits", 0.2, 0)
    shards = partition(train.y, agents, "iid", 0, train.num_classes)
    return {f"a{i}": AgentWorker(f"a{i}", train.subset(s), seed=i)
            for i, s in enumerate(shards)}


def _whole(bundle: Bundle) -> dict[str, np.ndarray]:
    return {**to_arrays(bundle.client_module(), "client"),
            **to_arrays(bundle.server_module(), "server")}


def _set_weights(arrays: dict[str, np.ndarray], kind: str = Kind.SET_WEIGHTS.value,
                 sender: str = "coordinator") -> bytes:
    msg = command_message("r", 1, Command(kind, {}, arrays), round=1, step=0)
    msg.sender = sender
    return encode_message(msg)


def test_agent_takes_the_whole_model_its_manifest_declares_and_not_a_byte_more(
        alexnet: Path) -> None:
    bundle = load_bundle(alexnet)
    worker = next(iter(_workers(1).values()))
    assert worker.accepts("coordinator", Kind.SET_WEIGHTS.value) is None  # no bundle yet
    worker.bundle = bundle
    arrays = _whole(bundle)
    down = _set_weights(arrays)
    assert len(down) > DEFAULT_MAX_MESSAGE_BYTES  # the old constant refused this message
    with pytest.raises(OversizedMessage):
        decode_message(down)
    command = decode_message(down, allowance=worker.accepts)
    reply = respond(worker, command, lambda: 2).reply
    assert reply.type == MessageType.REPLY and reply.meta["blocks"] == ["client", "server"]

    bound = worker.accepts("coordinator", Kind.SET_WEIGHTS.value)
    assert bound is not None and len(down) <= bound
    padded = {**arrays, "server/extra": np.zeros(bound - len(down) + 1, np.uint8)}
    with pytest.raises(OversizedMessage, match="accounted"):
        decode_message(_set_weights(padded), allowance=worker.accepts)
    for other in (_set_weights(arrays, kind=Kind.FORWARD.value),  # not a weights message
                  _set_weights(arrays, sender="a1")):  # not from the coordinator
        with pytest.raises(OversizedMessage):
            decode_message(other, allowance=worker.accepts)


def test_chunks_over_the_cap_are_taken_only_for_an_accounted_kind() -> None:
    """The reassembler asks the allowance at the first chunk (the chunk names the kind it
    carries); the limits stay for every other kind and sender."""
    body = {"w": np.arange(40_000, dtype=np.float32)}
    whole = encode_message(Message(MessageType.REPLY, run="r", sender="a0", seq=1,
                                   kind=Kind.GET_WEIGHTS.value, tensors=body))
    limits = Limits(max_message_bytes=64 * 1024)
    assert len(whole) > limits.max_message_bytes

    def chunks(kind: str) -> list[Message]:
        return [decode_message(c) for c in chunk_message(
            whole, run="r", sender="a0", seq_start=2, msg_id="m", chunk_bytes=16 * 1024,
            kind=kind)]

    def allowance(sender: str, kind: str) -> int | None:
        return len(whole) if (sender, kind) == ("a0", Kind.GET_WEIGHTS.value) else None

    taken = Reassembler(limits, allowance=allowance)
    out = [taken.feed(c) for c in chunks(Kind.GET_WEIGHTS.value)]
    assert out[-1] == whole and all(o is None for o in out[:-1])
    got = decode_message(out[-1], limits=limits, allowance=allowance)
    assert np.array_equal(got.tensors["w"], body["w"])
    for kind in (Kind.FORWARD.value, ""):
        with pytest.raises(OversizedMessage):
            Reassembler(limits, allowance=allowance).feed(chunks(kind)[0])
    with pytest.raises(OversizedMessage, match="accounted"):
        Reassembler(limits, allowance=lambda s, k: len(whole) - 1).feed(
            chunks(Kind.GET_WEIGHTS.value)[0])


def test_coordinator_pulls_and_pushes_the_whole_default_model(alexnet: Path) -> None:
    """FedAvg's exchange at the default model, through the in-process engine's encoder:
    every agent's whole-model weights come back (before: every agent missed get_weights)."""
    engine = InProcessEngine(_workers(2))
    _, test = load_dataset_split("digits", 0.2, 0)
    trainer = Trainer(engine, alexnet, Settings(algorithm="fedavg", rounds=1), test)
    live = trainer.live(engine.online())
    assert live == ["a0", "a1"]
    blocks = ("client", "server")
    assert trainer.weights_bytes(blocks, live) > DEFAULT_MAX_MESSAGE_BYTES
    states = trainer.pull(live, blocks)
    assert sorted(states) == live and not trainer.books.missed
    assert trainer.push(live, states["a0"]) == live
    assert max(engine.counters.by_kind()["up"].values()) > 2 * DEFAULT_MAX_MESSAGE_BYTES


def test_a_round_without_any_update_fails_in_one_line(tmp_path: Path) -> None:
    """Every agent misses get_weights: the run stops naming who missed what and why."""
    report = write_bundle(TINY, 2, tmp_path / "bundle", seed=3, tar=True, aux_ratio=None)
    assert report.tar_path is not None
    workers = _workers(2)
    for worker in workers.values():
        def refuse(*args: object) -> None:
            raise JetsplitError("disk full")

        worker._do_get_weights = refuse  # type: ignore[method-assign]
    _, test = load_dataset_split("digits", 0.2, 0)
    settings = Settings(algorithm="fedavg", rounds=2, local_steps=1, batch=16)
    with pytest.raises(RoundFailed) as failed:
        execute(InProcessEngine(workers), RunSpec(settings, report.tar_path, test,
                                                  tmp_path / "run", checkpoint=False))
    text = str(failed.value)
    assert "\n" not in text and text.startswith("fedavg round 0: no update")
    assert "a0 missed get_weights: error: disk full" in text and "a1 missed" in text


def test_over_mqtt_an_accounted_reply_arrives_and_an_unaccounted_one_is_refused(
        mosquitto: object) -> None:
    """Through a real broker, chunked: a reply over the limits arrives while its receiver
    accounts for it; without that it is refused, and the refusal is kept by sender (what
    the coordinator names when that agent misses its deadline)."""
    import queue
    import threading

    from jetsplit.broker_url import BrokerAddress
    from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
    from jetsplit.wire import accounted_bound

    address = BrokerAddress("127.0.0.1", mosquitto.port)  # type: ignore[attr-defined]
    options = EndpointOptions(limits=Limits(max_message_bytes=256 * 1024),
                              chunk_bytes=64 * 1024)
    allowed: dict[tuple[str, str], int] = {}
    receiver = MqttEndpoint(address, "test-coordinator", options, sender="coordinator",
                            subscriptions=("w/#",),
                            allowance=lambda s, k: allowed.get((s, k))).start(wait_s=10)
    sender = MqttEndpoint(address, "test-a0", options, sender="a0").start(wait_s=10)
    weights = {"w": np.arange(200_000, dtype=np.float32)}  # 800 kB

    def reply() -> Message:
        return Message(MessageType.REPLY, run="r", sender="a0", seq=sender.next_seq(),
                       kind=Kind.GET_WEIGHTS.value, tensors=weights)

    try:
        assert receiver.subscribed.wait(10)  # start() waited for it: still so
        allowed[("a0", Kind.GET_WEIGHTS.value)] = accounted_bound(weights["w"].nbytes)
        sender.send("w/a0", reply())
        got = receiver.inbox.get(timeout=30).message
        assert np.array_equal(got.tensors["w"], weights["w"]) and "a0" not in receiver.refused
        allowed.clear()
        sender.send("w/a0", reply())
        for _ in range(300):
            if "a0" in receiver.refused:
                break
            threading.Event().wait(0.1)
        assert "OversizedMessage" in receiver.refused["a0"][1]
        with pytest.raises(queue.Empty):
            receiver.inbox.get(timeout=0.5)
    finally:
        sender.close()
        receiver.close()


def test_mqtt_coordinator_accounts_only_pending_weights_and_names_refusals() -> None:
    """The MQTT engine's allowance is the `reply_bytes` of a command still pending for that
    agent and kind; a refused reply is named when the agent misses the deadline."""
    import time

    from jetsplit.broker_url import BrokerAddress
    from jetsplit.server.engines.mqtt import MqttEngine, _Pending

    engine = MqttEngine(BrokerAddress("127.0.0.1", 1), "f", run_id="r")  # never started
    command = Command(Kind.GET_WEIGHTS.value, reply_bytes=123_456_789)
    message = command_message("r", 7, command, round=0, step=0)
    pending = _Pending("a0", 7, message, command)
    engine._pending[("a0", 7)] = pending
    assert engine._allowance("a0", Kind.GET_WEIGHTS.value) == 123_456_789
    assert engine._allowance("a0", Kind.FORWARD.value) is None
    assert engine._allowance("a1", Kind.GET_WEIGHTS.value) is None
    assert engine._silence(pending) == "deadline"
    engine.endpoint.refused["a0"] = (time.monotonic(), "OversizedMessage: too big")
    assert engine._silence(pending) == ("deadline (its reply was refused: "
                                        "OversizedMessage: too big)")
    del engine._pending[("a0", 7)]
    assert engine._allowance("a0", Kind.GET_WEIGHTS.value) is None

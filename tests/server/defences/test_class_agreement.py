"""Classes agree by name: the coordinator's list is the run's, a device lacking some of
them registers with its histogram in the run's order, a device with a class the run does
not know is refused at registration (unit, then over a real Mosquitto on loopback)."""

from __future__ import annotations

import logging
import time

import pytest

from jetsplit.errors import ConfigError
from jetsplit.protocol import parse_registration
from jetsplit.server.defences.class_agreement import agree_classes
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import Topics
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint, presence_payload
from jetsplit.wire import Message, MessageType

RUN = ("bird", "cat", "dog", "fox")
FLEET = "classes"


def _registration(agent: str, classes: list[str] | None, histogram: list[int]) -> dict:
    dataset = {"name": "camera", "size": sum(histogram), "num_classes": len(histogram),
               "input_shape": [3, 16, 16], "label_histogram": histogram}
    if classes is not None:
        dataset["classes"] = classes
    return {"agent": agent, "role": "client", "version": "0.1.0", "zoo_version": 1,
            "dataset": dataset, "profile": None}


def test_a_device_lacking_classes_is_booked_in_the_runs_order() -> None:
    reg = parse_registration(_registration("a0", ["fox", "cat"], [7, 2]))
    dataset = agree_classes(reg, RUN)["dataset"]
    assert dataset["classes"] == list(RUN) and dataset["num_classes"] == 4
    assert dataset["label_histogram"] == [0, 2, 0, 7]  # fox was the device's 0, the run's 3
    assert dataset["size"] == 9


def test_an_unknown_class_is_one_line_naming_it() -> None:
    reg = parse_registration(_registration("a1", ["cat", "wolf"], [3, 4]))
    with pytest.raises(ConfigError) as exc:
        agree_classes(reg, RUN)
    assert str(exc.value) == ("agent a1: class 'wolf' is not one of the run's 4 classes "
                              "(bird, cat, dog, fox)")


@pytest.mark.parametrize(("run", "classes"), [(None, ["cat", "dog"]), (RUN, None)])
def test_without_names_on_either_side_the_registration_is_as_sent(
        run: tuple[str, ...] | None, classes: list[str] | None) -> None:
    reg = parse_registration(_registration("a2", classes, [5, 1]))
    assert agree_classes(reg, run) == reg.model_dump(mode="json")


def _register(broker: MosquittoProcess, agent: str, registration: dict) -> MqttEndpoint:
    topics = Topics(FLEET)
    device = MqttEndpoint(broker.address, f"dev-{agent}", EndpointOptions(), sender=agent,
                          subscriptions=(topics.down_all, topics.down(agent))).start(wait_s=30)
    device.publish_raw(topics.presence(agent),
                       presence_payload("-", agent, "online", fleet_key=None), retain=True)
    device.send(topics.up(agent), Message(MessageType.REGISTER, run="-", sender=agent,
                                          seq=device.next_seq(), kind="register",
                                          meta=registration))
    return device


def test_the_coordinator_refuses_a_device_with_an_unknown_class(
        mosquitto: MosquittoProcess, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "jetsplit")
    engine = MqttEngine(mosquitto.address, FLEET, run_id="r1", classes=RUN).start(wait_s=30)
    devices = []
    try:
        devices.append(_register(mosquitto, "wolfcam", _registration(
            "wolfcam", ["cat", "wolf"], [3, 4])))
        devices.append(_register(mosquitto, "foxcam", _registration(
            "foxcam", ["fox", "cat"], [7, 2])))
        end = time.monotonic() + 30
        while engine.registry.online() != ["foxcam"] or engine.rejected_agents < 1:
            assert time.monotonic() < end, (engine.registry.online(), engine.rejected_agents)
            time.sleep(0.05)
        time.sleep(0.3)  # a late second registration of wolfcam would show here
        assert engine.registry.registered() == ["foxcam"]
        assert engine.endpoint.rejected["UnknownClass"] == 1
        booked = engine.registry.registration("foxcam")["dataset"]
        assert booked["label_histogram"] == [0, 2, 0, 7] and booked["classes"] == list(RUN)
        refusals = [r.getMessage() for r in caplog.records if "refused registration" in
                    r.getMessage()]
        assert refusals == ["refused registration from wolfcam: agent wolfcam: class 'wolf' "
                            "is not one of the run's 4 classes (bird, cat, dog, fox)"]
    finally:
        for device in devices:
            device.close()
        engine.close()

"""Device-side protocol schemas (command arguments, registrations), without torch: these also
run under Python 3.8 and 3.9 in `.ci/run` (marker `device_pure`), where a run-time annotation
that only 3.10 understands fails at import."""

from __future__ import annotations

import pytest

from jetsplit.protocol import (
    ForwardArgs,
    ProtocolError,
    TrainArgs,
    WeightsArgs,
    parse_args,
    parse_registration,
)

pytestmark = pytest.mark.device_pure

_SUMMARY = {"name": "digits", "size": 10, "num_classes": 10, "input_shape": [1, 8, 8],
            "label_histogram": [1] * 10}


def test_command_arguments_validate_and_ignore_routing_keys() -> None:
    args = parse_args("forward", {"batch": 32, "codec": "int8", "cmd": "c1", "to": ["a0"]})
    assert args == ForwardArgs(batch=32, codec="int8")
    assert parse_args("train", {"steps": 3, "batch": 8, "lr": 0.1}) == TrainArgs(
        steps=3, batch=8, lr=0.1)
    assert parse_args("get_weights", {}) == WeightsArgs(blocks=["client"])
    assert parse_args("backward", {}).forward_step is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kind", "meta", "needle"), [
    ("forward", {"batch": 0}, "batch"),
    ("forward", {"batch": "32"}, "batch"),  # strict: no string coercion
    ("forward", {"batch": 8, "codec": "fp8"}, "codec"),
    ("train", {"steps": 1, "batch": 8, "lr": float("nan")}, "lr"),
    ("get_weights", {"blocks": ["client", "nope"]}, "blocks"),
    ("eval", {"batch": 8, "surprise": 1}, "surprise"),
    ("format_disk", {}, "unknown command"),
])
def test_bad_command_arguments_are_one_line(kind: str, meta: dict, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_args(kind, meta)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_registration_is_validated() -> None:
    reg = parse_registration({"agent": "a0", "role": "client", "version": "0.1.0",
                              "zoo_version": 1, "dataset": _SUMMARY, "bundle": None})
    assert reg.agent == "a0" and reg.dataset.input_shape == [1, 8, 8] and reg.profile is None
    with pytest.raises(ProtocolError) as info:
        parse_registration({"agent": "../etc", "role": "client", "version": "0.1.0",
                            "zoo_version": 1, "dataset": _SUMMARY})
    assert "agent" in str(info.value) and "\n" not in str(info.value)


_REGISTRATION = {"agent": "a0", "role": "client", "version": "0.1.0", "zoo_version": 1,
                 "dataset": _SUMMARY}


def _with(path: tuple, value: object) -> dict:
    """The registration above with one field, at `path`, replaced."""
    import copy

    out = copy.deepcopy(_REGISTRATION)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


@pytest.mark.parametrize("path", [("zoo_version",), ("dataset", "size"),
                                  ("dataset", "num_classes"), ("dataset", "input_shape", 0),
                                  ("dataset", "label_histogram", 3)])
@pytest.mark.parametrize("value", [10**400, -1, float("nan"), float("inf"), "7", 2.5, None])
def test_every_number_in_a_registration_is_bounded(path: tuple, value: object) -> None:
    """10^400 once overflowed the FedAvg weights and SCALA's prior and stopped the
    coordinator: now any such number costs the device its registration, in one line."""
    with pytest.raises(ProtocolError) as info:
        parse_registration(_with(path, value))
    assert str(info.value).startswith("registration a0: ") and "\n" not in str(info.value)


@pytest.mark.parametrize(("dataset", "needle"), [
    ({**_SUMMARY, "size": 11}, "adds up to 10, size says 11"),
    ({**_SUMMARY, "label_histogram": [1] * 9}, "9 classes, num_classes says 10"),
    ({**_SUMMARY, "label_histogram": [10] + [0] * 9}, None),  # skewed but consistent: fine
])
def test_a_histogram_must_add_up_to_the_claimed_size(dataset: dict, needle: object) -> None:
    meta = {**_REGISTRATION, "dataset": dataset}
    if needle is None:
        assert parse_registration(meta).dataset.label_histogram[0] == 10
        return
    with pytest.raises(ProtocolError, match=str(needle)):
        parse_registration(meta)


def test_a_registered_profile_is_validated_and_bounded() -> None:
    from jetsplit.profiles import resolve_profile

    good = resolve_profile("jetson-nano-4gb").model_dump(mode="json")
    assert parse_registration({**_REGISTRATION, "profile": good}).profile == good
    for section, key, bad in (("compute", "cuda_cores", 10**400), ("compute", "efficiency", 2.0),
                              ("network", "uplink_mbps", float("nan")),
                              ("memory", "total_mb", 1e300), ("device", "name", 7)):
        broken = {**good, section: {**good[section], key: bad}}
        with pytest.raises(ProtocolError) as info:
            parse_registration({**_REGISTRATION, "profile": broken})
        assert f"{section}.{key}" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ProtocolError, match="profile"):
        parse_registration({**_REGISTRATION, "profile": {"device": "x"}})

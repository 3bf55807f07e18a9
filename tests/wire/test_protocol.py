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

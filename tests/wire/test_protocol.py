"""Device-side protocol schemas, agent.toml and the device CLI, without torch: these also run
under Python 3.9 in `.ci/run` (marker `device_pure`), where a run-time annotation that only
3.10 understands fails at import."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import DEVICE_COMMANDS, coordinator_refusal, device_only, main
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.errors import ConfigError
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


def test_agent_config_loads_with_optional_sections(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('fleet = "f1"\nagent = "nx-07"\nprofile = "xavier-nx-8gb"\n'
                    '[mqtt]\nbroker = "mqtt://user:pw@broker.local:1884"\n'
                    'tls_ca = "/etc/jetsplit/ca.pem"\n'
                    '[data]\ndataset = "npz:/data/local.npz"\n'
                    '[emulation]\nprofile = "jetson-nano-4gb"\nuplink_mbps = 50.0\n')
    cfg = load_agent_config(path)
    assert (cfg.fleet, cfg.agent, cfg.profile) == ("f1", "nx-07", "xavier-nx-8gb")
    address = cfg.mqtt.address()
    assert (address.host, address.port, address.username) == ("broker.local", 1884, "user")
    assert cfg.emulation is not None and cfg.emulation.uplink_mbps == 50.0
    assert cfg.emulation.downlink_mbps is None
    assert cfg.state_path() == Path("~/.local/state/jetsplit/f1/nx-07").expanduser()


@pytest.mark.parametrize(("body", "needle"), [
    ('agent = "a0"\nthreads = -1\n', "threads"),
    ('agent = "a0"\n[mqtt]\nkeepalive_s = "30"\n', "keepalive_s"),
    ('agent = "a0"\nsurprise = 1\n', "surprise"),
    ('agent = "a 0"\n', "agent"),
    ('agent = "a0"\n[emulation]\nuplink_mbps = 0\n', "uplink_mbps"),
])
def test_bad_agent_config_is_one_line(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_device_commands_mount_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """typer evaluates command annotations when it builds the command: on the device's
    interpreter this is where a 3.10-only annotation would fail."""
    assert main(["agent", "run", "--help"]) == 0
    assert "agent run" in capsys.readouterr().out
    assert main(["doctor", "--help"]) == 0
    assert device_only(["agent", "run"], (3, 12)) and device_only(["trial"], (3, 8))
    assert not device_only(["trial"], (3, 10))


def test_coordinator_commands_on_an_old_python_are_one_line() -> None:
    line = coordinator_refusal(["server", "run"], (3, 8, 10))
    assert line is not None and "Python 3.10+" in line and "3.8" in line
    assert all(name in line for name in DEVICE_COMMANDS)
    assert coordinator_refusal(["server", "run"], (3, 10)) is None
    assert coordinator_refusal(["agent", "run"], (3, 8)) is None
    assert coordinator_refusal(["--version"], (3, 8)) is None

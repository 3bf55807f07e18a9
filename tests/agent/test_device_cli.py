"""The device's commands parse on the device's Python (JetPack 5: 3.8).

typer on Python < 3.10 ignores every `typer.Option` whose annotation is a string, so these
run the real CLI in-process: on 3.8 and 3.9 (`.ci/run`) they fail if a device command's
options are lost or a usage error ends in a traceback. Torch-free: nothing here loads it.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from jetsplit.cli import DEVICE_COMMANDS, build_app, coordinator_refusal, device_only, main

pytestmark = pytest.mark.device_pure


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("argv", "options"), [
    (("agent", "run", "--help"), ("--config", "--broker", "--fleet", "--agent", "--state-dir")),
    (("agent", "host", "--help"), ("--config", "--count", "--first", "--stride")),
    (("doctor", "--help"), ("--broker", "--wait")),
    (("profile", "--help"), ("--model", "--input-shape", "--batch", "--out", "--base-profile",
                             "--device")),
])
def test_device_commands_list_their_options(capsys: pytest.CaptureFixture[str],
                                            argv: tuple[str, ...], options: tuple[str, ...]
                                            ) -> None:
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    missing = [o for o in options if o not in out]
    assert missing == [], f"{' '.join(argv)} lost {missing} on Python {sys.version_info[:2]}"


def test_device_app_mounts_exactly_the_device_commands() -> None:
    app = build_app(device=True)
    names = {g.name for g in app.registered_groups} | {
        c.name for c in app.registered_commands}
    assert names == set(DEVICE_COMMANDS)


def test_command_signatures_hold_real_types() -> None:
    """No string annotation reaches typer (what `from __future__ import annotations`
    would do to a command module)."""
    from jetsplit.edge_agent import cli as agent_cli
    from jetsplit.edge_agent.doctor import doctor
    from jetsplit.export.profile_cli import profile

    commands = [doctor, profile, agent_cli.run, agent_cli.host]
    stringly = [f"{fn.__module__}.{fn.__name__}({name})" for fn in commands
                for name, p in inspect.signature(fn).parameters.items()
                if isinstance(p.annotation, str)]
    assert stringly == []


def test_agent_run_missing_config_is_one_line(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "agent", "run", "--config", str(tmp_path / "a0.toml"))
    assert code == 2
    assert err.strip().splitlines() == [f"error: agent config {tmp_path / 'a0.toml'}: file "
                                        "not found"]


def test_agent_run_bad_field_is_one_line(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    path = tmp_path / "a0.toml"
    path.write_text('fleet = "lab"\nagent = "a0"\n[mqtt]\nkeepalive = 30\n')
    code, _, err = run_cli(capsys, "agent", "run", "--config", str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: agent config {path}: mqtt.keepalive")


@pytest.mark.parametrize(("argv", "message"), [
    (("agent", "run", "--bogus"), "error: No such option: --bogus (see --help)"),
    (("agent", "run"), "error: Missing option '--config'. (see --help)"),
    (("profile", "--model"), "error: Option '--model' requires an argument. (see --help)"),
])
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                   message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.strip().splitlines() == [message]


def test_profile_bad_value_is_one_line_before_torch(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    code, _, err = run_cli(capsys, "profile", "--model", "mlp", "--batch", "0")
    assert code == 2
    assert err.strip().splitlines() == ["error: --batch must be at least 1, got 0"]


@pytest.mark.skipif(sys.version_info >= (3, 10), reason="the refusal is for Python < 3.10")
def test_coordinator_commands_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    code, _, err = run_cli(capsys, "server", "run", "--config", "server.toml")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: `jetsplit server` needs Python 3.10+ (this is {sys.version_info[0]}."
        f"{sys.version_info[1]}); here only the device commands run: agent, doctor, profile"]


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

"""`jetsplit agent run` / `jetsplit server run` user errors: a bad config, an unreachable
broker and agents that never register each end in one `error:` line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.server.ops.brokers import MosquittoProcess, free_port


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


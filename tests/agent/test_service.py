"""systemd: the units pass `systemd-analyze verify`, and the agent speaks sd_notify
(READY=1, then WATCHDOG=1 at half the watchdog interval) to a fake NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jetsplit.edge_agent.service import SystemdNotifier
from jetsplit.server.ops.brokers import MosquittoProcess

ROOT = Path(__file__).resolve().parents[2]
UNITS = ["jetsplit-agent.service", "jetsplit-coordinator.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
@pytest.mark.parametrize("unit", UNITS)
def test_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    # verify needs ExecStart's binary to exist: point it at a stand-in with the same name.
    fake = tmp_path / "jetsplit"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    text = (ROOT / "systemd" / unit).read_text()
    assert "/opt/jetsplit/venv/bin/jetsplit" in text
    copy = tmp_path / unit
    copy.write_text(text.replace("/opt/jetsplit/venv/bin/jetsplit", str(fake)))
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                          text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if unit in line or "Unknown" in line or "Failed" in line]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


def test_agent_unit_hardening_keeps_the_gpu_reachable() -> None:
    text = (ROOT / "systemd" / "jetsplit-agent.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "SupplementaryGroups=video",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                 "PrivateTmp=yes", "Restart=on-failure", "EnvironmentFile="):
        assert line in text, line
    assert "PrivateDevices=yes" not in text  # would hide /dev/nvhost-* from CUDA


def test_notifier_is_silent_outside_systemd() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled and notifier.notify("READY=1") is False
    assert notifier.interval_s is None
    other_pid = SystemdNotifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000",
                                 "WATCHDOG_PID": "1"})
    assert other_pid.interval_s is None  # the watchdog is meant for another process


def test_agent_process_sends_ready_then_watchdog(tmp_path: Path,
                                                 mosquitto: MosquittoProcess) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    config = tmp_path / "agent.toml"
    config.write_text(f'agent = "svc"\nstate_dir = "{tmp_path / "state"}"\n'
                      f'[mqtt]\nbroker = "mqtt://127.0.0.1:{mosquitto.port}"\n'
                      '[data]\ndataset = "digits"\n')
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    agent = subprocess.Popen([sys.executable, "-m", "jetsplit.cli", "agent", "run",
                              "--config", str(config)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        states = [sock.recv(4096).decode() for _ in range(3)]
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        sock.close()
    assert states[0].startswith("READY=1")
    assert states[1] == "WATCHDOG=1" and states[2] == "WATCHDOG=1"

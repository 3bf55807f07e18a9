"""`jetsplit fleet` over a real Mosquitto with real agent processes: ls shows state and
profile, an agent killed with SIGKILL turns offline (its last will), status/logs/stop work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetsplit.cli import main

PROFILES = ["jetson-nano-4gb", "orin-nx-16gb", "jetson-nano-4gb"]


def _ls(url: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    assert main(["fleet", "ls", "--broker", url, "--fleet", "ops", "--json",
                 "--wait", "5"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _until(url: str, capsys: pytest.CaptureFixture[str], ok, timeout_s: float = 90) -> list:
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = _ls(url, capsys)
        if ok(rows):
            return rows
        time.sleep(1)
    raise AssertionError(f"fleet never reached the expected state: {rows}")


def test_fleet_ls_status_logs_stop(mosquitto, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = mosquitto.address.url()
    procs = {}
    for i, profile in enumerate(PROFILES):
        cfg = tmp_path / f"a{i}.toml"
        cfg.write_text(f'fleet = "ops"\nagent = "a{i}"\nprofile = "{profile}"\n'
                       f'state_dir = "{tmp_path / "state"}"\nthreads = 1\n'
                       f'[mqtt]\nbroker = "{url}"\n[data]\ndataset = "digits"\n'
                       f'partition = "iid"\nclients = 3\nindex = {i}\n')
        log = (tmp_path / f"a{i}.log").open("wb")
        procs[f"a{i}"] = subprocess.Popen(
            [sys.executable, "-m", "jetsplit.cli", "agent", "run", "--config", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        rows = _until(url, capsys, lambda r: len(r) == 3 and all(
            x["state"] == "online" and x["profile"] for x in r))
        assert [(r["agent"], r["profile"], r["role"]) for r in rows] == [
            (f"a{i}", p, "client") for i, p in enumerate(PROFILES)]
        assert all(r["rss_mb"] and r["rss_mb"] > 10 and r["bundle"] is None for r in rows)
        # not a Jetson and no trace: the power mode is unknown; too few bytes yet for a rate
        assert all(r["power_mode"] == "unknown" and r["up_mbps"] is None for r in rows)
        server_toml = tmp_path / "server.toml"  # fleet and [mqtt] from the coordinator's config
        server_toml.write_text(f'fleet = "ops"\n[mqtt]\nbroker = "{url}"\n')
        assert main(["fleet", "ls", "--config", str(server_toml), "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == 3

        assert main(["fleet", "logs", "a1", "--broker", url, "--fleet", "ops", "-n", "5"]) == 0
        assert "serving fleet ops" in capsys.readouterr().out

        procs["a2"].send_signal(signal.SIGKILL)
        procs["a2"].wait()
        rows = _until(url, capsys, lambda r: r[2]["state"] == "offline")
        assert [r["state"] for r in rows] == ["online", "online", "offline"]
        assert main(["fleet", "ls", "--broker", url, "--fleet", "ops"]) == 0
        table = capsys.readouterr().out
        assert "2 of 3 online" in table and "offline" in table

        assert main(["fleet", "status", "nope", "--broker", url, "--fleet", "ops"]) == 2
        assert "never announced itself" in capsys.readouterr().err

        assert main(["fleet", "stop", "a0", "--broker", url, "--fleet", "ops"]) == 0
        assert "a0: stopping" in capsys.readouterr().out
        assert procs["a0"].wait(timeout=30) == 0  # a clean exit
        rows = _until(url, capsys, lambda r: r[0]["state"] == "offline")
        assert rows[1]["state"] == "online"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)

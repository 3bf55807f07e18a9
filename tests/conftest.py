"""Shared fixtures: a private Mosquitto on a free loopback port, started by the tests, and
agent daemons as real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jetsplit.server.brokers import MosquittoProcess


@pytest.fixture()
def mosquitto() -> Iterator[MosquittoProcess]:
    with MosquittoProcess() as broker:
        yield broker


def kit_lines(kit: Path) -> str:
    """The `[mqtt]` lines that point a config at a startup kit."""
    return "".join(f'{name} = "{kit / file}"\n' for name, file in (
        ("tls_ca", "ca.crt"), ("tls_cert", "client.crt"), ("tls_key", "client.key"),
        ("signing_key", "signing.key"), ("trusted_keys", "trusted")))


class AgentFleet:
    """Agent daemons as real processes (`jetsplit agent run`), one config file each:
    clients a0…, and with `edges` also data-less edge agents e0… (role `edge`)."""

    def __init__(self, root: Path, broker_url: str, fleet: str, count: int, *,
                 dataset: str = "digits", threads: int = 1, fleet_key_file: Path | None = None,
                 edges: int = 0, kits: Path | None = None) -> None:
        """`kits`: a `jetsplit provision` output; each agent uses its own kit (mTLS +
        signing key)."""
        self.root, self.broker_url, self.fleet = root, broker_url, fleet
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.configs: dict[str, Path] = {}
        for i in range(count):
            agent = f"a{i}"
            key = f'fleet_key_file = "{fleet_key_file}"\n' if fleet_key_file else ""
            if kits is not None:
                key += kit_lines(kits / agent)
            path = root / f"{agent}.toml"
            path.write_text(
                f'fleet = "{fleet}"\nagent = "{agent}"\nstate_dir = "{root / "state"}"\n'
                f"threads = {threads}\nseed = {i}\n"
                f'[mqtt]\nbroker = "{broker_url}"\n{key}'
                f'[data]\ndataset = "{dataset}"\npartition = "iid"\nclients = {count}\n'
                f"index = {i}\n")
            self.configs[agent] = path
        for j in range(edges):
            agent = f"e{j}"
            path = root / f"{agent}.toml"
            path.write_text(
                f'fleet = "{fleet}"\nagent = "{agent}"\nrole = "edge"\n'
                f'state_dir = "{root / "state"}"\nthreads = {threads}\n'
                f'[mqtt]\nbroker = "{broker_url}"\n'
                + (f'fleet_key_file = "{fleet_key_file}"\n' if fleet_key_file else ""))
            self.configs[agent] = path

    def start(self) -> AgentFleet:
        for agent, path in self.configs.items():
            log = (self.root / f"{agent}.log").open("wb")
            self.processes[agent] = subprocess.Popen(
                [sys.executable, "-m", "jetsplit.cli", "agent", "run", "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self, agent: str) -> str:
        return (self.root / f"{agent}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture()
def agent_fleet(tmp_path: Path) -> Iterator[Callable[..., AgentFleet]]:
    fleets: list[AgentFleet] = []

    def make(broker_url: str, fleet: str, count: int, **kwargs: object) -> AgentFleet:
        fleets.append(AgentFleet(tmp_path, broker_url, fleet, count, **kwargs))  # type: ignore[arg-type]
        return fleets[-1]

    yield make
    for fleet in fleets:
        fleet.stop()

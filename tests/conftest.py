"""Shared fixtures: a private Mosquitto on a free loopback port, started by the tests, and
agent daemons as real processes; the coordinator as a process, and the same fleet replayed
with the in-process engine (the two must end bit for bit equal)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetsplit.edge_agent.attacks import ALLOW_ENV
from jetsplit.server.ops.brokers import MosquittoProcess

# Test helpers that are not part of the installed package (the wire fuzzer): importable as
# top-level modules from the checkout's testing/ folder (that folder, not the checkout root:
# `server`, `export` must never import under their bare names).
TESTING = str(Path(__file__).resolve().parents[1] / "testing")
if TESTING not in sys.path:
    sys.path.insert(0, TESTING)


@pytest.fixture()
def one_torch_thread() -> Iterator[None]:
    """One torch thread while a test runs: agents and server share the process, and on 2
    busy cores two threads per conv only contend (torch imported here, not at the top:
    the torch-free device tests load this file too)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
                 edges: int = 0, kits: Path | None = None,
                 attacks: dict[str, str] | None = None) -> None:
        """`kits`: a `jetsplit provision` output; each agent uses its own kit (mTLS +
        signing key). `attacks`: {agent: spec} written into that agent's `[attack]`
        (edge_agent/attacks.py); its process runs with JETSPLIT_ALLOW_ATTACKS=1."""
        self.root, self.broker_url, self.fleet = root, broker_url, fleet
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.configs: dict[str, Path] = {}
        self.attacks = dict(attacks or {})
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
                f"index = {i}\n"
                + (f'[attack]\nkind = "{self.attacks[agent]}"\n' if agent in self.attacks
                   else ""))
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

    def start(self, only: list[str] | None = None) -> AgentFleet:
        """Start the agents' processes (`only` those named, if given)."""
        for agent, path in self.configs.items():
            if only is not None and agent not in only:
                continue
            log = (self.root / f"{agent}.log").open("wb")
            env = {**os.environ, ALLOW_ENV: "1"} if agent in self.attacks else None
            self.processes[agent] = subprocess.Popen(
                [sys.executable, "-m", "jetsplit.cli", "agent", "run", "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
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


def server_run(config: Path, url: str, *, timeout: int = 400,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`jetsplit server run --config CONFIG --broker URL` as a process, one OpenMP thread
    unless `env` says otherwise; a non-zero exit fails the test with its stderr tail."""
    done = subprocess.run([sys.executable, "-m", "jetsplit.cli", "server", "run",
                           "--config", str(config), "--broker", url], capture_output=True,
                          text=True, env=env or {**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def run_weights(run_dir: Path) -> dict[str, Any]:
    """Every weight file a run wrote (its blocks and per-client blocks), by file:name, to
    compare two engines' runs bit for bit."""
    from safetensors.numpy import load_file

    out: dict[str, Any] = {}
    for path in sorted(run_dir.glob("*.safetensors")) + sorted(run_dir.glob("clients/*")):
        out.update({f"{path.stem}:{k}": v for k, v in load_file(str(path)).items()})
    return out


def run_in_process(fleet: AgentFleet, config: Path, out: Path, *, threads: int = 1,
                   settings: dict[str, Any] | None = None,
                   cuts: dict[str, int] | None = None,
                   server_cut: int | None = None) -> None:
    """The MQTT run of `config` once more with the in-process engine: workers built from
    the fleet's own agent configs, this process at `threads` torch threads (the engines
    pin agent and server compute, so any count must give the same bits); the run lands
    in `out`, its bundle beside it. `settings` replaces fields of the config's training
    settings (e.g. a private activation_dir); `cuts` and `server_cut` are what the MQTT run
    planned (the same run assembly as `jetsplit server run`, server/run/assembly.py), and
    with `[train] replan = "on"` the same re-planner reads the same fleet books."""

    import torch

    from jetsplit.data import load_dataset_split
    from jetsplit.edge_agent.config import load_agent_config
    from jetsplit.edge_agent.worker_factory import build_worker
    from jetsplit.server.cuts.planning import fleet_replanner
    from jetsplit.server.engines.seam import InProcessEngine
    from jetsplit.server.fleet.books import FleetBooks
    from jetsplit.server.run.assembly import RunSpec, execute, prepare_bundle
    from jetsplit.server.run.config import load_server_config

    before = torch.get_num_threads()
    try:
        workers = {a: build_worker(load_agent_config(p)) for a, p in fleet.configs.items()}
        torch.set_num_threads(threads)  # after build_worker, which sets the agents' count
        cfg = load_server_config(config)
        if server_cut is not None:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
                update={"split": server_cut})})
        _, test = load_dataset_split(cfg.data.dataset, cfg.data.test_fraction, 0)
        archive = prepare_bundle(cfg, out.with_name(f"{out.name}-bundle"))
        engine = InProcessEngine(workers, run_id="local")
        replanner, extras = None, []
        if cfg.train.replan == "on":
            registrations = {a: engine.registry.registration(a) for a in workers}
            replanner = fleet_replanner(cfg, registrations, int(cfg.model.split))
            extras = [FleetBooks(engine).collect]
        execute(engine, RunSpec(
            cfg.settings().model_copy(update=settings or {}), archive, test, out,
            server_cut=int(cfg.model.split), cuts=cuts or {}, row_extras=extras,
            replanner=replanner))
    finally:
        torch.set_num_threads(before)

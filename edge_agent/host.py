"""`jetsplit agent host`: many emulated agents in one process, each a full device on the wire.

A fleet of real agent processes costs ~0.5 GB each (torch, the dataset, the interpreter), so
one machine cannot host hundreds. The host loads torch and the dataset once and runs N
`AgentDaemon`s side by side: each keeps its own MQTT connection (client id, persistent
session, last will), shard, seed, reply cache, bundle state and emulated clock, and speaks
exactly the protocol a device speaks, because it is the device's own daemon and worker.
What is shared: the interpreter, torch (one intra-op thread per agent's work), the dataset
arrays the shards are cut from, and verified bundles (one copy per content hash).

Agent n (n = first, first + stride, …, count of them) is `<agent><n>` with data shard n and
seed `seed + n`: what `jetsplit trial` gives its agent processes, so a hosted fleet trains
bit for bit like a fleet of processes.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from jetsplit.bundle import Bundle
from jetsplit.data import Dataset, client_shards, load_dataset_split
from jetsplit.edge_agent.config import AgentConfig
from jetsplit.edge_agent.daemon import AgentDaemon, ReplyCache
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.emulation import DeviceClock
from jetsplit.edge_agent.service import SystemdNotifier
from jetsplit.edge_agent.worker import AgentWorker
from jetsplit.edge_agent.worker_factory import agent_attack, image_options, pick_device
from jetsplit.errors import ConfigError
from jetsplit.profiles import resolve_profile

log = logging.getLogger("jetsplit.agent.host")

MAX_HOSTED = 10_000
# A hosted agent answers a retransmitted command from its cache; only the latest few matter,
# and hundreds of 256 MiB caches (a device's default) would not be a bound at all.
HOSTED_CACHE_ENTRIES = 4
HOSTED_CACHE_BYTES = 32 * 1024 * 1024


def hosted_indices(count: int, first: int = 0, stride: int = 1) -> list[int]:
    """The agent numbers one host runs: `count` of them from `first`, `stride` apart."""
    if not 1 <= count <= MAX_HOSTED:
        raise ConfigError(f"--count must be 1..{MAX_HOSTED}, got {count}")
    if first < 0 or stride < 1:
        raise ConfigError(f"--first must be >= 0 and --stride >= 1 (got {first}, {stride})")
    return [first + k * stride for k in range(count)]


def hosted_config(base: AgentConfig, n: int) -> AgentConfig:
    """Agent n's own config: id `<agent><n>`, shard n, seed `seed + n`."""
    agent = f"{base.agent}{n}"
    if len(agent) > 64:
        raise ConfigError(f"agent id {agent!r} is longer than 64 characters")
    data = base.data
    if base.role == "client" and data.clients > 1:
        if n >= data.clients:
            raise ConfigError(f"agent {agent}: shard {n} but data.clients is {data.clients}")
        data = data.model_copy(update={"index": n})
    return base.model_copy(update={"agent": agent, "seed": base.seed + n, "data": data})


class FleetHost:
    """N agent daemons in this process, one thread and one MQTT session each."""

    def __init__(self, base: AgentConfig, indices: list[int]) -> None:
        self.base = base
        self.configs = [hosted_config(base, n) for n in indices]
        self.bundles: dict[str, Bundle] = {}  # verified bundles, shared by content hash
        self.daemons: list[AgentDaemon] = []
        self._threads: list[threading.Thread] = []

    def _shards(self) -> list[Dataset]:
        """Every hosted client's shard, cut from one copy of the dataset loaded once."""
        if self.base.role != "client":
            return [no_data() for _ in self.configs]
        data = self.base.data
        train, _ = load_dataset_split(data.dataset, data.test_fraction, data.seed,
                                      image_options(data))
        shards = client_shards(train.y, data.clients, data.partition, data.seed,
                               train.num_classes)
        return [train.subset(shards[c.data.index]) for c in self.configs]

    def build(self) -> FleetHost:
        """Workers and daemons (no connection yet)."""
        base = self.base
        # Agents compute side by side on their own threads: one torch thread each, and each
        # agent's emulated compute is its own thread's CPU time.
        torch.set_num_threads(base.threads or 1)
        profile = (resolve_profile(base.profile).model_dump(mode="json")
                   if base.profile else None)
        device = pick_device(base.device)
        address, options = base.mqtt.address(), base.mqtt.endpoint_options()
        shards = self._shards()
        for i, config in enumerate(self.configs):
            shard = shards[i]
            state = config.state_path()
            state.mkdir(parents=True, exist_ok=True)
            worker = AgentWorker(config.agent, shard, role=config.role, seed=config.seed,
                                 state_dir=state, device=device, profile=profile,
                                 bundle_cache=self.bundles,
                                 clock=DeviceClock(config.emulation, cpu_clock=time.thread_time),
                                 attack=agent_attack(config))
            self.daemons.append(AgentDaemon(
                worker, address, config.fleet, options,
                cache=ReplyCache(HOSTED_CACHE_ENTRIES, HOSTED_CACHE_BYTES)))
        return self

    def start(self, stop: threading.Event) -> FleetHost:
        """One serving thread per agent; each connects on its own (paho retries)."""
        quiet = SystemdNotifier(env={})  # the host, not each agent, talks to systemd
        for daemon in self.daemons:
            thread = threading.Thread(target=daemon.run, args=(stop, quiet), daemon=True,
                                      name=f"agent-{daemon.agent}")
            thread.start()
            self._threads.append(thread)
        return self

    def connected(self) -> int:
        return sum(1 for d in self.daemons if d.endpoint.connected.is_set())

    def join(self, timeout_s: float = 15.0) -> None:
        """Wait for every agent to publish its `offline` presence and disconnect."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def run(self, stop: threading.Event, notifier: SystemdNotifier | None = None) -> None:
        """Serve until `stop` is set (SIGTERM); under systemd READY=1 once all are up."""
        notifier = notifier or SystemdNotifier()
        self.start(stop)
        log.info("hosting %d agents (%s … %s) for fleet %s", len(self.daemons),
                 self.configs[0].agent, self.configs[-1].agent, self.base.fleet)
        ready = False
        while not stop.wait(0.5):
            notifier.tick()
            if not ready and self.connected() == len(self.daemons):
                ready = True
                notifier.ready(f"hosting {len(self.daemons)} agents")
                log.info("all %d hosted agents connected", len(self.daemons))
        notifier.stopping()
        self.join()

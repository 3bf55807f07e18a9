"""Fleet scale on one Mosquitto: what a registered-but-idle agent costs the coordinator.

For fleets of 10, 50, 200 and 500 agents (run by `jetsplit agent host` processes, each agent
its own MQTT session, exactly a device's protocol) on one private Mosquitto this measures,
side by side in one run:

* registration: seconds from the first agent's registration to the whole fleet's (the
  connect + register burst), and from launching the host processes (imports included);
* per-step coordinator overhead at a FIXED number selected (5): the coordinator process's
  CPU seconds per step of a small command (`release`) sent to 5 agents and answered, and
  the step's wall time; this is what must not grow with the fleet;
* a training round at 10% selected (mobilenetv3-small on UCI digits, splitfed-v2, 2 local
  steps, 4 samples per selected client): the last round's seconds (bundle installs of newly
  selected agents included);
* coordinator RSS, and the registry's bytes per registered-but-idle agent;
* broker message rate: messages on the fleet's topics per second during registration and
  the round (a wildcard subscriber counts them).

Growth factors per 10x agents (50 -> 500) are printed under the table. Timing on a shared
machine is noisy; the CPU-seconds column is steadier than wall time.

    .venv/bin/python benchmarks/bench_scale.py [--sizes 10,50,200,500] [--steps 30]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from jetsplit.data import load_dataset_split
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.engines.seam import Command
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.run.assembly import RunSpec, execute, prepare_bundle
from jetsplit.server.run.config import load_server_config

FIXED_SELECTED = 5
AGENTS_PER_HOST = 100


def raise_fd_limit(need: int) -> int:
    """Mosquitto (our child) needs a descriptor per connection: lift the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def deep_size(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes an object graph holds (containers, dataclass slots, strings)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, s), seen) for s in obj.__slots__ if hasattr(obj, s))
    elif hasattr(obj, "__dict__"):
        size += deep_size(vars(obj), seen)
    return size


class TopicCounter:
    """Every message the broker routes on the fleet's topics, counted by a `mosquitto_sub`
    process writing one timestamped line per message (none of it in the coordinator's
    process, whose CPU is what we measure)."""

    def __init__(self, port: int, fleet: str, log: Path) -> None:
        binary = shutil.which("mosquitto_sub")
        if binary is None:
            raise SystemExit("error: mosquitto_sub is not installed (apt-get install "
                             "mosquitto-clients)")
        self.log = log
        self._out = log.open("wb")
        self._proc = subprocess.Popen(
            [binary, "-h", "127.0.0.1", "-p", str(port), "-q", "0", "-F", "%U %t",
             "-t", f"jetsplit/v1/{fleet}/#"], stdout=self._out, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # subscribed before the fleet starts

    def stamps(self, *, agents_only: bool = False) -> list[float]:
        """Arrival times (Unix seconds) of the messages so far; `agents_only`: what agents
        published (presence, up), not the coordinator's commands."""
        self._out.flush()
        out = []
        for line in self.log.read_bytes().splitlines():
            stamp, _, topic = line.decode(errors="replace").partition(" ")
            if stamp and not (agents_only and "/down/" in topic):
                out.append(float(stamp))
        return out

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._out.close()


def write_configs(root: Path, port: int, fleet: str, agents: int, rounds: int) -> tuple[Path, Path]:
    agent = root / "agent.toml"
    agent.write_text(f'fleet = "{fleet}"\nagent = "a"\nstate_dir = "{root / "state"}"\n'
                     'threads = 1\nlog_level = "warning"\n'
                     f'[mqtt]\nbroker = "mqtt://127.0.0.1:{port}"\n'
                     f'[data]\ndataset = "digits"\npartition = "iid"\nclients = {agents}\n')
    server = root / "server.toml"
    server.write_text(
        f'fleet = "{fleet}"\nagents = {agents}\nout = "{root / "runs"}"\nrun = "bench"\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
        '[data]\ndataset = "digits"\n'
        f'[train]\nalgorithm = "splitfed-v2"\nrounds = {rounds}\nlocal_steps = 2\n'
        # 4 samples per selected client whatever the fleet (BatchNorm needs more than 1)
        f"batch = {4 * max(1, round(0.1 * agents))}\nlr = 0.05\nfraction = 0.1\n"
        "deadline_s = 120\n")
    return agent, server


def measure(size: int, steps: int, rounds: int, archive: Path | None, root: Path
            ) -> tuple[dict[str, float], Path]:
    """One fleet size, on its own broker and host processes."""
    fleet = f"bench{size}"
    me = psutil.Process()
    with MosquittoProcess() as broker:
        agent_toml, server_toml = write_configs(root, broker.port, fleet, size, rounds)
        counter = TopicCounter(broker.port, fleet, root / "messages.log")
        engine = MqttEngine(broker.address, fleet, run_id="bench").start(10.0)
        hosts: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            launched = time.time()
            for first in range(0, size, AGENTS_PER_HOST):
                count = min(AGENTS_PER_HOST, size - first)
                hosts.append(subprocess.Popen(
                    [sys.executable, "-m", "jetsplit.cli", "agent", "host", "--config",
                     str(agent_toml), "--count", str(count), "--first", str(first)],
                    stdout=subprocess.DEVNULL, stderr=(root / f"host{first}.log").open("wb"),
                    env=env, cwd=root))
            online = engine.wait_for_agents(size, 300)
            registered = time.time()
            if len(online) < size:
                raise SystemExit(f"error: only {len(online)} of {size} agents registered")
            time.sleep(1.0)  # let mosquitto_sub write out the burst
            # From the first agent's first message (presence) to the last registration.
            stamps = [t for t in counter.stamps() if launched <= t <= registered]
            first_seen = min((t for t in counter.stamps(agents_only=True) if t >= launched),
                             default=registered)
            register_rate = len(stamps) / max(1e-3, registered - first_seen)
            gc.collect()
            per_agent = deep_size(engine.registry._agents) / size

            # Per-step overhead at a fixed selection: the coordinator's CPU per step.
            chosen = online[:FIXED_SELECTED]
            engine.broadcast(Command("release"), chosen, deadline_s=60)  # warm up
            cpu, wall = time.process_time(), time.perf_counter()
            for step in range(steps):
                out = engine.send_and_receive(dict.fromkeys(chosen, Command("release")),
                                              step=step, deadline_s=60)
                if out.missed:
                    raise SystemExit(f"error: step {step} missed {out.missed}")
            step_cpu = (time.process_time() - cpu) / steps
            step_wall = (time.perf_counter() - wall) / steps

            # A training round at 10% selected.
            cfg = load_server_config(server_toml)
            if archive is None:  # the export is setup, not part of any round
                archive = prepare_bundle(cfg, root.parent / "bundle")
            _, test = load_dataset_split("digits", 0.2, 0)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            round_from = time.time()
            try:
                execute(engine, RunSpec(cfg.settings(), archive, test, root / "runs" / fleet))
            finally:
                torch.set_num_threads(threads)
            round_to = time.time()
            time.sleep(1.0)
            round_rate = sum(round_from <= t <= round_to for t in counter.stamps()) / max(
                1e-3, round_to - round_from)
            rows = [json.loads(line) for line in
                    (root / "runs" / fleet / "metrics.jsonl").open()]
            return {
                "agents": size,
                "register_s": registered - first_seen,
                "launch_to_registered_s": registered - launched,
                "step_cpu_ms": step_cpu * 1e3,
                "step_wall_ms": step_wall * 1e3,
                "round_s": rows[-1]["seconds"],
                "selected": len(rows[-1]["selected"]),
                "coordinator_rss_mb": me.memory_info().rss / 2**20,
                "registry_bytes_per_agent": per_agent,
                "broker_msgs_per_s_register": register_rate,
                "broker_msgs_per_s_round": round_rate,
                "host_rss_mb": sum(psutil.Process(h.pid).memory_info().rss
                                   for h in hosts) / 2**20 / size,
            }, archive
        finally:
            engine.close()
            counter.close()
            for host in hosts:
                host.terminate()
            for host in hosts:
                try:
                    host.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    host.kill()
                    host.wait()


COLUMNS = [("agents", "agents", "{:d}"), ("register_s", "register s", "{:.2f}"),
           ("launch_to_registered_s", "launch->all s", "{:.1f}"),
           ("step_cpu_ms", f"step CPU ms ({FIXED_SELECTED} sel)", "{:.2f}"),
           ("step_wall_ms", "step wall ms", "{:.1f}"), ("selected", "10% sel", "{:d}"),
           ("round_s", "round s", "{:.1f}"), ("coordinator_rss_mb", "coord RSS MB", "{:.0f}"),
           ("registry_bytes_per_agent", "registry B/agent", "{:.0f}"),
           ("host_rss_mb", "host RSS MB/agent", "{:.1f}"),
           ("broker_msgs_per_s_register", "msg/s register", "{:.0f}"),
           ("broker_msgs_per_s_round", "msg/s round", "{:.0f}")]


def print_table(results: list[dict[str, float]]) -> None:
    print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in results:
        print("| " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |")
    by_size = {int(r["agents"]): r for r in results}
    pairs = [(a, b) for a, b in ((2, 20), (10, 100), (20, 200), (50, 500))
             if a in by_size and b in by_size]
    for a, b in pairs:
        print(f"\ngrowth {a} -> {b} agents (10x):")
        for key, title, _ in COLUMNS[1:]:
            if key == "selected":
                continue
            lo, hi = by_size[a][key], by_size[b][key]
            print(f"  {title:>26}: {hi / lo if lo else float('nan'):.2f}x")
    if 50 in by_size and 500 in by_size:
        growth = by_size[500]["step_cpu_ms"] / by_size[50]["step_cpu_ms"]
        print(f"\ngoal per-step overhead 50->500 <= 1.5x: {growth:.2f}x "
              f"({'met' if growth <= 1.5 else 'NOT met'}); registration of 500 < 30 s: "
              f"{by_size[500]['register_s']:.1f} s "
              f"({'met' if by_size[500]['register_s'] < 30 else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,50,200,500")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 2 and 20 agents (one 10x growth pair), 3 steps, 1 round
        args.sizes, args.steps, args.rounds = "2,20", 3, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    limit = raise_fd_limit(max(sizes) * 2 + 256)
    print(f"RLIMIT_NOFILE soft limit {limit}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    results, archive = [], None
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for size in sizes:
            root = Path(tmp) / str(size)
            root.mkdir()
            result, archive = measure(size, args.steps, args.rounds, archive, root)
            results.append(result)
            print(json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print_table(results)


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()

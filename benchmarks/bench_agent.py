"""Agent memory: an idle agent's RSS and its RSS while training, next to a bare
`import torch` process, all measured in one run.

A real Mosquitto, one agent process (`jetsplit agent run`, MNIST shard 1 of 4, one torch
thread, as in the demo) and this process as coordinator training PSL on AlexNet split 2
with batch 32. RSS is read from /proc/<pid>/status (VmRSS while sampling, VmHWM for the
peak). Goal: the agent adds at most 150 MB over bare torch while training.

    .venv/bin/python benchmarks/bench_agent.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from jetsplit.data import load_dataset_split
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.run.assembly import RunSpec, execute, prepare_bundle
from jetsplit.server.run.config import ModelSection, ServerConfig
from jetsplit.server.training.settings import Settings

MB = 1 << 20


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") * 1024 / MB


def peak_mb(pid: int) -> float:
    return _status_kb(pid, "VmHWM") * 1024 / MB


def bare_torch_mb() -> float:
    """RSS of a process that did nothing but `import torch` (one thread, as agents run)."""
    code = "import torch, sys; torch.set_num_threads(1); print('ok', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        time.sleep(0.5)
        return rss_mb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


TORCH_TRAINING = """
import sys, torch
torch.set_num_threads(1)
from jetsplit.models import ModelSpec, build_model, split
client, _ = split(build_model(ModelSpec("alexnet", (1, 28, 28), 10), seed=0), 2)
opt = torch.optim.SGD(client.parameters(), lr=0.01)
for _ in range(40):
    y = client(torch.randn(32, 1, 28, 28))
    opt.zero_grad()
    y.backward(torch.ones_like(y))
    opt.step()
print("ok", flush=True)
sys.stdin.read()
"""


def torch_training_mb() -> float:
    """The floor: a bare process training the same client block (batch 32, one thread).
    Running torch's kernels pages in code and caches that `import torch` alone does not."""
    proc = subprocess.Popen([sys.executable, "-c", TORCH_TRAINING], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        return rss_mb(proc.pid)
    finally:
        proc.kill()
        proc.wait()


class Sampler(threading.Thread):
    """Polls a process's RSS until stopped; keeps the largest value seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.top = pid, 0.0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.top = max(self.top, rss_mb(self.pid))
            self.halt.wait(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="local iterations (batch 32)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    # --smoke: 2 steps of mobilenetv3-small on UCI digits (no MNIST download)
    dataset, model, shape = (("digits", "mobilenetv3-small", [1, 8, 8]) if args.smoke
                             else ("mnist", "alexnet", [1, 28, 28]))
    if args.smoke:
        args.steps = 2
    torch_mb = bare_torch_mb()
    floor_mb = torch_training_mb()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp, MosquittoProcess() as broker:
        root = Path(tmp)
        url = f"mqtt://127.0.0.1:{broker.port}"
        config = root / "a0.toml"
        config.write_text(
            f'fleet = "bench"\nagent = "a0"\nstate_dir = "{root / "state"}"\nthreads = 1\n'
            f'[mqtt]\nbroker = "{url}"\n[data]\ndataset = "{dataset}"\npartition = "iid"\n'
            "clients = 4\nindex = 0\n")
        log = (root / "agent.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agent = subprocess.Popen([sys.executable, "-m", "jetsplit.cli", "agent", "run",
                                  "--config", str(config)], stdout=log, stderr=log, env=env,
                                 cwd=root)
        engine = MqttEngine(broker.address, "bench", run_id="bench").start(10)
        try:
            if engine.wait_for_agents(1, 120) != ["a0"]:
                raise SystemExit(f"agent did not register; log: {root / 'agent.log'}")
            time.sleep(1.0)
            idle = rss_mb(agent.pid)
            cfg = ServerConfig(model=ModelSection(name=model, input_shape=shape, split=2))
            archive = prepare_bundle(cfg, root / "bundle")
            _, test = load_dataset_split(dataset, 0.2, 0)
            settings = Settings(algorithm="psl", rounds=2, local_steps=args.steps, batch=32)
            sampler = Sampler(agent.pid)
            sampler.start()
            summary = execute(engine, RunSpec(settings, archive, test, root / "run",
                                                      checkpoint=False))
            sampler.halt.set()
            sampler.join()
            training, peak = sampler.top, peak_mb(agent.pid)
        finally:
            engine.close()
            agent.terminate()
            agent.wait(timeout=30)
            log.close()
    print(f"{model} split 2, PSL, batch 32, {args.steps} steps x 2 rounds, {dataset} shard 1/4; "
          f"bundle bytes to the agent: {summary['bundle_bytes'] / MB:.2f} MB")
    print(f"bare `import torch` process : {torch_mb:8.1f} MB")
    print(f"bare torch training block   : {floor_mb:8.1f} MB  (+{floor_mb - torch_mb:.1f}: torch's "
          "own cost of running the client block, the floor)")
    print(f"agent idle (registered)     : {idle:8.1f} MB  (+{idle - torch_mb:.1f} over torch)")
    print(f"agent training (max VmRSS)  : {training:8.1f} MB  "
          f"(+{training - torch_mb:.1f} over torch; goal <= +150)")
    print(f"agent peak (VmHWM)          : {peak:8.1f} MB  (+{peak - torch_mb:.1f} over torch)")
    print(f"ratio training/bare torch   : {training / torch_mb:.2f}")


if __name__ == "__main__":
    main()

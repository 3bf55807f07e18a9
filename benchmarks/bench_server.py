"""The coordinator's server step against the plain computation it wraps, on CUDA and on the
CPU, side by side in one run.

Three timings per device, each the median of `--repeats` after `--warmup`:

- **coordinator step**: one iteration of a split method as the coordinator runs it
  (`SplitMethod.split_step`, SCALA by default) through a real `Trainer`, whose engine
  replays fixed activations at once (`ReplayEngine`: no wire, no devices, so what is timed
  is the coordinator alone): the replies checked, activations and labels to the device in
  one transfer, the defences' screen and loss bound, the server update, the divergence
  guard, the activation gradients back on the host in one transfer, ready to send.
- **plain step**: the same server block on the same concatenated batch, already on the
  device: forward, the gradient with respect to the inputs (kept graph) and the backward
  to the parameters (SCALA's two backward passes), an SGD step; then synchronised.
- **copies**: the step's bytes alone, between pinned host buffers and the device, each way.

Printed ratios: coordinator / plain, coordinator / (plain + copies), and CPU / CUDA. On
CUDA it also counts the host synchronisations inside one coordinator step
(`torch.cuda.set_sync_debug_mode`), with where they happen. Without CUDA it prints the CPU
rows and one "no CUDA: ..." line, and exits 0.

Default workload: ResNet-18 split after layer 2, CIFAR-shaped input (3×32×32), 16 clients ×
32 samples.

Run: `.venv/bin/python benchmarks/bench_server.py [--method scala] [--clients 16]
[--samples 32] [--model resnet18] [--split 2] [--repeats 10] [--precision off|bf16]`
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from jetsplit.data import ArrayDataset
from jetsplit.devices import torch_threads
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.protocol import Kind
from jetsplit.server.engines.seam import Command, Engine, Outcome, Reply
from jetsplit.server.methods import build_method
from jetsplit.server.methods.base import SplitMethod
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

CLASSES = 10


class ReplayEngine(Engine):
    """Agents that answer every command at once: a forward with fixed activations and
    labels, anything else with an empty reply. What is left to time is the coordinator."""

    def __init__(self, acts: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> None:
        super().__init__("bench")
        self.acts, self.labels = dict(acts), dict(labels)
        for agent, y in self.labels.items():
            histogram = np.bincount(y, minlength=CLASSES).tolist()
            self.registry.register(agent, {"dataset": {"size": 100 * len(y),
                                                       "label_histogram": histogram}})

    def send_and_receive(self, commands: Mapping[str, Command], *, round: int = 0,
                         step: int = 0, deadline_s: float = 60.0) -> Outcome:
        replies = {}
        for agent, command in commands.items():
            tensors = ({"activations": self.acts[agent], "labels": self.labels[agent]}
                       if command.kind == Kind.FORWARD.value else {})
            replies[agent] = Reply(agent, command.kind, {}, tensors)
        kind = next(iter(commands.values())).kind if commands else ""
        return self._finish(replies, {}, kind, round, step)


def median_ms(step: Callable[[], None], repeats: int, warmup: int) -> float:
    """Median wall time of `step` in ms (`step` itself waits for the device)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


Step = Callable[[], None]


def coordinator(archive: Path, method: str, device: str, acts: dict[str, np.ndarray],
                labels: dict[str, np.ndarray], precision: str) -> tuple[SplitMethod, Step]:
    """A trainer and method over a replay engine, and one coordinator step."""
    samples = len(next(iter(labels.values())))
    settings = Settings(algorithm=method, device=device, batch=samples * len(labels),
                        rounds=1, local_steps=1, autocast=precision, seed=0)
    rng = np.random.default_rng(1)
    test = ArrayDataset(rng.standard_normal((8, 3, 32, 32)).astype(np.float32),
                        rng.integers(0, CLASSES, 8), "bench", CLASSES)
    trainer = Trainer(ReplayEngine(acts, labels), archive, settings, test)
    split_method = build_method(method, trainer)
    if not isinstance(split_method, SplitMethod):
        raise SystemExit(f"error: {method} has no server step (not a split method)")
    batches = dict.fromkeys(sorted(labels), samples)
    split_method.begin_round(sorted(labels))

    def step() -> None:
        if split_method.split_step(batches, 0) is None:
            raise SystemExit("error: the coordinator step trained nobody")

    return split_method, step


def plain(server: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """The plain step on device-resident inputs: forward, ∇x (kept graph), ∇w, SGD."""
    optimizer = torch.optim.SGD(server.parameters(), lr=0.01)
    leaf = x.detach().requires_grad_(True)

    def step() -> None:
        loss = F.cross_entropy(server(leaf), y)
        torch.autograd.grad(loss, [leaf], retain_graph=True)
        optimizer.zero_grad(set_to_none=True)
        loss.backward(inputs=list(server.parameters()))
        optimizer.step()
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


def copies(device: torch.device, acts: np.ndarray, labels: np.ndarray) -> Callable[[], None]:
    """The step's bytes alone: activations and labels in (pinned), gradients out."""
    a, y = torch.from_numpy(acts).pin_memory(), torch.from_numpy(labels).pin_memory()
    grads = torch.empty(acts.shape, device=device)
    back = torch.empty(acts.shape, pin_memory=True)

    def step() -> None:
        a.to(device, non_blocking=True)
        y.to(device, non_blocking=True)
        back.copy_(grads)  # waits for all three

    return step


def traced_syncs(step: Callable[[], None]) -> collections.Counter[str]:
    """The host synchronisations one CUDA step makes, each named by the innermost jetsplit
    frame that asked for it (the warning's own frame is torch's)."""
    found: collections.Counter[str] = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "jetsplit" in f.filename or "/server/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else filename
        found[where] += 1

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return found


def host_profile(step: Step, top: int = 12) -> str:
    """Where one step's host time goes (cProfile, by own time)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(step)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def rows(archive: Path, args: argparse.Namespace, device: str, acts: dict[str, np.ndarray],
         labels: dict[str, np.ndarray], precision: str = "off") -> dict[str, float]:
    method, step = coordinator(archive, args.method, device, acts, labels, precision)
    dev = torch.device(device)
    result = {"coordinator": median_ms(step, args.repeats, args.warmup)}
    server = method.trainer.bundle.server_module().to(dev)
    x = torch.from_numpy(np.concatenate(list(acts.values()))).to(dev)
    y = torch.from_numpy(np.concatenate(list(labels.values()))).to(dev)
    from jetsplit.server.training.placement import autocast

    with autocast(dev, precision):
        result["plain"] = median_ms(plain(server, x, y), args.repeats, args.warmup)
    if dev.type == "cuda":
        both = np.concatenate(list(acts.values()))
        result["copies"] = median_ms(copies(dev, both, np.concatenate(list(labels.values()))),
                                     args.repeats, args.warmup)
        if args.profile:
            print(host_profile(step))
        syncs = traced_syncs(step)
        result["syncs"] = float(sum(syncs.values()))
        print(f"  host syncs in one coordinator step on {device} ({precision}): "
              f"{sum(syncs.values())}: " + ", ".join(f"{w} ×{n}" for w, n in syncs.most_common()))
    return result


def report(label: str, r: dict[str, float]) -> None:
    line = (f"{label}: coordinator step {r['coordinator']:8.2f} ms, plain step "
            f"{r['plain']:8.2f} ms, coordinator / plain {r['coordinator'] / r['plain']:.2f}x")
    if "copies" in r:
        line += (f"; copies {r['copies']:.2f} ms, coordinator / (plain + copies) "
                 f"{r['coordinator'] / (r['plain'] + r['copies']):.2f}x")
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="scala")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples", type=int, default=32, help="per client")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cpu-repeats", type=int, default=0,
                        help="timed steps on the CPU (0: --repeats); a CPU step is slow")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU intra-op threads (0: torch's default here)")
    parser.add_argument("--no-cpu", action="store_true", help="CUDA rows only")
    parser.add_argument("--profile", action="store_true",
                        help="also where one CUDA step's host time goes (cProfile)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 2 clients x 4 samples of a small model, 2 timed steps
        args.clients, args.samples, args.repeats, args.warmup = 2, 4, 2, 1
        args.model = "vgg11"

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        report_ = write_bundle(ModelSpec(args.model, (3, 32, 32), CLASSES), args.split,
                               Path(tmp) / "bundle", aux_ratio=None, tar=True, compresslevel=0)
        assert report_.tar_path is not None
        archive = report_.tar_path
        from jetsplit.bundle import load_bundle

        client = load_bundle(archive).client_module().eval()
        agents = [f"a{i:02d}" for i in range(args.clients)]
        with torch.no_grad():
            x = torch.from_numpy(rng.standard_normal(
                (args.clients * args.samples, 3, 32, 32)).astype(np.float32))
            acts_all = client(x).numpy()
        acts = dict(zip(agents, np.split(acts_all, args.clients), strict=True))
        labels = {a: rng.integers(0, CLASSES, args.samples) for a in agents}
        print(f"{args.method}, {args.model} split {args.split}, input 3x32x32, "
              f"{args.clients} clients x {args.samples} samples; activations "
              f"{list(acts_all.shape[1:])} ({acts_all.nbytes / 2**20:.1f} MiB per step); "
              f"torch {torch.__version__}; median of {args.repeats}", flush=True)

        cpu = None
        if not args.no_cpu:
            with torch_threads(args.threads):
                threads = torch.get_num_threads()
                cpu_args = argparse.Namespace(**{**vars(args), "repeats": args.cpu_repeats
                                                 or args.repeats})
                cpu = rows(archive, cpu_args, "cpu", acts, labels)
            report(f"cpu ({threads} threads)", cpu)
        if not torch.cuda.is_available():
            print(f"no CUDA: torch {torch.__version__} sees no GPU here, so there is no CUDA "
                  f"timing or ratio on this machine")
            return
        name = torch.cuda.get_device_name(torch.device("cuda"))
        gpu = rows(archive, args, "cuda", acts, labels)
        report(f"cuda ({name})", gpu)
        if cpu is not None:
            print(f"ratio cpu / cuda, coordinator step: "
                  f"{cpu['coordinator'] / gpu['coordinator']:.1f}x")
        if torch.cuda.is_bf16_supported():
            bf16 = rows(archive, args, "cuda", acts, labels, "bf16")
            report(f"cuda bf16 autocast ({name})", bf16)


if __name__ == "__main__":
    main()

"""The coordinator's server-side step on CUDA against CPU, side by side in one run.

One step is what a split method does on the coordinator per iteration: the activations of
every client (NumPy arrays, as they arrive off the wire) cross to the device in one
transfer, SCALA's server step runs on the server block (forward over the concatenation,
backward, SGD update), and the per-client activation gradients come back to the host in one
transfer, ready to send. Default workload: ResNet-18 split after layer 2, CIFAR-shaped input
(3×32×32), 16 clients × 32 samples.

Prints the median step time per device (and with bf16 autocast on CUDA) and the ratio
CPU / CUDA. Without CUDA it prints the CPU timing and one "no CUDA: ..." line, and exits 0.

Run: `.venv/bin/python benchmarks/bench_server.py [--clients 16] [--samples 32]
[--model resnet18] [--split 2] [--repeats 10]`
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from jetsplit.devices import torch_threads
from jetsplit.models import ModelSpec, build_model, split
from jetsplit.server.methods.scala_math import scala_server_step
from jetsplit.server.training.placement import autocast, to_device, to_host


def step_ms(server: torch.nn.Module, device: torch.device, acts: list[np.ndarray],
            labels: list[np.ndarray], classes: int, repeats: int, warmup: int,
            precision: str = "off") -> float:
    """Median wall time of one full server-side step (transfers included), in ms."""
    server = server.to(device)
    optimizer = torch.optim.SGD(server.parameters(), lr=0.01)

    def step() -> None:
        xs = to_device(acts, np.float32, device)
        ys = to_device(labels, np.int64, device)
        with autocast(device, precision):
            _, grads = scala_server_step(server, xs, ys, classes, optimizer)
        to_host(grads)  # waits for the device: the gradients are on the host after this

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples", type=int, default=32, help="per client")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU intra-op threads (0: torch's default here)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds (tests/benchmarks/test_benchmarks_smoke.py)")
    args = parser.parse_args()
    if args.smoke:  # 2 clients x 4 samples, 2 timed steps
        args.clients, args.samples, args.repeats, args.warmup = 2, 4, 2, 1

    spec = ModelSpec(args.model, (3, 32, 32), 10)
    model = build_model(spec, seed=0)
    client, server = split(model, args.split)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        x = torch.from_numpy(rng.standard_normal(
            (args.clients * args.samples, 3, 32, 32)).astype(np.float32))
        acts_all = client(x).numpy()
    acts = np.split(acts_all, args.clients)
    labels = [rng.integers(0, 10, args.samples) for _ in range(args.clients)]
    print(f"{args.model} split {args.split}, input 3x32x32, {args.clients} clients x "
          f"{args.samples} samples; activations {list(acts_all.shape[1:])} "
          f"({acts_all.nbytes / 2**20:.1f} MiB per step); median of {args.repeats}")

    with torch_threads(args.threads):
        threads = torch.get_num_threads()
        cpu = step_ms(server, torch.device("cpu"), acts, labels, 10, args.repeats,
                      args.warmup)
    print(f"cpu ({threads} threads): {cpu:9.1f} ms/step")
    if not torch.cuda.is_available():
        print(f"no CUDA: torch {torch.__version__} sees no GPU here, so there is no CUDA "
              f"timing or ratio on this machine")
        return
    cuda = torch.device("cuda")
    name = torch.cuda.get_device_name(cuda)
    gpu = step_ms(server, cuda, acts, labels, 10, args.repeats, args.warmup)
    print(f"cuda ({name}): {gpu:9.1f} ms/step")
    rows = [("cuda", gpu)]
    if torch.cuda.is_bf16_supported():
        bf16 = step_ms(server, cuda, acts, labels, 10, args.repeats, args.warmup, "bf16")
        print(f"cuda bf16 autocast: {bf16:9.1f} ms/step")
        rows.append(("cuda bf16", bf16))
    for label, ms in rows:
        print(f"ratio cpu / {label}: {cpu / ms:.1f}x")


if __name__ == "__main__":
    main()

"""Wire codecs, the MQTT engine and the two brokers, measured side by side on this machine.

1. Codec throughput: `encode_message` / `decode_message` MB/s (of the fp32 source bytes) for
   fp32, fp16, bf16 and int8, each with no compression, lz4 and zstd, on AlexNet-size
   activations, with the encoded size relative to raw fp32. Best of N with perf_counter.
2. Per-step overhead of the MQTT engine over the in-process engine: one PSL iteration
   (`server.algorithms.psl.PSL.iterate`) with real agent processes (`jetsplit agent
   run`, one torch thread each) behind a private Mosquitto,
   against the same agents as in-process `AgentWorker`s, steps interleaved in one run (goal:
   MQTT / in-process <= 1.15). Both engines start from the same bundle, data shards and
   seeds, so their losses must agree step by step; the benchmark checks that too. A median
   `status` round trip to all agents (no compute) isolates the transport's own latency; the
   library disables Nagle's algorithm on every endpoint socket and in the Mosquitto config it
   writes, so small request/reply exchanges do not wait for delayed ACKs.
3. Broker throughput: one `MqttEndpoint` sending fp32 messages (chunked at 1 MiB) to another
   through the embedded amqtt broker and through Mosquitto, rounds alternated.

Performance is measured, not asserted: the script prints what it saw and exits 0. A step
that fails (an agent dropped, a NaN loss) is a benchmark bug, not a measurement: the run
stops there, the steps before it are still reported, a `DIVERGED` line names the step, and
the script exits 2 after the other sections.

The PSL step trains: lr 0.002 on the mean of the agents' losses. PSL's own sum over 8 agents
at lr 0.01 (an effective 0.08 on AlexNet without normalisation) blew up to NaN at step 6.

Run: `.venv/bin/python benchmarks/bench_transport.py [--steps 20] [--agents 8] [--quick]`
(`--smoke`: 2 agents, tiny sizes, seconds; tests/benchmarks/test_benchmarks_smoke.py runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetsplit.edge_agent.config import AgentConfig, DataSection
from jetsplit.edge_agent.worker_factory import build_worker
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec, build_model, split
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.engines.seam import Command, InProcessEngine, Outcome
from jetsplit.server.methods.psl import PSL
from jetsplit.server.ops.brokers import EmbeddedBroker, MosquittoProcess
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
from jetsplit.wire import CODECS, COMPRESSIONS, Message, MessageType, decode_message, encode_message

FLEET = "bench"
MODEL = ModelSpec("alexnet", (3, 32, 32), 10)
SPLIT = 2  # SCALA's AlexNet split: client = conv1+conv2, activations 192×4×4 per sample
SMOKE_MODEL = ModelSpec("mobilenetv3-small", (3, 32, 32), 10)  # --smoke: a 2 MB bundle
LR = 0.002  # with PSL_REDUCTION: the loss falls from 2.6 towards ln 10 over 23 steps, 8 agents
PSL_REDUCTION = "mean"


class Diverged(Exception):
    """A benchmark step failed (missed agent, NaN loss): reported, never measured."""


# ---------------------------------------------------------------------------- 1. codecs


def _best_s(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def codec_inputs(quick: bool) -> dict[str, np.ndarray]:
    """ReLU outputs of random normals (half zeros, like activations before pooling) and the
    real split-2 AlexNet activation of a random batch (post-pool, fewer zeros)."""
    rng = np.random.default_rng(0)
    shapes = [(32, 64, 8, 8)] if quick else [(32, 64, 8, 8), (32, 192, 16, 16)]
    out = {f"relu{list(s)}": np.maximum(rng.standard_normal(s, dtype=np.float32), 0)
           for s in shapes}
    client, _ = split(build_model(MODEL, seed=0), SPLIT)
    with torch.no_grad():
        act = client(torch.from_numpy(rng.standard_normal((32, 3, 32, 32), dtype=np.float32)))
    out[f"alexnet-k2{list(act.shape)}"] = np.ascontiguousarray(act.numpy())
    return out


def bench_codecs(inputs: dict[str, np.ndarray], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, x in inputs.items():
        msg = Message(MessageType.REPLY, run="bench", sender="a", seq=1, kind="forward",
                      tensors={"activations": x})
        raw = len(encode_message(msg))
        for codec in CODECS:
            for compression in COMPRESSIONS:
                wire = encode_message(msg, codec=codec, compression=compression)
                back = decode_message(wire).tensors["activations"]
                enc_s = _best_s(lambda: encode_message(  # noqa: B023
                    msg, codec=codec, compression=compression), repeats)  # noqa: B023
                dec_s = _best_s(lambda: decode_message(wire), repeats)  # noqa: B023
                rows.append({"tensor": name, "codec": codec, "compression": compression,
                             "enc": x.nbytes / enc_s / 1e6, "dec": x.nbytes / dec_s / 1e6,
                             "size": len(wire) / raw,
                             "err": float(np.abs(back - x).max())})
    return rows


# ---------------------------------------------------------------------------- 2. engines


class TimedEngine:
    """Delegates to an engine and adds up the seconds spent in `send_and_receive`, so a
    step splits into engine time (agents + transport) and coordinator compute."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    @property
    def seconds(self) -> float:
        return sum(self.calls)

    def send_and_receive(self, commands: Mapping[str, Command], **kwargs: Any) -> Outcome:
        t0 = time.perf_counter()
        try:
            return self.engine.send_and_receive(commands, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _time_handle(worker: Any, sink: list[float]) -> None:
    """Record the seconds each command spends in the worker itself (agent compute)."""
    handle = worker.handle

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return handle(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    worker.handle = timed


def write_dataset(path: Path, samples: int) -> None:
    """CIFAR-shaped synthetic images (uint8 N×32×32×3, standardised on load), 10 classes."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8),
             y=rng.integers(0, 10, samples, dtype=np.int64))


def agent_config(i: int, agents: int, dataset: Path, state_dir: Path) -> AgentConfig:
    return AgentConfig(fleet=FLEET, agent=f"a{i}", state_dir=str(state_dir), threads=1,
                       device="cpu", log_level="warning",
                       data=DataSection(dataset=f"npz:{dataset}", partition="iid",
                                        clients=agents, index=i))


def agent_toml(cfg: AgentConfig) -> str:
    d = cfg.data
    return (f'fleet = "{cfg.fleet}"\nagent = "{cfg.agent}"\nstate_dir = "{cfg.state_dir}"\n'
            f'threads = {cfg.threads}\ndevice = "{cfg.device}"\nlog_level = "{cfg.log_level}"\n'
            f'[data]\ndataset = "{d.dataset}"\npartition = "{d.partition}"\n'
            f"clients = {d.clients}\nindex = {d.index}\n")


def jetsplit_cli() -> str:
    here = Path(sys.executable).parent / "jetsplit"
    found = str(here) if here.exists() else shutil.which("jetsplit")
    if found is None:
        raise SystemExit("the `jetsplit` command is not installed next to this Python")
    return found


@contextlib.contextmanager
def agent_processes(configs: list[AgentConfig], port: int, workdir: Path
                    ) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`jetsplit agent run` per agent; terminated (then killed) on the way out, always."""
    procs: list[subprocess.Popen[bytes]] = []
    cli = jetsplit_cli()
    try:
        for cfg in configs:
            toml = workdir / f"{cfg.agent}.toml"
            toml.write_text(agent_toml(cfg))
            with (workdir / f"{cfg.agent}.log").open("wb") as log:
                procs.append(subprocess.Popen(
                    [cli, "agent", "run", "--config", str(toml),
                     "--broker", f"mqtt://127.0.0.1:{port}"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _log_tails(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-600:]}"
                     for p in sorted(workdir.glob("*.log")))


def prepare_engines(agents: int, batch: int, aux_ratio: float | None, workdir: Path
                    ) -> tuple[Path, Path, float]:
    """The synthetic dataset and the bundle archive both engines share."""
    dataset = workdir / "data.npz"
    write_dataset(dataset, max(agents * 4 * batch, 512))
    t0 = time.perf_counter()
    report = write_bundle(MODEL, SPLIT, workdir / "bundle", aux_ratio=aux_ratio, seed=0,
                          tar=True)
    assert report.tar_path is not None
    return dataset, report.tar_path, time.perf_counter() - t0


def bench_engines(agents: int, steps: int, warmup: int, batch: int, codec: str,
                  dataset: Path, archive: Path, workdir: Path) -> dict[str, Any]:
    """Fresh agents on both sides (same shards, seeds and bundle), then interleaved steps."""
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    configs = [agent_config(i, agents, dataset, workdir / "agent-state") for i in range(agents)]
    info: dict[str, Any] = {"bundle_mb": archive.stat().st_size / 1e6}
    lr = LR

    # In-process: the same configs, other state dirs, torch at 1 thread (build_worker sets it).
    compute: list[float] = []
    workers = {}
    for c in configs:
        w = build_worker(c.model_copy(update={"state_dir": str(workdir / "inproc-state")}))
        _time_handle(w, compute)
        workers[c.agent] = w
    local = InProcessEngine(workers, run_id="bench")

    with (MosquittoProcess() as broker,
          agent_processes(configs, broker.port, workdir) as procs):
        remote = MqttEngine(broker.address, FLEET, run_id="bench").start(wait_s=10)
        try:
            t0 = time.perf_counter()
            online = remote.wait_for_agents(agents, timeout_s=180)
            info["agents_up_s"] = time.perf_counter() - t0
            if len(online) < agents:
                dead = [c.agent for c, p in zip(configs, procs, strict=True)
                        if p.poll() is not None]
                raise SystemExit(f"only {len(online)}/{agents} agents registered (exited: "
                                 f"{dead})\n{_log_tails(workdir)}")
            t0 = time.perf_counter()
            ready = BundleShipper(remote, archive, lr=lr, deadline_s=600).ensure(online)
            info["ship_mqtt_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ready_local = BundleShipper(local, archive, lr=lr, deadline_s=600).ensure(
                local.online())
            info["ship_local_s"] = time.perf_counter() - t0
            if len(ready) < agents or len(ready_local) < agents:
                raise SystemExit(f"bundle installed on {len(ready)} MQTT and "
                                 f"{len(ready_local)} in-process agents of {agents}\n"
                                 f"{_log_tails(workdir)}")
            info["rows"], info["diverged"] = [], None
            try:
                _interleaved_steps(local, remote, archive, lr, ready, steps, warmup, batch,
                                   codec, compute, info["rows"])
            except Diverged as exc:
                info["diverged"] = str(exc)
            info["status_ms"] = _status_round_trips(local, remote, ready, max(steps, 5))
            info["bytes_mqtt"] = remote.counters.by_kind()
            info["late"] = remote.late_replies
        finally:
            remote.close()
    return info


def _interleaved_steps(local: InProcessEngine, remote: MqttEngine, archive: Path, lr: float,
                       agents: list[str], steps: int, warmup: int, batch: int, codec: str,
                       compute: list[float], rows: list[dict[str, Any]]) -> None:
    """Step s on both engines back to back, alternating which goes first; appends to
    `rows` so that the steps before a failed one are kept when it raises Diverged."""
    sides = {}
    test = next(iter(local.workers.values())).data  # any labelled set: PSL needs no test here
    for name, engine in (("inproc", local), ("mqtt", remote)):
        timed = TimedEngine(engine)
        settings = Settings(algorithm="psl", batch=batch * len(agents), lr=lr, codec=codec,
                            deadline_s=120, psl_reduction=PSL_REDUCTION)
        sides[name] = (timed, PSL(Trainer(timed, archive, settings, test)))  # type: ignore[arg-type]
    for s in range(warmup + steps):
        order = ("inproc", "mqtt") if s % 2 == 0 else ("mqtt", "inproc")
        row: dict[str, Any] = {"step": s, "warmup": s < warmup}
        for name in order:
            timed, method = sides[name]
            timed.calls = []
            compute.clear()
            method.trainer.books.reset()
            t0 = time.perf_counter()
            loss = method.iterate(agents, s)  # one PSL iteration: forward, server, backward
            total = time.perf_counter() - t0
            missed = method.trainer.books.missed
            if missed or loss is None or not math.isfinite(loss):
                raise Diverged(f"{name} step {s}: loss {loss}, missed {missed}")
            fwd, bwd = timed.calls
            row[name] = {"total": total, "engine": fwd + bwd, "fwd": fwd, "bwd": bwd,
                         "loss": loss,
                         "agent": sum(compute) if name == "inproc" else None}
        rows.append(row)


def _status_round_trips(local: InProcessEngine, remote: MqttEngine, agents: list[str],
                        rounds: int) -> dict[str, float]:
    """Median ms of one `status` exchange with every agent (one command each, as
    a PSL iteration sends them): the engine's round trip with next to no agent compute."""
    times: dict[str, list[float]] = {"inproc": [], "mqtt": []}
    for i in range(rounds + 1):
        for name, engine in (("inproc", local), ("mqtt", remote)):
            commands = {a: Command("status") for a in agents}
            t0 = time.perf_counter()
            out = engine.send_and_receive(commands, step=10_000 + i, deadline_s=60)
            if i and not out.missed:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items() if v}


# ---------------------------------------------------------------------------- 3. brokers


def _endpoint_pair(address: Any, opened: list[MqttEndpoint]) -> tuple[MqttEndpoint, MqttEndpoint]:
    """A sender and a subscribed receiver; both are added to `opened` for closing."""
    tag = uuid.uuid4().hex[:8]
    rx = MqttEndpoint(address, f"bench-rx-{tag}", EndpointOptions(), subscriptions=("t/x",))
    opened.append(rx)
    rx.start(wait_s=10)
    tx = MqttEndpoint(address, f"bench-tx-{tag}", EndpointOptions())
    opened.append(tx)
    tx.start(wait_s=10)
    # CONNACK comes before SUBACK: ping until the subscription demonstrably delivers.
    for attempt in range(100):
        tx.send("t/x", Message(MessageType.REPLY, run="bench", sender="tx", seq=attempt,
                               kind="ping"))
        with contextlib.suppress(Exception):
            rx.inbox.get(timeout=0.1)
            break
    else:
        raise SystemExit(f"broker {address.url()}: subscription never delivered")
    time.sleep(0.2)
    while not rx.inbox.empty():
        rx.inbox.get_nowait()
    return tx, rx


def _transfer(tx: MqttEndpoint, rx: MqttEndpoint, payload: np.ndarray, count: int
              ) -> tuple[float, int]:
    """Seconds from the first send until the last message is received and decoded."""
    t0 = time.perf_counter()
    wire = 0
    for i in range(count):
        wire += tx.send("t/x", Message(MessageType.REPLY, run="bench", sender="tx", seq=i,
                                       kind="forward", tensors={"activations": payload}),
                        codec="fp32")
    for _ in range(count):
        got = rx.inbox.get(timeout=120)
        if got.message.tensors["activations"].nbytes != payload.nbytes:
            raise SystemExit("broker benchmark: a message arrived truncated")
    return time.perf_counter() - t0, wire


def bench_brokers(total_mb: int, message_mb: int, rounds: int) -> dict[str, Any]:
    payload = np.random.default_rng(0).standard_normal(message_mb * 2**18, dtype=np.float32)
    count = max(1, total_mb // message_mb)
    best = {"mosquitto": float("inf"), "embedded": float("inf")}
    wire = 0
    opened: list[MqttEndpoint] = []
    with MosquittoProcess() as mosq, EmbeddedBroker() as amqtt:
        try:
            pairs = {"mosquitto": _endpoint_pair(mosq.address, opened),
                     "embedded": _endpoint_pair(amqtt.address, opened)}
            for _ in range(rounds):
                for name, (tx, rx) in pairs.items():
                    seconds, wire = _transfer(tx, rx, payload, count)
                    best[name] = min(best[name], seconds)
        finally:
            for endpoint in opened:
                endpoint.close()
    return {"count": count, "payload_mb": count * payload.nbytes / 1e6, "wire_mb": wire / 1e6,
            "best_s": best}


# ---------------------------------------------------------------------------- report


def _ms(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values) * 1e3, statistics.median(values) * 1e3


def print_engines(info: dict[str, Any], agents: int, batch: int, codec: str,
                  aux_ratio: float | None) -> None:
    rows = [r for r in info["rows"] if not r["warmup"]]
    if info["diverged"] is not None:
        print(f"\n# 2. engines: DIVERGED at {info['diverged']}; {len(rows)} timed steps before it")
    if not rows:
        return
    print(f"\n# 2. engines: PSL iteration per step, MQTT engine (Mosquitto, {agents} "
          f"`jetsplit agent run` processes, 1 torch thread each) vs in-process engine "
          f"({agents} AgentWorkers run one after another); {MODEL.name} split {SPLIT}, aux head "
          f"{'none' if aux_ratio is None else aux_ratio}, batch {batch} per agent, codec "
          f"{codec}, coordinator torch threads {torch.get_num_threads()}; {len(rows)} timed "
          f"steps after {len(info['rows']) - len(rows)} warm-up, interleaved")
    print(f"  bundle {info['bundle_mb']:.1f} MB, exported in {info['export_s']:.1f}s; agents "
          f"registered in {info['agents_up_s']:.1f}s; bundle installed over MQTT in "
          f"{info['ship_mqtt_s']:.1f}s, in-process in {info['ship_local_s']:.1f}s")
    part = {}
    print("median ms per step unless noted; fwd/bwd = forward/backward exchange with all "
          "agents, engine = fwd + bwd, coord = the rest (server block), agents = compute "
          "inside AgentWorker (in-process only)")
    print(f"{'engine':<12}{'mean ms':>10}{'median ms':>11}{'fwd':>8}{'bwd':>8}{'engine':>8}"
          f"{'coord':>8}{'agents':>8}")
    for name in ("inproc", "mqtt"):
        total = [r[name]["total"] for r in rows]
        eng = [r[name]["engine"] for r in rows]
        coord = [r[name]["total"] - r[name]["engine"] for r in rows]
        agent = [r[name]["agent"] for r in rows] if name == "inproc" else None
        part[name] = (total, eng, coord)
        mean, median = _ms(total)
        agent_ms = f"{_ms(agent)[1]:>8.1f}" if agent else f"{'n/a':>8}"
        fwd, bwd = ([r[name][k] for r in rows] for k in ("fwd", "bwd"))
        print(f"{name:<12}{mean:>10.1f}{median:>11.1f}{_ms(fwd)[1]:>8.1f}{_ms(bwd)[1]:>8.1f}"
              f"{_ms(eng)[1]:>8.1f}{_ms(coord)[1]:>8.1f}{agent_ms}")
    ratio_steps = [r["mqtt"]["total"] / r["inproc"]["total"] for r in rows]
    mean_ratio = statistics.mean(part["mqtt"][0]) / statistics.mean(part["inproc"][0])
    eng_ratio = statistics.median(part["mqtt"][1]) / statistics.median(part["inproc"][1])
    agent_med = statistics.median(r["inproc"]["agent"] for r in rows)
    inproc_med = statistics.median(part["inproc"][0])
    coord_med = statistics.median(part["inproc"][2])
    print(f"ratio MQTT / in-process per step: mean {mean_ratio:.3f}, median of per-step "
          f"ratios {statistics.median(ratio_steps):.3f} (goal <= 1.15); engine part only "
          f"(step minus coordinator compute): {eng_ratio:.3f}")
    print(f"in-process step shares (median): agent compute {agent_med / inproc_med:.0%}, "
          f"coordinator server block {coord_med / inproc_med:.0%}, codec + bookkeeping "
          f"{(inproc_med - agent_med - coord_med) / inproc_med:.0%}")
    diff = max(abs(r["mqtt"]["loss"] - r["inproc"]["loss"]) for r in info["rows"])
    up, down = info["bytes_mqtt"]["up"], info["bytes_mqtt"]["down"]
    steps_all = len(info["rows"])
    per_step = (up.get("forward", 0) + down.get("backward", 0)) / steps_all / 1e6
    st = info["status_ms"]
    print(f"status round trip to all {agents} agents (no compute), median: in-process "
          f"{st['inproc']:.1f} ms, MQTT {st['mqtt']:.1f} ms; a step makes two such exchanges "
          f"(forward, backward) plus {agents} activation uploads and gradient downloads")
    print("note: the library disables Nagle's algorithm (TCP_NODELAY on every MqttEndpoint "
          "socket, set_tcp_nodelay in the Mosquitto >= 2 config it writes); with Nagle on, a "
          "small QoS 1 publish behind an unacknowledged one waited for a delayed ACK and the "
          "measured small request/reply round trip was 88 ms, now ~0.4-4 ms.")
    print(f"losses: max |MQTT - in-process| over all steps = {diff:.3g} (0 = bit-identical); "
          f"last loss {info['rows'][-1]['mqtt']['loss']:.4f}; late replies {info['late']}; "
          f"activations + gradients on the wire {per_step:.2f} MB per step")
    cores = os.cpu_count() or 1
    print(f"notes: the coordinator's server block (conv3-5 + fc 4096x4096, batch "
          f"{agents * batch}) dominates both engines and is the same work in both. In-process "
          f"the {agents} agents run one after another in this process; over MQTT they run in "
          f"parallel on {cores} core(s), which hides agent compute (ideal "
          f"{agent_med * 1e3:.0f} -> {agent_med * 1e3 / min(cores, agents):.0f} ms) while "
          f"MQTT adds publish/route/deliver, chunk reassembly, envelope decode in paho's "
          f"thread and process scheduling of {agents} + 2 processes on {cores} core(s).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3)")
    parser.add_argument("--agents", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument("--batch", type=int, default=32, help="samples per agent per step")
    parser.add_argument("--codec", default="fp32", choices=CODECS, help="activation/gradient codec")
    parser.add_argument("--aux", type=float, default=None,
                        help="aux head ratio in the bundle (default: no aux head; "
                             "PSL does not use it)")
    parser.add_argument("--repeats", type=int, default=None, help="codec best-of-N")
    parser.add_argument("--broker-mb", type=int, default=None, help="MB through each broker")
    parser.add_argument("--message-mb", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=None, help="broker rounds, best taken")
    parser.add_argument("--sections", default="codecs,engines,brokers")
    parser.add_argument("--quick", action="store_true", help="small sizes: about a minute")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: checks that every section still runs")
    args = parser.parse_args()
    if args.smoke:  # explicit options still win
        args.quick = True
        for name, value in (("steps", 2), ("warmup", 1), ("agents", 2), ("repeats", 1),
                            ("broker_mb", 2), ("rounds", 1)):
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.batch, args.message_mb = min(args.batch, 8), 1
        global MODEL
        MODEL = SMOKE_MODEL  # a 90 MB AlexNet bundle takes 12 s to export alone
    q = args.quick
    steps = args.steps if args.steps is not None else (3 if q else 20)
    warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    repeats = args.repeats if args.repeats is not None else (3 if q else 9)
    broker_mb = args.broker_mb if args.broker_mb is not None else (16 if q else 64)
    agents = args.agents if args.agents is not None else (4 if q else 8)
    rounds = args.rounds if args.rounds is not None else (1 if q else 3)
    sections = set(args.sections.split(","))
    # SIGTERM unwinds like Ctrl-C, so every finally below stops agents, brokers and temp dirs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # amqtt (3.1.1 only) drops the endpoints' MQTT 5 probe; it and asyncio log that with
    # tracebacks. The endpoint then connects with 3.1.1 as designed: keep the table readable.
    for noisy in ("amqtt", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    torch.set_num_threads(1)  # coordinator and in-process agents: one thread, like each agent
    print(f"# machine: {os.cpu_count()} cores, torch {torch.__version__} with "
          f"{torch.get_num_threads()} thread(s) in this process")

    if "codecs" in sections:
        print(f"\n# 1. codecs: encode_message / decode_message, MB/s of fp32 source bytes "
              f"(best of {repeats}); size = encoded / raw fp32 envelope; err = max |decoded - x|")
        print(f"{'tensor':<26}{'codec':<6}{'comp':<6}{'enc MB/s':>10}{'dec MB/s':>10}"
              f"{'size':>7}{'err':>10}")
        for r in bench_codecs(codec_inputs(q), repeats):
            print(f"{r['tensor']:<26}{r['codec']:<6}{r['compression']:<6}{r['enc']:>10.0f}"
                  f"{r['dec']:>10.0f}{r['size']:>7.3f}{r['err']:>10.2g}")
        print("note: fp32 decode is a zero-copy view after the CRC32 check, hence its speed.")

    diverged = None
    if "engines" in sections:
        workdir = Path(tempfile.mkdtemp(prefix="jetsplit-bench-"))
        try:
            dataset, archive, export_s = prepare_engines(agents, args.batch, args.aux, workdir)
            info = bench_engines(agents, steps, warmup, args.batch, args.codec, dataset,
                                 archive, workdir)
            info["export_s"] = export_s
            print_engines(info, agents, args.batch, args.codec, args.aux)
            diverged = info["diverged"]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    if "brokers" in sections:
        res = bench_brokers(broker_mb, args.message_mb, rounds)
        print(f"\n# 3. brokers: {res['count']} messages of {args.message_mb} MiB fp32 "
              f"({res['payload_mb']:.0f} MB payload, {res['wire_mb']:.1f} MB on the wire in "
              f"1 MiB chunks, QoS 1), one MqttEndpoint to another, best of {rounds} "
              f"alternated rounds; the embedded broker runs in this process, like a "
              f"coordinator that hosts it")
        print(f"{'broker':<12}{'seconds':>9}{'MB/s':>9}")
        for name, seconds in res["best_s"].items():
            print(f"{name:<12}{seconds:>9.2f}{res['payload_mb'] / seconds:>9.1f}")
        ratio = res["best_s"]["embedded"] / res["best_s"]["mosquitto"]
        print(f"Mosquitto / embedded throughput: {ratio:.2f}x")
    if diverged is not None:
        print(f"DIVERGED: {diverged} (a benchmark bug: its settings must train)")
        sys.exit(2)


if __name__ == "__main__":
    main()

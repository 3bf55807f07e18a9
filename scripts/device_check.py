#!/usr/bin/env python3
"""`make device-check`: the device side on its own floor, as a Jetson user would run it.

A Debian bullseye arm64 userland under QEMU user-mode emulation (glibc 2.31, Python 3.9.2,
PyPI's CPU `torch==1.13.1` and `numpy<2` installed system-wide as the "vendor" torch, a
stand-in `/etc/nv_tegra_release` for L4T R35) is the nearest thing to a JetPack 5 Jetson this
machine can hold. In it, from a copy of this checkout:

  install   scripts/install-agent.sh (non-editable, --no-enable), as root, like on a Jetson
  doctor    jetsplit doctor against the check's own Mosquitto
  r32       a second device standing in for a stock JetPack 4.6 Nano (an L4T R32.7
            release file, no torch for its python3; Debian's python3.9 stands in for
            Ubuntu 18.04's python3.8, which Debian does not carry): the installer's CPU
            route with --yes (apt-get, isolated venv, PyPI's torch 1.13.1, OpenBLAS core
            type), and its doctor
  profile   jetsplit profile on a small model; the host's `jetsplit export plan` takes it
  train     two ARM agents (`jetsplit agent run --config`) and a native coordinator
            (`jetsplit server run`) over a real Mosquitto, the second one on the R32 device
            with the CPU-Nano profile (jetson-nano-4gb-cpu); then the same run with two
            native agents (the same profiles) at the same seed, losses side by side
  tests     the device-side tests that need torch (marker device_torch) and the torch-free
            ones (device_pure), on torch 1.13.1 inside the userland
  container Dockerfile.jetson's install script, as far as it runs without Docker

It fails on any traceback, missed step, non-decreasing loss or failed stage, and prints each
stage's time and the ARM agents' peak RSS. The userland is built once (mmdebstrap, ~5 min)
into a cache folder outside the clone and reused; each run works on a fresh copy of it.
Needs root (chroot, mounts), Debian's qemu-user-static, binfmt-support and mmdebstrap
(installed with apt-get when missing) and the host's .venv (`make setup`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST_JETSPLIT = REPO / ".venv" / "bin" / "jetsplit"
SUITE = "bullseye"  # glibc 2.31 as JetPack 5's Ubuntu 20.04; Python 3.9.2
# apt: the installer's JetPack 4 route installs Ubuntu's python3.8 packages with it.
DEBIAN_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "procps",
                   "passwd", "apt")
VENDOR_TORCH = ("torch==1.13.1", "numpy<2")  # JetPack 5's floor; PyPI's aarch64 CPU wheel
L4T_RELEASE = "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n"
# A stock Nano's JetPack 4.6.4 (its last release).
L4T_R32_RELEASE = ("# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, "
                   "EABI: aarch64, DATE: Fri Jun  9 04:25:08 UTC 2023\n")
PROFILES = ("jetson-nano-4gb", "jetson-nano-4gb-cpu")  # agent 0's and agent 1's
USERLAND_FORMAT = "2"  # bump when the recipe above changes: the cache is rebuilt
CHECKOUT = "/home/jetson/jetsplit"  # where the user's checkout lies on the device
# The testbed's other layout: the coordinator on an arm64 Jetson (JetPack 6: Python 3.10 and
# NVIDIA's torch 2.x). Debian has no arm64 Python 3.10: bookworm's 3.11 is the nearest, with
# PyPI's torch 2.5.1 (CPU only; JetPack 6.1's NVIDIA torch is 2.5.0, and PyPI's newer aarch64
# torch wheels are CUDA builds that pull gigabytes of CUDA libraries).
COORDINATOR_SUITE = "bookworm"
COORDINATOR_TORCH = "torch==2.5.1"
COORDINATOR_VENV = "/opt/coordinator"
# Orin's Cortex-A78AE is an Armv8.2-A core like this model.
COORDINATOR_CPU = "neoverse-n1"
# Under QEMU user mode PyPI's onnxruntime 1.32.0 for aarch64 dies on import (signal 11, before
# any session: the coordinator then died as it wrote the first bundle); 1.19.2, what the agents'
# userland runs, imports and runs. Only this emulated coordinator is held to it: a Jetson has
# NVIDIA's onnxruntime-gpu.
COORDINATOR_ORT = "onnxruntime==1.19.2"
# export: onnx for the bundles it sends; data: scikit-learn for the digits it evaluates on
COORDINATOR_EXTRAS = "server,export,data"
VENV = "/opt/jetsplit/venv"  # edge_agent/install_layout.py's VENV
MODEL = ("mobilenetv3-small", "1,8,8")  # small enough for emulation, digits-shaped
FLEET = "devcheck"


class CheckFailed(Exception):
    """A stage failed; the message is one line."""


# ------------------------------------------------------------------------------ running
def run(command: Sequence[str], *, timeout: float = 3600, env: dict[str, str] | None = None,
        cwd: Path | str | None = None, log: Path | None = None, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    """Run a command; its output goes to ``log`` (or is captured). A failure names the
    command and shows its last lines."""
    out = open(log, "a") if log else subprocess.PIPE  # noqa: SIM115 - closed below
    try:
        done = subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env=env, cwd=cwd)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    text = log.read_text(errors="replace") if log else (done.stdout or "")
    if check and done.returncode != 0:
        tail = "\n    ".join(text.strip().splitlines()[-15:])
        raise CheckFailed(f"`{' '.join(command[:6])}` exited {done.returncode}:\n    {tail}")
    return subprocess.CompletedProcess(done.args, done.returncode, text, "")


def device_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment inside the userland: nothing of the host's leaks in but the CA
    bundle the host trusts (copied in), so pip reaches PyPI through the same proxy."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_CERT": "/etc/ssl/certs/host-ca-bundle.crt",
           "SSL_CERT_FILE": "/etc/ssl/certs/host-ca-bundle.crt",
           "PIP_DEFAULT_TIMEOUT": "180", "PYTHONUNBUFFERED": "1",
           # Byte-compiling scipy, sympy and scikit-learn under emulation took minutes of
           # the install; Python compiles what it imports anyway, so behaviour is the same.
           "PIP_NO_COMPILE": "1"}
    env.update(extra or {})
    return env


class Device:
    """The emulated device: a root folder entered with chroot (binfmt runs its arm64
    binaries through qemu-aarch64-static)."""

    def __init__(self, root: Path, qemu_cpu: str | None = None) -> None:
        self.root = root
        self.qemu_cpu = qemu_cpu  # QEMU_CPU for its programs (None: QEMU's default)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def command(self, argv: Sequence[str], cwd: str = "/", env: dict[str, str] | None = None
                ) -> list[str]:
        extra = {"QEMU_CPU": self.qemu_cpu} if self.qemu_cpu else {}
        pairs = [f"{k}={v}" for k, v in device_env({**extra, **(env or {})}).items()]
        return ["chroot", str(self.root), "/usr/bin/env", "-i", *pairs,
                "/bin/sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]

    def run(self, argv: Sequence[str], *, cwd: str = "/", log: Path | None = None,
            timeout: float = 3600, env: dict[str, str] | None = None, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        return run(self.command(argv, cwd, env), log=log, timeout=timeout, check=check)

    def popen(self, argv: Sequence[str], log: Path, cwd: str = "/") -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(argv, cwd), stdout=open(log, "ab"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, start_new_session=True)

    @contextlib.contextmanager
    def mounted(self, pip_cache: Path) -> Iterator[None]:
        """/proc, /sys, /dev and a pip cache kept between runs; unmounted on the way out."""
        pip_cache.mkdir(parents=True, exist_ok=True)
        mounts = [(["-t", "proc", "proc"], "proc"), (["-t", "sysfs", "sysfs"], "sys"),
                  (["--bind", "/dev"], "dev"), (["--bind", str(pip_cache)], "root/.cache/pip")]
        done: list[Path] = []
        try:
            for how, where in mounts:
                target = self.path(where)
                target.mkdir(parents=True, exist_ok=True)
                run(["mount", *how, str(target)])
                done.append(target)
            yield
        finally:
            for target in reversed(done):
                subprocess.run(["umount", "-l", str(target)], check=False)


# ------------------------------------------------------------------------------ stages
class Stages:
    """Times each stage and prints it as it ends."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started
            self.times.append((name, took))
            print(f"   {name}: {took:.1f} s", flush=True)


def ensure_host_tools() -> None:
    """qemu-user-static, binfmt for aarch64 and mmdebstrap, from Debian."""
    missing = [pkg for pkg, tool in (("qemu-user-static", "qemu-aarch64-static"),
                                     ("binfmt-support", "update-binfmts"),
                                     ("mmdebstrap", "mmdebstrap")) if not shutil.which(tool)]
    if missing:
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", *missing])
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)])
    if not (binfmt / "qemu-aarch64").exists():
        run(["update-binfmts", "--enable", "qemu-aarch64"])
    if not (binfmt / "qemu-aarch64").exists():
        raise CheckFailed("binfmt has no qemu-aarch64 entry: arm64 binaries cannot run here")


def host_ca_bundle() -> Path:
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise CheckFailed("no CA bundle on this host to hand to the emulated device")


def build_userland(cache: Path, log: Path) -> Path:
    """The cached arm64 userland with the vendor torch; built once (atomically)."""
    ready = cache / f"{SUITE}-arm64-torch1.13.1-v{USERLAND_FORMAT}"
    if (ready / ".jetsplit-ready").is_file():
        print(f"   reusing {ready}")
        return ready
    for old in cache.glob(f"{SUITE}-arm64-*"):
        shutil.rmtree(old, ignore_errors=True)  # an older recipe's (or a half-built one)
    tmp = ready.with_name(ready.name + ".tmp")
    cache.mkdir(parents=True, exist_ok=True)
    print(f"   building {ready} (once; mmdebstrap + pip under emulation)", flush=True)
    run(["mmdebstrap", "--variant=essential", "--architectures=arm64",
         f"--include={','.join(DEBIAN_PACKAGES)}", SUITE, str(tmp),
         "http://deb.debian.org/debian"], log=log)
    device = Device(tmp)
    shutil.copyfile(host_ca_bundle(), device.path("/etc/ssl/certs/host-ca-bundle.crt"))
    with device.mounted(cache / "pip-cache"):
        device.run(["python3", "-m", "pip", "install", *VENDOR_TORCH], log=log)
    device.path("/etc/nv_tegra_release").write_text(L4T_RELEASE)
    (tmp / ".jetsplit-ready").write_text(USERLAND_FORMAT + "\n")
    tmp.rename(ready)
    return ready


def build_coordinator_userland(cache: Path, log: Path) -> Path:
    """The cached bookworm arm64 userland with a venv holding torch and the coordinator's
    dependencies (those of this pyproject.toml: a change to it builds a new one)."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:12]
    ready = cache / (f"{COORDINATOR_SUITE}-arm64-{COORDINATOR_TORCH.replace('==', '')}-"
                     f"{digest}-v{USERLAND_FORMAT}")
    if (ready / ".jetsplit-ready").is_file():
        print(f"   reusing {ready}")
        return ready
    for old in cache.glob(f"{COORDINATOR_SUITE}-arm64-*"):
        shutil.rmtree(old, ignore_errors=True)  # an older pyproject's: gigabytes each
    tmp = ready.with_name(ready.name + ".tmp")
    cache.mkdir(parents=True, exist_ok=True)
    print(f"   building {ready} (once; mmdebstrap + pip under emulation)", flush=True)
    run(["mmdebstrap", "--variant=essential", "--architectures=arm64",
         f"--include={','.join(DEBIAN_PACKAGES)}", COORDINATOR_SUITE, str(tmp),
         "http://deb.debian.org/debian"], log=log)
    device = Device(tmp)
    shutil.copyfile(host_ca_bundle(), device.path("/etc/ssl/certs/host-ca-bundle.crt"))
    copy_checkout(device, "/tmp/jetsplit-deps")
    with device.mounted(cache / "pip-cache"):
        device.run(["python3", "-m", "venv", COORDINATOR_VENV], log=log)
        pip = [f"{COORDINATOR_VENV}/bin/python", "-m", "pip"]
        device.run([*pip, "install", "--upgrade", "pip"], log=log)
        device.run([*pip, "install", COORDINATOR_TORCH,
                    f"/tmp/jetsplit-deps[{COORDINATOR_EXTRAS}]"], log=log)
        device.run([*pip, "uninstall", "-y", "jetsplit"], log=log)
    shutil.rmtree(device.path("/tmp/jetsplit-deps"))
    (tmp / ".jetsplit-ready").write_text(USERLAND_FORMAT + "\n")
    tmp.rename(ready)
    return ready


def copy_checkout(device: Device, inside: str = CHECKOUT) -> None:
    """This checkout's tracked and untracked, not ignored, files (what a `git clone` plus
    local edits would hold) to ``inside`` on the device."""
    files = run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"]).stdout
    target = device.path(inside)
    for name in filter(None, files.split("\0")):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def fresh_device(userland: Path, cache: Path, name: str = "work") -> Device:
    """A throwaway copy of the userland with this checkout at CHECKOUT (tracked and
    untracked, not ignored, files: what a `git clone` plus local edits would hold)."""
    work = cache / name
    if work.exists():
        subprocess.run(["umount", "-R", "-l", str(work)], capture_output=True, check=False)
        shutil.rmtree(work)
    run(["cp", "-a", "--reflink=auto", str(userland), str(work)])
    device = Device(work)
    shutil.copyfile(host_ca_bundle(), device.path("/etc/ssl/certs/host-ca-bundle.crt"))
    copy_checkout(device)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mosquitto(workdir: Path) -> Iterator[int]:
    """A private Mosquitto on a free loopback port (the emulated device shares the host's
    network namespace)."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "mosquitto.log", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"mosquitto did not start (see {workdir / 'mosquitto.log'})")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def agent_toml(agent: str, index: int, broker: str, state_dir: str) -> str:
    """An agent config as the README's fleet example writes it: a shard of UCI digits (the
    fleet is named after the run's label: each run on the broker is its own fleet) and the
    profile PROFILES gives its index."""
    fleet = f"{FLEET}-{agent.rstrip('0123456789')}"
    return (f'fleet = "{fleet}"\nagent = "{agent}"\nstate_dir = "{state_dir}"\nthreads = 1\n'
            f'seed = {index}\nprofile = "{PROFILES[index]}"\n[mqtt]\nbroker = "{broker}"\n'
            f'[data]\ndataset = "digits"\npartition = "iid"\nclients = 2\nindex = {index}\n')


def server_toml(out: Path, label: str, algorithm: str, rounds: int) -> str:
    name, shape = MODEL
    return (f'fleet = "{FLEET}-{label}"\nagents = 2\nwait_s = 600\nout = "{out}"\nrun = "run"\n'
            f"seed = 0\n[model]\nname = \"{name}\"\ninput_shape = [{shape}]\nsplit = 2\n"
            f'[data]\ndataset = "digits"\n'
            f'[train]\nalgorithm = "{algorithm}"\nrounds = {rounds}\nlocal_steps = 8\n'
            f"batch = 32\nlr = 0.05\ndeadline_s = 600\n")


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a process (under QEMU: the emulated agent plus the emulator)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def agent_pid(launcher: subprocess.Popen[bytes]) -> int:
    """chroot → env → sh exec into python: the launcher's pid is the agent's own."""
    return launcher.pid


def run_peak(command: Sequence[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run a command (output to ``log``); its exit code and peak RSS in MB (the kernel's
    ru_maxrss of that child: under QEMU the emulated program plus the emulator)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 1024
        if time.monotonic() > deadline:
            stop(proc)
            raise CheckFailed(f"`{' '.join(command[:6])}` ran past {timeout:.0f} s (see {log})")
        time.sleep(0.5)


def train(label: str, workdir: Path, port: int, algorithm: str, rounds: int,
          start_agent: Callable[[str, int, Path], tuple[subprocess.Popen[bytes], Path]],
          timeout: float, coordinator: Device | None = None
          ) -> tuple[list[float], dict[str, float | None]]:
    """One coordinator (here, or on the ``coordinator`` device) and two agents; returns the
    per-round train losses and the peak RSS of each agent and of the coordinator. Fails on a
    traceback in any log, a missed step or a coordinator error."""
    if coordinator is None:
        out = workdir / f"runs-{label}"
        config = workdir / f"server-{label}.toml"
        config.write_text(server_toml(out, label, algorithm, rounds))
        command = [str(HOST_JETSPLIT), "server", "run", "--config", str(config)]
    else:
        out = coordinator.path(f"/tmp/runs-{label}")
        coordinator.path(f"/tmp/server-{label}.toml").write_text(
            server_toml(Path(f"/tmp/runs-{label}"), label, algorithm, rounds))
        command = coordinator.command([f"{COORDINATOR_VENV}/bin/jetsplit", "server", "run",
                                       "--config", f"/tmp/server-{label}.toml"])
    shutil.rmtree(out, ignore_errors=True)
    agents = {f"{label}{i}": start_agent(f"{label}{i}", i, workdir) for i in range(2)}
    coordinator_log = workdir / f"coordinator-{label}.log"
    rss: dict[str, float | None] = {}
    try:
        code, rss["coordinator"] = run_peak([*command, "--broker", f"mqtt://127.0.0.1:{port}"],
                                            coordinator_log, timeout)
        done = subprocess.CompletedProcess(command, code)
        for agent, (proc, _) in agents.items():
            rss[agent] = peak_rss_mb(agent_pid(proc))
            if proc.poll() is not None:
                raise CheckFailed(f"agent {agent} exited early with {proc.returncode}")
    finally:
        for proc, _ in agents.values():
            stop(proc)
    logs = [coordinator_log] + [log for _, log in agents.values()]
    for log in logs:
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            start = text.index("Traceback")
            raise CheckFailed(f"traceback in {log}:\n{text[start:start + 2000]}")
    if done.returncode != 0:
        tail = "\n    ".join(coordinator_log.read_text().strip().splitlines()[-10:])
        raise CheckFailed(f"coordinator exited {done.returncode}:\n    {tail}")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text()
            .splitlines() if line.strip()]
    if len(rows) != rounds:
        raise CheckFailed(f"{label}: {len(rows)} rounds in metrics.jsonl, wanted {rounds}")
    for row in rows:
        if row["missed"]:
            raise CheckFailed(f"{label}: round {row['round'] + 1} missed steps: {row['missed']}")
        if len(row["selected"]) != 2:
            raise CheckFailed(f"{label}: round {row['round'] + 1} selected {row['selected']}")
    losses = [float(row["train_loss"]) for row in rows]
    if any(b >= a for a, b in zip(losses, losses[1:], strict=False)):
        raise CheckFailed(f"{label}: training loss does not decrease: {losses}")
    accuracy = rows[-1].get("accuracy")
    print(f"   {label}: train loss per round {[round(x, 4) for x in losses]}, final "
          f"accuracy {accuracy:.4f}", flush=True)
    return losses, rss


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "JETSPLIT_DEVICE_CACHE", "/var/cache/jetsplit-device")),
        help="where the arm64 userland and pip's cache are kept between runs")
    parser.add_argument("--algorithm", default="splitfed-v1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", action="append", default=[],
                        choices=("profile", "tests", "container", "native", "r32"),
                        help="leave out a stage (repeatable)")
    parser.add_argument("--coordinator-only", action="store_true",
                        help="instead: the arm64 coordinator (bookworm, torch 2.x) with two "
                             "native agents, beside a native coordinator at the same seed "
                             "(`make device-check-server`; too slow for CI's budget)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the device check needs root (chroot and mounts)", file=sys.stderr)
        return 2
    if not HOST_JETSPLIT.exists():
        print("error: no .venv/bin/jetsplit: run `make setup` first", file=sys.stderr)
        return 2
    stages = Stages()
    logs = args.cache / ("logs-coordinator" if args.coordinator_only else "logs")
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    started = time.monotonic()
    try:
        with stages.stage("host tools (qemu-user-static, binfmt, mmdebstrap)"):
            ensure_host_tools()
        with contextlib.ExitStack() as stack:
            port = stack.enter_context(mosquitto(logs))
            broker = f"mqtt://127.0.0.1:{port}"
            native = None
            if not args.coordinator_only:
                native = devices(stack, stages, logs, broker, port, args)
            if args.coordinator_only:
                arm64_coordinator(stack, stages, logs, broker, port, args, native)
    except CheckFailed as exc:
        print(f"device check FAILED: {exc}", file=sys.stderr)
        print(f"logs: {logs}", file=sys.stderr)
        return 1
    print("== device check passed")
    for name, took in stages.times:
        print(f"   {took:7.1f} s  {name}")
    print(f"   {time.monotonic() - started:7.1f} s  total")
    return 0


def devices(stack: contextlib.ExitStack, stages: Stages, logs: Path, broker: str, port: int,
            args: argparse.Namespace) -> list[float] | None:
    """The bullseye devices (JetPack 5's, and the stock Nano's) and every stage on them;
    returns the native run's losses (None where it was skipped)."""
    with stages.stage("userland (Debian bullseye arm64, Python 3.9, torch 1.13.1)"):
        userland = build_userland(args.cache, logs / "userland.log")
    with stages.stage("copy the checkout onto a fresh device"):
        device = fresh_device(userland, args.cache)
    nano = None
    if "r32" not in args.skip:
        with stages.stage("copy the checkout onto a second device (the stock Nano's)"):
            nano = fresh_device(userland, args.cache, "work-r32")
    stack.enter_context(device.mounted(args.cache / "pip-cache"))
    if nano is not None:
        stack.enter_context(nano.mounted(args.cache / "pip-cache"))
    return check_device(device, nano, stages, logs, broker, port, args)


def native_agents(broker: str) -> Callable[[str, int, Path], tuple[subprocess.Popen[bytes],
                                                                    Path]]:
    """Starts agents on this machine with the host's jetsplit."""
    def start(agent: str, index: int, workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
        path = workdir / f"{agent}.toml"
        path.write_text(agent_toml(agent, index, broker, str(workdir / "state" / agent)))
        log = workdir / f"{agent}.log"
        return subprocess.Popen([str(HOST_JETSPLIT), "agent", "run", "--config", str(path)],
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                start_new_session=True), log
    return start


def arm64_coordinator(stack: contextlib.ExitStack, stages: Stages, logs: Path, broker: str,
                      port: int, args: argparse.Namespace, native: list[float] | None) -> None:
    """`jetsplit server run` on an arm64 device (the testbed's Orin NX coordinator) with two
    native agents; losses beside a native coordinator's at the same seed, and its peak RSS."""
    with stages.stage(f"coordinator userland (Debian {COORDINATOR_SUITE} arm64, Python 3.11, "
                      f"{COORDINATOR_TORCH})"):
        userland = build_coordinator_userland(args.cache, logs / "coordinator-userland.log")
    with stages.stage("copy the checkout onto the coordinator's device, pip install it"):
        coordinator = fresh_device(userland, args.cache, "work-coordinator")
        coordinator.qemu_cpu = COORDINATOR_CPU
        stack.enter_context(coordinator.mounted(args.cache / "pip-cache"))
        coordinator.run([f"{COORDINATOR_VENV}/bin/python", "-m", "pip", "install", "--quiet",
                         f"{CHECKOUT}[{COORDINATOR_EXTRAS}]"],
                        log=logs / "coordinator-install.log")
        coordinator.run([f"{COORDINATOR_VENV}/bin/python", "-m", "pip", "install", "--quiet",
                         COORDINATOR_ORT], log=logs / "coordinator-install.log")
        print(f"   {COORDINATOR_ORT} for the emulated coordinator (newer aarch64 wheels die "
              "on import under QEMU)")
        found = coordinator.run([f"{COORDINATOR_VENV}/bin/python", "-c",
                                 "import sys, platform, torch, numpy; print(platform.machine(), "
                                 "sys.version.split()[0], torch.__version__, numpy.__version__)"])
        print(f"   coordinator: machine, Python, torch, numpy: {found.stdout.strip()}")
    start = native_agents(broker)
    with stages.stage(f"train: arm64 coordinator, 2 native agents, {args.algorithm}, "
                      f"{args.rounds} rounds"):
        losses, rss = train("coord", logs, port, args.algorithm, args.rounds, start,
                            timeout=3000, coordinator=coordinator)
        final = (logs / "coordinator-coord.log").read_text().strip().splitlines()[-1]
        print(f"   arm64 coordinator's final line: {final}")
        print(f"   arm64 coordinator's peak RSS under QEMU: {rss['coordinator']:.0f} MB")
    if native is None:
        with stages.stage("train: native coordinator, 2 native agents, same seed"):
            native, _ = train("native", logs, port, args.algorithm, args.rounds, start,
                              timeout=900)
    print("   loss per round  arm64 coordinator (torch 2.5.1) | native coordinator (host torch)")
    for i, (a, b) in enumerate(zip(losses, native, strict=True)):
        print(f"   round {i + 1}: {a:.4f} | {b:.4f}")


def doctor_rows(text: str) -> list[str]:
    """The table rows of `jetsplit doctor`'s output (rich wraps long values onto more
    lines: they are joined back to one line per row)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 3 or cells[0] == "check":
            continue
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return [f"{name}: {value} [{verdict}]" for name, value, verdict in rows]


R32_INSTALL = "r32: scripts/install-agent.sh --yes on a JetPack 4.6 stand-in"


def install_stock_nano(nano: Device, logs: Path, broker: str) -> tuple[list[str], float]:
    """The installer's JetPack 4 route on a stand-in for a stock Nano; returns what to print
    and the seconds it took. It runs beside the JetPack 5 install (each under QEMU is one
    busy core for most of its time), so it prints nothing itself."""
    started = time.monotonic()
    said = ["stand-in: L4T R32.7.4 release file; Debian bullseye's python3.9 for Ubuntu "
            "18.04's python3.8 (Debian has no python3.8); no torch for it (the userland's "
            "removed)"]
    # pip uninstall takes minutes under emulation: the files go from here instead.
    removed = [path for pattern in ("torch", "torch-*.dist-info", "torchgen", "functorch")
               for path in nano.root.glob(f"usr/local/lib/python3*/dist-packages/{pattern}")]
    if not any(path.name.startswith("torch-") for path in removed):
        raise CheckFailed("no vendor torch to remove from the R32 device's userland")
    for path in removed:
        shutil.rmtree(path)
    nano.run(["python3", "-c", "import importlib.util, sys; "
              "sys.exit(importlib.util.find_spec('torch') is not None)"])
    nano.path("/etc/nv_tegra_release").write_text(L4T_R32_RELEASE)
    nano.run(["bash", f"{CHECKOUT}/scripts/install-agent.sh", "--agent", "arm1",
              "--broker", broker, "--fleet", FLEET, "--profile", PROFILES[1], "--yes",
              "--no-enable"], cwd=CHECKOUT, log=logs / "install-r32.log")
    text = (logs / "install-r32.log").read_text()
    said += [line for line in text.splitlines()
             if line.startswith(("jetsplit agent install:", "[", "this Jetson", "done;"))]
    for wanted in ("(JetPack 4)", "trains on its CPU: NVIDIA ships no CUDA torch",
                   "apt-get install python3.9-dev", "without system site-packages",
                   "held to torch==1.13.1, numpy<2", "OPENBLAS_CORETYPE=ARMV8", "done;"):
        if wanted not in text:
            raise CheckFailed(f"the R32 install did not say {wanted!r} (see install-r32.log)")
    found = nano.run([f"{VENV}/bin/python", "-c",
                      "import os, sys, torch; print(sys.version.split()[0], "
                      "torch.__version__, torch.version.cuda, "
                      "os.environ.get('OPENBLAS_CORETYPE'))"]).stdout.split()
    said.append(f"venv: Python, torch, torch CUDA, OPENBLAS_CORETYPE: {' '.join(found)}")
    if found[1:] != ["1.13.1", "None", "ARMV8"]:
        raise CheckFailed(f"the R32 venv has {found}, wanted torch 1.13.1 without CUDA "
                          "and OPENBLAS_CORETYPE=ARMV8")
    if "OPENBLAS_CORETYPE=ARMV8" not in nano.path("/etc/jetsplit/agent.env").read_text():
        raise CheckFailed("/etc/jetsplit/agent.env lacks OPENBLAS_CORETYPE=ARMV8")
    return said, time.monotonic() - started


def doctor_stock_nano(nano: Device, stages: Stages, logs: Path, broker: str) -> None:
    """`jetsplit doctor` on the stock Nano's device: it must say why it trains on its CPU."""
    with stages.stage("r32: doctor"):
        doctor = nano.run([f"{VENV}/bin/jetsplit", "doctor", "--broker", broker],
                          log=logs / "doctor-r32.log", env={"COLUMNS": "200"})
        rows = doctor_rows(doctor.stdout)
        print("   " + "\n   ".join(rows))
        if not any(r.startswith("training on: this Jetson") and "trains on its CPU" in r
                   for r in rows):
            raise CheckFailed("the R32 doctor does not say that the device trains on its CPU")


def jetpack5(device: Device, stages: Stages, logs: Path, broker: str) -> None:
    """The installer on the JetPack 5 stand-in (the vendor torch kept), then its doctor."""
    jetsplit = f"{VENV}/bin/jetsplit"
    with stages.stage("install: scripts/install-agent.sh --no-enable"):
        device.run(["bash", f"{CHECKOUT}/scripts/install-agent.sh", "--agent", "arm0",
                    "--broker", broker, "--fleet", FLEET, "--no-enable"],
                   cwd=CHECKOUT, log=logs / "install.log")
        text = (logs / "install.log").read_text()
        if "done;" not in text:
            raise CheckFailed("install-agent.sh did not finish (see install.log)")
        versions = device.run([f"{VENV}/bin/python", "-c",
                               "import sys, torch, numpy, jetsplit, importlib.metadata as m;"
                               "print(sys.version.split()[0], torch.__version__, "
                               "numpy.__version__, m.version('jetsplit'), jetsplit.__file__)"])
        print(f"   venv: Python, torch, numpy, jetsplit: {versions.stdout.strip()}")
        if "site-packages" not in versions.stdout:
            raise CheckFailed(f"the venv's jetsplit is not the installed one: {versions.stdout}")
    with stages.stage("doctor"):
        doctor = device.run([jetsplit, "doctor", "--broker", broker], log=logs / "doctor.log",
                            env={"COLUMNS": "200"})
        print("   " + "\n   ".join(doctor_rows(doctor.stdout)))


def check_device(device: Device, nano: Device | None, stages: Stages, logs: Path, broker: str,
                 port: int, args: argparse.Namespace) -> list[float] | None:
    """Every stage that runs on the emulated devices (see the module docstring); returns the
    native run's losses (None where it was skipped)."""
    jetsplit = f"{VENV}/bin/jetsplit"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        r32 = None if nano is None else pool.submit(install_stock_nano, nano, logs, broker)
        jetpack5(device, stages, logs, broker)
        if r32 is not None:
            with stages.stage("r32: the rest of its install (it ran beside the one above)"):
                said, took = r32.result()
            print("   " + "\n   ".join(said))
            stages.times.append((f"{R32_INSTALL} (beside the JetPack 5 install)", took))
            print(f"   {R32_INSTALL}: {took:.1f} s", flush=True)
    if nano is not None:
        doctor_stock_nano(nano, stages, logs, broker)
    name, shape = MODEL
    if "profile" not in args.skip:
        with stages.stage(f"profile: jetsplit profile --model {name} on the device"):
            device.run([jetsplit, "profile", "--model", name, "--input-shape", shape,
                        "--batch", "16", "--repeats", "3", "--warmup", "1", "--base-profile",
                        "jetson-nano-4gb", "--out", "/tmp/arm-measured.toml"],
                       log=logs / "profile.log", env={"JETSPLIT_PROFILES_DIR":
                                                      "/opt/jetsplit/profiles", "COLUMNS": "120"})
            measured = device.path("/tmp/arm-measured.toml")
            shutil.copyfile(measured, logs / "arm-measured.toml")
            plan = run([str(HOST_JETSPLIT), "export", "plan", "--model", name, "--input-shape",
                        shape, "--profile", str(logs / "arm-measured.toml")],
                       log=logs / "plan.log")
            print("   host plan with the device's profile: "
                  + next((line.strip() for line in plan.stdout.splitlines()
                          if "split" in line.lower()), plan.stdout.strip().splitlines()[-1]))

    def arm_agent(agent: str, index: int, workdir: Path
                  ) -> tuple[subprocess.Popen[bytes], Path]:
        """Agent 1 runs on the stock Nano's device where there is one."""
        on = nano if index == 1 and nano is not None else device
        inside = f"/etc/jetsplit/{agent}.toml"
        on.path(inside).write_text(agent_toml(agent, index, broker,
                                              f"/var/lib/jetsplit/{agent}"))
        log = workdir / f"{agent}.log"
        return on.popen([jetsplit, "agent", "run", "--config", inside], log), log

    native_agent = native_agents(broker)
    where = ("arm1 on the R32 device" if nano is not None else "both on one device")
    with stages.stage(f"train: 2 ARM agents ({', '.join(PROFILES)}; {where}), "
                      f"{args.algorithm}, {args.rounds} rounds"):
        arm_losses, rss = train("arm", logs, port, args.algorithm, args.rounds, arm_agent,
                                timeout=1800)
        for agent, mb in rss.items():
            who = "native coordinator" if agent == "coordinator" else f"{agent} under QEMU"
            print(f"   {who} peak RSS: " + ("unknown" if mb is None else f"{mb:.0f} MB"))
    native_losses = None
    if "native" not in args.skip:
        with stages.stage("train: 2 native agents, same seed"):
            native_losses, _ = train("native", logs, port, args.algorithm, args.rounds,
                                     native_agent, timeout=900)
        print("   loss per round  ARM (torch 1.13.1, aarch64) | native (host torch)")
        for i, (a, b) in enumerate(zip(arm_losses, native_losses, strict=True)):
            print(f"   round {i + 1}: {a:.4f} | {b:.4f}")
    if "tests" not in args.skip:
        with stages.stage("tests: device_torch (and the CLI's parsing) on torch 1.13.1"):
            device.run([f"{VENV}/bin/python", "-m", "pip", "install", "--quiet", "pytest>=7",
                        "pytest-timeout>=2.1", "hypothesis>=6.90"], log=logs / "tests.log")
            files = device_test_files()
            result = device.run([f"{VENV}/bin/pytest", "-q", "-p", "no:cacheprovider",
                                 "-m", "device_torch or device_pure", "-o", "addopts=",
                                 *files], cwd=CHECKOUT, log=logs / "tests.log", check=False)
            summary = result.stdout.strip().splitlines()[-1]
            print(f"   {summary}")
            if result.returncode != 0:
                raise CheckFailed(f"device tests failed: {summary} (see tests.log)")
    if "container" not in args.skip:
        with stages.stage("container: Dockerfile.jetson's install script in the userland"):
            # The image's python3 with its torch: the userland's, through a venv that sees
            # its site-packages (the script upgrades pip first, as in the image).
            device.run(["python3", "-m", "venv", "--system-site-packages", "/opt/image"])
            device.run(["bash", "scripts/container-install.sh"], cwd=CHECKOUT,
                       env={"PATH": "/opt/image/bin:/usr/bin:/bin"},
                       log=logs / "container.log")
            print("   " + (logs / "container.log").read_text().strip().splitlines()[-1])
    return native_losses


# The torch-free device tests run natively on CPython 3.8 and 3.9 (.ci/python3*-tests.sh);
# of those, the CLI's parsing is repeated here, on the device's own interpreter, and so are
# the partitions, which hang on the platform's libm (pow, log, exp, log1p) bit for bit.
ON_DEVICE_PURE = ("tests/agent/test_device_cli.py", "tests/core/test_partition_every_numpy.py")


def device_test_files() -> list[str]:
    """Test files marked device_torch (torch on the device), relative to the checkout, and
    ON_DEVICE_PURE."""
    files = [path.relative_to(REPO).as_posix()
             for path in sorted((REPO / "tests").rglob("test_*.py"))
             if "pytestmark = pytest.mark.device_torch" in path.read_text()]
    return files + list(ON_DEVICE_PURE)


if __name__ == "__main__":
    sys.exit(main())

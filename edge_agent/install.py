"""`jetsplit agent install` (and `scripts/install-agent.sh`): put the agent on a device as a
systemd service — venv, package, user, config, unit — in one idempotent run.

This module probes the host and plans the steps; what each step does to the system lives in
install_actions.py, the fixed paths in install_layout.py. All three need only the standard
library at import time, so the shell script can run them with the system `python3` straight
from a checkout, before any dependency is installed; checks that need the project's own code
(config validation) run in-process where that code imports, else with the new venv's Python.

On a Jetson the venv is made with `--system-site-packages` so NVIDIA's torch wheel (the only
CUDA torch for aarch64) is reused, and pip is held to that torch by a constraint: it can
never replace it with a CPU wheel from PyPI; numpy is held to what that torch was built
against, and an onnxruntime-gpu already there is kept (CPU onnxruntime only where none is).
On JetPack 4 (L4T R32) with no torch for the agent's Python, the CPU route: Ubuntu's python3.8
from apt (asked first, or --yes), an isolated venv from it and PyPI's CPU-only torch 1.13.1,
with OPENBLAS_CORETYPE=ARMV8 for numpy on the Nano's Cortex-A57. Which Python and wheel
folder each JetPack needs lives in edge_agent/jetpack.py.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Set, Tuple

from jetsplit.compat import removesuffix
from jetsplit.edge_agent import install_actions as actions
from jetsplit.edge_agent import jetpack
from jetsplit.edge_agent.install_actions import InstallError
from jetsplit.edge_agent.install_layout import (
    CONFIG,
    CONFIG_DIR,
    ENV_FILE,
    KIT_DIR,
    OPENBLAS_PTH,
    PROFILES_DIR,
    PROFILES_ENV,
    STATE_DIR,
    UNIT,
    UNIT_NAME,
    USER,
    VENV,
)
from jetsplit.edge_agent.kit import REPLACED, apply_kit, copy_kit, read_kit
from jetsplit.errors import JetsplitError

# Device-tree model text → bundled profile; first match wins (so "orin nano" before "nano").
MODEL_PROFILES = (("agx orin", "agx-orin-64gb"), ("orin nx", "orin-nx-16gb"),
                  ("orin nano", "orin-nano-8gb"), ("xavier nx", "xavier-nx-8gb"),
                  ("agx xavier", "agx-xavier-32gb"), ("jetson-agx", "agx-xavier-32gb"),
                  ("nano", "jetson-nano-4gb"))


@dataclass(frozen=True)
class Options:
    agent: str
    broker: str
    fleet: str = "default"
    profile: Optional[str] = None
    source: Path = Path(__file__).resolve().parents[1]
    root: Path = Path("/")
    dry_run: bool = False
    enable: bool = True
    user: bool = True
    venv: bool = True
    jetson_extra: bool = False
    # the operator's model packages (pip requirements: a path, a wheel, name==version): the
    # code a `module:factory` model source imports; bundles carry only its sha256
    model_packages: Tuple[str, ...] = ()
    kit: Optional[Path] = None  # a `jetsplit provision` startup kit for this device
    yes: bool = False  # run apt-get without asking


@dataclass
class Host:
    """What the installer found; read-only probes, also done on --dry-run."""

    l4t: Optional[Tuple[int, int]]  # (major, minor) of /etc/nv_tegra_release
    l4t_text: Optional[str]
    model: Optional[str]  # /proc/device-tree/model
    python: str  # interpreter the venv is made from
    python_version: Tuple[int, int]
    torch: Optional[str]  # torch version that interpreter sees, None where absent
    euid: int
    groups: Set[str] = field(default_factory=set)  # of video, jtop: those that exist
    user_exists: bool = False
    numpy: Optional[str] = None  # numpy version that interpreter sees
    onnxruntime: Optional[str] = None  # "onnxruntime-gpu 1.17.0" (or CPU onnxruntime), if any
    apt_missing: List[str] = field(default_factory=list)  # on R32: Ubuntu packages to install

    @property
    def jetson(self) -> bool:
        return self.l4t is not None

    @property
    def cpu_route(self) -> bool:
        """JetPack 4 without a torch for this Python: PyPI's CPU-only torch 1.13.1."""
        return jetpack.cpu_route(self.l4t, self.torch)

    @property
    def r32(self) -> bool:
        return self.l4t is not None and self.l4t[0] == 32


@dataclass
class Step:
    title: str
    action: Callable[[], Optional[str]]  # performs the change; returns a short note


def detect_host(root: Path) -> Host:
    """Probe the machine (under `root` for the files a fake root can stand in for)."""
    release = actions.read(root / "etc/nv_tegra_release")
    l4t = jetpack.parse_l4t(release) if release else None
    model = actions.read(root / "proc/device-tree/model")
    python = getattr(sys, "_base_executable", None) or sys.executable
    probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or not probe.stderr.strip():
        raise InstallError(f"{python} does not run: {probe.stderr.strip()[-200:]}")
    major, minor = (int(p) for p in probe.stderr.strip().splitlines()[-1].split("."))
    found = dict(line.split("=", 1) for line in probe.stdout.splitlines() if "=" in line)
    ort = next((f"{name} {found[name]}" for name in ("onnxruntime-gpu", "onnxruntime")
                if found.get(name)), None)
    groups = set()
    for name in ("video", "jtop"):
        try:
            grp.getgrnam(name)
            groups.add(name)
        except KeyError:
            pass
    try:
        pwd.getpwnam(USER)
        user_exists = True
    except KeyError:
        user_exists = False
    missing = (apt_missing(jetpack.apt_packages((major, minor)))
               if l4t is not None and l4t[0] == 32 else [])
    return Host(l4t=l4t, l4t_text=release.splitlines()[0].lstrip("# ")[:80] if release else None,
                model=model.strip("\x00 \n") if model else None, python=python,
                python_version=(major, minor), torch=found.get("torch") or None,
                euid=os.geteuid(), groups=groups, user_exists=user_exists,
                numpy=found.get("numpy") or None, onnxruntime=ort, apt_missing=missing)


def apt_missing(packages: List[str]) -> List[str]:
    """Those of ``packages`` dpkg does not list as installed ([] where there is no dpkg)."""
    if shutil.which("dpkg-query") is None:
        return []
    missing = []
    for name in packages:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0 or not done.stdout.strip().endswith(" installed"):
            missing.append(name)
    return missing


# Runs in the interpreter the venv is made from, which may be too old for this module (a
# Nano's 3.6): its version goes first, on stderr, so preflight can say what it needs.
_PROBE = """import sys
print('%d.%d' % sys.version_info[:2], file=sys.stderr)
try:
    import importlib.metadata as m
except ImportError:
    sys.exit(0)
for name in ('torch', 'numpy', 'onnxruntime-gpu', 'onnxruntime'):
    try:
        print(name + '=' + m.version(name))
    except m.PackageNotFoundError:
        pass
"""


def preflight(opts: Options, host: Host) -> str | None:
    """Refuse early, in one line, what would fail later; returns the chosen profile."""
    fake_root = opts.root != Path("/")
    if not (opts.dry_run or fake_root) and host.euid != 0:
        raise InstallError("installing the agent needs root: run it with sudo (or --dry-run "
                           "to see every step, or --root DIR to install into a directory)")
    for name in ("pyproject.toml", "systemd/agent.toml", "systemd/agent.env",
                 f"systemd/{UNIT_NAME}"):
        if not (opts.source / name).is_file():
            raise InstallError(f"--source {opts.source}: not a jetsplit checkout ({name} "
                               "missing); pass the directory that holds pyproject.toml")
    problem = jetpack.python_problem(host.l4t, host.python_version, host.torch)
    if opts.venv and problem:
        raise InstallError(f"{host.python}: {problem}")
    if opts.venv and host.l4t is not None and host.torch is None and not host.cpu_route:
        raise InstallError(jetpack.torch_hint(host.l4t, host.python, host.python_version))
    profile = opts.profile or guess_profile(host.model, cpu=host.cpu_route, source=opts.source)
    if profile and "/" not in profile and not (opts.source / "profiles" /
                                               f"{removesuffix(profile, '.toml')}.toml").is_file():
        known = ", ".join(sorted(p.stem for p in (opts.source / "profiles").glob("*.toml")))
        raise InstallError(f"--profile {profile}: no such bundled profile (known: {known}); "
                           "or pass a path to a measured profile")
    return removesuffix(profile, ".toml") if profile and "/" not in profile else profile


def guess_profile(model: str | None, *, cpu: bool = False, source: Path | None = None
                  ) -> str | None:
    """The bundled profile of this module; on the CPU route its CPU-training profile
    (``<name>-cpu``), or none where there is no such file (a GPU profile would promise the
    planner a GPU the agent cannot use)."""
    text = (model or "").lower()
    name = next((name for key, name in MODEL_PROFILES if key in text), None)
    if name is None or not cpu:
        return name
    profiles = (source or Options.source) / "profiles"
    return f"{name}-cpu" if (profiles / f"{name}-cpu.toml").is_file() else None


# --------------------------------------------------------------------------------- rendering
def render_agent_toml(template: str, opts: Options, profile: str | None, root: Path
                      ) -> tuple[str, list[str]]:
    """The example agent.toml with the flags' values filled in, and the keys commented out:
    those naming files that do not exist yet (CA, fleet key) would stop the service from
    starting; their comment says how to turn them back on."""
    values = {("", "agent"): opts.agent, ("", "fleet"): opts.fleet,
              ("", "state_dir"): STATE_DIR, ("", "profile"): profile,
              ("mqtt", "broker"): opts.broker}
    section, out, commented = "", [], []
    for line in template.splitlines():
        head = re.match(r"\s*\[([A-Za-z0-9_.]+)\]\s*(#.*)?$", line)
        if head:
            section = head.group(1)
        match = re.match(r'(\s*)([A-Za-z_]+)(\s*=\s*)("[^"]*")(.*)$', line)
        if match and (section, match.group(2)) in values:
            value = values[(section, match.group(2))]
            if value is None:
                line = f"# {match.group(2)} = ...  # none chosen: set one with --profile"
            else:
                line = f"{match.group(1)}{match.group(2)}{match.group(3)}{json.dumps(value)}"
                line += match.group(5) if match.group(5).strip().startswith("#") else ""
        elif match and match.group(2) in ("tls_ca", "tls_cert", "tls_key", "fleet_key_file"):
            path = json.loads(match.group(4))
            if not (root / path.lstrip("/")).is_file():
                line = (f"# {match.group(2)} = {match.group(4)}  # put the file there, then "
                        "uncomment")
                commented.append(match.group(2))
        out.append(line)
    return "\n".join(out) + "\n", commented


def render_env(template: str, existing: str | None, openblas: bool = False) -> str:
    """agent.env: an existing file is kept as it is (it may hold the fleet key); only the
    profiles directory (and on JetPack 4 the OpenBLAS core type) is added where missing."""
    text = existing if existing is not None else template
    if not re.search(rf"^\s*{PROFILES_ENV}=", text, re.MULTILINE):
        text = text.rstrip("\n") + ("\n" if text.strip() else "") + \
            f"# Where bare profile names (profile = \"jetson-nano-4gb\") are looked up:\n" \
            f"{PROFILES_ENV}={PROFILES_DIR}\n"
    name, value = jetpack.OPENBLAS_ENV
    if openblas and not re.search(rf"^\s*{name}=", text, re.MULTILINE):
        text = text.rstrip("\n") + "\n" + \
            "# numpy's OpenBLAS dies with 'illegal instruction' on the Cortex-A57 without it:\n" \
            f"{name}={value}\n"
    return text


def check_config_text(text: str, source: str) -> str:
    """Validate a rendered agent.toml with the project's own model (one-line errors)."""
    from jetsplit.config_io import model_from_dict, tomllib
    from jetsplit.edge_agent.config import AgentConfig

    cfg = model_from_dict(AgentConfig, tomllib.loads(text), "agent config", source)
    return cfg.mqtt.address().url()


def _importable() -> bool:
    try:
        import jetsplit.config_io  # noqa: F401
        import jetsplit.edge_agent.config  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------ steps
def plan(opts: Options, host: Host, profile: str | None) -> list[Step]:
    """Every step, in order, each with a title that says exactly what it will change."""
    return (_venv_steps(opts, host) if opts.venv else []) + _system_steps(opts, host, profile)


def _at(root: Path, path: str) -> Path:
    """A fixed path under --root (the device's / unless testing or building an image)."""
    return root / path.lstrip("/")


def _venv_steps(opts: Options, host: Host) -> list[Step]:
    """Python, the venv and what pip puts in it: NVIDIA's torch reused, or the CPU route."""
    fake_root = opts.root != Path("/")
    venv = _at(opts.root, VENV)
    venv_python = venv / "bin/python"
    cpu = host.cpu_route
    steps: list[Step] = []
    if host.apt_missing and not fake_root:
        packages = list(host.apt_missing)
        steps.append(Step(f"apt-get install {' '.join(packages)} (Ubuntu's own packages: the "
                          "agent needs Python >= 3.8; asks first unless --yes)",
                          lambda: actions.apt_install(packages, opts.yes)))
    if venv_python.exists():
        steps.append(Step(f"reuse the venv {venv}",
                          lambda: actions.check_venv(venv, isolated=cpu)))
    elif cpu:
        # Ubuntu's /usr/lib/python3/dist-packages holds Python 3.6 builds (numpy among
        # them) that pip would take as installed; NVIDIA ships nothing there for 3.8.
        steps.append(Step(
            f"create the venv {venv} from {host.python} without system site-packages "
            "(the system's are built for Python 3.6)",
            lambda: actions.run([host.python, "-m", "venv", str(venv)])))
    else:
        steps.append(Step(
            f"create the venv {venv} with --system-site-packages from {host.python}"
            + (f" (reuses NVIDIA's torch {host.torch})" if host.torch else ""),
            lambda: actions.run([host.python, "-m", "venv", "--system-site-packages",
                                 str(venv)])))
    if host.r32:
        name, value = jetpack.OPENBLAS_ENV
        steps.append(Step(f"set {name}={value} for every run of the venv's Python "
                          f"({OPENBLAS_PTH}: numpy dies with 'illegal instruction' on the "
                          "Cortex-A57 without it)",
                          lambda: actions.write_openblas_pth(venv_python)))
    # Distro pips (Debian's 20.3, Ubuntu 20.04's 20.0) build a PEP 517 project as
    # UNKNOWN 0.0.0 inside a --system-site-packages venv: upgrade pip there first (pip
    # picks the newest release that still supports the venv's Python).
    steps.append(Step("upgrade pip inside the venv (a distro pip cannot build this "
                      "project)", lambda: actions.upgrade_pip(venv_python)))
    extras = "agent,jetson" if opts.jetson_extra else "agent"
    pins = constraints(host)
    held = f", held to {', '.join(pins)}" if pins else ""
    if cpu:
        held += " (PyPI's CPU-only torch for aarch64: no CUDA)"
    steps.append(Step(f"pip install {opts.source}[{extras}] into the venv{held}",
                      lambda: actions.pip_install(venv_python, [f"{opts.source}[{extras}]"],
                                                  pins)))
    if opts.model_packages:
        models = list(opts.model_packages)
        steps.append(Step(f"pip install the model package(s) {' '.join(models)} into the "
                          f"venv{held}", lambda: actions.pip_install(venv_python, models, pins)))
    if host.onnxruntime:
        steps.append(Step(f"keep {host.onnxruntime} (PyPI's CPU onnxruntime is never "
                          "installed over it)",
                          lambda: actions.ensure_onnxruntime(venv_python, pins)))
    else:
        steps.append(Step("pip install onnxruntime (CPU) into the venv unless an "
                          "onnxruntime or onnxruntime-gpu is importable there",
                          lambda: actions.ensure_onnxruntime(venv_python, pins)))
    return steps


def _system_steps(opts: Options, host: Host, profile: str | None) -> list[Step]:
    """Profiles, user, folders, config, environment file, config check and the unit."""
    root = opts.root
    fake_root = root != Path("/")

    def at(path: str) -> Path:
        return _at(root, path)

    owner = None if fake_root or not (opts.user or host.user_exists) else USER
    agent_text, commented = render_agent_toml(
        (opts.source / "systemd/agent.toml").read_text(), opts, profile, root)
    if opts.kit is not None:
        agent_text = apply_kit(agent_text, KIT_DIR)
        commented = [c for c in commented if c not in REPLACED]
    venv_python = at(VENV) / "bin/python"
    steps: list[Step] = []
    steps.append(Step(f"copy the device profiles to {at(PROFILES_DIR)}",
                      lambda: actions.copy_profiles(opts.source / "profiles", at(PROFILES_DIR))))
    if opts.user and not fake_root:
        groups = ",".join(g for g in ("video", "jtop") if g in host.groups)
        if host.user_exists:
            title = f"add the existing user {USER} to the groups {groups or '(none exist)'}"
        else:
            title = (f"create the system user {USER} (no login shell, home {STATE_DIR}, "
                     f"groups {groups or '(none exist)'})")
        steps.append(Step(title, lambda: actions.ensure_user(groups, host.user_exists)))
    steps.append(Step(f"create {at(STATE_DIR)} (owner {owner or 'unchanged'}, mode 0750)",
                      lambda: actions.ensure_dir(at(STATE_DIR), 0o750, owner, owner)))
    steps.append(Step(f"create {at(CONFIG_DIR)} ("
                      f"{'root:' + owner if owner else 'owner unchanged'}, mode 0750)",
                      lambda: actions.ensure_dir(at(CONFIG_DIR), 0o750,
                                                 "root" if owner else None, owner)))
    if opts.kit is not None:
        kit = read_kit(opts.kit)
        steps.append(Step(f"copy the startup kit {opts.kit} to {at(KIT_DIR)} (keys mode 0640)",
                          lambda: copy_kit(kit, at(KIT_DIR), owner)))
    steps.append(Step(
        f"write {at(CONFIG)} (agent {opts.agent}, fleet {opts.fleet}, broker "
        f"{_safe_url(opts.broker)}, profile {profile or 'none'}; mode 0640)",
        lambda: actions.write(at(CONFIG), agent_text, owner, backup=True) + (
            f"; commented out until their files exist: {', '.join(commented)}"
            if commented else "")))
    existing_env = actions.read(at(ENV_FILE))
    env_text = render_env((opts.source / "systemd/agent.env").read_text(), existing_env,
                          openblas=host.r32)
    verb = ("write" if existing_env is None else
            "keep" if existing_env == env_text else "add lines to")
    extra = "; {}={}".format(*jetpack.OPENBLAS_ENV) if host.r32 else ""
    steps.append(Step(
        f"{verb} {at(ENV_FILE)} ({PROFILES_ENV}={PROFILES_DIR}{extra}; mode 0640)",
        lambda: actions.write(at(ENV_FILE), env_text, owner, backup=False)))
    if opts.venv or venv_python.exists():
        steps.append(Step(f"check {at(CONFIG)} loads with the venv's jetsplit",
                          lambda: actions.check_with(venv_python, at(CONFIG))))
    elif _importable():
        steps.append(Step(f"check {at(CONFIG)} loads with this jetsplit",
                          lambda: "broker " + check_config_text(at(CONFIG).read_text(),
                                                                str(at(CONFIG)))))
    steps.append(Step(f"install {UNIT_NAME} into {at(UNIT).parent}",
                      lambda: actions.write(at(UNIT), (opts.source / "systemd" / UNIT_NAME)
                                            .read_text(), None, backup=False, mode=0o644)))
    if opts.enable and not fake_root:
        steps.append(Step("systemctl daemon-reload",
                          lambda: actions.run(["systemctl", "daemon-reload"])))
        steps.append(Step(f"systemctl enable {UNIT_NAME} and (re)start it",
                          lambda: actions.enable_now()))
    return steps


def constraints(host: Host) -> list[str]:
    """What pip may not change: NVIDIA's CUDA torch (never swapped for a PyPI CPU wheel) and
    the numpy that torch was built against; on the CPU route PyPI's torch 1.13.1."""
    return jetpack.cpu_pins() if host.cpu_route else jetpack.pins(host.torch, host.numpy)


def _safe_url(url: str) -> str:
    """The broker URL without its password (titles are printed)."""
    return re.sub(r"(://[^:@/]+):[^@/]*@", r"\1:***@", url)


# ------------------------------------------------------------------------------------- run
def install(opts: Options, host: Host | None = None, echo: Callable[[str], None] = print
            ) -> int:
    """Check, then run (or with --dry-run, list) every step; returns the exit code."""
    host = host or detect_host(opts.root)
    profile = preflight(opts, host)
    if _importable():  # validate the flags before anything changes
        text, _ = render_agent_toml((opts.source / "systemd/agent.toml").read_text(), opts,
                                    profile, opts.root)
        try:
            check_config_text(text, "(from the install flags)")
        except JetsplitError as exc:
            raise InstallError(str(exc)) from None
    where = (" ".join(filter(None, ("Jetson", host.model, jetpack.describe(host.l4t))))
             if host.l4t else "not a Jetson")
    echo(f"jetsplit agent install: {where}; torch "
         f"{host.torch or 'absent (pip will install it)'}"
         + (f"; profile {profile}" + ("" if opts.profile else " (guessed from the model)")
            if profile else ""))
    if host.cpu_route:
        echo(jetpack.cpu_line(host.model))
    steps = plan(opts, host, profile)
    for number, step in enumerate(steps, 1):
        prefix = f"[{number}/{len(steps)}]"
        if opts.dry_run:
            echo(f"{prefix} would {step.title}")
            continue
        echo(f"{prefix} {step.title}")
        note = step.action()
        if note:
            echo(f"      {note}")
    if opts.dry_run:
        echo("dry run: nothing was changed")
    elif not opts.enable or opts.root != Path("/"):
        echo(f"done; start it with: systemctl enable --now {UNIT_NAME}")
    else:
        echo(f"done; check the device with: sudo -u {USER} {VENV}/bin/jetsplit doctor "
             f"--broker '{_safe_url(opts.broker)}'")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line instead of usage + error."""
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jetsplit agent install",
        description="Install the edge agent as a systemd service on this device (Jetson or "
                    "any Linux): venv, package, user, /etc/jetsplit config, unit. Idempotent.")
    parser.add_argument("--agent", help="this device's agent id (unique; default: the kit's)")
    parser.add_argument("--broker", required=True,
                        help="mqtt[s]://[user:pass@]host:port of the fleet's broker")
    parser.add_argument("--fleet", default="default", help="fleet name (default: default)")
    parser.add_argument("--profile", help="bundled profile name or a path (default: guessed "
                        "from the Jetson model)")
    parser.add_argument("--source", type=Path, default=Options.source,
                        help="the jetsplit checkout to install (default: this one)")
    parser.add_argument("--root", "--prefix", dest="root", type=Path, default=Path("/"),
                        help="install under this directory instead of / (no users, no "
                             "systemctl; for tests and images)")
    parser.add_argument("--dry-run", action="store_true", help="print every step, change "
                        "nothing")
    parser.add_argument("--no-enable", dest="enable", action="store_false",
                        help="do not enable or start the service")
    parser.add_argument("--no-user", dest="user", action="store_false",
                        help=f"do not create the {USER} user or change its groups")
    parser.add_argument("--no-venv", dest="venv", action="store_false",
                        help=f"leave {VENV} as it is (no venv, no pip)")
    parser.add_argument("--kit", type=Path, help="startup kit from `jetsplit provision` "
                        "(mutual TLS + signing key; sets agent id and fleet)")
    parser.add_argument("--jetson", dest="jetson_extra", action="store_true",
                        help="also install the [jetson] extra (jetson-stats, AGPL-3.0)")
    parser.add_argument("--model-package", dest="model_packages", action="append",
                        default=[], metavar="REQUIREMENT",
                        help="also pip install this model package (repeatable): the code of a "
                        "module:factory model source")
    parser.add_argument("--yes", "-y", action="store_true",
                        help="run apt-get (JetPack 4: Ubuntu's python3.8) without asking")
    return parser


def _kit_identity(args: argparse.Namespace) -> dict[str, Any]:
    """Agent id and fleet from --kit (flags that disagree with it are an error)."""
    if args.kit is None:
        if not args.agent:
            raise InstallError("the following arguments are required: --agent (see --help)")
        return {}
    kit = read_kit(args.kit.resolve())
    for flag, given, own in (("--agent", args.agent, kit.agent),
                             ("--fleet", None if args.fleet == "default" else args.fleet,
                              kit.fleet)):
        if given is not None and given != own:
            raise InstallError(f"{flag} {given} disagrees with the kit ({own})")
    return {"agent": kit.agent, "fleet": kit.fleet, "kit": kit.path}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m jetsplit.edge_agent.install` and `jetsplit agent install`."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    try:
        opts = Options(**{**vars(args), **_kit_identity(args), "source": args.source.resolve(),
                          "model_packages": tuple(args.model_packages),
                          "root": args.root.resolve()})
        return install(opts)
    except JetsplitError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}".replace("error: : ",
                                                                          "error: "),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

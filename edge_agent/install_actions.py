"""What each step of `jetsplit agent install` does to the system, one function each: run a
command, write a file only when it changed, make a directory or user, pip into the venv.

Standard library only at import time (the installer runs before any dependency is there).
Every function returns a short note for the installer's output, or raises InstallError with
one line saying what to do.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jetsplit.compat import removeprefix
from jetsplit.edge_agent import jetpack
from jetsplit.edge_agent.install_layout import NEUTRAL_CWD, OPENBLAS_PTH, STATE_DIR, UNIT_NAME, USER
from jetsplit.errors import JetsplitError


class InstallError(JetsplitError):
    """A precondition or step failed; the message is one line saying what to do."""


def check_venv(venv: Path, isolated: bool = False) -> str:
    """An existing venv must see the system's site-packages (NVIDIA's torch), or on the CPU
    route must not (they hold Python 3.6 builds)."""
    cfg = read(venv / "pyvenv.cfg") or ""
    if not isolated and re.search(r"include-system-site-packages\s*=\s*false", cfg):
        raise InstallError(f"{venv} was made without --system-site-packages, so NVIDIA's "
                           "torch is invisible to it: remove it and re-run")
    if isolated and re.search(r"include-system-site-packages\s*=\s*true", cfg):
        raise InstallError(f"{venv} was made with --system-site-packages, which on JetPack 4 "
                           "shows it Python 3.6 builds: remove it and re-run")
    return "kept"


def write_openblas_pth(python: Path) -> str:
    """A .pth line in the venv's site-packages sets the variable before numpy loads, for the
    service and for doctor or profile run by hand alike."""
    venv = python.parent.parent
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    if not sites:
        raise InstallError(f"{venv}: no lib/python3.*/site-packages in the venv")
    site = sites[-1]
    name, value = jetpack.OPENBLAS_ENV
    return write(site / OPENBLAS_PTH, f"import os; os.environ.setdefault({name!r}, "
                  f"{value!r})\n", None, backup=False, mode=0o644)


def apt_install(packages: list[str], yes: bool) -> str:
    """apt-get update + install, after asking (or with --yes)."""
    command = ["apt-get", "install", "-y", *packages]
    if not yes:
        if not sys.stdin.isatty():
            raise InstallError(f"`{' '.join(command)}` needs your consent: re-run with --yes, "
                               "or install them first")
        answer = input(f"run apt-get update and `{' '.join(command)}`? [y/N] ")
        if not answer.strip().lower().startswith("y"):
            raise InstallError(f"not installing {' '.join(packages)}: nothing was changed; "
                               "re-run with --yes, or install them first")
    run(["apt-get", "update"])
    run(command)
    return "installed"


def pip_install(python: Path, requirements: list[str], pins: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix="jetsplit-install-") as tmp:
        command = [str(python), "-m", "pip", "install", "--upgrade", *requirements]
        if pins:
            path = Path(tmp) / "constraints.txt"
            path.write_text("".join(f"{pin}\n" for pin in pins))
            command += ["--constraint", str(path)]
        run(command)
    return "installed"


def upgrade_pip(python: Path) -> str:
    run([str(python), "-m", "pip", "install", "--upgrade", "pip"])
    return venv_output(python, "import pip; print('pip', pip.__version__)")


def venv_output(python: Path, code: str) -> str:
    """stdout of ``python -c code`` run from a neutral folder: inside a checkout, its
    ``jetsplit/`` folder would shadow the package installed in the venv."""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=NEUTRAL_CWD)
    return done.stdout.strip()


def ensure_onnxruntime(python: Path, pins: list[str]) -> str:
    """CPU onnxruntime only where no onnxruntime (NVIDIA's onnxruntime-gpu included, which
    imports under the same name) is importable from the venv."""
    found = subprocess.run([str(python), "-c", "import onnxruntime as o; print(o.__version__)"],
                           capture_output=True, text=True, timeout=300, cwd=NEUTRAL_CWD)
    if found.returncode == 0:
        return f"kept onnxruntime {found.stdout.strip()}"
    return pip_install(python, ["onnxruntime"], pins)


def copy_profiles(source: Path, target: Path) -> str:
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    for path in sorted(source.glob("*.toml")):
        shutil.copyfile(path, target / path.name)
        (target / path.name).chmod(0o644)
        count += 1
    return f"{count} profiles"


def ensure_user(groups: str, exists: bool) -> str:
    if not exists:
        nologin = shutil.which("nologin") or "/usr/sbin/nologin"
        command = ["useradd", "--system", "--user-group", "--home-dir", STATE_DIR,
                   "--no-create-home", "--shell", nologin]
        run(command + (["--groups", groups] if groups else []) + [USER])
        return "created"
    if groups:
        run(["usermod", "--append", "--groups", groups, USER])
    return "groups ensured"


def ensure_dir(path: Path, mode: int, user: str | None, group: str | None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    if user or group:
        shutil.chown(path, user, group)
    return None if user or group else "ownership unchanged"


def write(path: Path, text: str, group: str | None, *, backup: bool, mode: int = 0o640
           ) -> str:
    """Write only when the content changed; root-owned, readable by `group`."""
    old = read(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    note = "unchanged"
    if old != text:
        if old is not None and backup:
            shutil.copy2(path, path.with_name(path.name + ".bak"))
            note = f"updated (previous in {path.name}.bak)"
        else:
            note = "written" if old is None else "updated"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.replace(path)
    path.chmod(mode)
    if group:
        shutil.chown(path, "root", group)
    return note


def check_with(python: Path, config: Path) -> str:
    code = ("import sys\nfrom jetsplit.edge_agent.install import check_config_text\n"
            "from jetsplit.errors import JetsplitError\n"
            "p = sys.argv[1]\n"
            "try: print('broker', check_config_text(open(p).read(), p))\n"
            "except JetsplitError as e: sys.exit(f'error: {e}')\n")
    done = subprocess.run([str(python), "-c", code, str(config)], capture_output=True,
                          text=True, timeout=300, cwd=NEUTRAL_CWD)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise InstallError(removeprefix(lines[-1], "error: ") if lines else
                           f"{config} does not load")
    return done.stdout.strip()


def enable_now() -> str:
    run(["systemctl", "enable", UNIT_NAME])
    run(["systemctl", "restart", UNIT_NAME])  # starts it, or picks up changed files
    return f"running; logs: journalctl -u {UNIT_NAME} -f"


def run(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, timeout=3600)
    except FileNotFoundError:
        raise InstallError(f"{command[0]}: command not found") from None
    if done.returncode != 0:
        raise InstallError(f"`{' '.join(command[:4])}…` failed with exit code "
                           f"{done.returncode} (its output is above)")
    return None


def read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None

"""Installing a `jetsplit provision` startup kit on a device: read and check it, copy it
under the config folder, and point agent.toml's `[mqtt]` section at the copied files."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from jetsplit.errors import ConfigError

KIT_FILES = ("ca.crt", "client.crt", "client.key", "signing.key", "kit.json")
PRIVATE = ("client.key", "signing.key")
# agent.toml [mqtt] key -> file in the kit
KIT_KEYS = (("tls_ca", "ca.crt"), ("tls_cert", "client.crt"), ("tls_key", "client.key"),
            ("signing_key", "signing.key"), ("trusted_keys", "trusted"))
REPLACED = tuple(k for k, _ in KIT_KEYS) + ("fleet_key_file",)


@dataclass(frozen=True)
class Kit:
    path: Path
    fleet: str
    agent: str


def read_kit(path: Path) -> Kit:
    """The kit's fleet and agent id, after checking every file it must hold."""
    missing = [f for f in KIT_FILES if not (path / f).is_file()]
    if not (path / "trusted").is_dir():
        missing.append("trusted/")
    if missing:
        raise ConfigError(f"kit {path}: not a jetsplit startup kit (missing "
                          f"{', '.join(missing)})")
    try:
        info = json.loads((path / "kit.json").read_text())
        fleet, agent = str(info["fleet"]), str(info["id"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"kit {path}: kit.json is not valid") from None
    if agent == "coordinator":
        raise ConfigError(f"kit {path}: this is the coordinator's kit, not a device's")
    return Kit(path, fleet, agent)


def copy_kit(kit: Kit, target: Path, group: str | None) -> str:
    """Copy the kit to `target` (0750; private keys 0640, readable by the service group)."""
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target, 0o750)
    for name in KIT_FILES:
        shutil.copyfile(kit.path / name, target / name)
        os.chmod(target / name, 0o640 if name in PRIVATE else 0o644)
    shutil.rmtree(target / "trusted", ignore_errors=True)
    shutil.copytree(kit.path / "trusted", target / "trusted")
    if group is not None:
        for path in [target, *target.rglob("*")]:
            shutil.chown(path, "root", group)
    return f"agent {kit.agent} of fleet {kit.fleet}"


def apply_kit(text: str, installed: str) -> str:
    """agent.toml with the `[mqtt]` TLS and signing keys pointing at the installed kit (and
    no shared fleet key: per-device keys replace it)."""
    out, section, done = [], "", False
    for line in text.splitlines():
        head = re.match(r"\s*\[([A-Za-z0-9_.]+)\]", line)
        if head:
            section = head.group(1)
        key = re.match(r"\s*#?\s*([A-Za-z_]+)\s*=", line)
        if section == "mqtt" and key and key.group(1) in REPLACED:
            continue
        out.append(line)
        if section == "mqtt" and not done and re.match(r"\s*broker\s*=", line):
            out.append(f"# per-device identity: the startup kit in {installed}")
            out += [f'{k} = "{installed}/{f}"' for k, f in KIT_KEYS]
            done = True
    if not done:
        raise ConfigError("agent.toml template has no [mqtt] broker line")
    return "\n".join(out) + "\n"

"""The coordinator's job for a fleet: make (or take) the bundle, cut from it what each
device runs, and keep that installed on the agents that train, including ones that
restarted since they got it.

Shipping API (role-true, per cut):

* `prepare_bundle(cfg, workdir)` gives the coordinator's `full` bundle (the whole model; it
  never leaves the coordinator except to FedAvg devices).
* `DeviceBundles(archive, workdir)` cuts device bundles from it: one per distinct
  `(role, cut, aux, edge_layers)` — a client bundle holds its cut's client block (+ the aux
  head when the method uses one), an edge bundle SHeRL-FL's middle block, a full bundle the
  whole model. Devices with the same role and cut share one manifest.
* `BundleShipper.ensure(agents, round, cuts={agent: cut})` installs on each agent the bundle
  for its registered role and its cut (default: the full bundle's split for everyone).

Transfer is resumable and content-addressed: the coordinator offers the manifest; the
agent installs from its file cache or answers which files it lacks and how many of their
bytes it already holds; only the missing bytes follow, in parts. A part lost to a timeout
is re-sent alone (with backoff; the first retry waits at least as long as the agent's
profiled downlink needs for it), and an offer after a restart or a missed deadline resumes
at the first missing byte.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetsplit.bundle import MANIFEST_NAME, Bundle, load_bundle
from jetsplit.protocol import Kind
from jetsplit.server.engines.seam import Command, Engine

log = logging.getLogger("jetsplit.coordinator")

PIECE_BYTES = 1 << 20  # one part of a file per command (the unit a retry re-sends)
RETRY_LINK_FACTOR = 2.0  # first retry of a part: at least this × its time on the downlink
OFFER_ROUNDS = 3  # offer → parts → offer cycles per ensure() before giving up till later
@dataclass(frozen=True)
class DeviceBundle:
    """One device bundle as shipped: its manifest bytes (sha256 = the bundle's id), and
    each file's sha256, size and path on the coordinator."""

    role: str
    cut: int
    manifest: bytes
    sha256: str
    files: dict[str, tuple[int, Path]]  # file sha256 -> (size, path)
    root: Path  # the bundle's folder on the coordinator

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(size for size, _ in self.files.values())


class DeviceBundles:
    """Device bundles cut from one full bundle, made once per (role, cut, aux, edge) key."""

    def __init__(self, source: Path, workdir: Path | None = None, *, seed: int = 0,
                 loaded: Bundle | None = None,
                 aux_weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> None:
        """`loaded`: the full bundle already verified from `source` (saves a second read).
        `aux_weights`: the aux head for a cut other than the full bundle's (Ampere's phase
        2 ships each cut's trained head); other cuts get a fresh seeded head."""
        import tempfile

        self.full: Bundle = loaded if loaded is not None else load_bundle(source)
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="jetsplit-device-bundles-")
            workdir = Path(self._tmp.name)
        self.workdir = Path(workdir)
        self.seed = seed
        self.aux_weights = dict(aux_weights or {})
        self._made: dict[tuple[str, int, bool, int | None], DeviceBundle] = {}

    def get(self, role: str, cut: int | None = None, *, aux: bool = False,
            edge_layers: int | None = None) -> DeviceBundle:
        """The bundle for `role` at `cut` (default: the full bundle's split)."""
        cut = self.full.split if cut is None else cut
        key = (role, cut, aux and role == "client", edge_layers if role == "edge" else None)
        if key not in self._made:
            self._made[key] = self._make(*key)
        return self._made[key]

    def _make(self, role: str, cut: int, aux: bool, edge_layers: int | None) -> DeviceBundle:
        from jetsplit.export.bundle_writer import derive_bundle, write_bundle

        name = f"{role}-k{cut}" + ("-aux" if aux else "") + \
            ("" if edge_layers is None else f"-e{edge_layers}")
        source = self.full
        if cut != self.full.split:  # another cut: re-export the same weights split there
            weights = {**source.client_module().state_dict(),
                       **source.server_module().state_dict(),
                       **{f"aux.{k}": v for k, v in self.aux_weights.get(cut, {}).items()}}
            report = write_bundle(source.spec, cut, self.workdir / f"full-k{cut}",
                                  aux_ratio=source.manifest.aux_ratio, seed=self.seed,
                                  weights=weights)
            source = load_bundle(report.path)
        role_dir = self.workdir / name
        derive_bundle(source, role, role_dir, aux=aux, edge_layers=edge_layers)
        bundle = load_bundle(role_dir)
        files = {entry.sha256: (entry.size, role_dir / fname)
                 for fname, entry in bundle.manifest.files.items()}
        manifest = (role_dir / MANIFEST_NAME).read_bytes()
        return DeviceBundle(role, cut, manifest, hashlib.sha256(manifest).hexdigest(), files,
                            role_dir)

    def close(self) -> None:
        """Remove the bundles made in a temporary folder (a given workdir is the caller's)."""
        if self._tmp is not None:
            self._tmp.cleanup()


def downlink_bytes_per_s(registration: dict[str, Any]) -> float | None:
    """The agent's profiled downlink (bytes/s), when its registration carries a profile."""
    profile = registration.get("profile") or {}
    network = profile.get("network") if isinstance(profile, dict) else None
    mbps = network.get("downlink_mbps") if isinstance(network, dict) else None
    if isinstance(mbps, (int, float)) and not isinstance(mbps, bool) and mbps > 0:
        return float(mbps) * 1e6 / 8
    return None


class BundleShipper:
    """Installs on each agent the bundle its role and cut need, resuming cut transfers."""

    def __init__(self, engine: Engine, archive: Path, *, lr: float, deadline_s: float,
                 kind: str = Kind.BUNDLE.value, content: str = "client",
                 workdir: Path | None = None, piece_bytes: int = PIECE_BYTES,
                 seed: int = 0, bundle: Bundle | None = None,
                 optimizer: dict[str, Any] | None = None,
                 aux_weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> None:
        """`kind` BUNDLE is setup traffic; TRAINED_BUNDLE (a bundle carrying trained
        weights, Ampere's phase 2) is counted as training traffic. `content` is what a
        client runs: "client", "aux" (client block + aux head) or "full" (FedAvg).
        `optimizer` is the client optimiser the agents train with (`OptimizerArgs`;
        default plain SGD at `lr`); `aux_weights` per cut: see `DeviceBundles`."""
        self.optimizer = dict(optimizer) if optimizer is not None else {"lr": lr}
        self.engine, self.lr, self.deadline_s, self.kind = engine, lr, deadline_s, kind
        self.part_kind = (Kind.TRAINED_BUNDLE_PART if kind == Kind.TRAINED_BUNDLE.value
                          else Kind.BUNDLE_PART).value
        self.content = content
        self.edge_layers: int | None = None  # SHeRL-FL sets it once it knows k2
        self.piece_bytes = piece_bytes
        self.sha256 = hashlib.sha256(Path(archive).read_bytes()).hexdigest()  # the full one
        self.bundles = DeviceBundles(archive, workdir, seed=seed, loaded=bundle,
                                     aux_weights=aux_weights)

    def close(self) -> None:
        self.bundles.close()

    # ------------------------------------------------------------------ what goes where

    def target(self, agent: str, cut: int | None = None) -> DeviceBundle:
        """The bundle `agent` runs: by its registered role, this method's needs, its cut."""
        role = self.engine.registry.registration(agent).get("role", "client")
        if role == "edge":
            if self.edge_layers is None:
                raise RuntimeError("edge bundles need the edge split (set edge_layers)")
            return self.bundles.get("edge", cut, edge_layers=self.edge_layers)
        if self.content == "full":
            return self.bundles.get("full", cut)
        return self.bundles.get("client", cut, aux=self.content == "aux")

    def needs(self, agent: str, cut: int | None = None) -> bool:
        """An agent reports its bundle when it registers (a restart re-registers it without
        one); the registry also notes each install we saw succeed."""
        have = self.engine.registry.registration(agent).get("bundle")
        return have != self.target(agent, cut).sha256

    # ------------------------------------------------------------------ shipping

    def ensure(self, agents: list[str], round: int = 0,
               cuts: Mapping[str, int] | None = None) -> list[str]:
        """Install on each agent the bundle for its role and cut (`cuts`, default the full
        bundle's split); returns the agents that now have theirs. Agents with the same
        (role, cut) get one shared manifest and their parts in shared publishes."""
        cuts = cuts or {}
        targets = {a: self.target(a, cuts.get(a)) for a in agents}
        todo = [a for a in agents if self.needs(a, cuts.get(a))]
        deadline = time.monotonic() + self.deadline_s
        for _ in range(OFFER_ROUNDS):
            if not todo or time.monotonic() >= deadline:
                break
            missing = self._offer(todo, targets, round, deadline)
            if missing:
                self._send_parts(missing, targets, round, deadline)
            # Offer again to those still reachable: installs, or says where to resume.
            registry = self.engine.registry
            todo = [a for a in sorted(missing) if registry.state(a) not in (None, "offline")]
        for agent in todo:
            log.warning("agent %s did not install its bundle yet", agent)
        return [a for a in agents if not self.needs(a, cuts.get(a))]

    def _offer(self, agents: list[str], targets: dict[str, DeviceBundle], round: int,
               deadline: float) -> dict[str, dict[str, int]]:
        """Offer each agent its manifest; returns {agent: {file sha: bytes held}} of the
        agents that still lack files (installed ones are noted in the registry)."""
        commands: dict[str, Command] = {}
        shared: dict[str, Command] = {}
        for agent in agents:
            target = targets[agent]
            if target.sha256 not in shared:
                shared[target.sha256] = Command(
                    self.kind, {"sha256": target.sha256, "role": target.role,
                                "optimizer": self.optimizer},
                    {"manifest": np.frombuffer(target.manifest, dtype=np.uint8)})
            commands[agent] = shared[target.sha256]
        out = self.engine.send_and_receive(commands, round=round,
                                           deadline_s=max(1.0, deadline - time.monotonic()))
        missing: dict[str, dict[str, int]] = {}
        for agent, reply in out.replies.items():
            if reply.meta.get("installed") is True:
                self.engine.registry.note_bundle(agent, targets[agent].sha256)
                continue
            lacks = reply.meta.get("missing")
            files = targets[agent].files
            if not isinstance(lacks, dict) or not lacks or not set(lacks) <= set(files) or \
                    any(not isinstance(v, int) or not 0 <= v < files[k][0]
                        for k, v in lacks.items()):
                log.warning("agent %s answered the bundle offer with a bad file list", agent)
                continue
            missing[agent] = dict(lacks)
        for agent, reason in out.missed.items():
            log.warning("agent %s did not take the bundle offer: %s", agent, reason)
        return missing

    def _retry_s(self, agent: str, nbytes: int) -> float | None:
        rate = downlink_bytes_per_s(self.engine.registry.registration(agent))
        return None if rate is None else RETRY_LINK_FACTOR * nbytes / rate

    def _send_parts(self, missing: dict[str, dict[str, int]], targets: dict[str, DeviceBundle],
                    round: int, deadline: float) -> list[str]:
        """Send each agent its missing bytes, one part per agent per wave; agents at the
        same (file, offset) share one command. Returns the agents that got everything
        (one that misses a part stops here; its next offer resumes where it stopped)."""
        queue = {a: sorted(lacks.items()) for a, lacks in missing.items()}
        offsets = {a: dict(lacks) for a, lacks in missing.items()}
        done: list[str] = []
        step = 0
        while queue and time.monotonic() < deadline:
            groups: dict[tuple[str, int], list[str]] = {}
            for agent, files in list(queue.items()):
                sizes = targets[agent].files
                while files and offsets[agent][files[0][0]] >= sizes[files[0][0]][0]:
                    files.pop(0)
                if not files:
                    done.append(agent)
                    del queue[agent]
                    continue
                groups.setdefault((files[0][0], offsets[agent][files[0][0]]), []).append(agent)
            wave: dict[str, Command] = {}
            for (sha, offset), group in groups.items():
                size, path = targets[group[0]].files[sha]
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read(min(self.piece_bytes, size - offset))
                waits = [w for w in (self._retry_s(a, len(data)) for a in group) if w]
                command = Command(self.part_kind,
                                  {"sha256": sha, "size": size, "offset": offset},
                                  {"data": np.frombuffer(data, dtype=np.uint8)},
                                  retry_s=max(waits) if waits else None)
                wave.update(dict.fromkeys(group, command))
            if not wave:
                break
            step += 1
            out = self.engine.send_and_receive(wave, round=round, step=step,
                                               deadline_s=max(1.0, deadline - time.monotonic()))
            for agent in wave:
                reply = out.replies.get(agent)
                held = None if reply is None else reply.meta.get("received")
                sha = queue[agent][0][0]
                if not isinstance(held, int) or not 0 < held <= targets[agent].files[sha][0]:
                    log.warning("agent %s missed a bundle part (%s); resuming later", agent,
                                out.missed.get(agent, "bad reply"))
                    del queue[agent]  # its next offer says where to resume
                    continue
                offsets[agent][sha] = held
        return sorted(done)

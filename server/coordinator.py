"""The coordinator's job for a fleet: make (or take) the bundle and keep it installed on the
agents that train, including ones that restarted since they got it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from jetsplit.bundle import load_bundle
from jetsplit.models import ModelSpec
from jetsplit.protocol import Kind
from jetsplit.server.config import ServerConfig
from jetsplit.server.engine import Command, Engine

log = logging.getLogger("jetsplit.coordinator")


def prepare_bundle(cfg: ServerConfig, workdir: Path) -> Path:
    """The bundle archive to ship: the configured one (verified), or a fresh export."""
    if cfg.model.bundle:
        path = Path(cfg.model.bundle)
        load_bundle(path)  # fail here, in one line, rather than on every agent
        return path
    from jetsplit.export.bundle_writer import write_bundle

    spec = ModelSpec(cfg.model.name, tuple(cfg.model.input_shape), cfg.model.classes)
    report = write_bundle(spec, cfg.model.split, workdir / "bundle", aux_ratio=cfg.model.aux_ratio,
                          seed=cfg.seed, tar=True)
    assert report.tar_path is not None
    return report.tar_path


class BundleShipper:
    """Installs the bundle on agents that lack it, including ones that restarted since."""

    def __init__(self, engine: Engine, archive: Path, *, lr: float, deadline_s: float,
                 kind: str = Kind.BUNDLE.value) -> None:
        """`kind` BUNDLE is setup traffic; TRAINED_BUNDLE (a bundle carrying trained
        weights, Ampere's phase 2) is counted as training traffic."""
        self.engine, self.lr, self.deadline_s, self.kind = engine, lr, deadline_s, kind
        self.data = np.frombuffer(archive.read_bytes(), dtype=np.uint8)
        self.sha256 = hashlib.sha256(self.data).hexdigest()

    def needs(self, agent: str) -> bool:
        """An agent reports its bundle when it registers (a restart re-registers it without
        one); the registry also notes each install we saw succeed."""
        return self.engine.registry.registration(agent).get("bundle") != self.sha256

    def ensure(self, agents: list[str], round: int = 0) -> list[str]:
        """Ship to those that need it; returns the agents that now have it."""
        todo = [a for a in agents if self.needs(a)]
        if todo:
            command = Command(self.kind,
                              {"sha256": self.sha256, "optimizer": {"lr": self.lr}},
                              {"bundle": self.data})
            outcome = self.engine.broadcast(command, todo, round=round,
                                            deadline_s=self.deadline_s)
            for agent in outcome.agents:
                self.engine.registry.note_bundle(agent, self.sha256)
            for agent, reason in outcome.missed.items():
                log.warning("agent %s did not install the bundle: %s", agent, reason)
        return [a for a in agents if not self.needs(a)]

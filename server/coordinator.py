"""The coordinator's job for a fleet: ship the bundle, run split-training rounds over the
engine with per-step deadlines, and write metrics and a summary.

Engine-neutral: the same function drives agents in-process or over MQTT.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetsplit.bundle import load_bundle
from jetsplit.errors import JetsplitError
from jetsplit.models import ZOO_VERSION, ModelSpec
from jetsplit.models.weights import to_arrays
from jetsplit.protocol import Kind
from server.config import ServerConfig
from server.engine import Command, Engine
from server.split_step import split_step

log = logging.getLogger("jetsplit.coordinator")


def prepare_bundle(cfg: ServerConfig, workdir: Path) -> Path:
    """The bundle archive to ship: the configured one (verified), or a fresh export."""
    if cfg.model.bundle:
        path = Path(cfg.model.bundle)
        load_bundle(path)  # fail here, in one line, rather than on every agent
        return path
    from export.bundle_writer import write_bundle

    spec = ModelSpec(cfg.model.name, tuple(cfg.model.input_shape), cfg.model.classes)
    report = write_bundle(spec, cfg.model.split, workdir / "bundle", aux_ratio=cfg.model.aux_ratio,
                          seed=cfg.seed, tar=True)
    assert report.tar_path is not None
    return report.tar_path


class BundleShipper:
    """Installs the bundle on agents that lack it, including ones that restarted since."""

    def __init__(self, engine: Engine, archive: Path, cfg: ServerConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.data = np.frombuffer(archive.read_bytes(), dtype=np.uint8)
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self._installed: dict[str, int] = {}  # agent -> registration generation at install

    def needs(self, agent: str) -> bool:
        registry = self.engine.registry
        if registry.registration(agent).get("bundle") == self.sha256:
            return False
        return self._installed.get(agent) != registry.generation(agent)

    def ensure(self, agents: list[str], round: int = 0) -> list[str]:
        """Ship to those that need it; returns the agents that now have it."""
        todo = [a for a in agents if self.needs(a)]
        if todo:
            command = Command(Kind.BUNDLE.value,
                              {"sha256": self.sha256,
                               "optimizer": {"lr": self.cfg.train.lr}},
                              {"bundle": self.data})
            outcome = self.engine.broadcast(command, todo, round=round,
                                            deadline_s=self.cfg.train.bundle_deadline_s)
            for agent in outcome.agents:
                self._installed[agent] = self.engine.registry.generation(agent)
            for agent, reason in outcome.missed.items():
                log.warning("agent %s did not install the bundle: %s", agent, reason)
        return [a for a in agents if not self.needs(a)]


def save_weights(engine: Engine, server: torch.nn.Module, agents: list[str], out_dir: Path,
                 *, deadline_s: float) -> list[str]:
    """The final server block and every reachable agent's client block, as safetensors."""
    from safetensors.numpy import save_file

    save_file(to_arrays(server, "server"), str(out_dir / "server.safetensors"))
    outcome = engine.broadcast(Command(Kind.GET_WEIGHTS.value, {"blocks": ["client"]}), agents,
                               deadline_s=deadline_s)
    (out_dir / "clients").mkdir(exist_ok=True)
    for agent, reply in outcome.replies.items():
        save_file({k: np.ascontiguousarray(v) for k, v in reply.tensors.items()},
                  str(out_dir / "clients" / f"{agent}.safetensors"))
    return outcome.agents


def select(pool: list[str], fraction: float, rng: np.random.Generator) -> list[str]:
    """A seeded random subset of ⌈fraction·|pool|⌉ agents, in id order."""
    if not pool:
        return []
    count = max(1, min(len(pool), round(fraction * len(pool))))
    return sorted(str(a) for a in rng.choice(sorted(pool), size=count, replace=False))


def run_split_training(
    engine: Engine,
    archive: Path,
    cfg: ServerConfig,
    out_dir: Path,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Ship the bundle, then `rounds × steps` split-training steps; returns the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    shipper = BundleShipper(engine, archive, cfg)
    pool = engine.registry.eligible(zoo_version=ZOO_VERSION)
    for agent in sorted(set(engine.online()) - set(pool)):
        log.warning("agent %s is not eligible (role or model-zoo version differs)", agent)
    ready = shipper.ensure(pool)
    if not ready:
        raise JetsplitError("no agent installed the bundle (see the log for each reason)")
    server = load_bundle(archive).server_module()
    optimizer = torch.optim.SGD(server.parameters(), lr=cfg.train.lr)
    rng = np.random.default_rng(cfg.seed)
    started = time.perf_counter()
    steps_done = 0
    with (out_dir / "metrics.jsonl").open("w") as metrics:
        for round_ in range(cfg.train.rounds):
            selected = select(engine.registry.eligible(zoo_version=ZOO_VERSION),
                              cfg.train.fraction, rng)
            losses = []
            for step in range(cfg.train.steps):
                # Offline agents are skipped by the engine; one that came back without the
                # bundle (a restart) gets it again before it is asked to train.
                live = shipper.ensure([a for a in selected
                                       if engine.registry.state(a) != "offline"], round_)
                step_started = time.perf_counter()
                report = split_step(engine, server, optimizer,
                                    dict.fromkeys(live, cfg.train.batch), round=round_,
                                    step=step, deadline_s=cfg.train.deadline_s,
                                    codec=cfg.train.codec, compression=cfg.train.compression)
                row = {**report.as_dict(), "seconds": time.perf_counter() - step_started,
                       "elapsed": time.perf_counter() - started,
                       "bytes_up": engine.counters.total("up"),
                       "bytes_down": engine.counters.total("down")}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                steps_done += 1
                if report.agents:
                    losses.append(report.loss)
                if on_step is not None:
                    on_step(row)
            log.info("round %d: %d agents, mean loss %.4f, up %.1f MB, down %.1f MB", round_,
                     len(selected), float(np.mean(losses)) if losses else float("nan"),
                     engine.counters.total("up") / 1e6, engine.counters.total("down") / 1e6)
    save_weights(engine, server, sorted(set(ready) | set(engine.online())), out_dir,
                 deadline_s=cfg.train.deadline_s)
    summary = {
        "run": engine.run_id, "steps": steps_done, "seconds": time.perf_counter() - started,
        "bundle_sha256": shipper.sha256, "agents": engine.registry.snapshot(),
        "missed": [m.__dict__ for m in engine.registry.missed],
        "bytes": engine.counters.snapshot(), "bytes_by_kind": engine.counters.by_kind(),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

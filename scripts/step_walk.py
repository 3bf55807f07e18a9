"""Walk one SCALA split step over MQTT and count where it goes.

A measuring tool, not part of the package. It starts a private Mosquitto on a free loopback
port and `--agents` agent daemons as real processes (`jetsplit agent run`, as the
integration tests do), ships them the bundle, runs one warm-up step of SCALA (lazy imports
and first-call set-up happen there), then records the next step, `method.iterate(live, 1)`
(the method's size-proportional batches, forwards, screening, server update, backwards),
with `sys.setprofile` on the coordinator's main thread and `threading.setprofile` on the
threads the MQTT engine starts (its network loop), and prints:

(a) the distinct first-party modules the step passes through: every file under the
    checkout's `server/`, `jetsplit/`, `edge_agent/` or `export/` folders (the package's
    own code) with at least one profiled call, whatever thread it ran on;
(b) the method↔trainer crossings: on the main thread, the number of profiled `call`
    events (a function call, or a generator resumed) whose frame is in the trainer module
    (`--trainer`, a path suffix) while the nearest first-party frame below it is in the
    methods folder (`--methods`), or the other way round (a trainer frame calling a
    method's function or closure). Frames outside first-party code (the standard library's
    `contextlib`, torch) are looked through, so a context manager of the trainer entered
    by a method counts once on enter and once on exit. Returns are not counted. Printed
    apart: crossings with another first-party module between the two frames (a closure of
    the trainer's a method hands to a defence module, which calls it).

The layout is detected: the rooms of server/ (methods/, training/trainer.py) or, on a tree
before them, the flat server/trainer.py and server/algorithms/. The same counting runs on
both; `--methods` and `--trainer` override the detected patterns.

    .venv/bin/python scripts/step_walk.py               # this checkout
    cd OLD && .venv/bin/python /path/to/scripts/step_walk.py   # another checkout's tree
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOMS = {  # the rooms of server/
    "brokers": "jetsplit.server.ops.brokers", "mqtt": "jetsplit.server.engines.mqtt",
    "trainer": "jetsplit.server.training.trainer", "methods": "jetsplit.server.methods",
    "settings": "jetsplit.server.training.settings", "assembly": "jetsplit.server.run.assembly",
    "config": "jetsplit.server.run.config"}
FLAT = {  # before them: one flat folder
    "brokers": "jetsplit.server.brokers", "mqtt": "jetsplit.server.mqtt_engine",
    "trainer": "jetsplit.server.trainer", "methods": "jetsplit.server.algorithms",
    "settings": "jetsplit.server.settings", "assembly": "jetsplit.server.bundle_shipping",
    "config": "jetsplit.server.config"}
FIRST_PARTY = ("server", "jetsplit", "edge_agent", "export")


def layout() -> tuple[dict[str, str], str, str]:
    """The modules to import and the (methods, trainer) path patterns of this tree."""
    if importlib.util.find_spec("jetsplit.server.training") is not None:
        return ROOMS, "server/methods/", "server/training/trainer.py"
    return FLAT, "server/algorithms/", "server/trainer.py"


class Walk:
    """The profile hook: which first-party files were called, and the crossings."""

    def __init__(self, root: Path, methods: str, trainer: str) -> None:
        self.root, self.methods, self.trainer = root, methods, trainer
        self.on = False
        self.files: set[str] = set()
        self.crossings: list[str] = []
        self.indirect: list[str] = []  # through a third first-party module (a closure)
        self.main = threading.get_ident()
        self._names: dict[str, str | None] = {}

    def name(self, filename: str) -> str | None:
        """The checkout-relative path of a first-party file, else None."""
        if filename not in self._names:
            try:
                rel = Path(filename).resolve().relative_to(self.root).as_posix()
            except ValueError:
                rel = None
            self._names[filename] = rel if rel and rel.split("/")[0] in FIRST_PARTY else None
        return self._names[filename]

    def side(self, rel: str | None) -> str | None:
        if rel is None:
            return None
        if rel.startswith(self.methods):
            return "method"
        return "trainer" if rel.endswith(self.trainer) else "other"

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if not self.on or event != "call":
            return
        rel = self.name(frame.f_code.co_filename)
        if rel is None:
            return
        self.files.add(rel)
        here = self.side(rel)
        if here not in ("method", "trainer") or threading.get_ident() != self.main:
            return
        caller, through = frame.f_back, False
        while caller is not None:
            there = self.side(self.name(caller.f_code.co_filename))
            if there in ("method", "trainer"):
                break
            through |= there == "other"  # first-party, neither side
            caller = caller.f_back  # look through the standard library and torch
        else:
            return
        if there != here:
            books = self.indirect if through else self.crossings
            books.append(f"{there} → {here}: {frame.f_code.co_qualname}")


def agent_processes(folder: Path, url: str, fleet: str, count: int
                    ) -> list[subprocess.Popen[bytes]]:
    """`count` agent daemons on `url`, each with a config and log in `folder`."""
    out = []
    for i in range(count):
        config = folder / f"a{i}.toml"
        config.write_text(
            f'fleet = "{fleet}"\nagent = "a{i}"\nstate_dir = "{folder / "state"}"\n'
            f'threads = 1\nseed = {i}\n[mqtt]\nbroker = "{url}"\n'
            f'[data]\ndataset = "digits"\npartition = "iid"\nclients = {count}\nindex = {i}\n')
        log = (folder / f"a{i}.log").open("wb")
        out.append(subprocess.Popen([sys.executable, "-m", "jetsplit.cli", "agent", "run",
                                     "--config", str(config)], stdout=log,
                                    stderr=subprocess.STDOUT))
    return out


def walk_step(modules: dict[str, str], walk: Walk, agents: int, folder: Path) -> None:
    """Set up a SCALA run over MQTT, warm it up for one step, record the next."""
    m = {key: importlib.import_module(name) for key, name in modules.items()}
    from jetsplit.data import load_dataset_split

    fleet = "walk"
    with m["brokers"].MosquittoProcess() as broker:
        processes = agent_processes(folder, f"mqtt://127.0.0.1:{broker.port}", fleet, agents)
        threading.setprofile(walk.hook)  # the engine's threads, started next
        engine = m["mqtt"].MqttEngine(broker.address, fleet, run_id="walk").start()
        try:
            engine.wait_for_agents(agents, 300)
            cfg = m["config"].ServerConfig(
                fleet=fleet, agents=agents, model=m["config"].ModelSection(
                    name="mobilenetv3-small", input_shape=[1, 8, 8], split=2))
            archive = m["assembly"].prepare_bundle(cfg, folder / "bundle")
            _, test = load_dataset_split("digits", 0.2, 0)
            settings = m["settings"].Settings(algorithm="scala", rounds=1, local_steps=2,
                                              batch=48, deadline_s=300, bundle_deadline_s=300)
            trainer = m["trainer"].Trainer(engine, archive, settings, test)
            method = m["methods"].build_method("scala", trainer)
            selected = trainer.select()
            live = trainer.live(selected)  # ships the bundles
            trainer.completions.begin_round(selected, trainer.global_client, fresh=True)
            method.begin_round(selected)
            method.iterate(live, 0)  # warm-up
            record(walk, lambda: method.iterate(live, 1))
        finally:
            threading.setprofile(None)  # type: ignore[arg-type]
            engine.close()
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=30)


def record(walk: Walk, step: Callable[[], object]) -> None:
    walk.on = True
    sys.setprofile(walk.hook)
    try:
        step()
    finally:
        sys.setprofile(None)
        walk.on = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modules, methods, trainer = layout()
    parser.add_argument("--methods", default=methods, help="path prefix of the methods' folder")
    parser.add_argument("--trainer", default=trainer, help="path suffix of the trainer module")
    parser.add_argument("--agents", type=int, default=3, help="agent processes (2–4)")
    parser.add_argument("--list", action="store_true", help="print each crossing")
    args = parser.parse_args()
    root = Path(importlib.import_module("jetsplit.server").__file__ or "").resolve().parents[1]
    walk = Walk(root, args.methods, args.trainer)
    with tempfile.TemporaryDirectory(prefix="step-walk-") as folder:
        walk_step(modules, walk, args.agents, Path(folder))
    print(f"tree: {root} ({'rooms' if modules is ROOMS else 'flat'} layout)")
    print(f"(a) first-party modules: {len(walk.files)}")
    for rel in sorted(walk.files):
        print(f"    {rel}")
    print(f"(b) method↔trainer crossings ({args.methods} ↔ {args.trainer}): "
          f"{len(walk.crossings)}")
    if args.list:
        for crossing in walk.crossings:
            print(f"    {crossing}")
    print(f"    and through a third first-party module (a closure handed on): "
          f"{len(walk.indirect)}")
    if args.list:
        for crossing in walk.indirect:
            print(f"    {crossing}")


if __name__ == "__main__":
    main()

"""Role-true bundles and their transfer: a device receives only what it runs, a cut
transfer resumes at the missing parts (over a real Mosquitto), a file the device already
holds is not sent again, and a manifest naming a block the role does not need is refused."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jetsplit.data import ArrayDataset, load_dataset_split
from jetsplit.edge_agent.daemon import AgentDaemon
from jetsplit.edge_agent.edge import no_data
from jetsplit.edge_agent.worker import AgentWorker, Result
from jetsplit.export.bundle_writer import write_bundle
from jetsplit.models import ModelSpec
from jetsplit.protocol import Kind
from jetsplit.server.cuts.shipping import BundleShipper
from jetsplit.server.engines.mqtt import MqttEngine
from jetsplit.server.engines.seam import Command, Engine, InProcessEngine
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.training.settings import Settings
from jetsplit.server.training.trainer import Trainer

BUNDLE_KINDS = (Kind.BUNDLE.value, Kind.BUNDLE_PART.value)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report = write_bundle(ModelSpec("alexnet", (1, 8, 8), 10), 2,
                          tmp_path_factory.mktemp("b") / "bundle", seed=0, tar=True)
    assert report.tar_path is not None
    return report.tar_path


@pytest.fixture(scope="module")
def data() -> ArrayDataset:
    return load_dataset_split("digits", 0.2, 0)[0].subset(range(64))


def _bundle_bytes(engine: Engine, agent: str) -> int:
    down = engine.counters.snapshot().get(agent, {}).get("down", {})
    return sum(down.get(kind, 0) for kind in BUNDLE_KINDS)


def _files(archive: Path, *names: str) -> int:
    return sum((archive.parent / "bundle" / n).stat().st_size for n in names)


def _installed_files(worker: AgentWorker) -> set[str]:
    assert worker.bundle is not None
    return {p.name for p in worker.bundle.root.iterdir()}


def test_clients_get_their_block_fedavg_the_whole_model(archive: Path, data: ArrayDataset,
                                                         tmp_path: Path) -> None:
    workers = {"a0": AgentWorker("a0", data, state_dir=tmp_path / "a0"),
               "a1": AgentWorker("a1", data, state_dir=tmp_path / "a1")}
    engine = InProcessEngine(workers)
    split = Trainer(engine, archive, Settings(algorithm="psl"), data)
    assert split.live(["a0"]) == ["a0"]
    assert _installed_files(workers["a0"]) == {"manifest.json", "client.safetensors",
                                               "client.onnx"}
    assert workers["a0"].server is None and workers["a0"].aux is None
    assert _bundle_bytes(engine, "a0") < _files(archive, "client.safetensors",
                                                "client.onnx") + 16384
    fedavg = Trainer(engine, archive, Settings(algorithm="fedavg"), data)
    assert fedavg.live(["a1"]) == ["a1"]
    assert _installed_files(workers["a1"]) == {"manifest.json", "client.safetensors",
                                               "client.onnx", "server.safetensors"}
    out = engine.send_and_receive({"a1": Command(Kind.TRAIN.value,
                                                 {"target": "full", "steps": 1, "batch": 8})})
    assert out.missed == {}
    out = engine.send_and_receive({"a0": Command(Kind.TRAIN.value,
                                                 {"target": "full", "steps": 1, "batch": 8})})
    assert "no server block" in out.missed["a0"]
    # Ampere's clients: client block + aux head, still no server block.
    ampere = Trainer(engine, archive, Settings(algorithm="ampere"), data)
    assert ampere.live(["a0"]) == ["a0"]
    assert _installed_files(workers["a0"]) == {"manifest.json", "client.safetensors",
                                               "client.onnx", "aux.safetensors", "aux.onnx"}


def test_a_cached_file_is_not_sent_again(archive: Path, data: ArrayDataset, tmp_path: Path) -> None:
    state = tmp_path / "state"
    engine = InProcessEngine({"a0": AgentWorker("a0", data, state_dir=state)})
    assert BundleShipper(engine, archive, lr=0.01, deadline_s=60).ensure(["a0"]) == ["a0"]
    # The aux variant shares the client files: only the aux head's bytes travel.
    before = engine.counters.snapshot()["a0"]["down"][Kind.BUNDLE_PART.value]
    aux = BundleShipper(engine, archive, lr=0.01, deadline_s=60, content="aux")
    assert aux.ensure(["a0"]) == ["a0"]
    sent = engine.counters.snapshot()["a0"]["down"][Kind.BUNDLE_PART.value] - before
    aux_bytes = _files(archive, "aux.safetensors", "aux.onnx")
    assert aux_bytes <= sent < aux_bytes + 8192
    # A restarted agent (same state dir, nothing in memory) installs from its cache.
    engine = InProcessEngine({"a0": AgentWorker("a0", data, state_dir=state)})
    assert engine.registry.registration("a0")["bundle"] is None
    assert aux.engine is not engine
    again = BundleShipper(engine, archive, lr=0.01, deadline_s=60, content="aux")
    assert again.ensure(["a0"]) == ["a0"]
    down = engine.counters.snapshot()["a0"]["down"]
    assert Kind.BUNDLE_PART.value not in down and down[Kind.BUNDLE.value] < 8192
    # A cached file that was tampered with is noticed on use and downloaded again.
    cached = next((state / "cache" / "files").iterdir())
    cached.write_bytes(b"x" + cached.read_bytes()[1:])
    engine = InProcessEngine({"a0": AgentWorker("a0", data, state_dir=state)})
    shipper = BundleShipper(engine, archive, lr=0.01, deadline_s=60, content="aux")
    assert shipper.ensure(["a0"]) == ["a0"]
    assert engine.counters.snapshot()["a0"]["down"][Kind.BUNDLE_PART.value] > 0


def _tampered(manifest: dict[str, object], **changes: object) -> Command:
    import hashlib

    raw = json.dumps({**manifest, **changes}).encode()
    return Command(Kind.BUNDLE.value, {"sha256": hashlib.sha256(raw).hexdigest(),
                                       "role": str(changes.get("role", "client"))},
                   {"manifest": np.frombuffer(raw, np.uint8)})


def test_a_manifest_naming_an_unneeded_block_is_refused_in_one_line(
        archive: Path, data: ArrayDataset, tmp_path: Path) -> None:
    manifest = json.loads((archive.parent / "bundle" / "manifest.json").read_text())
    assert manifest["role"] == "full" and "server.safetensors" in manifest["files"]
    engine = InProcessEngine({
        "a0": AgentWorker("a0", data, state_dir=tmp_path / "a0"),
        "e0": AgentWorker("e0", no_data(), role="edge", state_dir=tmp_path / "e0")})
    out = engine.send_and_receive({"a0": _tampered(manifest, role="client")})
    reason = out.missed["a0"]
    assert reason.startswith("error: ") and "\n" not in reason
    assert "role client does not run server.safetensors; refused" in reason
    out = engine.send_and_receive({"e0": _tampered(manifest, role="full")})
    assert "refused: a full bundle for an agent with role edge" in out.missed["e0"]
    assert [m.reason.startswith("error: ") for m in engine.registry.missed] == [True, True]
    # The agent lives on: it answers, and a proper bundle still installs.
    assert engine.send_and_receive({"a0": Command(Kind.STATUS.value)}).missed == {}
    assert BundleShipper(engine, archive, lr=0.01, deadline_s=60).ensure(["a0"]) == ["a0"]


class _DiesAfter(AgentWorker):
    """An agent whose process goes away after receiving `parts` bundle parts."""

    def __init__(self, *args: object, parts: int, stop: threading.Event, **kwargs: object
                 ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.parts_left, self.stop = parts, stop

    def _do_bundle_part(self, *args: object) -> Result:
        result = super()._do_bundle_part(*args)  # type: ignore[arg-type]
        self.parts_left -= 1
        if self.parts_left == 0:
            self.stop.set()  # the daemon closes its session: last will `offline`
        return result


def _serve(daemon: AgentDaemon, stop: threading.Event) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=10)


def test_an_interrupted_transfer_resumes_at_the_missing_parts(
        archive: Path, data: ArrayDataset, tmp_path: Path, mosquitto: MosquittoProcess) -> None:
    state = tmp_path / "state"
    engine = MqttEngine(mosquitto.address, "resume", run_id="resume").start(wait_s=10)
    try:
        shipper = BundleShipper(engine, archive, lr=0.01, deadline_s=120, content="aux")
        stop = threading.Event()
        first = _DiesAfter("a0", data, state_dir=state, parts=0, stop=stop)
        daemon = AgentDaemon(first, mosquitto.address, "resume")
        for thread in _serve(daemon, stop):
            assert engine.wait_for_agents(1, 120) == ["a0"]
            target = shipper.target("a0")
            shipper.piece_bytes = target.nbytes // 16
            parts = sum(-(-size // shipper.piece_bytes) for size, _ in target.files.values())
            assert parts >= 8
            first.parts_left = parts // 2
            assert shipper.ensure(["a0"]) == []  # the agent died half way
            thread.join(timeout=10)
        sent_first = _bundle_bytes(engine, "a0")
        assert 0.4 * target.nbytes < sent_first < 0.75 * target.nbytes

        stop = threading.Event()
        second = AgentWorker("a0", data, state_dir=state)
        for _ in _serve(AgentDaemon(second, mosquitto.address, "resume"), stop):
            assert engine.registry.wait_for(1, 20) == ["a0"]
            assert shipper.ensure(["a0"]) == ["a0"]
        again = _bundle_bytes(engine, "a0") - sent_first
        assert again < 0.6 * target.nbytes, (again, target.nbytes)
        assert second.bundle_sha == target.sha256
        assert _installed_files(second) == {"manifest.json", "client.safetensors",
                                            "client.onnx", "aux.safetensors", "aux.onnx"}
    finally:
        engine.close()


def test_bundles_per_cut_one_manifest_per_distinct_cut(archive: Path, data: ArrayDataset,
                                                       tmp_path: Path) -> None:
    workers = {a: AgentWorker(a, data, state_dir=tmp_path / a) for a in ("a0", "a1", "a2")}
    engine = InProcessEngine(workers)
    shipper = BundleShipper(engine, archive, lr=0.01, deadline_s=60)
    cuts = {"a0": 1, "a1": 2, "a2": 2}
    assert shipper.ensure(["a0", "a1", "a2"], cuts=cuts) == ["a0", "a1", "a2"]
    assert [workers[a].bundle.split for a in ("a0", "a1", "a2")] == [1, 2, 2]  # type: ignore[union-attr]
    assert workers["a1"].bundle_sha == workers["a2"].bundle_sha != workers["a0"].bundle_sha
    assert shipper.target("a1", 2) is shipper.target("a2", 2)  # one manifest per cut
    # The cut-1 client block holds the full bundle's weights for those layers.
    full = BundleShipper(engine, archive, lr=0.01, deadline_s=60).bundles.full
    want = full.client_module().state_dict()
    got = workers["a0"].client.state_dict()  # type: ignore[union-attr]
    assert set(got) < set(want) and all(got[k].equal(want[k]) for k in got)
    assert not shipper.needs("a0", 1) and shipper.needs("a0", 2)  # another cut: another bundle


def test_retries_back_off_and_wait_for_the_downlink(mosquitto: MosquittoProcess) -> None:
    """A silent agent is re-sent a command after retry_s, then after 2x, 4x... (not every
    retry_s); a command whose bytes need longer on the agent's downlink is not re-sent
    before that. Counted in publishes, with generous margins (no timing is asserted)."""
    from jetsplit.server.cuts.shipping import downlink_bytes_per_s

    engine = MqttEngine(mosquitto.address, "retry", run_id="retry", retry_s=0.1).start(10)
    try:
        engine.registry.register("ghost", {"role": "client"})  # nobody answers for it
        status = Command(Kind.STATUS.value)
        out = engine.send_and_receive({"ghost": status}, deadline_s=1.6)
        assert out.missed == {"ghost": "deadline"}
        per_send = engine.counters.snapshot()["ghost"]["down"][Kind.STATUS.value]
        engine.counters = type(engine.counters)()
        engine.send_and_receive({"ghost": Command(Kind.STATUS.value, retry_s=5.0)},
                                deadline_s=1.0)
        once = engine.counters.snapshot()["ghost"]["down"][Kind.STATUS.value]
    finally:
        engine.close()
    # Without backoff 0.1 s retries would send ~16 copies in 1.6 s; 0.1+0.2+0.4+0.8 allows 4.
    assert once > 0 and 2 <= round(per_send / once) <= 5
    profile = {"network": {"downlink_mbps": 8.0}}
    assert downlink_bytes_per_s({"profile": profile}) == 1e6
    assert downlink_bytes_per_s({"profile": None}) is None

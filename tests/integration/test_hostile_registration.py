"""A live coordinator (`jetsplit server run`, SCALA, whose client priors read the registered
label histogram) on a real Mosquitto, with one honest agent process, while a rogue device
keeps registering with every number out of bounds: 10^400, -1, the wrong type, a histogram
that does not add up, a profile with 10^400 CUDA cores. Each costs the rogue its
registration (counted, one log line each) and the run finishes. NaN and infinity never get
this far: the envelope's header parser refuses them (tests/wire)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from jetsplit.profiles import resolve_profile
from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.transport import Topics
from jetsplit.transport.mqtt import EndpointOptions, MqttEndpoint
from jetsplit.wire import Message, MessageType

_DATASET = {"name": "digits", "size": 10, "num_classes": 10, "input_shape": [1, 8, 8],
            "label_histogram": [1] * 10}


def _bad_registrations() -> list[dict[str, Any]]:
    """x9's registration with one field broken at a time."""
    good = {"agent": "x9", "role": "client", "version": "0.1.0", "zoo_version": 1,
            "dataset": _DATASET, "profile": None}
    out = []
    for path in (("zoo_version",), ("dataset", "size"), ("dataset", "num_classes"),
                 ("dataset", "label_histogram", 0), ("dataset", "input_shape", 0)):
        for value in (10**400, -1, "7", 2.5):
            reg = copy.deepcopy(good)
            target = reg
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
            out.append(reg)
    out.append({**good, "dataset": {**_DATASET, "size": 10**9}})  # histogram disagrees
    profile = resolve_profile("jetson-nano-4gb").model_dump(mode="json")
    out.append({**good, "profile": {**profile, "compute": {**profile["compute"],
                                                           "cuda_cores": 10**400}}})
    out.append({**good, "profile": {"device": "x"}})
    return out


def test_a_coordinator_outlives_registrations_with_unbounded_numbers(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    agent_fleet(url, "claims", 1).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "claims"\nagents = 1\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\n'
        'split = 2\n[data]\ndataset = "digits"\n[train]\ndeadline_s = 300\n'
        'algorithm = "scala"\nrounds = 1\nlocal_steps = 2\nbatch = 16\nlr = 0.05\n')
    server = subprocess.Popen(
        [sys.executable, "-m", "jetsplit.cli", "server", "run", "--config", str(config),
         "--broker", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    bad = _bad_registrations()
    sent = {"rounds": 0}
    stop = threading.Event()

    def rogue() -> None:
        topics = Topics("claims")
        endpoint = MqttEndpoint(mosquitto.address, "x9", EndpointOptions()).start(wait_s=30)
        try:
            while not stop.is_set():  # until the run is over: before, during and after
                for meta in bad:
                    endpoint.send(topics.up("x9"), Message(
                        MessageType.REGISTER, run="-", sender="x9", seq=endpoint.next_seq(),
                        kind="register", meta=meta))
                sent["rounds"] += 1
                stop.wait(1.0)
        finally:
            endpoint.close()

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        out, err = server.communicate(timeout=600)
    finally:
        stop.set()
        thread.join(30)
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err[-3000:]
    assert sent["rounds"] >= 1
    assert "scala: 1 rounds with 1 agents" in out
    tally = dict(item.rsplit(" ", 1) for item in
                 out.split("rejected messages: ", 1)[1].splitlines()[0].split(", "))
    assert int(tally["BadRegistration"]) >= len(bad)  # every kind, at least once
    assert err.count("rejected registration from x9: registration x9: ") >= len(bad)
    assert "Traceback" not in err and "OverflowError" not in err
    summary = json.loads((tmp_path / "runs" / "mqtt" / "summary.json").read_text())
    assert [a["agent"] for a in summary["agents"]] == ["a0"]
    assert summary["final_accuracy"] is not None

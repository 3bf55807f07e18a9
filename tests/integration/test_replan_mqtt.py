"""Live re-planning over a real Mosquitto (issue 25, "same bits"): a Nano whose power mode
and uplink drop after round 0 and recover after round 2, beside an Orin NX, trained by
`jetsplit server run` with `replan = "on"` on the model clock. The coordinator moves the
Nano to a shallower cut (predicted 2.14 → 1.73 s per round) and back once it recovers
(1.13 → 1.07 s: a 5% gain, so this fleet re-plans at a 4% threshold); the in-process engine
on the same agents makes the same switches at the same rounds and ends with the same
weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from conftest import run_in_process, run_weights, server_run

from jetsplit.server.ops.brokers import MosquittoProcess

PROFILES = {"a0": "jetson-nano-4gb", "a1": "orin-nx-16gb"}
# the Nano's emulation: a quarter of its speed and a 5 Mbit/s uplink in rounds 1-2
TRACE = ('[[emulation.trace.at]]\nround = 0\npower_mode = "MAXN"\n'
         '[[emulation.trace.at]]\nround = 1\ncompute = 0.25\nuplink_mbps = 5.0\n'
         'power_mode = "5W"\n'
         '[[emulation.trace.at]]\nround = 3\ncompute = 1.0\nuplink_mbps = 1000.0\n'
         'power_mode = "MAXN"\n')


def test_switches_over_mqtt_match_the_in_process_engine(
        mosquitto: MosquittoProcess, agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    fleet = agent_fleet(url, "replan", 2, dataset="mnist")
    for agent, path in fleet.configs.items():
        text = path.read_text().replace(f'agent = "{agent}"\n',
                                        f'agent = "{agent}"\nprofile = "{PROFILES[agent]}"\n')
        text += f'[emulation]\nprofile = "{PROFILES[agent]}"\n'
        text += TRACE if agent == "a0" else "uplink_mbps = 1000.0\n"
        path.write_text(text)
    fleet.start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "replan"\nagents = 2\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[model]\nname = "alexnet"\ninput_shape = [1, 28, 28]\nsplit = "auto"\n'
        '[data]\ndataset = "mnist"\n[train]\ndeadline_s = 300\nalgorithm = "splitfed-v1"\n'
        'rounds = 6\nlocal_steps = 2\nbatch = 32\nlr = 0.01\nreplan = "on"\n'
        'replan_clock = "model"\nreplan_threshold = 0.04\n')
    done = server_run(config, url)
    planned = re.search(r"cuts: (\{.*?\}) \(server cut (\d+)\)", done.stdout)
    assert planned is not None, done.stdout
    cuts = {k: int(v) for k, v in re.findall(r"'(a\d)': (\d+)", planned.group(1))}
    server_cut = int(planned.group(2))
    local = tmp_path / "runs" / "local"
    run_in_process(fleet, config, local, cuts=cuts, server_cut=server_cut)

    mqtt_run = tmp_path / "runs" / "mqtt"
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").open()]
            for run in (mqtt_run, local)]
    moves = [[(r["round"], r["replan"]["moved"]) for r in run if "replan" in r]
             for run in rows]
    # down to a shallower cut when the Nano slows, back (for free) when it recovers
    assert len(moves[0]) == 2 and moves[0] == moves[1], moves
    (first, there), (second, back) = moves[0]
    assert first == 1 and there["a0"][1] < there["a0"][0] == cuts["a0"]
    assert second > first and back == {"a0": [there["a0"][1], cuts["a0"]]}
    returned = next(r for r in rows[0] if r["round"] == second)["replan"]
    assert returned["switch_bytes"] == {}  # it holds its old cut's bundle
    for key in ("cuts", "train_loss", "accuracy"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key
    a, b = run_weights(mqtt_run), run_weights(local)
    assert set(a) == set(b) and len(a) > 5
    assert [k for k in a if a[k].tobytes() != b[k].tobytes()] == []

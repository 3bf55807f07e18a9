"""A device that goes quiet costs the fleet a few probes, not minutes: four agent processes
on a Mosquitto the test starts, `jetsplit server run` (SCALA), and a3 running the `silent`
fault (edge_agent/attacks.py: it registers and installs its bundle, then answers nothing,
its connection up). Asserted on the books, not on wall time: a3 costs one whole deadline
(its first forward, before any step time is known), two adapted ones, then only
round-start probes at the probe deadline, never a step; the step deadlines adapt below
`deadline_s` after round 0; the honest agents miss nothing and the report names a3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import server_run

from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.report.document import write_report

DEADLINE_S, FLOOR_S = 40.0, 10.0


def test_a_silent_agent_costs_probes_not_deadlines(mosquitto: MosquittoProcess,
                                                   agent_fleet: Any, tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    agent_fleet(url, "quiet", 4, attacks={"a3": "silent"}).start()
    config = tmp_path / "server.toml"
    config.write_text(
        f'fleet = "quiet"\nagents = 4\nwait_s = 120\nout = "{tmp_path / "runs"}"\n'
        'run = "mqtt"\n[server]\nthreads = 1\n'
        '[model]\nname = "mobilenetv3-small"\ninput_shape = [1, 8, 8]\nsplit = 2\n'
        '[data]\ndataset = "digits"\n[train]\nalgorithm = "scala"\nrounds = 6\n'
        f"local_steps = 4\nbatch = 48\nlr = 0.05\ndeadline_s = {DEADLINE_S}\n"
        f"deadline_floor_s = {FLOOR_S}\nprobe_deadline_s = 3\n")
    server_run(config, url)
    run = tmp_path / "runs" / "mqtt"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    summary = json.loads((run / "summary.json").read_text())
    misses = [(m["agent"], m["round"], m["kind"]) for m in summary["missed"]]
    for row in rows:  # the books, for a failure's log
        print(row["round"], row["selected"], row["benched"], row["probes"], row["deadlines_s"],
              row["full_deadlines"], row["missed"], round(row["seconds"], 1))
    print(misses)
    # a3: three forwards in round 0 (the first one the whole deadline: no step time known
    # yet; the next two at the adapted one), benched; then only the probes of rounds 2 and
    # 5 (3 s each), never a step; nobody else missed anything
    assert misses == [("a3", 0, "forward")] * 3 + [("a3", 2, "status"), ("a3", 5, "status")]
    assert [r["probes"] for r in rows] == [{}, {}, {"a3": "no answer: deadline"}, {}, {},
                                           {"a3": "no answer: deadline"}]
    assert [r["benched"] for r in rows] == [["a3"]] * 6
    assert summary["benched"] == {"a3": 3}  # round 0-1, then 2-4 (probe), 5- (probe)
    assert [r["selected"] for r in rows] == [["a0", "a1", "a2", "a3"]] + [["a0", "a1", "a2"]] * 5
    # the step deadline adapts once a step time is known, within [floor, deadline_s]
    assert rows[0]["full_deadlines"]["forward"] == 1  # the very first forward only
    for row in rows[1:]:
        assert FLOOR_S <= row["deadlines_s"]["forward"] < DEADLINE_S, row["deadlines_s"]
        assert row["full_deadlines"].get("forward", 0) == 0
    assert all(r["train_loss"] is not None for r in rows)
    report = write_report(run).read_text()
    assert "| step deadline s |" in report
    agents = report[report.index("| agent |"):]
    a3 = next(line for line in agents.splitlines() if line.startswith("| a3 |"))
    assert "| 6 |" in a3 and "| 0/2 |" in a3, a3  # rounds benched, probes answered

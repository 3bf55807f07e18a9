"""A device that goes quiet costs the fleet seconds, not minutes: four agent processes on a
Mosquitto the test starts, `jetsplit server run` (SCALA), and a3 running the `silent` fault
(edge_agent/attacks.py: it registers and installs its bundle, then answers nothing, its
connection up). Asserted on the books, not on wall time: a3 costs one cut-off wait (its
first forward, cut off once the others answered: server/engines/cutoff.py), then sits out
the round's later steps with a probe posted alongside them (server/training/rejoin.py);
the next round's start books the probe's silence and benches it, and later round-start
probes never hold a round up; the step deadlines adapt below `deadline_s` after round 0;
the honest agents miss nothing and the report names a3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import server_run

from jetsplit.server.ops.brokers import MosquittoProcess
from jetsplit.server.report.document import write_report

# deadline_s far over k × a cold first forward on a busy machine (4 × 10-25 s): the test
# checks that the deadline adapts below it, which a cold start near it would hide
DEADLINE_S, FLOOR_S = 120.0, 10.0


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
    # a3: one forward in round 0, cut off once the others answered, then nothing but
    # probes sent alongside the steps: round 0's, booked silent at round 1's start (benched
    # for rounds 1-2), and round 3's (out of round 3), booked at round 4's (benched 4-5)
    assert misses == [("a3", 0, "forward"), ("a3", 0, "status"), ("a3", 3, "status")]
    assert rows[0]["missed"]["a3"].startswith("deadline (cut off after "), rows[0]["missed"]
    assert [r["probes"] for r in rows] == [{}, {"a3": "no answer: deadline"}, {}, {},
                                           {"a3": "no answer: deadline"}, {}]
    assert [r["benched"] for r in rows] == [[], ["a3"], ["a3"], [], ["a3"], ["a3"]]
    assert [r["awaiting_probe"] for r in rows] == [["a3"], [], [], ["a3"], [], []]
    assert summary["benched"] == {"a3": 2}  # rounds 1-2, then 4-5
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

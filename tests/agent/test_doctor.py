"""`jetsplit doctor`: one table of what this device has; optional parts are "absent",
a missing requirement or an unreachable broker is a "problem" and exit code 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.doctor import checks, jetpack_release
from jetsplit.server.ops.brokers import MosquittoProcess, free_port


def test_jetpack_release_is_read_from_the_tegra_file(tmp_path: Path) -> None:
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref\n")
    assert jetpack_release(release) == "L4T R35.4.1"
    assert jetpack_release(tmp_path / "missing") is None


def test_report_names_every_part_and_reaches_the_broker(mosquitto: MosquittoProcess) -> None:
    rows = {name: (value, verdict) for name, value, verdict in
            checks(f"mqtt://127.0.0.1:{mosquitto.port}")}
    assert {"JetPack / L4T", "torch", "torch CUDA", "TensorRT", "ONNX Runtime", "memory",
            "broker"} <= set(rows)
    assert rows["ONNX Runtime"][1] == "ok" and "CPUExecutionProvider" in rows["ONNX Runtime"][0]
    assert rows["broker"] == (f"mqtt://127.0.0.1:{mosquitto.port} reachable (MQTT 5)", "ok")
    # No TensorRT or CUDA on this machine: reported as absent, not as a failure.
    assert rows["TensorRT"][1] in ("absent", "ok") and rows["torch CUDA"][1] in ("absent", "ok")


def test_unreachable_broker_is_a_problem_and_exit_1(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    code = main(["doctor", "--broker", f"mqtt://127.0.0.1:{free_port()}", "--wait", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "unreachable" in out and "problem" in out

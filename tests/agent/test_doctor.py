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


NANO_RELEASE = ("# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64, "
                "DATE: Fri Jun  9 04:25:08 UTC 2023\n")


def test_jetpack_4_says_why_it_trains_on_the_cpu_and_checks_openblas() -> None:
    from jetsplit.edge_agent import jetpack
    from jetsplit.edge_agent.doctor import jetpack4_rows

    model = "NVIDIA Jetson Nano Developer Kit\x00"
    rows = jetpack4_rows(NANO_RELEASE, model, False, {"OPENBLAS_CORETYPE": "ARMV8"})
    assert rows == [("training on", jetpack.cpu_line("NVIDIA Jetson Nano Developer Kit"), "ok"),
                    ("OpenBLAS core", "OPENBLAS_CORETYPE=ARMV8", "ok")]
    assert "this Jetson Nano trains on its CPU: NVIDIA ships no CUDA torch" in rows[0][1]
    [row] = jetpack4_rows(NANO_RELEASE, model, True, {})  # a CUDA torch: no CPU line
    assert row[0] == "OpenBLAS core" and row[2] == "problem" and "illegal instruction" in row[1]
    assert jetpack4_rows("# R35 (release), REVISION: 4.1, GCID: 1\n", model, False, {}) == []
    assert jetpack4_rows(None, None, False, {}) == []


def test_doctor_on_a_stock_nano_without_openblas_fails(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from jetsplit.edge_agent import doctor

    release = tmp_path / "nv_tegra_release"
    release.write_text(NANO_RELEASE)
    monkeypatch.setattr(doctor, "RELEASE", release)
    monkeypatch.setattr(doctor, "MODEL", tmp_path / "no-model")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setenv("COLUMNS", "400")
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1 and "trains on its CPU" in out and "OPENBLAS_CORETYPE is unset" in out
    monkeypatch.setenv("OPENBLAS_CORETYPE", "ARMV8")
    assert main(["doctor"]) == 0

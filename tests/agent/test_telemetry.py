"""Agent telemetry: the tegrastats parser on real line formats of several boards, thermal
zones with Jetson's fake sensors, the background GPU probe (fake tegrastats and jtop), and a
sample here, where no GPU tooling exists, that is cheap and JSON-safe."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetsplit.edge_agent.telemetry import GpuProbe, Telemetry, hottest_zone, parse_tegrastats

# Line formats as boards print them (shapes from public logs, values ours).
NANO_JP4 = ("RAM 1409/3964MB (lfb 28x4MB) SWAP 0/1982MB (cached 0MB) IRAM 0/252kB(lfb 252kB) "
            "CPU [22%@518,67%@518,off,off] EMC_FREQ 0%@1600 GR3D_FREQ 12%@76 APE 25 "
            "PLL@28.5C CPU@32C PMIC@100C GPU@30.5C AO@39.5C thermal@31.25C "
            "POM_5V_IN 2003/2003 POM_5V_GPU 40/38 POM_5V_CPU 320/320")
NANO_NO_CLOCKS = ("RAM 1766/3964MB (lfb 197x4MB) SWAP 0/2048MB (cached 0MB) "
                  "CPU [24%@1224,15%@1224,13%@1224,10%@1224] EMC_FREQ 3% GR3D_FREQ 0% "
                  "PLL@21C CPU@25C PMIC@100C GPU@23.5C AO@33.5C thermal@24.5C "
                  "POM_5V_IN 2545/2547 POM_5V_GPU 0/0 POM_5V_CPU 549/529")
XAVIER_NX = ("RAM 3347/7467MB (lfb 896x4MB) SWAP 0/3733MB (cached 0MB) CPU [21%@1190,19%@1190,"
             "18%@1190,21%@1190,20%@1190,20%@1190] EMC_FREQ 13%@1600 GR3D_FREQ 61% APE 150 "
             "MTS fg 0% bg 0% AO@48.5C GPU@49.2C PMIC@100C AUX@47.5C CPU@50C thermal@50.1C "
             "CV0@-256C VDD_IN 5336/4970 VDD_CPU_GPU_CV 2617/2336 VDD_SOC 1478/1318")
AGX_XAVIER_JP4 = ("RAM 10881/31919MB (lfb 4230x4MB) SWAP 0/15959MB (cached 0MB) "
                  "CPU [17%@1190,17%@1190,18%@1190,25%@1190,17%@1336,15%@1340,23%@1543,"
                  "15%@1574] EMC_FREQ 55%@2133 GR3D_FREQ 95%@1377 APE 150 MTS fg 0% bg 10% "
                  "AO@48C GPU@54.5C Tdiode@53.25C PMIC@100C AUX@46C CPU@49C thermal@49.45C "
                  "Tboard@47C GPU 18401/18525 CPU 2301/2330 SOC 4602/4602 CV 0/0 "
                  "VDDRQ 2914/2911 SYS5V 4632/4620")
AGX_XAVIER_JP5 = ("RAM 2400/31002MB (lfb 6912x4MB) SWAP 0/15501MB (cached 0MB) CPU [0%@1190,"
                  "1%@1190,0%@1190,0%@1189,0%@1190,0%@1191,0%@1190,0%@1190] EMC_FREQ 0%@1331 "
                  "GR3D_FREQ 0%@114 VIC_FREQ 115 APE 150 AUX@36C CPU@36.5C thermal@35.7C "
                  "Tboard@37C AO@35C GPU@35C Tdiode@38.75C PMIC@50C GPU 467mW/467mW "
                  "CPU 467mW/467mW SOC 1245mW/1245mW CV 0mW/0mW VDDRQ 311mW/311mW "
                  "SYS5V 2768mW/2768mW")
AGX_ORIN_JP6 = ("11-14-2024 12:34:56 RAM 3162/30536MB (lfb 6x4MB) SWAP 0/15268MB (cached 0MB) "
                "CPU [1%@729,0%@729,off,off,0%@729,0%@729,off,off,0%@729,0%@729,off,off] "
                "EMC_FREQ 0%@2133 GR3D_FREQ 50%@[611,0] VIC_FREQ 729 APE 174 cpu@47.968C "
                "soc0@46.906C soc1@45.5C soc2@44.2C tj@47.968C gpu@46.343C cv0@-256C "
                "VDD_GPU_SOC 3175mW/3175mW VDD_CPU_CV 793mW/793mW VIN_SYS_5V0 4032mW/4032mW "
                "VDDQ_VDD2_1V8AO 503mW/503mW")
ORIN_NANO_JP6 = ("RAM 4123/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) "
                 "CPU [34%@1510,28%@1510,30%@1510,27%@1510,off,off] EMC_FREQ 41%@2133 "
                 "GR3D_FREQ 99%@[1300] NVENC off NVDEC off NVJPG off NVJPG1 off VIC off "
                 "OFA off APE 200 cpu@52.1C soc2@50.5C soc0@51.3C gpu@53.3C tj@53.3C "
                 "soc1@51.1C VDD_IN 8912mW/8050mW VDD_CPU_GPU_CV 3201mW/2900mW "
                 "VDD_SOC 1497mW/1410mW")
TX1_OLD = ("RAM 3607/3983MB (lfb 47x4MB) SWAP 873/8192MB (cached 281MB) cpu [17%,11%,65%,0%]@1734 "
           "EMC 1%@1600 APE 25 GR3D 39%@76")


@pytest.mark.parametrize("line, expected", [
    (NANO_JP4, {"gpu_load_pct": 12.0, "gpu_freq_mhz": 76.0, "emc_load_pct": 0.0,
                "emc_freq_mhz": 1600.0, "power_mw": 2003.0, "power_rail": "POM_5V_IN",
                "rails_mw": {"POM_5V_IN": 2003.0, "POM_5V_GPU": 40.0, "POM_5V_CPU": 320.0}}),
    (NANO_NO_CLOCKS, {"gpu_load_pct": 0.0, "gpu_freq_mhz": None, "emc_load_pct": 3.0,
                      "emc_freq_mhz": None, "power_mw": 2545.0, "power_rail": "POM_5V_IN"}),
    (XAVIER_NX, {"gpu_load_pct": 61.0, "gpu_freq_mhz": None, "emc_load_pct": 13.0,
                 "emc_freq_mhz": 1600.0, "power_mw": 5336.0, "power_rail": "VDD_IN",
                 "rails_mw": {"VDD_IN": 5336.0, "VDD_CPU_GPU_CV": 2617.0, "VDD_SOC": 1478.0}}),
    (AGX_XAVIER_JP4, {"gpu_load_pct": 95.0, "gpu_freq_mhz": 1377.0, "emc_load_pct": 55.0,
                      "power_mw": 18401.0 + 2301 + 4602 + 0 + 2914 + 4632,
                      "power_rail": "sum of rails"}),
    (AGX_XAVIER_JP5, {"gpu_load_pct": 0.0, "gpu_freq_mhz": 114.0,
                      "power_mw": 467.0 + 467 + 1245 + 0 + 311 + 2768,
                      "power_rail": "sum of rails"}),
    (AGX_ORIN_JP6, {"gpu_load_pct": 50.0, "gpu_freq_mhz": 611.0, "emc_freq_mhz": 2133.0,
                    "power_mw": 3175.0 + 793 + 4032 + 503, "power_rail": "sum of rails",
                    "rails_mw": {"VDD_GPU_SOC": 3175.0, "VDD_CPU_CV": 793.0,
                                 "VIN_SYS_5V0": 4032.0, "VDDQ_VDD2_1V8AO": 503.0}}),
    (ORIN_NANO_JP6, {"gpu_load_pct": 99.0, "gpu_freq_mhz": 1300.0, "emc_load_pct": 41.0,
                     "power_mw": 8912.0, "power_rail": "VDD_IN"}),
    (TX1_OLD, {"gpu_load_pct": 39.0, "gpu_freq_mhz": 76.0, "emc_load_pct": 1.0,
               "emc_freq_mhz": 1600.0, "power_mw": None, "rails_mw": {}}),
], ids=["nano-jp4", "nano-no-clocks", "xavier-nx", "agx-xavier-jp4", "agx-xavier-jp5",
        "agx-orin-jp6", "orin-nano-jp6", "tx1-old"])
def test_tegrastats_formats(line: str, expected: dict) -> None:
    parsed = parse_tegrastats(line)
    for key, value in expected.items():
        assert parsed[key] == value, key
    # RAM/SWAP/IRAM "used/total" pairs and "APE 150"-style clocks are never power rails.
    assert not {"RAM", "SWAP", "IRAM", "APE", "MTS", "CPU_"} & set(parsed["rails_mw"])


def test_tegrastats_only_instantaneous_values() -> None:
    parsed = parse_tegrastats("RAM 2840/7620MB GR3D_FREQ 76% VDD_IN 5765mW "
                              "VDD_CPU_GPU_CV 1548mW VDD_SOC 1497mW APE 174")
    assert parsed["rails_mw"] == {"VDD_IN": 5765.0, "VDD_CPU_GPU_CV": 1548.0, "VDD_SOC": 1497.0}
    assert parsed["power_mw"] == 5765.0


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_tegrastats_parser_never_raises(text: str) -> None:
    parsed = parse_tegrastats(text)
    assert set(parsed) >= {"gpu_load_pct", "power_mw", "rails_mw"}


def _zone(root: Path, index: int, name: str, millideg: str) -> None:
    zone = root / f"thermal_zone{index}"
    zone.mkdir()
    (zone / "type").write_text(name + "\n")
    (zone / "temp").write_text(millideg + "\n")


def test_hottest_zone_skips_fake_sensors(tmp_path: Path) -> None:
    _zone(tmp_path, 0, "CPU-therm", "45500")
    _zone(tmp_path, 1, "PMIC-Die", "100000")  # a placeholder, not a measurement
    _zone(tmp_path, 2, "CV0-therm", "-256000")  # sensor powered off
    _zone(tmp_path, 3, "GPU-therm", "47000")
    _zone(tmp_path, 4, "broken", "n/a")
    assert hottest_zone(tmp_path) == (47.0, "GPU-therm")
    assert hottest_zone(tmp_path / "absent") == (None, None)


def test_sample_here_is_json_safe(tmp_path: Path) -> None:
    telemetry = Telemetry(GpuProbe(tegrastats=None, use_jtop=False), thermal_root=tmp_path)
    first = telemetry.sample()
    assert first["gpu"] is None and first["gpu_note"].startswith("absent:")
    assert first["temp_c"] is None and first["temp_zone"] is None
    assert 0 < first["rss_mb"] < first["mem_total_mb"]
    assert 0 < first["mem_available_mb"] <= first["mem_total_mb"]
    reading = telemetry.sample()  # a second call: CPU % from the primed counters
    assert all(isinstance(reading[k], float) for k in ("cpu_process_pct", "cpu_system_pct"))
    json.dumps(reading, allow_nan=False)


def test_module_sample_and_status_reply_carry_telemetry() -> None:
    from jetsplit.data import ArrayDataset
    from jetsplit.edge_agent.telemetry import sample
    from jetsplit.edge_agent.worker import AgentWorker
    from jetsplit.server.engines.seam import Command, InProcessEngine

    assert {"rss_mb", "mem_available_mb", "gpu", "gpu_note"} <= set(sample())
    data = ArrayDataset(np.zeros((4, 1, 8, 8), np.float32), np.arange(4, dtype=np.int64),
                        "tiny", 4)
    engine = InProcessEngine({"a0": AgentWorker("a0", data)})
    reply = engine.send_and_receive({"a0": Command("status")})["a0"]
    assert {"bundle", "commands", "pending_forwards"} <= set(reply.meta)  # kept
    assert reply.meta["telemetry"]["rss_mb"] > 0  # crossed the wire encoder (no NaN)


def _fake_tegrastats(tmp_path: Path, body: str) -> str:
    script = tmp_path / "tegrastats"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_probe_reads_tegrastats_in_the_background(tmp_path: Path) -> None:
    fake = _fake_tegrastats(tmp_path, f'echo "{ORIN_NANO_JP6}"\nexec sleep 30')
    probe = GpuProbe(tegrastats=fake, use_jtop=False, ttl_s=60, timeout_s=5)
    reading, note = probe.read()
    assert reading is None and note.startswith("pending")  # never waits on the probe
    probe.wait(10)
    reading, note = probe.read()
    assert note == "ok: tegrastats" and reading is not None
    assert reading["source"] == "tegrastats" and reading["gpu_load_pct"] == 99.0
    assert reading["power_mw"] == 8912.0 and reading["age_s"] >= 0


@pytest.mark.parametrize("body, reason", [
    ("exit 3", "tegrastats exited with code 3"),
    ("exec sleep 30", "printed nothing within 0.3s"),
])
def test_probe_failures_become_one_line_reasons(tmp_path: Path, body: str,
                                                reason: str) -> None:
    probe = GpuProbe(tegrastats=_fake_tegrastats(tmp_path, body), use_jtop=False, ttl_s=60,
                     timeout_s=0.3)
    probe.read()
    probe.wait(10)
    reading, note = probe.read()
    assert reading is None and note.startswith("error: tegrastats:") and reason in note


def _fake_jtop(monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> None:
    class JtopException(Exception):
        pass

    class Jtop:
        def __init__(self, interval: float = 1.0) -> None:
            self.stats = {"GPU": 37.5, "Power VDD_IN": 6100, "Power VDD_SOC": 1200,
                          "Power TOT": 6100}
            self.memory = {"EMC": {"val": 22}}

        def __enter__(self) -> Jtop:
            if fail:
                raise JtopException("The jtop.service is not active. Please run: sudo "
                                    "systemctl restart jtop.service")
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def ok(self) -> bool:
            return True

    module = types.ModuleType("jtop")
    module.jtop = Jtop  # type: ignore[attr-defined]
    module.JtopException = JtopException  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jtop", module)


def test_probe_prefers_jtop(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_jtop(monkeypatch, fail=False)
    probe = GpuProbe(tegrastats=None, use_jtop=True, ttl_s=60)
    probe.read()
    probe.wait(10)
    reading, note = probe.read()
    assert note == "ok: jtop" and reading is not None
    assert reading["gpu_load_pct"] == 37.5 and reading["emc_load_pct"] == 22.0
    assert reading["power_mw"] == 6100.0
    assert reading["rails_mw"] == {"VDD_IN": 6100.0, "VDD_SOC": 1200.0}


def test_probe_falls_back_from_a_dead_jtop_service(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    _fake_jtop(monkeypatch, fail=True)
    probe = GpuProbe(tegrastats=_fake_tegrastats(tmp_path, f'echo "{NANO_JP4}"'),
                     use_jtop=True, ttl_s=60, timeout_s=5)
    probe.read()
    probe.wait(10)
    reading, note = probe.read()
    assert note.startswith("ok: tegrastats (jtop: The jtop.service is not active")
    assert reading is not None and reading["power_mw"] == 2003.0
    no_fallback = GpuProbe(tegrastats=None, use_jtop=True, ttl_s=60)
    no_fallback.read()
    no_fallback.wait(10)
    reading, note = no_fallback.read()
    assert reading is None and note.startswith("error: jtop: The jtop.service is not active")


def test_probe_reads_the_power_mode_from_nvpmodel_where_present(tmp_path: Path) -> None:
    from jetsplit.edge_agent.telemetry import parse_nvpmodel

    assert parse_nvpmodel("NV Power Mode: MAXN\n0\n") == "MAXN"
    assert parse_nvpmodel("NVPM WARN: fan mode is not set!\nNV Power Mode: 15W\n2\n") == "15W"
    assert parse_nvpmodel("nvpmodel: command failed\n") is None
    tegra = _fake_tegrastats(tmp_path, f'echo "{ORIN_NANO_JP6}"')
    nvp = tmp_path / "nvpmodel"
    nvp.write_text('#!/bin/sh\n[ "$1" = "-q" ] && printf "NV Power Mode: 10W\\n1\\n"\n')
    nvp.chmod(0o755)
    probe = GpuProbe(tegrastats=tegra, use_jtop=False, nvpmodel=str(nvp), ttl_s=60,
                     timeout_s=5)
    probe.read()
    probe.wait(10)
    reading, _ = probe.read()
    assert reading is not None and reading["power_mode"] == "10W"
    absent = GpuProbe(tegrastats=tegra, use_jtop=False, nvpmodel="", ttl_s=60, timeout_s=5)
    absent.read()
    absent.wait(10)
    reading, _ = absent.read()
    assert reading is not None and reading["power_mode"] is None  # no nvpmodel: unknown

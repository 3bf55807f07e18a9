"""Profiles: every shipped file loads, every user mistake is one line naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jetsplit.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from jetsplit.profiles import (
    DeviceProfile,
    MeasuredLayer,
    MeasuredSection,
    bundled_profiles_dir,
    dump_profile,
    list_profiles,
    load_profile,
    profile_to_toml,
    resolve_profile,
)

# torch-free device side: `.ci/run` also runs this on Python 3.9
pytestmark = pytest.mark.device_pure

EXPECTED = {
    "jetson-nano-4gb",
    "xavier-nx-8gb",
    "agx-xavier-32gb",
    "orin-nano-8gb",
    "orin-nano-8gb-super",
    "orin-nx-16gb",
    "agx-orin-64gb",
    "x86-cpu",
}

NANO = bundled_profiles_dir() / "jetson-nano-4gb.toml"


def _bad(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of the Nano profile with one textual edit."""
    text = NANO.read_text()
    assert old in text, old
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, 1))
    return path


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"profile {path}: ")
    return msg


def test_every_bundled_profile_loads() -> None:
    paths = list_profiles(bundled_profiles_dir())
    assert {p.stem for p in paths} >= EXPECTED
    for path in paths:
        profile = load_profile(path)
        assert profile.name == path.stem
        assert profile.usable_memory_bytes < profile.total_memory_bytes or (
            profile.memory.usable_fraction == 1
        )
        assert 0 < profile.sustained_gflops() <= profile.peak_gflops()


def test_nano_numbers() -> None:
    nano = load_profile(NANO)
    assert nano.compute.peak_fp32_gflops == pytest.approx(128 * 2 * 0.9216, rel=1e-3)
    assert nano.sustained_gflops("fp16") == pytest.approx(2 * nano.sustained_gflops(), rel=1e-3)
    assert nano.usable_memory_bytes == int(4096 * 2**20 * 0.6)
    assert nano.uplink_bytes_per_s == 50e6 / 8
    cpu = resolve_profile("x86-cpu")
    assert cpu.sustained_gflops("fp16") == cpu.sustained_gflops("fp32")  # no fp16 path


@pytest.mark.parametrize(
    ("old", "new", "field", "reason"),
    [
        ("bandwidth_gbps = 25.6\n", "\n", "memory.bandwidth_gbps", "missing required field"),
        ("total_mb = 4096", 'total_mb = "lots"', "memory.total_mb", "valid number"),
        ("total_mb = 4096", "total_mb = -4096", "memory.total_mb", "greater than 0"),
        ("efficiency = 0.35", "efficiency = 1.5", "compute.efficiency", "less than or equal"),
        ("usable_fraction = 0.6", "usable_fraction = 0", "memory.usable_fraction", "greater"),
        ("uplink_mbps = 50", "uplink_mbps = 50\nuplnk_mbps = 5", "network.uplnk_mbps", "unknown"),
        ('kind = "jetson"', 'kind = "fpga"', "device.kind", "'jetson'"),
        ("jetson_clocks = true", 'jetson_clocks = "yes"', "software.jetson_clocks", "boolean"),
        ("[network]", "[netwrk]", "netwrk", "did you mean 'network'?"),
        ("gpu_clock_mhz = 921.6", "gpu_clock_mhz = 640", "compute.peak_fp32_gflops", "disagrees"),
    ],
)
def test_bad_profile_names_the_field(
    tmp_path: Path, old: str, new: str, field: str, reason: str
) -> None:
    msg = _error(_bad(tmp_path, old, new))
    assert f": {field}: " in msg
    assert reason in msg


def test_missing_section(tmp_path: Path) -> None:
    data = NANO.read_text().split("[network]")[0]
    path = tmp_path / "nonet.toml"
    path.write_text(data)
    assert ": network: missing required field" in _error(path)


def test_toml_syntax_error(tmp_path: Path) -> None:
    msg = _error(_bad(tmp_path, "total_mb = 4096", "total_mb 4096"))
    assert "toml: syntax error" in msg and "line" in msg


def test_missing_file(tmp_path: Path) -> None:
    msg = _error(tmp_path / "nope.toml")
    assert msg.endswith("file not found")


def test_bad_measured_layer_names_index(tmp_path: Path) -> None:
    text = NANO.read_text() + (
        '\n[measured]\nmodel = "m"\ninput_shape = [1, 28, 28]\nbatch = 8\n'
        'achieved_gflops = 10.0\n\n[[measured.layers]]\nname = "a"\nfwd_ms = 1.0\n'
        "bwd_ms = -2.0\npeak_mem_mb = 3.0\n"
    )
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert ": measured.layers[0].bwd_ms: " in _error(path)


def test_round_trip_with_measured(tmp_path: Path) -> None:
    nano = load_profile(NANO)
    measured = MeasuredSection(
        model="resnet18",
        input_shape=[3, 32, 32],
        batch=32,
        achieved_gflops=61.5,
        measured_at="2026-01-01T00:00:00Z",
        layers=[
            MeasuredLayer(name="conv1", fwd_ms=1.25, bwd_ms=2.5, peak_mem_mb=12.0, ort_fwd_ms=0.8),
            MeasuredLayer(name='odd "name"\\x', fwd_ms=0.0, bwd_ms=1e-5, peak_mem_mb=0.5),
        ],
    )
    profile = nano.model_copy(update={"measured": measured})
    out = dump_profile(profile, tmp_path / "sub" / "nano-measured.toml")
    again = load_profile(out)
    assert again == profile
    assert again.effective_gflops() == 61.5
    assert again.measured is not None
    assert again.measured.per_sample_ms(again.measured.layers[0]) == (1.25 / 32, 2.5 / 32)
    tomllib.loads(profile_to_toml(profile))  # valid TOML on its own


def test_round_trip_every_bundled(tmp_path: Path) -> None:
    for path in list_profiles(bundled_profiles_dir()):
        profile = load_profile(path)
        assert load_profile(dump_profile(profile, tmp_path / path.name)) == profile


def test_resolve_by_name_and_path(tmp_path: Path) -> None:
    assert resolve_profile("orin-nx-16gb").device.module == "Jetson Orin NX 16GB"
    assert resolve_profile("orin-nx-16gb.toml").name == "orin-nx-16gb"
    assert isinstance(resolve_profile(NANO), DeviceProfile)
    copy = tmp_path / "mine.toml"
    copy.write_text(NANO.read_text())
    assert resolve_profile(str(copy)).name == "jetson-nano-4gb"


def test_resolve_unknown_name_lists_known() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_profile("jetson-tx9")
    msg = str(info.value)
    assert "\n" not in msg and "jetson-tx9" in msg and "jetson-nano-4gb" in msg


def test_env_dir_is_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = NANO.read_text().replace('name = "jetson-nano-4gb"', 'name = "site-nano"')
    (tmp_path / "site-nano.toml").write_text(text)
    monkeypatch.setenv("JETSPLIT_PROFILES_DIR", str(tmp_path))
    assert resolve_profile("site-nano").name == "site-nano"


def test_list_profiles_missing_dir(tmp_path: Path) -> None:
    assert list_profiles(tmp_path / "absent") == []

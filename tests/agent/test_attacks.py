"""The attack harness (edge_agent/attacks.py) on plain arrays: each kind's transformation by
hand, strict one-line spec errors, and the refusal without JETSPLIT_ALLOW_ATTACKS.
Torch-free: these also run under Python 3.8 and 3.9 in `.ci/run` (marker `device_pure`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jetsplit.cli import main
from jetsplit.data import ArrayDataset
from jetsplit.edge_agent.attacks import (
    ALLOW_ENV,
    Attack,
    AttackSpec,
    build_attack,
    parse_attack,
    scaled_histogram,
)
from jetsplit.edge_agent.config import load_agent_config
from jetsplit.errors import ConfigError
from jetsplit.protocol import MAX_SAMPLES, parse_registration

pytestmark = pytest.mark.device_pure


@pytest.fixture()
def allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")


@pytest.fixture()
def forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)


def attack(spec: str, seed: int = 0) -> Attack:
    return Attack(parse_attack(spec), seed)


def weights() -> dict[str, np.ndarray]:
    """A get_weights reply's arrays: float weights and BatchNorm's integer counter."""
    return {"client/0.weight": np.array([[1.0, -2.0], [0.5, 4.0]], np.float32),
            "client/1.bias": np.array([3.0, -1.0], np.float32),
            "client/1.num_batches_tracked": np.array(7, np.int64)}


@pytest.mark.parametrize(("spec", "want"), [
    ("scale:1000", AttackSpec("scale", 1000.0)),
    ("scale:-0.5", AttackSpec("scale", -0.5)),
    ("signflip", AttackSpec("signflip")),
    ("noise:0.25", AttackSpec("noise", 0.25)),
    ("labelflip", AttackSpec("labelflip")),
    ("activation-scale:1e3", AttackSpec("activation-scale", 1000.0)),
    ("size-lie:5000", AttackSpec("size-lie", 5000.0)),
    (f"size-lie:{MAX_SAMPLES}", AttackSpec("size-lie", float(MAX_SAMPLES))),
    ("histogram-lie", AttackSpec("histogram-lie")),
])
def test_specs_parse(spec: str, want: AttackSpec) -> None:
    assert parse_attack(spec) == want


@pytest.mark.parametrize(("spec", "needle"), [
    ("scale:abc", "finite number"), ("scale", "finite number"), ("scale:", "finite number"),
    ("scale:1e400", "finite number"), ("scale:nan", "finite number"),
    ("scale:inf", "finite number"), ("scale:1e7", "|F| <= 1e+06"), ("scale: 2", "finite"),
    ("activation-scale:x", "finite number"), ("noise:-1", "SIGMA"), ("noise:0", "SIGMA"),
    ("noise:nan", "SIGMA"), ("size-lie:0", "1..2147483647"), ("size-lie:-3", "integer"),
    ("size-lie:1.5", "integer"), ("size-lie:" + "9" * 40, "1..2147483647"),
    (f"size-lie:{MAX_SAMPLES + 1}", "1..2147483647"), ("size-lie:" + "1" * 400, "characters"),
    ("signflip:2", "takes no number"), ("histogram-lie:1", "takes no number"),
    ("flood:3", "unknown attack"), ("", "characters"),
])
def test_bad_specs_are_one_line(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_attack(spec)
    text = str(err.value)
    assert needle in text and "\n" not in text and len(text) < 300


def test_weights_scaled_and_integer_buffers_untouched() -> None:
    out = attack("scale:1000").upload(weights())
    assert np.array_equal(out["client/0.weight"], [[1000.0, -2000.0], [500.0, 4000.0]])
    assert np.array_equal(out["client/1.bias"], [3000.0, -1000.0])
    assert out["client/0.weight"].dtype == np.float32
    assert out["client/1.num_batches_tracked"] == 7


def test_signflip_reverses_the_update_around_what_it_received() -> None:
    a = attack("signflip")
    g = {"client/0.weight": np.array([[0.0, -1.0], [1.0, 2.0]], np.float32),
         "client/1.bias": np.array([1.0, 1.0], np.float32),
         "client/1.num_batches_tracked": np.array(2, np.int64)}
    a.received(g)
    g["client/0.weight"][0, 0] = 99.0  # the sender's arrays may change later: a copy is kept
    out = a.upload(weights())
    # 2g - w, by hand
    assert np.array_equal(out["client/0.weight"], [[-1.0, 0.0], [1.5, 0.0]])
    assert np.array_equal(out["client/1.bias"], [-1.0, 3.0])
    assert out["client/1.num_batches_tracked"] == 7


def test_noise_is_seeded_gaussian_on_float_weights_only() -> None:
    w = weights()
    first, again = attack("noise:0.5", seed=4).upload(w), attack("noise:0.5", seed=4).upload(w)
    rng = np.random.default_rng(4)  # drawn in upload order
    for name in ("client/0.weight", "client/1.bias"):
        want = (w[name] + rng.normal(0.0, 0.5, w[name].shape)).astype(np.float32)
        assert np.array_equal(first[name], want) and np.array_equal(again[name], want)
    assert first["client/1.num_batches_tracked"] == 7
    other = attack("noise:0.5", seed=5).upload(w)
    assert not np.array_equal(other["client/1.bias"], first["client/1.bias"])


def test_activations_scaled() -> None:
    acts = np.array([[0.5, -1.0]], np.float32)
    out = attack("activation-scale:-3").activations(acts)
    assert np.array_equal(out, [[-1.5, 3.0]]) and out.dtype == np.float32
    assert attack("scale:3").activations(acts) is acts  # other kinds leave activations alone


def test_labelflip_shifts_every_label_by_one_class() -> None:
    data = ArrayDataset(np.zeros((4, 1, 2, 2), np.float32), np.array([0, 1, 2, 2]), "t", 3)
    flipped = attack("labelflip").poison(data)
    assert flipped.y.tolist() == [1, 2, 0, 0] and data.y.tolist() == [0, 1, 2, 2]
    assert attack("scale:2").poison(data) is data


def registration(summary: dict) -> dict:
    return {"agent": "a1", "role": "client", "version": "0", "zoo_version": 1,
            "dataset": summary}


def test_size_lie_registers_n_samples_and_still_adds_up() -> None:
    summary = {"name": "digits", "size": 10, "num_classes": 3, "input_shape": [1, 8, 8],
               "label_histogram": [3, 0, 7]}
    claim = attack("size-lie:5").claim(summary)
    assert claim["label_histogram"] == [2, 0, 3]  # 1.5 → 2 (larger remainder), 3.5 → 3
    got = parse_registration(registration(claim)).dataset
    assert (got.size, got.label_histogram) == (5, [2, 0, 3])
    big = parse_registration(registration(
        attack(f"size-lie:{MAX_SAMPLES}").claim(summary))).dataset
    assert big.size == MAX_SAMPLES and sum(big.label_histogram) == MAX_SAMPLES
    assert summary["size"] == 10  # the honest summary is not touched


def test_histogram_lie_claims_one_class() -> None:
    summary = {"name": "digits", "size": 10, "num_classes": 3, "input_shape": [1, 8, 8],
               "label_histogram": [3, 0, 7]}
    got = parse_registration(registration(attack("histogram-lie").claim(summary))).dataset
    assert (got.size, got.label_histogram) == (10, [10, 0, 0])


def test_scaled_histogram_by_hand() -> None:
    assert scaled_histogram([1, 1, 1], 10) == [4, 3, 3]
    assert scaled_histogram([0, 0], 3) == [2, 1]
    assert scaled_histogram([5, 5], 1) == [1, 0]


def test_honest_attack_changes_nothing() -> None:
    honest, w = Attack(), weights()
    out = honest.upload(w)
    assert honest.kind is None and all(out[k] is w[k] for k in w)
    honest.received(w)
    assert honest.claim({"size": 1}) == {"size": 1}


def test_build_attack_refused_without_the_variable(forbidden: None) -> None:
    assert build_attack(None, 0, "x").kind is None  # honest agents need nothing
    with pytest.raises(ConfigError, match=f"--attack a3: .*tests and benchmarks only .*"
                                          f"{ALLOW_ENV}=1"):
        build_attack("scale:1000", 0, "--attack a3")


def test_build_attack_allowed(allowed: None) -> None:
    assert build_attack("scale:1000", 0, "x").kind == "scale"
    with pytest.raises(ConfigError, match="^--attack a3: attack 'scale:abc'"):
        build_attack("scale:abc", 0, "--attack a3")


def write_config(tmp_path: Path, attack_section: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(f'agent = "a3"\n[data]\ndataset = "digits"\n[attack]\n{attack_section}')
    return path


def test_agent_config_with_attack_refused_without_the_variable(
        tmp_path: Path, forbidden: None) -> None:
    with pytest.raises(ConfigError) as err:
        load_agent_config(write_config(tmp_path, 'kind = "scale:1000"\n'))
    assert "attack: attacks are for tests and benchmarks only" in str(err.value)
    assert "\n" not in str(err.value)


def test_agent_run_with_attack_refused_without_the_variable(
        tmp_path: Path, forbidden: None, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["agent", "run", "--config", str(write_config(tmp_path,
                                                               'kind = "scale:1000"\n'))])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: agent config ") and err.count("\n") == 1
    assert f"{ALLOW_ENV}=1" in err


def test_agent_config_with_attack_loads_when_allowed(tmp_path: Path, allowed: None) -> None:
    cfg = load_agent_config(write_config(tmp_path, 'kind = "signflip"\n'))
    assert cfg.attack is not None and cfg.attack.kind == "signflip"


@pytest.mark.parametrize(("section", "needle"), [
    ('kind = "scale:abc"\n', "attack.kind: attack 'scale:abc'"),
    ('kind = "size-lie:0"\n', "size-lie needs an integer"),
    ('kind = 3\n', "attack.kind"),
    ('kind = "signflip"\nextra = 1\n', "attack.extra"),
])
def test_bad_attack_section_is_one_line(tmp_path: Path, allowed: None, section: str,
                                        needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_agent_config(write_config(tmp_path, section))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_production_paths_never_allow_attacks() -> None:
    """The systemd unit, its environment file, the install script and `jetsplit agent
    install` (which writes them) never set the variable."""
    root = Path(__file__).resolve().parents[2]
    paths = [*sorted((root / "systemd").iterdir()), root / "scripts" / "install-agent.sh",
             root / "scripts" / "container-install.sh", root / "edge_agent" / "install.py",
             root / "Dockerfile.jetson"]
    assert [p.name for p in paths if ALLOW_ENV in p.read_text()] == []

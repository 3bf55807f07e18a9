"""`jetsplit agent install` / scripts/install-agent.sh: every step listed on --dry-run and
nothing changed; into a fake root it writes config files the agent loads; re-runs are
idempotent; user mistakes end in one line. Nothing here touches the real system."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jetsplit.cli import main as cli
from jetsplit.edge_agent import install as inst
from jetsplit.edge_agent import install_actions as actions
from jetsplit.edge_agent.config import load_agent_config

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--agent", "orin-07", "--broker", "mqtts://orin-07:s3cret@broker.lab:8883",
         "--fleet", "lab"]


def _host(**changes: object) -> inst.Host:
    base = dict(l4t=None, l4t_text=None, model=None, python=sys.executable,
                python_version=(3, 10), torch=None, euid=0, groups={"video"},
                user_exists=False)
    return inst.Host(**{**base, **changes})  # type: ignore[arg-type]


def _opts(**changes: object) -> inst.Options:
    base = dict(agent="orin-07", broker="mqtt://10.0.0.2:1883", fleet="lab", source=ROOT)
    return inst.Options(**{**base, **changes})  # type: ignore[arg-type]


def test_dry_run_lists_every_step_and_changes_nothing(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    watched = [Path(p) for p in (inst.CONFIG, inst.ENV_FILE, inst.UNIT, inst.VENV)]
    before = [p.exists() for p in watched]
    assert cli(["agent", "install", *FLAGS, "--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("[")]
    expected = ["venv /opt/jetsplit/venv", "upgrade pip inside the venv", "pip install",
                "onnxruntime",
                "profiles to /opt/jetsplit/profiles",
                "user jetsplit", "/var/lib/jetsplit", "create /etc/jetsplit ",
                "/etc/jetsplit/agent.toml (agent orin-07, fleet lab", "/etc/jetsplit/agent.env",
                "check /etc/jetsplit/agent.toml", "jetsplit-agent.service into "
                "/etc/systemd/system", "systemctl daemon-reload", "systemctl enable"]
    assert len(steps) == len(expected), out
    for step, text in zip(steps, expected, strict=True):
        assert " would " in step and text in step, (step, text)
    assert "s3cret" not in out and "orin-07:***@broker.lab" in out
    assert out.rstrip().endswith("dry run: nothing was changed")
    assert [p.exists() for p in watched] == before


def test_dry_run_on_a_jetson_holds_nvidias_torch(capsys: pytest.CaptureFixture[str]) -> None:
    host = _host(l4t=(36, 4), model="NVIDIA Jetson Orin Nano Developer Kit",
                 torch="2.4.0a0+3bcc3cddb5.nv24.07", groups={"video", "jtop"})
    assert inst.install(_opts(dry_run=True, jetson_extra=True), host) == 0
    out = capsys.readouterr().out
    assert "L4T R36.4 (JetPack 6)" in out and "profile orin-nano-8gb (guessed" in out
    assert "--system-site-packages" in out and "reuses NVIDIA's torch 2.4.0a0" in out
    assert "[agent,jetson] into the venv, held to torch==2.4.0a0+3bcc3cddb5.nv24.07\n" in out
    assert "pip install onnxruntime (CPU) into the venv unless an onnxruntime or " \
           "onnxruntime-gpu is importable there" in out
    assert "groups video,jtop" in out


@pytest.mark.parametrize("host, opts, message", [
    (_host(l4t=(36, 4)), _opts(), "compute/redist/jp/v61/pytorch/"),
    (_host(l4t=(36, 3)), _opts(), "compute/redist/jp/v60/pytorch/"),
    (_host(python_version=(3, 7)), _opts(), "the agent needs Python >= 3.8"),
    (_host(l4t=(32, 7), python_version=(3, 6)), _opts(),
     "(L4T R32: Ubuntu 18.04, Python 3.6) needs Ubuntu's python3.8 for the agent: re-run "
     "scripts/install-agent.sh, which installs it with apt"),
    (_host(l4t=(32, 7), python_version=(3, 8), torch="1.10.0"), _opts(),
     "torch 1.10.0 is older than the agent needs (1.13); install torch >= 1.13 first"),
    (_host(l4t=(32, 7), python_version=(3, 8)), _opts(profile="jetson-tx9"),
     "--profile jetson-tx9: no such bundled profile"),
    (_host(l4t=(35, 4), python_version=(3, 8)), _opts(), "L4T R35.4 (JetPack 5)): install "
     "NVIDIA's wheel from https://developer.download.nvidia.com/compute/redist/jp/v512/"),
    (_host(l4t=(35, 6), python_version=(3, 8)), _opts(), "compute/redist/jp/v512/pytorch/"),
    (_host(l4t=(35, 4), python_version=(3, 10)), _opts(), "wheels for JetPack 5 are built for "
     "Python 3.8, this is 3.10; re-run with PYTHON=/usr/bin/python3.8"),
    (_host(l4t=(35, 1), python_version=(3, 8), torch="1.12.0a0+2c916ef.nv22.3"), _opts(),
     "torch 1.12.0a0+2c916ef.nv22.3 is older than the agent needs (1.13); install NVIDIA's "
     "newer wheel from https://developer.download.nvidia.com/compute/redist/jp/v502/"),
    (_host(euid=1000), _opts(), "needs root: run it with sudo"),
    (_host(), _opts(profile="jetson-tx9"), "--profile jetson-tx9: no such bundled profile"),
    (_host(), _opts(source=ROOT / "tests"), "not a jetsplit checkout"),
])
def test_preconditions_fail_in_one_line(host: inst.Host, opts: inst.Options, message: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # These run against the real root: make sure no step could ever run.
    monkeypatch.setattr(inst, "plan", lambda *_: pytest.fail("preflight let it through"))
    with pytest.raises(inst.InstallError) as info:
        inst.install(opts, host)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_fake_root_install_writes_loadable_config_and_is_idempotent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["agent", "install", "--agent", "nano-03", "--broker", "mqtt://10.1.2.3:1884",
             "--fleet", "field-a", "--profile", "jetson-nano-4gb", "--root", str(tmp_path),
             "--no-enable", "--no-user", "--no-venv"]
    assert cli(flags) == 0
    first = capsys.readouterr().out
    config = tmp_path / inst.CONFIG.lstrip("/")
    env = tmp_path / inst.ENV_FILE.lstrip("/")
    cfg = load_agent_config(config)
    assert (cfg.agent, cfg.fleet, cfg.profile) == ("nano-03", "field-a", "jetson-nano-4gb")
    assert cfg.mqtt.address().url() == "mqtt://10.1.2.3:1884"
    assert cfg.state_dir == inst.STATE_DIR
    assert cfg.mqtt.tls_ca is None and cfg.mqtt.fleet_key_file is None  # files absent
    assert "commented out until their files exist: tls_ca, fleet_key_file" in first
    for path in (config, env):
        assert path.stat().st_mode & 0o777 == 0o640
    env_text = env.read_text()
    assert f"{inst.PROFILES_ENV}={inst.PROFILES_DIR}" in env_text and "OMP_NUM_THREADS" in env_text
    unit = tmp_path / inst.UNIT.lstrip("/")
    assert unit.read_text() == (ROOT / "systemd" / inst.UNIT_NAME).read_text()
    # the bare profile name resolves on the device through the copied profiles
    from jetsplit.profiles import resolve_profile

    monkeypatch.setenv(inst.PROFILES_ENV, str(tmp_path / inst.PROFILES_DIR.lstrip("/")))
    assert resolve_profile(cfg.profile).name

    # re-run: nothing changes; a local edit of agent.env survives later runs
    env.write_text(env_text + "JETSPLIT_FLEET_KEY=0123456789abcdef0123\n")
    assert cli(flags) == 0
    second = capsys.readouterr().out
    assert "unchanged" in second and "written" not in second
    assert not config.with_name("agent.toml.bak").exists()
    assert cli([*flags[:5], "mqtt://10.9.9.9", *flags[6:]]) == 0
    assert load_agent_config(config).mqtt.address().url() == "mqtt://10.9.9.9:1883"
    assert "10.1.2.3" in config.with_name("agent.toml.bak").read_text()
    assert "JETSPLIT_FLEET_KEY=0123456789abcdef0123" in env.read_text()


def test_existing_ca_keeps_tls_ca(tmp_path: Path) -> None:
    (tmp_path / "etc/jetsplit").mkdir(parents=True)
    (tmp_path / "etc/jetsplit/ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    text, commented = inst.render_agent_toml((ROOT / "systemd/agent.toml").read_text(),
                                             _opts(), None, tmp_path)
    assert 'tls_ca = "/etc/jetsplit/ca.crt"' in text and commented == ["fleet_key_file"]
    assert "# profile = ..." in text  # no profile chosen: the key is left out


def test_bad_agent_id_is_one_line_and_changes_nothing(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    code = cli(["agent", "install", "--agent", "bad id!", "--broker", "mqtt://h",
                "--root", str(tmp_path), "--no-venv", "--no-user", "--no-enable"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "agent:" in err and "'bad id!'" in err
    assert list(tmp_path.iterdir()) == []
    assert cli(["agent", "install", "--broker", "mqtt://h"]) == 2
    assert capsys.readouterr().err == ("error: the following arguments are required: "
                                       "--agent (see --help)\n")


def test_shell_script_parses_and_runs_the_python_installer(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "install-agent.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    done = subprocess.run(["bash", str(script), "--agent", "a1", "--broker", "mqtt://h",
                           "--root", str(tmp_path), "--dry-run", "--no-user"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "would write" in done.stdout and list(tmp_path.iterdir()) == []


def test_unit_matches_installer_paths_and_field_notes_hardening() -> None:
    unit = (ROOT / "systemd" / inst.UNIT_NAME).read_text()
    lines = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in unit.splitlines()
             if "=" in line and not line.startswith("#")}
    assert lines["ExecStart"] == f"{inst.VENV}/bin/jetsplit agent run --config {inst.CONFIG}"
    assert lines["EnvironmentFile"].lstrip("-") == inst.ENV_FILE
    assert inst.STATE_DIR in lines["ReadWritePaths"].split()
    assert lines["StateDirectory"] == Path(inst.STATE_DIR).name
    assert lines["User"] == inst.USER and "video" in lines["SupplementaryGroups"].split()
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                       ("Restart", "on-failure"), ("Type", "notify")):
        assert lines[key] == value, key
    assert "PrivateDevices" not in lines  # would hide the GPU's device nodes
    template = (ROOT / "systemd" / "agent.toml").read_text()
    assert f'state_dir = "{inst.STATE_DIR}"' in template


def test_dry_run_on_jetpack_5_keeps_onnxruntime_gpu_and_numpy_1(
        capsys: pytest.CaptureFixture[str]) -> None:
    host = _host(l4t=(35, 4), model="NVIDIA Jetson Xavier NX Developer Kit",
                 python_version=(3, 8), torch="2.0.0+nv23.05", numpy="1.17.4",
                 onnxruntime="onnxruntime-gpu 1.16.0")
    assert inst.install(_opts(dry_run=True), host) == 0
    out = capsys.readouterr().out
    assert "L4T R35.4 (JetPack 5)" in out and "profile xavier-nx-8gb (guessed" in out
    assert "[agent] into the venv, held to torch==2.0.0+nv23.05, numpy<2\n" in out
    assert "would keep onnxruntime-gpu 1.16.0 (PyPI's CPU onnxruntime is never installed" in out
    assert "pip install onnxruntime" not in out


@pytest.mark.parametrize("torch, numpy, pin", [
    ("2.0.0+nv23.05", None, "numpy<2"),  # built against numpy 1.x
    ("2.1.0", "2.0.2", "numpy<2"),
    ("2.5.0a0+872d972e41.nv24.08", "1.26.4", "numpy<2"),  # keep the system's 1.x
    ("2.5.0", "2.1.3", None),
    (None, None, None),
    ("1.13.0", "1.24.4", "numpy<2"),
])
def test_numpy_is_held_to_what_torch_was_built_against(torch: str | None, numpy: str | None,
                                                       pin: str | None) -> None:
    from jetsplit.edge_agent import jetpack

    assert jetpack.numpy_constraint(torch, numpy) == pin
    pins = inst.constraints(_host(torch=torch, numpy=numpy))
    assert pins == [p for p in (f"torch=={torch}" if torch else None, pin) if p]


@pytest.mark.parametrize("release, model, l4t, profile, python", [
    ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
     "DATE: Tue Aug  1 19:57:35 UTC 2023\n", "NVIDIA Jetson Xavier NX Developer Kit\x00",
     (35, 4), "xavier-nx-8gb", (3, 8)),
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
     "DATE: Wed Jan  8 01:49:37 UTC 2025\n", "NVIDIA Jetson AGX Orin Developer Kit\x00",
     (36, 4), "agx-orin-64gb", (3, 10)),
    ("# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t210ref, EABI: aarch64, "
     "DATE: Sat Feb 19 17:05:08 UTC 2022\n", "NVIDIA Jetson Nano Developer Kit\x00",
     (32, 7), "jetson-nano-4gb", (3, 6)),
])
def test_release_files_in_a_fake_root_pick_the_jetpack(
        tmp_path: Path, release: str, model: str, l4t: tuple[int, int], profile: str,
        python: tuple[int, int]) -> None:
    from jetsplit.edge_agent import jetpack

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text(release)
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_text(model)
    host = inst.detect_host(tmp_path)
    assert host.l4t == l4t and inst.guess_profile(host.model) == profile
    found = jetpack.release(host.l4t)
    assert found is not None and found.python == python
    assert (jetpack.torch_wheels(l4t) is None) == (l4t[0] == 32)


def test_onnxruntime_already_importable_is_kept() -> None:
    """The real check, with this venv's interpreter (it has onnxruntime): no pip runs."""
    import onnxruntime

    assert actions.ensure_onnxruntime(Path(sys.executable), ["torch==9.9"]) == \
        f"kept onnxruntime {onnxruntime.__version__}"


def test_onnxruntime_is_installed_only_where_none_imports(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An interpreter without onnxruntime gets PyPI's, under the same constraints (the pip
    command is captured here instead of run)."""
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages
    bare.chmod(0o755)
    ran: list[tuple[list[str], str]] = []

    def fake_run(command: list[str]) -> None:
        constraint = command[command.index("--constraint") + 1]
        ran.append((command, Path(constraint).read_text()))

    monkeypatch.setattr(actions, "run", fake_run)
    assert actions.ensure_onnxruntime(bare, ["torch==2.0.0+nv23.05", "numpy<2"]) == "installed"
    [(command, constraints)] = ran
    assert command[1:6] == ["-m", "pip", "install", "--upgrade", "onnxruntime"]
    assert constraints == "torch==2.0.0+nv23.05\nnumpy<2\n"


def test_agent_extra_never_pulls_cpu_onnxruntime_and_floors_fit_jetpack_5() -> None:
    from jetsplit.config_io import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    agent = project["optional-dependencies"]["agent"]
    assert not [r for r in agent if r.split(">")[0].split("=")[0].split(";")[0].strip()
                in ("onnxruntime", "onnxruntime-gpu")]
    assert project["requires-python"] == ">=3.8"
    assert "torch>=1.13,<3" in project["dependencies"]


def test_shell_script_says_what_a_nano_needs_and_refuses_old_pythons(tmp_path: Path) -> None:
    from jetsplit.edge_agent import jetpack

    script = ROOT / "scripts" / "install-agent.sh"
    assert f'echo "error: {jetpack.NANO_LINE}"' in script.read_text()
    old = tmp_path / "python3.6"
    old.write_text("#!/bin/sh\nexit 1\n")  # fails the version check, like a 3.6 would
    old.chmod(0o755)
    done = subprocess.run(["bash", str(script), "--agent", "a1", "--broker", "mqtt://h"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(old)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: ") and "Python >= 3.8" in done.stderr


def test_shell_script_runs_from_a_checkout_with_nothing_installed(tmp_path: Path) -> None:
    """A fresh device: an interpreter that has no jetsplit (no site-packages at all)."""
    bare = tmp_path / "python3"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "install-agent.sh"), "--agent", "a1",
                           "--broker", "mqtt://h", "--root", str(tmp_path / "root"),
                           "--dry-run", "--no-user", "--no-venv"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": str(bare)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "would write" in done.stdout and not (tmp_path / "root").exists()


def test_constraints_command_runs_from_a_bare_checkout(tmp_path: Path) -> None:
    """Dockerfile.jetson runs `python3 edge_agent/jetpack.py constraints` before anything is
    installed: it must print the installer's own pins for that interpreter."""
    from jetsplit.edge_agent import jetpack

    script = str(ROOT / "edge_agent" / "jetpack.py")
    done = subprocess.run([sys.executable, script, "constraints"], capture_output=True,
                          text=True, timeout=60, check=True)
    expected = jetpack.pins(jetpack.installed("torch"), jetpack.installed("numpy"))
    assert expected and done.stdout.splitlines() == expected
    bare = subprocess.run([sys.executable, "-I", "-S", script, "constraints"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert bare.stdout == ""  # no torch, no numpy: pip may choose
    assert subprocess.run([sys.executable, script], capture_output=True,
                          timeout=60).returncode == 2


def test_dockerfile_jetson_builds_on_l4t_pytorch_from_what_exists() -> None:
    text = (ROOT / "Dockerfile.jetson").read_text()
    base = next(line.split("=", 1)[1] for line in text.splitlines()
                if line.startswith("ARG BASE="))
    assert base.startswith("nvcr.io/nvidia/l4t-pytorch:r35") and "FROM ${BASE}" in text
    sources = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")]
    assert sources and all((ROOT / s).exists() for s in sources), sources
    assert "RUN PIP_NO_CACHE_DIR=1 bash scripts/container-install.sh" in text
    script = (ROOT / "scripts/container-install.sh").read_text()  # also run by device-check
    assert script.index("pip install --upgrade pip") < script.index('".[agent]"')
    assert 'python3 edge_agent/jetpack.py constraints > "$constraints"' in script
    assert script.count('--constraint "$constraints"') == 3  # agent, model packages, onnxruntime
    assert 'python3 -c "import onnxruntime"' in script  # CPU onnxruntime only as a fallback
    # the import check runs from a neutral folder: the source folder would shadow the install
    assert script.index("\ncd /\n") < script.index("import torch, jetsplit.edge_agent")


# ------------------------------------------------------------------ JetPack 4: the CPU route
NANO = "NVIDIA Jetson Nano Developer Kit"


def test_dry_run_on_jetpack_4_takes_the_cpu_route(capsys: pytest.CaptureFixture[str]) -> None:
    """A stock Nano: Ubuntu's python3.8 (its -venv and -dev still missing), no torch for it."""
    from jetsplit.edge_agent import jetpack

    host = _host(l4t=(32, 7), model=NANO, python="/usr/bin/python3.8", python_version=(3, 8),
                 numpy=None, apt_missing=["python3.8-venv", "python3.8-dev"])
    assert inst.install(_opts(dry_run=True), host) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "L4T R32.7 (JetPack 4)" in lines[0]
    assert "profile jetson-nano-4gb-cpu (guessed from the model)" in lines[0]
    assert lines[1] == jetpack.cpu_line(NANO)
    assert lines[1].startswith("this Jetson Nano trains on its CPU: NVIDIA ships no CUDA torch "
                               "for Python >= 3.8 on JetPack 4")
    steps = [line for line in lines if line.startswith("[")]
    assert "would apt-get install python3.8-venv python3.8-dev (" in steps[0]
    assert "create the venv /opt/jetsplit/venv from /usr/bin/python3.8 without system " \
           "site-packages" in steps[1] and "--system-site-packages" not in out
    assert "OPENBLAS_CORETYPE=ARMV8 for every run of the venv's Python" in steps[2]
    assert "upgrade pip" in steps[3]
    assert "[agent] into the venv, held to torch==1.13.1, numpy<2 (PyPI's CPU-only" in steps[4]
    env = next(step for step in steps if "/etc/jetsplit/agent.env" in step)
    assert "OPENBLAS_CORETYPE=ARMV8" in env


def test_jetpack_4_with_a_torch_for_its_python_keeps_that_torch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A CUDA torch the user built for python3.8 is never replaced: no CPU route."""
    host = _host(l4t=(32, 7), model=NANO, python_version=(3, 8), torch="1.13.0a0+git7c98e70",
                 numpy="1.24.4")
    assert not host.cpu_route
    assert inst.install(_opts(dry_run=True), host) == 0
    out = capsys.readouterr().out
    assert "trains on its CPU" not in out and "profile jetson-nano-4gb (guessed" in out
    assert "--system-site-packages" in out and "reuses NVIDIA's torch 1.13.0a0" in out
    assert "held to torch==1.13.0a0+git7c98e70, numpy<2\n" in out
    assert "OPENBLAS_CORETYPE=ARMV8" in out  # the Cortex-A57 needs it whichever torch runs


def test_cpu_route_guesses_only_cpu_profiles() -> None:
    """No bundled CPU profile for a JetPack 4 Xavier NX: none rather than its GPU one."""
    assert inst.guess_profile(NANO, cpu=True, source=ROOT) == "jetson-nano-4gb-cpu"
    xavier = "NVIDIA Jetson Xavier NX Developer Kit"
    assert inst.guess_profile(xavier, cpu=True, source=ROOT) is None
    assert inst.guess_profile(NANO) == "jetson-nano-4gb"


def test_apt_runs_only_with_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(actions, "run", lambda command: ran.append(command))
    packages = ["python3.8-venv", "python3.8-dev"]

    class Stdin:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(sys, "stdin", Stdin(False))
    with pytest.raises(inst.InstallError, match="needs your consent: re-run with --yes"):
        actions.apt_install(packages, yes=False)
    monkeypatch.setattr(sys, "stdin", Stdin(True))
    answers = iter(["", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    with pytest.raises(inst.InstallError, match="not installing python3.8-venv python3.8-dev"):
        actions.apt_install(packages, yes=False)
    assert ran == []
    assert actions.apt_install(packages, yes=False) == "installed"
    assert ran == [["apt-get", "update"], ["apt-get", "install", "-y", *packages]]
    monkeypatch.setattr("builtins.input", lambda prompt: pytest.fail("asked despite --yes"))
    actions.apt_install(packages, yes=True)
    assert len(ran) == 4


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="no dpkg here")
def test_apt_missing_asks_dpkg() -> None:
    assert inst.apt_missing(["dpkg", "jetsplit-no-such-package"]) == ["jetsplit-no-such-package"]


def test_openblas_pth_reaches_every_run_of_the_venv(tmp_path: Path) -> None:
    """A real venv: its Python sees the variable without anyone exporting it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    assert actions.write_openblas_pth(python) == "written"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    seen = subprocess.run([str(python), "-c", "import os; print(os.environ['OPENBLAS_CORETYPE'])"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert seen.stdout.strip() == "ARMV8", seen.stderr
    assert actions.write_openblas_pth(python) == "unchanged"


def test_existing_venv_must_match_the_route(tmp_path: Path) -> None:
    (tmp_path / "pyvenv.cfg").write_text("include-system-site-packages = true\n")
    assert actions.check_venv(tmp_path) == "kept"
    with pytest.raises(inst.InstallError, match="shows it Python 3.6 builds"):
        actions.check_venv(tmp_path, isolated=True)
    (tmp_path / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
    assert actions.check_venv(tmp_path, isolated=True) == "kept"
    with pytest.raises(inst.InstallError, match="NVIDIA's torch is invisible"):
        actions.check_venv(tmp_path)


def test_env_file_gets_openblas_once_on_jetpack_4() -> None:
    template = (ROOT / "systemd/agent.env").read_text()
    text = inst.render_env(template, None, openblas=True)
    assert text.count("\nOPENBLAS_CORETYPE=ARMV8\n") == 1
    assert inst.render_env(template, text, openblas=True) == text
    assert "OPENBLAS_CORETYPE" not in inst.render_env(template, None)


def _r32_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text(
        "# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64\n")
    return root


def test_shell_names_the_installers_apt_packages() -> None:
    from jetsplit.edge_agent import jetpack

    text = (ROOT / "scripts" / "install-agent.sh").read_text()
    wanted = " ".join(jetpack.apt_packages(jetpack.R32_PYTHON))
    assert f"packages=({wanted})" in text


def _nano_bin(tmp_path: Path) -> Path:
    """PATH for a stock Nano: a python3 that is too old, an apt-get that records its calls
    and, on install, puts a python3.8 (this interpreter, without site-packages) in place."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("grep", "dirname", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))  # type: ignore[arg-type]
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 1\n")
    staged = tmp_path / "python3.8"  # moved into PATH by apt-get install
    staged.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    staged.chmod(0o755)
    (bin_dir / "apt-get").write_text(
        f"#!/bin/sh\necho \"$@\" >> {tmp_path}/apt.log\n"
        f"if [ \"$1\" = install ]; then {shutil.which('mv')} {staged} {bin_dir}/; fi\n")
    for name in ("python3", "apt-get"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/install-agent.sh on a stock Nano (_nano_bin's PATH), stdin not a terminal."""
    return subprocess.run([shutil.which("bash") or "bash", str(ROOT / "scripts/install-agent.sh"),
                           "--agent", "n1", "--broker", "mqtt://h", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": str(tmp_path / "bin"), "HOME": str(tmp_path)},
                          stdin=subprocess.DEVNULL)


def test_shell_on_a_stock_nano_lists_the_apt_step_on_dry_run(tmp_path: Path) -> None:
    _nano_bin(tmp_path)
    root = _r32_root(tmp_path)
    done = _script(tmp_path, "--root", str(root), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "apt-get install python3.8 python3.8-venv python3.8-dev" in done.stdout
    assert "dry run: would apt-get update" in done.stdout
    refused = _script(tmp_path, "--root", str(root))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "needs your consent: re-run with --yes" in refused.stderr
    assert not (tmp_path / "apt.log").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the script runs apt-get only as root")
def test_shell_on_a_stock_nano_installs_python38_then_runs_the_installer(tmp_path: Path
                                                                         ) -> None:
    _nano_bin(tmp_path)
    root = _r32_root(tmp_path)
    done = _script(tmp_path, f"--root={root}", "--yes", "--no-user", "--no-venv",
                   "--no-enable")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update", "install -y python3.8 python3.8-venv python3.8-dev"]
    assert "L4T R32.7 (JetPack 4)" in done.stdout
    env = (root / inst.ENV_FILE.lstrip("/")).read_text()
    assert "\nOPENBLAS_CORETYPE=ARMV8\n" in env

"""The method catalog: every method's facts in one place, read by every consumer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from jetsplit import catalog
from jetsplit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("jetsplit", "server", "export", "edge_agent")
# The same word naming something else: the Ampere paper's label-skew partition `ampere:α`.
OTHER_MEANINGS = {("ampere", "jetsplit/data/partition.py")}


def _string_literals(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_each_method_name_is_written_in_the_catalog_and_its_own_file_only() -> None:
    """A method's name as a string literal, in the shipped code: the catalog and the
    file of the class that implements it, nowhere else."""
    where: dict[str, set[str]] = {name: set() for name in catalog.NAMES}
    for top in SHIPPED:
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for value in _string_literals(path) & set(where):
                if (value, rel) not in OTHER_MEANINGS:
                    where[value].add(rel)
    for name, files in where.items():
        module = catalog.method(name).implementation.split(":")[0]
        assert files == {"jetsplit/catalog.py", f"server/methods/{module}.py"}, name


def test_every_entry_names_a_class_that_answers_to_it() -> None:
    from jetsplit.server.methods import method_class

    for name, entry in catalog.METHODS.items():
        assert method_class(name).name == name
        assert entry.client_content in catalog.CLIENT_CONTENTS
        if entry.planner_proxy is not None:
            proxy = catalog.method(entry.planner_proxy)
            assert proxy.planner_proxy is None and proxy.tiers == 2, name
        for preset in entry.presets:
            assert preset in catalog.PRESETS
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'; choose one of fedavg"):
        method_class("nope")


def test_the_planner_and_presets_read_the_catalog() -> None:
    from jetsplit.export.planner import ALGORITHMS, NOT_PLANNED, requires_common_split
    from jetsplit.server.training.optimisers import reduction, tier_optimizer
    from jetsplit.server.training.settings import Settings

    assert set(ALGORITHMS) == {n for n, e in catalog.METHODS.items()
                               if e.planner_proxy is None and e.tiers == 2}
    assert set(NOT_PLANNED) == {"sherl"}
    assert {n for n, a in ALGORITHMS.items() if requires_common_split(a)} == {"fedavg"}
    assert tier_optimizer(Settings(algorithm="gapsl", preset="paper"), "server").momentum == 0.9
    assert tier_optimizer(Settings(algorithm="scala", preset="paper"), "server").momentum == 0.0
    assert reduction(Settings(algorithm="psl")) == "mean"
    assert reduction(Settings(algorithm="psl", preset="paper")) == "sum"


def test_a_config_rejects_another_methods_options_in_one_line(tmp_path: Path) -> None:
    from jetsplit.server.run.config import load_server_config

    path = tmp_path / "server.toml"
    path.write_text('[train]\nalgorithm = "scala"\nk_min = 0.3\n')
    with pytest.raises(ConfigError, match="k_min is an option of gapsl, not of scala"):
        load_server_config(path)
    path.write_text('[train]\nalgorithm = "gapsl"\nk_min = 0.3\npsl_reduction = "sum"\n')
    assert load_server_config(path).train.k_min == 0.3
    path.write_text('[train]\nalgorithm = "magic"\n')
    with pytest.raises(ConfigError, match="unknown algorithm 'magic'"):
        load_server_config(path)
    assert catalog.foreign_options("ampere", ["patience", "tau1", "lr"]) == ("tau1",)


def test_the_catalog_imports_without_torch() -> None:
    code = ("import sys; import jetsplit.catalog, jetsplit.export.planner; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_a_config_written_out_whole_still_loads(tmp_path: Path) -> None:
    """A run's config.toml holds every [train] key at its value: another method's options
    at their defaults are not a mistake."""
    from jetsplit.server.run.config import ServerConfig, TrainSection

    whole = ServerConfig(train=TrainSection(algorithm="ampere", patience=3)).model_dump()
    again = ServerConfig.model_validate(whole)
    assert again.train.patience == 3 and again.train.algorithm == "ampere"


def test_one_flags_table_gives_every_launcher_the_same_training_flags() -> None:
    """`server run`, `simulate` and `trial` take their [train] flags from one table: the
    same spelling, help and shown default for a shared key."""
    import typer.main

    from jetsplit.cli import build_app

    commands: dict[str, dict[str, tuple[str | None, object]]] = {}

    def walk(command: object, path: str) -> None:
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, f"{path} {name}".strip())
        if path in ("server run", "simulate", "trial"):
            commands[path] = {p.opts[0]: (p.help, p.show_default) for p in command.params
                              if p.param_type_name == "option"}

    walk(typer.main.get_command(build_app()), "")
    shared = set.intersection(*(set(c) for c in commands.values()))
    assert {"--algorithm", "--rounds", "--local-steps", "--batch", "--lr", "--fraction",
            "--codec"} <= shared
    for flag_name in shared - {"--out", "--agents", "--resume", "--device"}:
        assert len({c[flag_name] for c in commands.values()}) == 1, flag_name

"""The [train] keys are declared once (server/training/settings.py `TrainFields`): the config
section, the flags, `Settings`, the method catalog's options and docs/configuration.md
all agree with that declaration."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from jetsplit import catalog
from jetsplit.server.run.config import ServerSection, TrainSection
from jetsplit.server.training.settings import Settings, TrainFields

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _documented() -> set[str]:
    """The keys docs/configuration.md's server.toml table names in its [train] rows."""
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        first = line.split("|")[1] if line.startswith("| `[train") else ""
        names.update(re.findall(r"`(?:\[train\] )?([a-z_0-9]+)`", first))
        names.update(re.findall(r"`\[train\.([a-z_]+)\]`", first))
    return names


def test_configuration_doc_lists_every_train_key() -> None:
    assert _documented() == set(TrainFields.model_fields)


def test_every_train_key_has_one_help_line() -> None:
    for name, info in TrainFields.model_fields.items():
        assert info.description and "\n" not in info.description, name


def test_section_and_settings_take_their_fields_from_the_declaration() -> None:
    assert TrainSection.model_fields.keys() == TrainFields.model_fields.keys()
    own = {"seed", "edges", "edge_split"}
    assert set(Settings.model_fields) == (set(TrainFields.model_fields)
                                          | set(ServerSection.model_fields) | own)
    for name, info in TrainFields.model_fields.items():
        assert Settings.model_fields[name].default == info.default, name


def test_method_options_default_as_declared() -> None:
    """A method's own options (jetsplit/catalog.py) are [train] keys (or [topology]'s) with
    the declared defaults."""
    for entry in catalog.METHODS.values():
        for option in fields(entry.options):
            assert option.name in Settings.model_fields, (entry.name, option.name)
            default = (option.default if option.default_factory is MISSING
                       else option.default_factory())
            assert Settings.model_fields[option.name].get_default(
                call_default_factory=True) == default, (entry.name, option.name)


def test_trial_spec_keeps_only_what_is_trial_specific(tmp_path: Path) -> None:
    """A trial's [train] keys live in `train` (its own default: re-planning on); a
    trial.json written with them flat still resumes."""
    import json
    from dataclasses import asdict

    from jetsplit.server.run.trial import load_spec
    from jetsplit.server.run.trial_fleet import TrialSpec

    from_spec = {f.name for f in fields(TrialSpec)}
    assert not from_spec & set(TrainFields.model_fields)
    spec = TrialSpec(train={"algorithm": "psl", "lr": 0.05}, agents=2)
    assert spec.training().replan == "on" and spec.training().lr == 0.05
    flat = {k: v for k, v in asdict(spec).items() if k != "train"}
    (tmp_path / "trial.json").write_text(json.dumps({**flat, "algorithm": "psl", "lr": 0.05}))
    assert load_spec(tmp_path) == spec

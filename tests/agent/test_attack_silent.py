"""The `silent` fault (edge_agent/attacks.py): an agent that registers and installs its
bundle, then answers nothing, as a hung process whose connection stays up. Only an engine
with a clock can show it, so `jetsplit simulate` refuses it in one line."""

from __future__ import annotations

import pytest

from jetsplit.cli import main
from jetsplit.edge_agent.attacks import ALLOW_ENV, Attack, AttackSpec, parse_attack
from jetsplit.errors import ConfigError

pytestmark = pytest.mark.fast


def test_silent_parses_and_answers_only_its_setup() -> None:
    assert parse_attack("silent") == AttackSpec("silent")
    with pytest.raises(ConfigError, match="silent takes no number"):
        parse_attack("silent:3")
    silent, honest = Attack(parse_attack("silent")), Attack()
    for kind in ("forward", "backward", "get_weights", "set_weights", "release", "status",
                 "train", "edge_step"):
        assert not silent.answers(kind) and honest.answers(kind), kind
    assert silent.answers("bundle") and silent.answers("bundle_part")


def test_simulate_refuses_silent_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: object) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    code = main(["simulate", "--dataset", "digits", "--agents", "2", "--attack", "a1=silent",
                 "--out", f"{tmp_path}/s"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --attack a1=silent: needs agents over a broker")

"""The root CLI: user mistakes end in one `error:` line and exit 2, never a traceback."""

from __future__ import annotations

import pytest

from jetsplit.cli import main


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["export", "plan", "--model", "nope", "--profile", "jetson-nano-4gb"], "unknown model"),
        (["export", "plan", "--model", "alexnet", "--profile", "jetson-nano-4gb",
          "--batch", "abc"], "--batch"),
        (["export", "plan", "--model", "alexnet", "--profile", "jetson-nano-4gb", "--bogus"],
         "No such option"),
        (["export", "plan", "--model", "alexnet", "--profile", "/nonexistent.toml"],
         "file not found"),
        (["export", "bundle", "--model", "alexnet", "--split", "9", "--out", "unused"],
         "out of range"),
        (["export", "engine", "/nonexistent-bundle"], "not found"),
    ],
)
def test_user_errors_are_one_line(argv: list[str], fragment: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err
    assert "Traceback" not in err


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert "jetsplit" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "export" in out and "profile" in out and "broker" in out

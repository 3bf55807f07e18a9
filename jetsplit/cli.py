"""The `jetsplit` command: one root that mounts each role's sub-commands.

Sub-command modules import their heavy dependencies lazily, so `jetsplit --help` works on a
device that installed only `jetsplit[agent]`.
"""

from __future__ import annotations

import sys

import typer

from jetsplit import __version__
from jetsplit.errors import JetsplitError

app = typer.Typer(
    name="jetsplit",
    help="Split federated learning across Jetson fleets.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"jetsplit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Split federated learning across Jetson fleets."""


def _mount() -> None:
    from export.cli import app as export_app

    app.add_typer(export_app, name="export", help="Cost model, split planner, bundles, engines.")
    from export.profile_cli import profile

    app.command("profile", help="Measure this machine: per-layer latency, memory, GFLOPS.")(
        profile
    )
    # The composition root is the one place allowed to know every role's package.
    from server.broker_cli import broker

    app.command("broker", help="Run an embedded MQTT broker on loopback (amqtt).")(broker)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user-caused errors end in one line on stderr and a non-zero exit."""
    _mount()
    try:
        app(args=argv, standalone_mode=False)
    except JetsplitError as exc:
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `jetsplit` command: one root that mounts each role's sub-commands.

Sub-command modules import their heavy dependencies lazily, so `jetsplit --help` works on a
device that installed only `jetsplit[agent]`.
"""

# No `from __future__ import annotations` here: typer reads `_root`'s signature, and on
# Python < 3.10 it does not evaluate string annotations.

import contextlib
import importlib
import sys
from typing import List, Optional, Sequence, Tuple, Type

import typer

from jetsplit import __version__
from jetsplit.errors import JetsplitError

HELP = {"help_option_names": ["-h", "--help"]}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"jetsplit {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Split federated learning across Jetson fleets."""


# Sub-commands a device runs. They (and all they import) work on Python 3.8 / torch 1.13
# (JetPack 5): profiling split points happens on the device. The coordinator's and the rest
# of the export tool's commands need Python 3.10+.
DEVICE_COMMANDS = ("agent", "doctor", "profile")
PROFILE_HELP = "Measure this machine: per-layer latency, memory, GFLOPS."


def device_only(argv: Optional[Sequence[str]],
                version: Tuple[int, ...] = sys.version_info) -> bool:
    """Whether to mount only the device commands: on an interpreter older than the
    coordinator needs, or when a device command runs (so the agent imports no coordinator)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return tuple(version[:2]) < (3, 10) or (bool(args) and args[0] in DEVICE_COMMANDS)


def coordinator_refusal(argv: Optional[Sequence[str]],
                        version: Tuple[int, ...] = sys.version_info) -> Optional[str]:
    """The one line for a coordinator command on an interpreter that only runs the device
    side (JetPack 5's Python 3.8), else None."""
    args = list(sys.argv[1:] if argv is None else argv)
    if tuple(version[:2]) >= (3, 10) or not args or args[0].startswith("-") \
            or args[0] in DEVICE_COMMANDS:
        return None
    return (f"`jetsplit {args[0]}` needs Python 3.10+ (this is {version[0]}.{version[1]}); "
            f"here only the device commands run: {', '.join(DEVICE_COMMANDS)}")


def build_app(device: bool = False) -> typer.Typer:
    """The root command with every role's sub-commands (`device`: only those a device runs).
    This composition root is the one place that knows every package; sub-command modules
    import heavy dependencies lazily."""
    app = typer.Typer(
        name="jetsplit",
        help="Split federated learning across Jetson fleets.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
        context_settings=HELP,  # inherited by every sub-command: -h works everywhere
    )
    app.callback()(_root)
    from jetsplit.edge_agent.cli import app as agent_app
    from jetsplit.edge_agent.doctor import doctor
    from jetsplit.export.profile_cli import profile

    if device:
        app.add_typer(agent_app, name="agent", help="The edge agent daemon.")
        app.command("doctor", help="What this device has: JetPack, CUDA, TensorRT, ONNX "
                    "Runtime, memory, broker.")(doctor)
        app.command("profile", help=PROFILE_HELP)(profile)
        return app
    from jetsplit.export.cli import app as export_app
    from jetsplit.server.fleet.provision import provision_command
    from jetsplit.server.ops.broker_cli import broker
    from jetsplit.server.report.document import report_command
    from jetsplit.server.run.fleet_cli import app as fleet_app
    from jetsplit.server.run.server_run import app as server_app
    from jetsplit.server.run.simulate import simulate_command
    from jetsplit.server.run.trial import trial_command

    app.add_typer(export_app, name="export", help="Cost model, split planner, bundles, engines.")
    app.command("profile", help=PROFILE_HELP)(profile)
    app.add_typer(agent_app, name="agent", help="The edge agent daemon.")
    app.add_typer(server_app, name="server", help="The coordinator.")
    app.add_typer(fleet_app, name="fleet", help="See and steer a fleet: ls, status, logs, stop.")
    app.command("simulate", help="Simulate a fleet in one process (in-process engine).")(
        simulate_command
    )
    app.command("doctor", help="What this device has: JetPack, CUDA, TensorRT, ONNX Runtime, "
                "memory, broker.")(doctor)
    app.command("broker", help="Run an embedded MQTT broker on loopback (amqtt).")(broker)
    app.command("trial", help="Field trial on this machine: broker, coordinator, emulated "
                "agents; report with plots.")(trial_command)
    app.command("report", help="Write report.md with plots for a run folder.")(report_command)
    from jetsplit.export.model_cli import predict

    app.command("predict", help="Accuracy and latency of an exported model on a dataset.")(
        predict)
    app.command("provision", help="Fleet CA, per-device startup kits (mTLS + signing keys), "
                "Mosquitto config with per-device ACLs.")(provision_command)
    return app


def _usage_error_types() -> Tuple[Type[Exception], ...]:
    """Usage-error base classes: typer ≥ 0.22 vendors click (typer.exceptions), older typer
    uses click itself; each is imported here, as `typer.exceptions` is not an attribute of
    the typer package until its module is imported."""
    types: List[Type[Exception]] = []
    for module, name in (("typer.exceptions", "TyperException"), ("click", "ClickException")):
        with contextlib.suppress(ImportError, AttributeError):
            types.append(getattr(importlib.import_module(module), name))
    return tuple(types)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; user-caused errors end in one line on stderr and a non-zero exit."""
    refusal = coordinator_refusal(argv)
    if refusal:
        typer.echo(f"error: {refusal}", err=True)
        return 2
    try:
        result = build_app(device_only(argv))(args=argv, standalone_mode=False)
    except JetsplitError as exc:
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        return 130
    except _usage_error_types() as exc:  # bad option or value
        if type(exc).__name__ == "NoArgsIsHelpError":
            return 0 if argv == [] else 2  # help was already printed
        message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
        typer.echo(f"error: {message} (see --help)", err=True)
        return int(getattr(exc, "exit_code", 2))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

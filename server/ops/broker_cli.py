"""`jetsplit broker`: an embedded MQTT broker for zero-setup runs on one machine."""

from __future__ import annotations

import threading

import typer

from jetsplit.server.ops.brokers import LOOPBACK, EmbeddedBroker


def broker(
    port: int = typer.Option(0, help="TCP port; 0 picks a free one."),
    host: str = typer.Option(LOOPBACK, help="Bind address (loopback unless you mean it)."),
) -> None:
    """Run an embedded amqtt broker until interrupted; prints its URL for --broker."""
    from jetsplit.cli_types import check_port

    check_port(port, "--port")  # before amqtt, which would print its own traceback
    with EmbeddedBroker(port or None, host) as running:
        typer.echo(f"broker listening: --broker {running.address.url()}  (Ctrl-C stops it)")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            typer.echo("broker stopped")

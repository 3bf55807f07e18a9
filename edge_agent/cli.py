"""Device-side commands mounted on the `jetsplit` root."""

from __future__ import annotations

import typer

from edge_agent.profile_cli import profile


def register(app: typer.Typer) -> None:
    """Mount the agent's commands on the root CLI."""
    app.command("profile", help="Measure this machine: per-layer latency, memory, GFLOPS.")(
        profile
    )

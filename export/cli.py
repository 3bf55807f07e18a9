"""`jetsplit export ...`: each sub-command lives in its own module and imports lazily."""

from __future__ import annotations

import typer

from jetsplit.export.bundle_cli import bundle, engine
from jetsplit.export.model_cli import model
from jetsplit.export.plan_cli import plan

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
app.command("plan", help="Cost of every split candidate and the planner's choice.")(plan)
app.command("bundle", help="Write a bundle (weights, ONNX, manifest) for one split.")(bundle)
app.command("engine", help="Build and validate a TensorRT engine for a bundle, on device.")(
    engine
)
app.command("model", help="The trained model of a run as one ONNX file (checked), optionally "
            "a TensorRT engine.")(model)

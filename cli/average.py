"""xformer average RUN: average the newest step checkpoints of a run into one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from xformer.checkpoint import average_run
from xformer_cli.common import user_errors


@user_errors
def average(
    run: Path = typer.Argument(..., help="A trained run directory."),
    last: int = typer.Option(5, "--last", help="How many of the newest step checkpoints to average."),
    name: str | None = typer.Option(None, "--name", help="Checkpoint name [default: averaged_last<N>]; "
                                                         "`xformer eval RUN --checkpoint NAME` reads it."),
    as_json: bool = typer.Option(False, "--json", help="Print {path, averaged, steps} as JSON."),
) -> None:
    """Average the weights of the last N step checkpoints a run kept (train.average_last of
    them), as fairseq's average_checkpoints.py does, into RUN/checkpoints/NAME.safetensors."""
    result = average_run(run, last, name)
    if as_json:
        typer.echo(json.dumps(result))
        return
    steps = ", ".join(str(s) for s in result["steps"])
    typer.echo(f"{result['path']}: the average of {len(result['steps'])} checkpoints (steps {steps})")

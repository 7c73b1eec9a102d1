"""xformer average RUN: average the newest step checkpoints of a run into one checkpoint."""

from __future__ import annotations

from typing import Annotated

import typer

from xformer.training.checkpoint import average_run
from xformer_cli.common import JsonOption, RunArgument, flags_named, user_errors


@user_errors
def average(
    run: RunArgument,
    last: Annotated[int, typer.Option("--last", min=1, help="How many of the newest step checkpoints to average.")] = 5,
    name: Annotated[str | None, typer.Option("--name", help="Checkpoint name [default: averaged_last<N>]; "
                                                            "`xformer eval RUN --checkpoint NAME` reads it.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Average the weights of the last N step checkpoints a run kept (train.average_last of
    them), as fairseq's average_checkpoints.py does, into RUN/checkpoints/NAME.safetensors."""
    with flags_named("last", "name"):
        result = average_run(run, last, name)
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    steps = ", ".join(str(s) for s in result.steps)
    typer.echo(f"{result.path}: the average of {len(result.steps)} checkpoints (steps {steps})")

"""xformer distill TEACHER_RUN STUDENT_RECIPE: train a student from a trained teacher ([distill])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from xformer_cli.common import DeviceOption, JsonOption, ReportOption, SetOption, choices, user_errors
from xformer_cli.train import train

Kind = choices("Kind", ("sequence", "word"))


@user_errors
def distill(
    teacher: Annotated[Path, typer.Argument(help="The teacher: a trained translation run directory.")],
    recipe: Annotated[Path, typer.Argument(help="The student's recipe (its [data] tokenizer settings must be "
                                                "the teacher's: the student shares its tokenizer).")],
    kind: Annotated[Kind, typer.Option("--kind", help="sequence: train on the teacher's beam translations of "
                                                      "the training sources (Kim & Rush 2016); word: match the "
                                                      "teacher's token distributions (distill.alpha, "
                                                      "distill.temperature).")] = Kind("sequence"),
    out: Annotated[Path | None, typer.Option("--out", help="Run directory [default: runs/<recipe name>].")] = None,
    overrides: SetOption = [],  # noqa: B006 - typer reads the default, never mutates it
    device: DeviceOption = "auto",
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after N optimizer steps.")] = None,
    max_time: Annotated[float | None, typer.Option("--max-time", help="Stop after MINUTES of training.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run directory.")] = False,
    report_to: ReportOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Train the student recipe with [distill] teacher = TEACHER_RUN and kind = --kind: `xformer
    train RECIPE --set distill.teacher=TEACHER_RUN --set distill.kind=KIND`, the same run
    directory, resume and options."""
    sets = [f"distill.teacher={json.dumps(str(teacher))}", f"distill.kind={kind.value}", *overrides]
    train(recipe, out=out, overrides=sets, device=device, precision=None, max_steps=max_steps, max_time=max_time,
          resume=resume, overwrite=overwrite, report_to=report_to, as_json=as_json)

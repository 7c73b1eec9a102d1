"""xformer train RECIPE: train a model into a run directory."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from xformer.config.loading import load_recipe
from xformer.config.schema import Recipe
from xformer.errors import RecipeError, RunError
from xformer.train import run
from xformer.training.cpuload import busy
from xformer.training.trackers import Reporting, requested
from xformer_cli.common import (
    DeviceOption,
    JsonOption,
    Precision,
    ReportOption,
    SetOption,
    flags_named,
    stdout,
    user_errors,
)
from xformer_cli.display import TrainDisplay, score_table

PRECISION_HELP = ("Sets train.precision. auto is bf16 on CUDA and on a CPU with native bf16 (AMX, AVX512-BF16), "
                  "else fp32 (fp16 with a scaler on GPUs without bf16).")


@user_errors
def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML, e.g. recipes/translation/multi30k_de_en.toml.")],
    out: Annotated[Path | None, typer.Option("--out", help="Run directory [default: runs/<recipe name>].")] = None,
    overrides: SetOption = [],  # noqa: B006 - typer reads the default, never mutates it
    device: DeviceOption = "auto",
    precision: Annotated[Precision | None, typer.Option("--precision", help=PRECISION_HELP)] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after N optimizer steps "
                                                                      "(train.max_steps).")] = None,
    max_time: Annotated[float | None, typer.Option("--max-time", help="Stop after MINUTES of training "
                                                                      "(train.max_time).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last "
                                                          "checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run directory.")] = False,
    branch_from: Annotated[Path | None, typer.Option(
        "--branch-from", help="Start --out as this run stood at --at-step (a checkpoint train.branch_every kept), "
                              "then train on with RECIPE's values: a cooldown from that step, say.")] = None,
    at_step: Annotated[int | None, typer.Option("--at-step", help="The step of --branch-from to start at.")] = None,
    init_from: Annotated[Path | None, typer.Option(
        "--init-from", help="Start --out from this run's weights and tokenizer (a trained or imported run; the "
                            "same [model]), at step 0 with a fresh optimizer: a fine-tune.")] = None,
    init_checkpoint: Annotated[str | None, typer.Option(
        "--init-checkpoint", help="The checkpoint of --init-from [default: its eval.checkpoint].")] = None,
    report_to: ReportOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Train the recipe's model: tokenizer, training with validation, checkpoints, averaging."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite: choose one (continue the run, or replace it)")
    if (branch_from is None) != (at_step is None):
        raise RunError("--branch-from and --at-step go together: the run and the step to start from")
    if init_checkpoint is not None and init_from is None:
        raise RunError("--init-checkpoint names a checkpoint of --init-from: give --init-from too")
    trackers = requested(report_to)  # one not installed: exit 2 before anything is read
    cfg = _recipe(recipe, overrides, precision=precision, max_steps=max_steps, max_time=max_time)
    rank = int(os.environ.get("RANK", "0"))  # under torchrun, process 0 alone draws and prints
    with flags_named("device", "init_checkpoint"), TrainDisplay() as display:
        result = run(cfg, out or Path("runs") / recipe.stem, device=device, resume=resume, overwrite=overwrite,
                     on_event=display if rank == 0 else None, recipe_path=recipe, branch_from=branch_from,
                     at_step=at_step, reporting=Reporting(trackers), init=init_from,
                     init_checkpoint=init_checkpoint)
    if rank != 0:
        return
    summary = _summary(result)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        stdout.print(score_table("training", summary))
    if busy(result.others_cpu):
        typer.echo(f"warning: trained while other processes took {result.others_cpu:.2f} CPU cores: its speed is "
                   "below what this machine does alone", err=True)
    if result.stop_reason == "interrupted":
        # the run's own recipe.toml holds every --set and limit it was started with
        run_dir = shlex.quote(result.run_dir)
        typer.echo(f"interrupted at step {result.steps}; continue with: xformer train {run_dir}/recipe.toml "
                   f"--out {run_dir} --resume", err=True)
        # Ctrl-C says so to the shell (`train && eval` stops); a scheduler's SIGTERM or a
        # closed terminal is a clean stop with a checkpoint
        raise typer.Exit(130 if result.stop_signal in ("SIGINT", "") else 0)


def _recipe(recipe: Path, overrides: list[str], **flags) -> Recipe:
    """The recipe with --set and the flags that are shorthands for train.* values (--precision,
    --max-steps, --max-time); a flag's bad value is named by the flag the user typed."""
    sets, named = list(overrides), {}
    for key, value in flags.items():
        if value is not None:
            sets.append(f"train.{key}={json.dumps(getattr(value, 'value', value))}")
            named[f"--set train.{key}:"] = f"--{key.replace('_', '-')}:"
    try:
        return load_recipe(recipe, sets)
    except RecipeError as exc:
        raise RecipeError([next((flag + line[len(s):] for s, flag in named.items() if line.startswith(s)), line)
                           for line in exc.problems]) from None


def _summary(result) -> dict:
    """What the run did, for the table (or --json) printed at its end."""
    best = result.best or {}
    return {"run": result.run_dir, "steps": result.steps, "epochs": round(result.epochs, 2),
            "stopped by": result.stop_reason, "minutes": result.train_seconds / 60,
            "best step": best.get("step"),
            **{f"best valid {key}": best[key] for key in ("bleu", "accuracy") if key in best},
            "best valid loss": best.get("loss"), "loop overhead %": 100 * result.loop_overhead,
            "peak memory MB": result.peak_memory_mb if result.device.startswith("cuda") else "not measured",
            "device": result.device, "precision": result.precision}

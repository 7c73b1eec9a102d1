"""xformer eval RUN and xformer translate RUN."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.evaluate import CannotExtrapolate, eval_view, evaluate_run, translate_lines
from xformer.results import ClassificationEval, TranslationEval
from xformer_cli.common import (
    CheckpointOption,
    DeviceOption,
    JsonOption,
    Quantize,
    RunArgument,
    console,
    flags_named,
    read_sentences,
    stdout,
    user_errors,
)
from xformer_cli.display import passing_bar, score_table

BeamOption = Annotated[int | None, typer.Option("--beam", min=1, help="Beam size; 1 is greedy [default: eval.beam].")]
LenpenOption = Annotated[float | None, typer.Option("--lenpen", min=0.0,
                                                    help="Length penalty [default: eval.lenpen].")]
QuantizeOption = Annotated[Quantize | None, typer.Option("--quantize", help="Quantize the Linear layers for "
                                                                           "inference on the CPU.")]


@user_errors
def evaluate(
    run: RunArgument,
    split: Annotated[str | None, typer.Option("--split", help="Split of the recipe's corpus "
                                                              "[default: data.test_split].")] = None,
    data: Annotated[str | None, typer.Option("--data", help="Score this JSONL file or folder instead.")] = None,
    beam: BeamOption = None,
    lenpen: LenpenOption = None,
    checkpoint: CheckpointOption = None,
    device: DeviceOption = "auto",
    quantize: QuantizeOption = None,
    ctranslate2: Annotated[Path | None, typer.Option("--ctranslate2", help="Decode with CTranslate2 from this "
                                                     "directory (xformer export --format ctranslate2).")] = None,
    baseline: Annotated[Path | None, typer.Option("--baseline", metavar="OTHER_RUN",
                                                  help="Also score the same test set with OTHER_RUN (a run of "
                                                       "the same task) and report the paired test between the "
                                                       "two: sacreBLEU's paired bootstrap for translation, "
                                                       "McNemar's exact test for classification.")] = None,
    length: Annotated[int | None, typer.Option("--length", min=1, metavar="N",
                                               help="A generated task's examples at N tokens instead of the "
                                                    "run's data.max_len (extrapolation).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Score a run on a test set: translation with beam search, sacreBLEU (cased and lowercased)
    and chrF; classification with accuracy and a confusion matrix."""
    flags = flags_named("split", "data", "device", "quantize", "ctranslate2", "baseline", "length")
    try:
        with flags, passing_bar(console) as progress:
            bar = progress.add_task("decoding", total=None)
            result = evaluate_run(run, split=split, data=data, beam=beam, lenpen=lenpen, checkpoint=checkpoint,
                                  device=device, quantize=quantize.value if quantize else None,
                                  ctranslate2=str(ctranslate2) if ctranslate2 else None, baseline=baseline,
                                  length=length,
                                  on_progress=lambda done, total: progress.update(bar, completed=done, total=total))
    except CannotExtrapolate as cannot:  # a result about the model, not a mistake in the command
        typer.echo(json.dumps({"length": length, "cannot": str(cannot)}) if as_json else f"{run}: {cannot}")
        return
    for warning in result.warnings or []:
        typer.echo(f"warning: {warning}", err=True)
    if as_json:
        typer.echo(result.to_json(indent=None))
    else:
        show_eval(run, result)


def show_eval(run: Path, result: TranslationEval | ClassificationEval) -> None:
    """The score's view (xformer.results.EvalView) as rich tables."""
    view = eval_view(run, result)
    stdout.print(score_table(view.title, view.rows))
    for title, columns, rows in view.grids:
        table = Table(title=title, header_style="bold")
        table.add_column("")
        for column in columns:
            table.add_column(column, justify="right")
        for label, *cells in rows:
            table.add_row(label, *(str(c) for c in cells))
        stdout.print(table)
    for note in view.notes:
        stdout.print(f"[dim]{note}[/dim]")
    if view.paired is not None:
        title, rows, notes = view.paired
        stdout.print(score_table(title, rows))
        for note in notes:
            stdout.print(f"[dim]{note}[/dim]")


@user_errors
def translate(
    run: RunArgument,
    input: Annotated[Path | None, typer.Option("--input", help="File of sentences, one per line "
                                                               "[default: stdin].")] = None,
    beam: BeamOption = None,
    lenpen: LenpenOption = None,
    checkpoint: CheckpointOption = None,
    device: DeviceOption = "auto",
    quantize: QuantizeOption = None,
) -> None:
    """Translate sentences from stdin or --input, one per line, to stdout."""
    lines = read_sentences(input)
    warn = lambda message: typer.echo(f"warning: {message}", err=True)  # noqa: E731
    with flags_named("device", "quantize"):
        translations = translate_lines(run, lines, checkpoint=checkpoint, beam=beam, lenpen=lenpen, device=device,
                                       on_warning=warn, quantize=quantize.value if quantize else None)
    for line in translations:
        typer.echo(line)

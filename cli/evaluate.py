"""xformer eval RUN and xformer translate RUN."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from xformer.errors import DataError
from xformer.evaluate import evaluate_run, translate_lines
from xformer_cli.common import user_errors
from xformer_cli.display import score_table

CHECKPOINT_HELP = ("best, last, averaged or a name from `xformer average` [default: the recipe's "
                   "eval.checkpoint].")


@user_errors
def evaluate(
    run: Path = typer.Argument(..., help="Run directory written by xformer train."),
    split: str | None = typer.Option(None, "--split", help="Split of the recipe's corpus [default: data.test_split]."),
    data: str | None = typer.Option(None, "--data", help="Score this JSONL file or folder instead."),
    beam: int | None = typer.Option(None, "--beam", min=1, help="Beam size; 1 is greedy [default: eval.beam]."),
    lenpen: float | None = typer.Option(None, "--lenpen", min=0.0, help="Length penalty [default: eval.lenpen]."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help=CHECKPOINT_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print eval.json instead of a table."),
) -> None:
    """Score a run on a test set: translation with beam search, sacreBLEU (cased and lowercased)
    and chrF; classification with accuracy and a confusion matrix."""
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=None)
        report = evaluate_run(run, split=split, data=data, beam=beam, lenpen=lenpen, checkpoint=checkpoint,
                              device=device, on_progress=lambda done, total: progress.update(task, completed=done,
                                                                                             total=total))
    if as_json:
        typer.echo(json.dumps(report))
        return
    if "accuracy" in report:
        show_classification(run, report)
        return
    rows = {k: report[k] for k in ("bleu", "bleu_lc", "chrf", "n_sentences", "checkpoint", "beam", "lenpen")}
    rows["sentences/s"] = report["sentences_per_s"]
    Console().print(score_table(f"{run}: {report['split'] or report['data']}", rows))
    Console().print(f"[dim]{report['signature']}[/dim]\n[dim]hypotheses: {report['hypotheses']}[/dim]")


def show_classification(run: Path, report: dict) -> None:
    rows = {k: report[k] for k in ("accuracy", "majority_accuracy", "loss", "n_examples", "checkpoint")}
    console = Console()
    console.print(score_table(f"{run}: {report['task']} {report['split']}", rows))
    if "confusion" in report:
        table = Table(title="confusion (rows: true, columns: predicted)", header_style="bold")
        table.add_column("")
        for label in report["labels"]:
            table.add_column(label, justify="right")
        for label, row in zip(report["labels"], report["confusion"], strict=True):
            table.add_row(label, *(str(c) for c in row))
        console.print(table)
    console.print(f"[dim]predictions: {report['predictions']}[/dim]")


@user_errors
def translate(
    run: Path = typer.Argument(..., help="Run directory written by xformer train."),
    input: Path | None = typer.Option(None, "--input", help="File of sentences, one per line [default: stdin]."),
    beam: int | None = typer.Option(None, "--beam", min=1, help="Beam size; 1 is greedy [default: eval.beam]."),
    lenpen: float | None = typer.Option(None, "--lenpen", min=0.0, help="Length penalty [default: eval.lenpen]."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help=CHECKPOINT_HELP),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
) -> None:
    """Translate sentences from stdin or --input, one per line, to stdout."""
    if input is not None and not input.exists():
        raise DataError(f"{input}: no such input file")
    if input is not None and input.is_dir():
        raise DataError(f"{input}: a folder, expected a file of sentences, one per line")
    try:  # a pipe or device (/dev/stdin, <(...)) reads like a file
        text = input.read_text(encoding="utf-8") if input is not None else sys.stdin.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{input or 'stdin'}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    lines = text.splitlines()
    warn = lambda message: typer.echo(f"warning: {message}", err=True)  # noqa: E731
    for line in translate_lines(run, lines, checkpoint=checkpoint, beam=beam, lenpen=lenpen, device=device,
                                on_warning=warn):
        typer.echo(line)

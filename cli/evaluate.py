"""xformer eval RUN and xformer translate RUN."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress

from xformer.errors import DataError
from xformer.evaluate import evaluate_run, translate_lines
from xformer_cli.common import user_errors
from xformer_cli.display import score_table

CHECKPOINT_HELP = "best, last or averaged [default: the recipe's eval.checkpoint]."


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
    """Translate a test set with beam search and score it: sacreBLEU (cased and lowercased) and chrF."""
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=None)
        report = evaluate_run(run, split=split, data=data, beam=beam, lenpen=lenpen, checkpoint=checkpoint,
                              device=device, on_progress=lambda done, total: progress.update(task, completed=done,
                                                                                             total=total))
    if as_json:
        typer.echo(json.dumps(report))
        return
    rows = {k: report[k] for k in ("bleu", "bleu_lc", "chrf", "n_sentences", "checkpoint", "beam", "lenpen")}
    rows["sentences/s"] = report["sentences_per_s"]
    Console().print(score_table(f"{run}: {report['split'] or report['data']}", rows))
    Console().print(f"[dim]{report['signature']}[/dim]\n[dim]hypotheses: {report['hypotheses']}[/dim]")


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
    if input is not None and not input.is_file():
        raise DataError(f"{input}: no such input file")
    text = input.read_text(encoding="utf-8") if input is not None else sys.stdin.read()
    lines = text.splitlines()
    for line in translate_lines(run, lines, checkpoint=checkpoint, beam=beam, lenpen=lenpen, device=device):
        typer.echo(line)

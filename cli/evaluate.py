"""xformer eval RUN and xformer translate RUN."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.evaluate import CannotExtrapolate, evaluate_run, translate_lines
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
    elif isinstance(result, ClassificationEval):
        show_classification(run, result)
    else:
        show_translation(run, result)


def show_translation(run: Path, result: TranslationEval) -> None:
    rows = {"bleu": result.bleu, "bleu_lc": result.bleu_lc, "chrf": result.chrf, "n_sentences": result.n_sentences,
            "checkpoint": result.checkpoint, "beam": result.beam, "lenpen": result.lenpen,
            "sentences/s": result.sentences_per_s, **({"quantize": result.quantize} if result.quantize else {}),
            **({"KV cache MB": result.kv_cache_mb} if result.kv_cache_mb is not None else {})}
    stdout.print(score_table(f"{run}: {result.split or result.data}", rows))
    stdout.print(f"[dim]{result.signature}[/dim]\n[dim]hypotheses: {result.hypotheses}[/dim]")
    if result.paired:
        p = result.paired
        stdout.print(score_table(f"paired bootstrap against {p['baseline']} ({p['samples']} resamples)", {
            "bleu": f"{p['bleu']:.2f} (mean {p['mean']:.2f} +- {p['interval']:.2f})",
            "baseline bleu": f"{p['baseline_bleu']:.2f} (mean {p['baseline_mean']:.2f} "
                             f"+- {p['baseline_interval']:.2f})",
            "difference": f"{p['difference']:+.2f}", "p-value": f"{p['p_value']:.4f}"}))
        stdout.print(f"[dim]{p['signature']}[/dim]")


def show_classification(run: Path, result: ClassificationEval) -> None:
    rows = {"accuracy": result.accuracy, "majority_accuracy": result.majority_accuracy, "loss": result.loss,
            "n_examples": result.n_examples, "examples/s": result.examples_per_s, "checkpoint": result.checkpoint}
    stdout.print(score_table(f"{run}: {result.task} {result.split}", rows))
    if result.confusion is not None:
        table = Table(title="confusion (rows: true, columns: predicted)", header_style="bold")
        table.add_column("")
        for label in result.labels:
            table.add_column(label, justify="right")
        for label, row in zip(result.labels, result.confusion, strict=True):
            table.add_row(label, *(str(c) for c in row))
        stdout.print(table)
    stdout.print(f"[dim]predictions: {result.predictions}[/dim]")
    if result.paired:
        p = result.paired
        stdout.print(score_table(f"McNemar's exact test against {p['baseline']}", {
            "accuracy": f"{p['accuracy']:.2f}", "baseline accuracy": f"{p['baseline_accuracy']:.2f}",
            "difference": f"{p['difference']:+.2f} +- {p['difference_interval']:.2f} (95%)",
            "right only here / only in the baseline": f"{p['wins']} / {p['losses']}",
            "p-value": f"{p['p_value']:.4f}"}))


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

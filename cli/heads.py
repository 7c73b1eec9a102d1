"""xformer inspect-heads RUN: what every attention head does, which heads matter, what pruning costs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from xformer.errors import RunError
from xformer.heads import HeadsConfig, inspect_heads
from xformer.results import HeadsReport
from xformer_cli.common import (
    Ablation,
    CheckpointOption,
    DeviceOption,
    Importance,
    PruneOrder,
    as_flag,
    console,
    flags_named,
    stdout,
    user_errors,
)
from xformer_cli.display import finish


@user_errors
def inspect_heads_command(
    run: Annotated[Path, typer.Argument(help="A trained run directory (translation or Transformer classifier).")],
    split: Annotated[str | None, typer.Option("--split", help="Split to analyse [default: validation].")] = None,
    data: Annotated[str | None, typer.Option("--data", help="A JSONL file or folder with the recipe's fields "
                                                            "instead.")] = None,
    n_examples: Annotated[int, typer.Option("--n-examples", min=1, help="Examples analysed (the first N).")] = 500,
    out: Annotated[Path | None, typer.Option("--out", help="Output folder [default: RUN/heads].")] = None,
    importance: Annotated[Importance, typer.Option(
        "--importance", help="Ablation metric (bleu: translation; accuracy: classification).")] = Importance("loss"),
    prune: Annotated[bool, typer.Option("--prune", help="Pruning curves (least important heads first).")] = False,
    prune_split: Annotated[str | None, typer.Option("--prune-split", help="Split the pruning cost is measured on "
                                                                          "[default: test].")] = None,
    max_drop: Annotated[float, typer.Option("--max-drop", min=0.0, help="Largest acceptable metric drop for "
                                                                        "--save-pruned.")] = 0.5,
    save_pruned: Annotated[Path | None, typer.Option("--save-pruned", help="Write the pruned model as a new run "
                                                                           "directory (implies --prune).")] = None,
    ablate: Annotated[Ablation, typer.Option("--ablate", help="A removed head outputs zero (Michel et al. 2019), its "
                                                              "mean, or its mean with the layer's other heads "
                                                              "rescaled by least squares (rescale), or zero with the "
                                                              "layer's other heads scaled by H / kept (renorm, as "
                                                              "DropHead trains them); folded into the weights when "
                                                              "saved.")] = Ablation("zero"),
    prune_order: Annotated[PruneOrder, typer.Option("--prune-order", help="one-shot (increasing ablation "
                                                                          "importance), gradient (Michel et al.'s "
                                                                          "normalised gradient importance) or greedy "
                                                                          "(re-ranked after every step).")
                           ] = PruneOrder("one-shot"),
    prune_step: Annotated[float, typer.Option("--prune-step", min=0.0, max=0.5,
                                              help="Spacing of the pruning curve, as a fraction of all heads.")] = 0.1,
    checkpoint: CheckpointOption = None,
    device: DeviceOption = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print heads.json to stdout instead of the table.")] = False,
) -> None:
    """Capture every head's attention, name positional / rare-word / special heads, rank heads by
    ablation, gradient and confidence, optionally prune, and write heads.json, PNGs and report.html."""
    config = HeadsConfig(split=split, data=data, n_examples=n_examples, out=out, importance=_word(importance),
                         ablate=_word(ablate), prune=prune, prune_split=prune_split, prune_order=_word(prune_order),
                         prune_step=prune_step, max_drop=max_drop, save_pruned=save_pruned, checkpoint=checkpoint,
                         device=device)
    problems = config.problems()
    if problems:  # the core names HeadsConfig's fields; a CLI user typed flags
        raise RunError([as_flag(line) for line in problems])
    progress, on_event = _phase_bar()
    try:
        with flags_named("importance", "save_pruned", "split", "data", "device"):
            report = inspect_heads(run, config, on_event=on_event)
    finally:
        finish(progress)
    if as_json:
        typer.echo(report.to_json())
        return
    _print_report(report)


def _phase_bar():
    """A bar a phase (statistics, ablation, gradients, report), each with its ETA; and the event
    handler that moves it."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
    state = {"task": None}

    def on_event(kind: str, payload: dict) -> None:
        if kind == "start":
            progress.start()
            console.print(f"[dim]{payload['heads']} heads in {payload['sites']} attention modules, "
                          f"{payload['examples']} examples[/dim]")
        elif kind == "phase":
            if state["task"] is not None:
                progress.update(state["task"], completed=progress.tasks[state["task"]].total)
            state["task"] = progress.add_task(payload["name"], total=payload["total"])
        elif kind == "advance":
            progress.update(state["task"], completed=payload["done"])

    return progress, on_event


def _print_report(report) -> None:
    """The heads table, the rank correlations, the pruning result and where the report is."""
    stdout.print(heads_table(report))
    correlation = ", ".join(f"{k} {v:.2f}" for k, v in report.rank_correlation.items())
    stdout.print(f"Spearman rank correlation: {correlation}")
    p = report.pruning
    if p is not None:
        best = p["largest_within_max_drop"]
        stdout.print(f"Pruning: {best['pruned']} heads ({best['fraction_of_heads']:.0%}) removed for "
                     f"{p['metric']} {p['base']:.2f} -> {best['metric']:.2f} on {p['split']} "
                     f"(largest step within --max-drop {p['max_drop']:g})")
    m = report.pruned_model
    if m is not None and m["path"] is None:
        stdout.print(m["reason"].replace("max_drop", "--max-drop"))
    elif m is not None:
        stdout.print(f"Pruned model: {m['path']} ({m['parameters']:,} parameters, was {m['parameters_before']:,}; "
                     f"{p['metric']} {m['metric']:.2f}; {m['seconds']:.1f} s vs {m['seconds_before']:.1f} s)")
    stdout.print(f"[dim]{report.syntactic}[/dim]")
    stdout.print(f"[dim]{report.artifacts['report']} (and heads.json, PNGs beside it)[/dim]")


def _word(choice) -> str:
    """An Enum choice's word (typer passes the Enum; a default given as a string stays one)."""
    return getattr(choice, "value", choice)


def heads_table(report: HeadsReport) -> Table:
    """One row per head, most important first. Narrow borders and two short headers keep every
    header whole at 80 columns; the roles column takes what is left and wraps."""
    table = Table(title=f"attention heads by {report.ablate}-ablation importance ({report.importance_metric}, "
                        f"{report.n_examples} examples)", header_style="bold", box=box.SIMPLE_HEAD,
                  expand=True, collapse_padding=True, pad_edge=False,
                  caption="grad.: gradient importance; conf.: confidence (mean max weight)")
    slots = any("memory" in h for h in report.heads)  # a model with memory slots: their share per head
    for column in ("attention", "head", "ablation", "grad.", "conf.", "entropy", "special") + (("memory",) * slots):
        table.add_column(column, justify="left" if column == "attention" else "right", no_wrap=True,
                         min_width=len(column))
    table.add_column("roles", ratio=1, min_width=8)
    for h in sorted(report.heads, key=lambda h: -h["ablation"]):
        space = h["space"].replace("encoder", "enc").replace("decoder", "dec")
        memory = (f"{h.get('memory', 0.0):.2f}",) * slots
        table.add_row(f"{space} L{h['layer']}", str(h["head"]), f"{h['ablation']:+.4f}", f"{h['gradient']:.3f}",
                      f"{h['confidence']:.2f}", f"{h['entropy']:.2f}", f"{h['special']:.2f}", *memory,
                      ", ".join(h["roles"]))
    return table

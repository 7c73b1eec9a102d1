"""xformer inspect-heads RUN: what every attention head does, which heads matter, what pruning costs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from xformer.heads import inspect_heads
from xformer_cli.common import user_errors


@user_errors
def inspect_heads_command(
    run: Path = typer.Argument(..., help="A trained run directory (translation or Transformer classifier)."),
    split: str | None = typer.Option(None, "--split", help="Split to analyse [default: validation]."),
    data: str | None = typer.Option(None, "--data", help="A JSONL file or folder with the recipe's fields instead."),
    n_examples: int = typer.Option(500, "--n-examples", min=1, help="Examples analysed (the first N)."),
    out: Path | None = typer.Option(None, "--out", help="Output folder [default: RUN/heads]."),
    importance: str = typer.Option("loss", "--importance", help="Ablation metric: loss, bleu or accuracy."),
    prune: bool = typer.Option(False, "--prune", help="Pruning curves (least important heads first)."),
    prune_split: str | None = typer.Option(None, "--prune-split", help="Split the pruning cost is measured on "
                                                                      "[default: test]."),
    max_drop: float = typer.Option(0.5, "--max-drop", help="Largest acceptable metric drop for --save-pruned."),
    save_pruned: Path | None = typer.Option(None, "--save-pruned", help="Write the pruned model as a new run "
                                                                        "directory (implies --prune)."),
    ablate: str = typer.Option("zero", "--ablate", help="A removed head outputs zero (Michel et al. 2019), its "
                                                         "mean, or its mean with the layer's other heads "
                                                         "rescaled by least squares (rescale), or zero with the "
                                                         "layer's other heads scaled by H / kept (renorm, as "
                                                         "DropHead trains them); folded into the weights when "
                                                         "saved."),
    prune_order: str = typer.Option("one-shot", "--prune-order", help="one-shot (increasing ablation importance), "
                                                                      "gradient (Michel et al.'s normalised gradient "
                                                                      "importance) or greedy (re-ranked after every "
                                                                      "step)."),
    prune_step: float = typer.Option(0.1, "--prune-step", help="Spacing of the pruning curve, as a fraction of "
                                                               "all heads."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="best, last or averaged [default: recipe's]."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda or cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="Print heads.json to stdout instead of the table."),
) -> None:
    """Capture every head's attention, name positional / rare-word / special heads, rank heads by
    ablation, gradient and confidence, optionally prune, and write heads.json, PNGs and report.html."""
    console = Console(stderr=True)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
    state = {"task": None}

    def on_event(kind: str, payload: dict) -> None:
        if kind == "start":
            console.print(f"[dim]{payload['heads']} heads in {payload['sites']} attention modules, "
                          f"{payload['examples']} examples[/dim]")
        elif kind == "phase":
            if state["task"] is not None:
                progress.update(state["task"], completed=progress.tasks[state["task"]].total)
            state["task"] = progress.add_task(payload["name"], total=payload["total"])
        elif kind == "advance":
            progress.update(state["task"], completed=payload["done"])

    with progress:
        report = inspect_heads(run, out=out, split=split, data=data, n_examples=n_examples, importance=importance,
                               prune=prune, prune_split=prune_split, max_drop=max_drop, save_pruned=save_pruned,
                               checkpoint=checkpoint, ablate=ablate, prune_order=prune_order, prune_step=prune_step,
                               device=device, on_event=on_event)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    Console().print(heads_table(report))
    correlation = ", ".join(f"{k} {v:.2f}" for k, v in report["rank_correlation"].items())
    Console().print(f"Spearman rank correlation: {correlation}")
    if "pruning" in report:
        p = report["pruning"]
        best = p["largest_within_max_drop"]
        Console().print(f"Pruning: {best['pruned']} heads ({best['fraction_of_heads']:.0%}) removed for "
                        f"{p['metric']} {p['base']:.2f} -> {best['metric']:.2f} on {p['split']} "
                        f"(largest step within --max-drop {p['max_drop']:g})")
    if report.get("pruned_model", {}).get("path") is None and "pruned_model" in report:
        Console().print(report["pruned_model"]["reason"])
    elif "pruned_model" in report:
        m = report["pruned_model"]
        Console().print(f"Pruned model: {m['path']} ({m['parameters']:,} parameters, was {m['parameters_before']:,}; "
                        f"{p['metric']} {m['metric']:.2f}; {m['seconds']:.1f} s vs {m['seconds_before']:.1f} s)")
    Console().print(f"[dim]{report['syntactic']}[/dim]")
    Console().print(f"[dim]{report['artifacts']['report']} (and heads.json, PNGs beside it)[/dim]")


def heads_table(report: dict) -> Table:
    """One row per head, most important first. Narrow borders and two short headers keep every
    header whole at 80 columns; the roles column takes what is left and wraps."""
    table = Table(title=f"attention heads by {report['ablate']}-ablation importance ({report['importance_metric']}, "
                        f"{report['n_examples']} examples)", header_style="bold", box=box.SIMPLE_HEAD,
                  expand=True, collapse_padding=True, pad_edge=False,
                  caption="grad.: gradient importance; conf.: confidence (mean max weight)")
    for column in ("attention", "head", "ablation", "grad.", "conf.", "entropy", "special"):
        table.add_column(column, justify="left" if column == "attention" else "right", no_wrap=True,
                         min_width=len(column))
    table.add_column("roles", ratio=1, min_width=8)
    for h in sorted(report["heads"], key=lambda h: -h["ablation"]):
        space = h["space"].replace("encoder", "enc").replace("decoder", "dec")
        table.add_row(f"{space} L{h['layer']}", str(h["head"]), f"{h['ablation']:+.4f}", f"{h['gradient']:.3f}",
                      f"{h['confidence']:.2f}", f"{h['entropy']:.2f}", f"{h['special']:.2f}", ", ".join(h["roles"]))
    return table

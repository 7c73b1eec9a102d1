"""xformer longrange SWEEP: Transformer (and its variants) vs LSTM across sequence lengths, as tables and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.studies.grid import GridStopped
from xformer.studies.longrange import load_sweep, run_sweep
from xformer.training.trackers import requested
from xformer_cli.common import DeviceOption, ReportOption, stdout, user_errors
from xformer_cli.display import GridBar


@user_errors
def longrange(
    sweep: Annotated[Path, typer.Argument(help="Sweep TOML ([sweep] names the two recipes, lengths, seeds, "
                                               "budget; [sweep.variants] any Transformer variants).")],
    out: Annotated[Path | None, typer.Option("--out", help="Sweep directory [default: runs/<sweep name>].")] = None,
    overrides: Annotated[list[str], typer.Option("--set", help="Override a sweep value: "
                                                               "--set sweep.lengths=[64,128].")] = [],  # noqa: B006
    device: DeviceOption = "auto",
    report_to: ReportOption = [],  # noqa: B006 - typer reads the default, never mutates it
) -> None:
    """Train every model (the Transformer, its variants, the LSTM) at every length and seed
    (rows already done are kept), then write comparison.json, comparison.md and comparison.png."""
    trackers = requested(report_to)  # one not installed: exit 2 before anything is read
    loaded = load_sweep(sweep, overrides)
    out_dir = out or Path("runs") / sweep.stem
    bar = GridBar("sweep")

    def on_event(kind: str, payload: dict) -> None:
        if kind == "plan":  # rows already done do not report again
            bar.plan(payload["rows"], payload["done"], out_dir, silent=payload["done"])
        elif kind == "row_start":
            bar.start(f"{payload['model']} length {payload['length']} seed {payload['seed']}", payload["resume"])
        elif kind == "row_progress":
            bar.advance(payload["fraction"])
        elif kind == "row_end":
            bar.end(f"{payload['model']:>11} length {payload['length']:>5} seed {payload['seed']}: "
                    f"test accuracy {payload['test_accuracy']:.2f}%, {payload['tokens_per_s']:,.0f} tokens/s, "
                    f"{payload['steps']} steps")

    try:
        with bar:
            comparison = run_sweep(loaded, out_dir, device=device, on_event=on_event, report_to=trackers)
    except (KeyboardInterrupt, GridStopped) as stop:
        name = stop.signal if isinstance(stop, GridStopped) else "SIGINT"
        typer.echo(f"stopped by {name}; run the same command again to continue the sweep in {out_dir}", err=True)
        raise typer.Exit(130 if name == "SIGINT" else 0) from None  # as train: Ctrl-C 130, SIGTERM/SIGHUP 0
    table = Table(title=f"{comparison.task}: test accuracy % (mean +- std over seeds), "
                        f"{comparison.budget_per_run} per run", header_style="bold")
    for column in ("length", "model", "accuracy %", "params", "tokens/s", "peak MB", "tokens/s vs transformer"):
        table.add_column(column, justify="left" if column == "model" else "right")
    by = {(g["model"], g["length"]): g for g in comparison.summary}
    for n in comparison.lengths:
        base = by[("transformer", n)]
        for model in comparison.models:
            g = by[(model, n)]
            table.add_row(str(n), model, f"{g['accuracy_mean']:.2f} +- {g['accuracy_std']:.2f}",
                          f"{g['parameters']:,}", f"{g['tokens_per_s']:,.0f}", f"{g['peak_memory_mb']:.0f}",
                          f"{g['tokens_per_s'] / max(base['tokens_per_s'], 1e-9):.2f}x")
        table.add_section()
    stdout.print(table)
    stdout.print(f"[dim]{out_dir}/comparison.json, comparison.md, comparison.png[/dim]")

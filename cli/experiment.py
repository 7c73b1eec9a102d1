"""xformer experiment SPEC: a grid of recipe overrides over seeds, compared with a baseline cell."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.studies.experiment import load_experiment, run_experiment
from xformer.studies.grid import GridStopped
from xformer.training.trackers import requested
from xformer_cli.common import DeviceOption, JsonOption, ReportOption, stdout, user_errors
from xformer_cli.display import GridBar


@user_errors
def experiment(
    spec: Annotated[Path, typer.Argument(help="Experiment TOML ([experiment] names the recipe, seeds, baseline "
                                              "and budget; [experiment.cells] the overrides of each cell).")],
    out: Annotated[Path | None, typer.Option("--out", help="Experiment directory [default: "
                                                           "runs/<spec name>].")] = None,
    overrides: Annotated[list[str], typer.Option(
        "--set", help="A recipe value for every cell, TOML-typed (--set train.lr=3e-4), or the spec's own "
                      "(--set experiment.max_steps=3000); repeatable.")] = [],  # noqa: B006
    reuse: Annotated[list[Path], typer.Option("--reuse", help="Folder of finished runs (searched at any depth, "
                                                              "repeatable): a run whose resolved recipe is the "
                                                              "same is copied in instead of trained again.")] = [],  # noqa: B006
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Runs trained at once, each in its own process with "
                                                          "the CPU threads split between them (on CUDA, sharing the "
                                                          "device); an experiment that times its runs runs them one at "
                                                          "a time.")] = 1,
    device: DeviceOption = "auto",
    report_to: ReportOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Train every cell at every seed (finished runs are kept, stopped ones resume), score each
    on the test split with its best validation checkpoint, then write results.json, results.md
    and results.png with paired tests against the baseline cell."""
    trackers = requested(report_to)  # one not installed: exit 2 before anything is read
    loaded = load_experiment(spec, overrides)
    out_dir = out or Path("runs") / spec.stem
    bar = GridBar("experiment")
    on_event = _events(bar, out_dir)

    try:
        with bar:
            result = run_experiment(loaded, out_dir, device=device, reuse=reuse, on_event=on_event, jobs=jobs,
                                    report_to=trackers)
    except (KeyboardInterrupt, GridStopped) as stop:
        name = stop.signal if isinstance(stop, GridStopped) else "SIGINT"
        typer.echo(f"stopped by {name}; run the same command again to continue the experiment in {out_dir}", err=True)
        raise typer.Exit(130 if name == "SIGINT" else 0) from None  # as train: Ctrl-C 130, SIGTERM/SIGHUP 0
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    stdout.print(_cells_table(result))
    stdout.print(f"[dim]{out_dir}/results.json, results.md, results.png[/dim]")


def _events(bar: GridBar, out_dir: Path):
    """The handler of run_experiment's events: the bar and its one-line messages."""

    def on_event(kind: str, payload: dict) -> None:
        if kind == "plan":  # finished runs report again (their scores), so the bar starts at 0
            bar.plan(payload["runs"], payload["done"], out_dir)
        elif kind == "reused":
            again = "; scored again" if payload["rescore"] else ""
            bar.say(f"{payload['cell']} seed {payload['seed']}: the same run is finished in {payload['source']}; "
                    f"copied, not trained again{again}")
        elif kind == "run_start":
            at = f" at {payload['budget']} steps" if payload.get("budget") else ""
            bar.start(f"{payload['cell']} seed {payload['seed']}{at}", payload["resume"])
        elif kind == "setup":
            bar.say(payload["message"])
        elif kind == "jobs":
            bar.say(f"{payload['waiting']} runs to train, {payload['jobs']} at a time, {payload['threads']} CPU "
                    "thread(s) each")
        elif kind == "job_end":
            bar.say(f"{payload['cell']} seed {payload['seed']}: trained and scored")
        elif kind == "diverged":
            bar.say(f"{payload['cell']} seed {payload['seed']}: diverged at step {payload['diverged_at']} (the loss "
                    "stayed non-finite); scored as an empty output")
        elif kind == "run_progress":
            bar.advance(payload["fraction"])
        elif kind == "run_end":
            at = f" at {payload['budget']} steps" if payload.get("budget") else ""
            bar.end(f"{payload['cell']} seed {payload['seed']}{at}: test {payload['metric']} {payload['test']:.2f}, "
                    f"{payload['steps']} steps")

    return on_event


def _cells_table(result) -> Table:
    """Each cell's test score over the seeds, against the baseline."""
    seeds = f"{len(result.seeds)} seed{'s' if len(result.seeds) > 1 else ''}"
    table = Table(title=f"test {result.metric}, mean +- std over {seeds}, "
                        f"{result.budget_per_run} per run", header_style="bold")
    for column in ("cell", "test", "valid", "vs baseline", "paired p < 0.05", "parameters"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for c in result.cells:
        table.add_row(c["cell"], f"{c['test_mean']:.2f} +- {c['test_std']:.2f}",
                      f"{c['valid_mean']:.2f}" if c["valid_mean"] is not None else "n/a",
                      f"{c['difference']:+.2f}" if "difference" in c else "baseline",
                      f"{c['significant_seeds']} of {len(result.seeds)}" if "significant_seeds" in c else "",
                      f"{c['parameters']:,}")
    return table

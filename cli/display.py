"""Rich rendering shared by commands: the training progress display, the bar over a grid of
runs and score tables."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

from xformer_cli import common

TOTAL = 1000  # the bar counts thousandths of the run (steps, epochs or minutes, whichever ends it first)


def finish(progress: Progress) -> None:
    """Stop a bar that was started; rich's stop() of one never started, or of a transient bar
    outside a terminal, writes an empty line (which would stand above the error that ended it)."""
    if progress.live.is_started:
        progress.stop()


def passing_bar(console: Console) -> Progress:
    """A transient bar (gone once done) for work of unknown length; drawn on a terminal only,
    where it can erase itself."""
    return Progress(console=console, transient=True, disable=not console.is_terminal)


class TrainDisplay:
    """Consumes xformer.train events: a progress bar with step, epoch, loss, lr, tokens/s and
    ETA; a printed line per validation."""

    def __init__(self, console: Console | None = None):
        self.console = console or common.console
        # Times come first and the bar is short, so a narrow (80-column) terminal cuts the
        # statistics at the end rather than the elapsed time and ETA.
        self.progress = Progress(
            TextColumn("[bold]train[/bold]"), BarColumn(bar_width=16), TaskProgressColumn(),
            TimeElapsedColumn(table_column=Column(min_width=7, no_wrap=True)), TextColumn("ETA"),
            TimeRemainingColumn(table_column=Column(min_width=7, no_wrap=True)),
            TextColumn("step {task.fields[step]} ep {task.fields[epoch]} loss {task.fields[loss]} "
                       "lr {task.fields[lr]} {task.fields[tps]} tok/s",
                       table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=self.console, transient=False,
        )
        self.task = None
        self.teacher_bar: Progress | None = None

    def __enter__(self):
        return self  # the bar appears at the "start" event, after data and tokenizer are ready

    def __exit__(self, *exc):
        finish(self.progress)  # an error before the "start" event leaves no empty line above it
        if self.teacher_bar is not None:
            finish(self.teacher_bar)

    def __call__(self, kind: str, payload: dict) -> None:
        if kind == "setup":
            self.progress.console.print(payload["message"], style="dim", markup=False)
        elif kind == "distill":  # the teacher translating the training sources, before training
            if self.teacher_bar is None:
                self.teacher_bar = Progress(TextColumn("[bold]teacher[/bold]"), BarColumn(bar_width=16),
                                            TaskProgressColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                                            TimeRemainingColumn(), TextColumn("{task.completed:,.0f} sentences"),
                                            console=self.console, transient=True,
                                            disable=not self.console.is_terminal)
                self.teacher_bar.start()
                self.teacher_bar.add_task("teacher", total=payload["total"])
            self.teacher_bar.update(0, completed=payload["done"])
            if payload["done"] >= payload["total"]:
                finish(self.teacher_bar)
        elif kind == "warning":
            self.progress.console.print(payload["message"], style="bold yellow", markup=False)
        elif kind == "start":
            self.progress.start()
            self.task = self.progress.add_task("train", total=TOTAL, step=0, epoch=1, loss="-", lr="-", tps="-")
            self.progress.console.print(
                f"[dim]{payload['parameters']:,} parameters, {payload['steps_per_epoch']} steps per epoch, "
                f"run directory {payload['run_dir']}[/dim]")
            self.progress.update(self.task, step=payload["step"])
        elif kind == "tick":
            self.progress.update(self.task, completed=payload["fraction"] * TOTAL, step=payload["step"])
        elif kind == "step":
            loss = "not finite" if payload["loss"] is None else f"{payload['loss']:.3f}"
            self.progress.update(
                self.task, completed=payload["fraction"] * TOTAL, step=payload["step"], epoch=payload["epoch"],
                loss=loss, lr=f"{payload['lr']:.2e}", tps=f"{payload['tokens_per_s']:,.0f}")
            if payload.get("skipped"):
                self.progress.console.print(f"[yellow]step {payload['step']}: {payload['skipped']} step(s) skipped "
                                            "since the last line (loss or gradients not finite)[/yellow]")
        elif kind == "valid":
            extra = "".join(f" {key} {payload[key]:.2f}" for key in ("ppl", "bleu", "accuracy") if key in payload)
            mark = " [green]best[/green]" if payload.get("best") else ""
            self.progress.console.print(f"step {payload['step']}: valid loss {payload['loss']:.3f}{extra}{mark}")


class GridBar:
    """One bar over a grid of runs (an experiment's cells x seeds, a sweep's rows), moved on by
    each run's fraction done, with the run in training named beside it; use as a context."""

    def __init__(self, label: str, console: Console | None = None):
        self.progress = Progress(TextColumn(f"[bold]{label}[/bold]"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[run]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                 TimeRemainingColumn(), console=console or common.console)
        self.task, self.done = None, 0

    def __enter__(self):
        return self  # the bar appears with plan(), once the grid is known to be runnable

    def __exit__(self, *exc):
        finish(self.progress)

    def plan(self, runs: int, done: int, out_dir, *, silent: int = 0) -> None:
        """`silent`: finished runs that will not report again (the bar starts past them)."""
        self.done = silent
        self.progress.start()
        self.task = self.progress.add_task("grid", total=runs * TOTAL, completed=silent * TOTAL, run="")
        self.progress.console.print(f"[dim]{runs} runs, {done} done already; results in {out_dir}[/dim]")

    def start(self, name: str, resumed: bool) -> None:
        self.progress.update(self.task, run=name + (" (resumed)" if resumed else ""))

    def advance(self, fraction: float) -> None:
        self.progress.update(self.task, completed=(self.done + fraction) * TOTAL)

    def end(self, line: str) -> None:
        self.done += 1
        self.progress.update(self.task, completed=self.done * TOTAL)
        self.progress.console.print(line)

    def say(self, line: str) -> None:
        self.progress.console.print(line)


def score_table(title: str, rows: dict) -> Table:
    table = Table(title=title, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    return table

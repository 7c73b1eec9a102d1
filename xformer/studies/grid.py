"""Driving a grid of runs (`xformer experiment`'s cells x seeds, `xformer longrange`'s lengths x
models x seeds): each run trained to its budget whatever state an earlier attempt left it in,
and the grid's settings pinned in its folder so a rerun adds to the same comparison or is
refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from xformer.allocator import release
from xformer.config.schema import Recipe
from xformer.errors import RunError
from xformer.files import atomic_write_text
from xformer.locks import LOCK
from xformer.studies.archive import ARCHIVED
from xformer.studies.sittings import SITTINGS
from xformer.train import run
from xformer.training.progress import StopSignals
from xformer.training.run_folder import is_run_dir, run_state
from xformer.training.trackers import STATE, Reporting


class GridStopped(Exception):  # noqa: N818 - a stop asked for, like KeyboardInterrupt, not an error
    """Ctrl-C, SIGTERM or SIGHUP reached a grid (experiment, longrange sweep): the run in
    progress stopped with its checkpoint, nothing after it started. `signal` names it."""

    def __init__(self, signal: str):
        super().__init__(signal)
        self.signal = signal


def stop_if_asked(stops: StopSignals) -> None:
    """Raise GridStopped once a stop signal reached the grid (between runs: before the next starts)."""
    if stops.received:
        raise GridStopped(stops.name)


def train_to_end(recipe: Recipe, run_dir: Path, *, device: str, on_fraction: Callable[[float], None],
                 measure_memory: bool = False, branch: tuple[Path, int] | None = None,
                 reporting: Reporting = Reporting()) -> None:
    """Train the run in run_dir to its budget: from scratch when new, resumed when an earlier
    attempt stopped part way, nothing when it is trained (rundir.run_state). on_fraction gets
    the run's progress, 0..1. A stop signal stops the run with its checkpoint saved and raises
    GridStopped, so the grid stops too, even when it landed on the run's last step;
    DivergedError (non-finite losses) propagates. `branch` = (RUN, STEP): a new run starts as
    RUN stood at STEP (xformer.train's branches). `reporting`: its trackers (train.run's)."""
    state = run_state(run_dir)
    if state == "trained":
        return
    release()  # the last run's freed memory, kept resident by the tuned heap, goes back first

    def forward(kind, payload):
        if kind in ("tick", "step"):
            on_fraction(payload["fraction"])

    fresh = state == "new" and branch is not None and not run_dir.exists()
    result = run(recipe, run_dir, device=device, resume=state == "resume", overwrite=state == "new" and not fresh,
                 on_event=forward, measure_memory=measure_memory, branch_from=branch[0] if fresh else None,
                 at_step=branch[1] if fresh else None, reporting=reporting)
    if result.stop_reason == "interrupted" or result.stop_signal:
        raise GridStopped(result.stop_signal or "SIGINT")


def restored_only(out_dir: Path) -> bool:
    """Whether OUT holds nothing but a runs/ folder of archived runs restore_runs put there (and
    the sittings restored beside them)."""
    runs = out_dir / "runs"
    return ({p.name for p in out_dir.iterdir()} - {LOCK, STATE, SITTINGS} == {"runs"} and runs.is_dir()
            and all((run / ARCHIVED).is_file() for run in runs.iterdir()))


def check_grid_dir(out_dir: Path, pinned: str, command: str) -> None:
    """Refuse an --out that is not this kind of grid's: a file, a training run's folder, or a
    non-empty folder without the grid's `pinned` settings file (a user's files would be
    overwritten by same-named ones). Missing or empty folders are fine."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise RunError(f"{out_dir}: is a file, not a folder; choose another --out")
    if is_run_dir(out_dir):
        raise RunError(f"{out_dir}: is a training run's folder (xformer train), not one xformer {command} writes; "
                       "choose another --out")
    if restored_only(out_dir):
        return  # runs put back from their records (xformer.studies.archive), before the experiment's first start
    if {p.name for p in out_dir.iterdir()} - {LOCK, STATE} and not (out_dir / pinned).is_file():
        raise RunError(f"{out_dir}: not empty and not a folder xformer {command} wrote (no {pinned}); it will not "
                       "write into it: choose another --out")


def pin(path: Path, settings: dict, refusal: str, *, as_now: Callable[[dict], dict] = lambda old: old) -> None:
    """Write the grid's settings to path the first time; on a rerun, refuse (RunError: path and
    `refusal`) unless they are the same. as_now reads the saved settings the way today's code
    would write them (a field added since, at its default, is no difference)."""
    if path.is_file():
        if as_now(json.loads(path.read_text())) != json.loads(json.dumps(settings)):
            raise RunError(f"{path}: {refusal}")
        return
    atomic_write_text(path, json.dumps(settings, indent=2))

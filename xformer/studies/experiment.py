"""Experiments: one recipe, a grid of cells (each a list of --set overrides) over several seeds,
each cell and seed an ordinary run directory, compared with a baseline cell.

    [experiment]
    recipe = "../translation/multi30k_de_en.toml"   # relative to the spec file
    seeds = [1, 2, 3]                                # train.seed of each run
    baseline = "heads_8"                             # the cell the others are compared with
    max_time = 10.0                                  # minutes of training per run (or max_steps)
    set = ["train.valid_every=500"]                  # overrides of every cell
    rescore = false                                  # true: score runs copied by --reuse again

    [experiment.cells]
    heads_1 = ["model.n_heads=1"]
    heads_8 = []

Every run lives in OUT/runs/<cell>-s<seed>; a finished run is kept, one stopped part way
(Ctrl-C, a kill) resumes from its last checkpoint, so a rerun continues where it stopped. With
`reuse` folders, a run not started yet is first looked for among the finished runs there (any
depth): one whose resolved recipe.toml is this run's, setting for setting and seed for seed, is
copied in rather than trained again (specs that share a baseline train it once); one that
differs only in how it is decoded (eval.beam, lenpen, checkpoint, quantize: what a cell such as
`eval.quantize=int8` changes) is copied with this run's recipe and scored again, as is every
copy with `rescore = true` (timings taken in one sitting). RUN/copied-from.json names the
source. Each run's checkpoint with the best validation score (train.best_metric) is scored once
on the test split. Then

    OUT/results.json   every run, and per cell: the test and validation metric's mean and std
                       over seeds, the mean difference from the baseline, a paired test
                       against the baseline run of the same seed (translation: sacreBLEU's
                       paired bootstrap; classification: McNemar's exact test), and the mean
                       speeds: training steps a second (validation excluded) and test
                       sentences decoded (translation) or examples classified a second (timed
                       on the machine that ran the run: compare cells run on one machine, one
                       at a time), and for translation the decoder's KV cache at its largest
    OUT/results.md     the same as a table (xformer.studies.experiment_report)
    OUT/results.png    the test metric per cell, mean and std
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from xformer.errors import DivergedError, RecipeError, RunError
from xformer.evaluate import paired_set
from xformer.events import Event, ignore
from xformer.locks import FolderLock
from xformer.results import ExperimentResult
from xformer.significance import SIGNIFICANT
from xformer.studies.archive import archived_best
from xformer.studies.experiment_report import SPEEDS, write_results
from xformer.studies.experiment_scoring import (
    at_lengths,
    diverged_at,
    head_roles,
    input_lengths,
    score_diverged,
    score_run,
    teachers,
)
from xformer.studies.experiment_spec import Experiment, cooldown_start, load_experiment, run_key
from xformer.studies.grid import check_grid_dir, pin, stop_if_asked, train_to_end
from xformer.studies.jobs import Jobs
from xformer.studies.reuse import copy_run, finished_runs, reused_branch, same_run
from xformer.studies.sittings import Sitting
from xformer.tasks import make_task
from xformer.training.pauses import Pauses
from xformer.training.progress import StopSignals
from xformer.training.run_folder import run_state
from xformer.training.trackers import Reporting, experiment_reporting

MEASURES = (*SPEEDS, "decode_cache_mb")  # averaged per cell


def run_experiment(experiment: Experiment, out_dir: str | Path, *, device: str = "auto",
                   reuse: list[str | Path] = (), on_event: Event | None = None, jobs: int = 1,
                   report_to: tuple[str, ...] = ()) -> ExperimentResult:
    """Train and score every run not done yet (copying a finished run of the same recipe from
    the `reuse` folders where there is one), then compare and write the results. One process
    at a time writes to an experiment's folder (xformer.locks). `jobs` > 1 trains that many
    runs at once (_in_parallel), except in an experiment whose checks time its runs: timed runs
    run alone. `report_to`: the trackers each run reports to, grouped under the experiment
    (xformer.training.trackers.experiment_reporting)."""
    check_grid_dir(Path(out_dir), "experiment.json", "experiment")
    emit = on_event or ignore
    if jobs > 1 and experiment.times_runs():
        emit("setup", {"message": f"--jobs {jobs}: this experiment's checks time its runs, so they run one at a "
                                  "time"})
        jobs = 1
    with FolderLock(out_dir, "experiment"), StopSignals() as stops, Pauses() as pauses:
        reporting, parent = experiment_reporting(tuple(report_to), Path(out_dir))
        # the wall time, across sittings (the ledger shows it), the time it stood stopped left out
        sitting = Sitting(Path(out_dir), jobs, clock=pauses.leave_out(time.monotonic))

        def timed(kind: str, fields: dict) -> None:
            emit(kind, fields)
            sitting.tick()

        finished = False
        try:
            result = _run_experiment(experiment, Path(out_dir), device=device, reuse=reuse, emit=timed, stops=stops,
                                     jobs=jobs, reporting=reporting)
            finished = True
            return result
        finally:
            sitting.end("finished" if finished else "stopped")
            if parent is not None:
                parent.close(finished)


def _run_experiment(experiment: Experiment, out_dir: Path, *, device: str, reuse: list[str | Path],
                    emit: Event, stops: StopSignals, jobs: int = 1,
                    reporting: Reporting = Reporting()) -> ExperimentResult:
    finished = finished_runs(reuse, out_dir)
    scored = _one_test_set(experiment)
    out_dir.mkdir(parents=True, exist_ok=True)
    _pin(experiment, out_dir)
    plan = [(cell, seed) for cell in experiment.cells for seed in experiment.config.seeds]
    rows: dict[tuple, dict] = {}  # (cell, seed): the run; (cell, seed, budget): a curve's cooldown
    folders = [run_key(c, s, b) for c, s in plan for b in [0, *experiment.config.budgets[:-1]]]
    emit("plan", {"runs": len(folders), "done": sum(run_state(out_dir / "runs" / f) == "trained"
                                                    and (out_dir / "runs" / f / "eval.json").is_file()
                                                    for f in folders)})
    if jobs > 1:
        _in_parallel(experiment, out_dir, plan, finished, device=device, jobs=jobs, emit=emit, stops=stops,
                     reporting=reporting)
    for index, (cell, seed) in enumerate(plan):
        stop_if_asked(stops)  # a stop that landed while the last run ended or was scored
        rows.update(_train_one(experiment, out_dir, index, cell, seed, device=device, finished=finished, emit=emit,
                               stops=stops, reporting=reporting))
    stop_if_asked(stops)
    largest = {key: row for key, row in rows.items() if len(key) == 2}
    curves = None
    if experiment.config.budgets:
        every = {key: {**row, "budget": experiment.config.budgets[-1]} for key, row in largest.items()}
        every.update({key: row for key, row in rows.items() if len(key) == 3})
        curves = []
        for b in experiment.config.budgets:
            at = _compare(experiment, {(c, s): r for (c, s, *_), r in every.items() if r["budget"] == b}, scored,
                          out_dir)
            curves.append({"budget": b, "cells": at.cells, "runs": at.runs})
        for (cell, seed), row in largest.items():  # the curve convergence is judged on: the budgets' best validation
            row["curve"] = [[b, every[(cell, seed, b) if b != experiment.config.budgets[-1] else (cell, seed)]["valid"]]
                            for b in experiment.config.budgets]
            row["budget"] = experiment.config.budgets[-1]
    result = _compare(experiment, largest, scored, out_dir)
    result.curves = curves
    c = experiment.config
    result.test_lengths = input_lengths(experiment, out_dir / "runs" / run_key(c.baseline, c.seeds[0]))
    result.teachers = teachers(experiment)
    write_results(result, out_dir)
    return result


def _train_one(experiment: Experiment, out_dir: Path, index: int, cell: str, seed: int, *, device: str,
               finished: list, emit: Event, stops: StopSignals | None,
               reporting: Reporting = Reporting()) -> dict[tuple, dict]:
    """The run of `cell` and `seed` (copied by --reuse where it can be), and its curve's
    cooldowns, each trained to the end and scored: their rows."""
    rows: dict[tuple, dict] = {}
    run_dir = out_dir / "runs" / run_key(cell, seed)
    state = run_state(run_dir)
    if state == "new" and not run_dir.exists() and finished:
        recipe = experiment.recipe(cell, seed)
        source, rescore = same_run(recipe.to_dict(), finished)
        rescore = rescore or experiment.config.rescore
        if source is not None and not (rescore and archived_best(source) is not None):  # archived: no weights
            copy_run(source, run_dir, recipe if rescore else None)
            emit("reused", {"cell": cell, "seed": seed, "source": str(source), "rescore": rescore})
            state = "trained"
    emit("run_start", {"index": index, "cell": cell, "seed": seed, "resume": state == "resume"})
    diverged = diverged_at(run_dir)  # an earlier attempt's loss stayed non-finite: an outcome, kept
    if state != "trained" and diverged is None:
        try:
            train_to_end(experiment.recipe(cell, seed), run_dir, device=device, reporting=reporting,
                         on_fraction=lambda f: emit("run_progress", {"index": index, "fraction": f}))
        except DivergedError as exc:
            diverged = exc.step
    if diverged is None:
        rows[(cell, seed)] = {**score_run(run_dir, cell, seed, device),
                              **at_lengths(run_dir, experiment.config.lengths, device),
                              **head_roles(run_dir, experiment.config.inspect_heads, device)}
    else:
        rows[(cell, seed)] = score_diverged(experiment, run_dir, cell, seed, diverged)
        if experiment.config.lengths:  # it answers nothing at any length
            rows[(cell, seed)]["test_at"] = {str(n): 0.0 for n in experiment.config.lengths}
        emit("diverged", rows[(cell, seed)])
    emit("run_end", rows[(cell, seed)])
    for budget in experiment.config.budgets[:-1]:  # the curve's cooldowns, branched from that run
        if stops is not None:
            stop_if_asked(stops)
        rows[(cell, seed, budget)] = _branched(experiment, out_dir, cell, seed, budget, rows[(cell, seed)],
                                               device, emit, reporting)
    return rows


def _in_parallel(experiment: Experiment, out_dir: Path, plan: list[tuple[str, int]], finished: list, *,
                 device: str, jobs: int, emit: Event, stops: StopSignals, reporting: Reporting) -> None:
    """Train and score the plan's runs `jobs` at a time, each (cell, seed) and its cooldowns in a
    process of its own (`python -m xformer.studies.experiment`) with this process's CPU threads split
    between them (on CUDA, `jobs` processes share the device). The runs they leave are what
    one job at a time would have made; the caller then reads them in order."""
    threads = max(1, torch.get_num_threads() // jobs)
    waiting = [(cell, seed) for cell, seed in plan
               if not all(run_state(out_dir / "runs" / run_key(cell, seed, b)) == "trained"
                          for b in [0, *experiment.config.budgets[:-1]])]
    pool = Jobs()
    emit("jobs", {"jobs": jobs, "threads": threads, "waiting": len(waiting)})
    try:
        while waiting or len(pool):
            while waiting and len(pool) < jobs and not stops.received:
                cell, seed = waiting.pop(0)
                fields = {"spec": str(experiment.source), "overrides": experiment.overrides, "out": str(out_dir),
                          "cell": cell, "seed": seed, "device": device, "threads": threads,
                          "reuse": [str(f) for f in finished], "reporting": reporting.to_dict()}
                pool.start((cell, seed), [sys.executable, "-m", "xformer.studies.experiment", json.dumps(fields)],
                           out_dir / "runs" / f"{run_key(cell, seed)}.job.log",
                           {**os.environ, "OMP_NUM_THREADS": str(threads)})
                emit("job_start", {"cell": cell, "seed": seed})
            if stops.received:
                pool.stop()  # each stops at a step boundary with its checkpoint
                stop_if_asked(stops)
            for job in pool.ended():
                if job.process.returncode != 0:
                    raise RunError(f"{run_key(*job.key)}: its job stopped ({job.last_line()}); see {job.log}")
                job.log.unlink(missing_ok=True)
                emit("job_end", {"cell": job.key[0], "seed": job.key[1]})
            time.sleep(0.2)
    finally:
        pool.stop()


def _branched(experiment: Experiment, out_dir: Path, cell: str, seed: int, budget: int, stable: dict, device: str,
              emit: Event, reporting: Reporting = Reporting()) -> dict:
    """The run of `budget` steps: a cooldown branched from the stable run of its cell and seed
    at the step it starts cooling (cooldown_start), trained and scored like any run."""
    recipe = experiment.recipe(cell, seed, budget)
    run_dir = out_dir / "runs" / run_key(cell, seed, budget)
    emit("run_start", {"index": -1, "cell": cell, "seed": seed, "budget": budget,
                       "resume": run_state(run_dir) == "resume"})
    diverged = stable.get("diverged_at") or diverged_at(run_dir)
    if diverged is None and run_state(run_dir) == "new" and not run_dir.exists():
        source, rescore = reused_branch(out_dir / "runs" / run_key(cell, seed), budget, recipe.to_dict())
        if source is not None:  # the stable run is a copy, and so is its cooldown
            copy_run(source, run_dir, recipe if rescore or experiment.config.rescore else None)
            emit("reused", {"cell": cell, "seed": seed, "budget": budget, "source": str(source), "rescore": rescore})
    if diverged is None:
        try:
            stable_run = out_dir / "runs" / run_key(cell, seed)
            train_to_end(recipe, run_dir, device=device, reporting=reporting,
                         branch=(stable_run, cooldown_start(budget, recipe.train.decay_fraction)),
                         on_fraction=lambda f: emit("run_progress", {"index": -1, "fraction": f}))
        except DivergedError as exc:
            diverged = exc.step
    if diverged is None:
        row = score_run(run_dir, cell, seed, device)
    elif stable.get("diverged_at") is not None and stable["diverged_at"] <= budget:  # it never got this far
        row = {**stable}
    else:
        row = score_diverged(experiment, run_dir, cell, seed, diverged)
    row = {**row, "budget": budget}
    emit("run_end", row)
    return row


def _compare(experiment: Experiment, rows: dict, scored: list, out_dir: Path) -> ExperimentResult:
    c = experiment.config
    task = make_task(experiment.recipe(c.baseline, c.seeds[0]))  # every cell's: one test set (_one_test_set)
    cells = []
    for cell in experiment.cells:
        mine = [rows[(cell, s)] for s in c.seeds]
        tests, valids = [r["test"] for r in mine], [r["valid"] for r in mine if r["valid"] is not None]
        entry = {"cell": cell, "sets": experiment.cells[cell], "test_mean": statistics.fmean(tests),
                 "test_std": statistics.stdev(tests) if len(tests) > 1 else 0.0,
                 "valid_mean": statistics.fmean(valids) if valids else None,
                 "valid_std": statistics.stdev(valids) if len(valids) > 1 else 0.0,
                 "parameters": mine[0]["parameters"],
                 **{f"{key}_mean": _mean([r.get(key) for r in mine]) for key in MEASURES}}
        if cell != c.baseline:
            base = [rows[(c.baseline, s)] for s in c.seeds]
            entry["difference"] = statistics.fmean(m["test"] - b["test"] for m, b in zip(mine, base, strict=True))
            entry["paired"] = [_paired(task, m, b, scored) for m, b in zip(mine, base, strict=True)]
            entry["significant_seeds"] = sum(p["p_value"] < SIGNIFICANT for p in entry["paired"])
        cells.append(entry)
    metric = rows[(c.baseline, c.seeds[0])]["metric"]
    budget = f"{c.max_steps} steps" if c.max_steps else f"{c.max_time:g} minutes"
    if c.budgets:
        budget = f"{c.budgets[-1]} steps (wsd; a curve at {', '.join(map(str, c.budgets))})"
    return ExperimentResult(metric=metric, baseline=c.baseline, seeds=c.seeds, budget_per_run=budget,
                            cells=cells, runs=[rows[k] for k in sorted(rows)], source=str(experiment.source))


def _mean(values: list) -> float | None:
    return statistics.fmean(values) if values and None not in values else None


def _paired(task, mine: dict, base: dict, scored: list) -> dict:
    """The run against the baseline run of its seed on the test set every cell shares
    (`scored`, evaluate.paired_set): the task's paired test of their output files (sacreBLEU's
    paired bootstrap for translation, McNemar's exact test for classification)."""
    p = task.paired_test(mine[task.OUTPUTS], base[task.OUTPUTS], scored)
    return {"seed": mine["seed"], "difference": p.difference, "p_value": p.p_value}


def _one_test_set(experiment: Experiment) -> list:
    """The test set every cell is scored on (evaluate.paired_set), read once: a cell whose
    overrides change it (data.max_len of a generated task, another corpus) is refused before
    anything trains, since a paired test needs one."""
    seed, baseline = experiment.config.seeds[0], experiment.config.baseline
    scored = paired_set(experiment.recipe(baseline, seed))
    for cell in experiment.cells:
        if cell != baseline and paired_set(experiment.recipe(cell, seed)) != scored:
            raise RecipeError(f"{experiment.source}: experiment.cells.{cell} is scored on another test set than the "
                              f"baseline {baseline!r} (its overrides change the data); a paired comparison needs one "
                              "test set: vary data settings with xformer longrange, or in separate experiments")
    return scored


def _pin(experiment: Experiment, out_dir: Path) -> None:
    """The spec as first run; a rerun into the same folder must be the same experiment."""
    c = experiment.config
    pinned = {"recipe": experiment.recipe(c.baseline, c.seeds[0]).to_dict(), "cells": experiment.cells,
              "seeds": c.seeds, "max_steps": c.max_steps, "max_time": c.max_time, "budgets": c.budgets,
              "lengths": c.lengths}
    pin(out_dir / "experiment.json", pinned, "this folder holds an experiment with other cells, seeds, budget or "
        "recipe; use another --out (runs of different settings cannot be compared)",
        as_now=lambda old: {"budgets": [], "lengths": [], **old})  # folders from before curves and lengths


def _job(fields: dict) -> None:
    """One job of _in_parallel: a (cell, seed) and its cooldowns, trained and scored."""
    torch.set_num_threads(fields["threads"])
    experiment = load_experiment(fields["spec"], fields["overrides"])
    finished = [Path(f) for f in fields["reuse"]]
    with StopSignals() as stops:
        _train_one(experiment, Path(fields["out"]), -1, fields["cell"], fields["seed"], device=fields["device"],
                   finished=finished, emit=ignore, stops=stops,
                   reporting=Reporting.from_dict(fields.get("reporting", {})))


if __name__ == "__main__":  # python -m xformer.studies.experiment FIELDS_JSON: one job of --jobs N
    _job(json.loads(sys.argv[1]))

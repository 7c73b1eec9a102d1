"""`xformer claims --plan`: what a ledger of claim specs costs, counted before it runs.

Each spec's experiment trains every cell at every seed: one run to the largest step budget and,
for a curve (experiment.budgets), a cooldown branched from it at each smaller budget, which
trains only its cooldown (budget - cooldown_start steps). Specs run in the order given, each
with `--reuse` over the ones before it (benchmarks/ledger_chain.sh), so a run whose recipe an
earlier spec trains already costs nothing: it is counted where it is first trained and named as
shared where it comes again. Runs are the same when their resolved recipes are, [eval]'s
decoding fields aside (xformer.studies.reuse, which does the copying).

With `timed`, each distinct shape of training (the recipe without its seed, budget and
schedule: what a step costs) has a few steps and one validation timed on real batches
(xformer.training.budget.calibrate), with the CPU threads each of `jobs` runs at once would get
(`xformer experiment --jobs`); a run's estimate is its steps at that pace plus its validations,
and a spec's wall-clock hours are its runs' hours over `jobs`. Not counted: test decoding, a
sequence-level teacher's translations, the seconds a --reuse copy spends scoring again.
A distilling cell is timed as its student without the teacher (a teacher is trained by an
earlier spec, so the plan cannot assume its weights), and a length curriculum's steps at the
final length (an overestimate of its first, shorter stages). An experiment whose checks time its runs
runs them one at a time with every thread: timed so, its runs add their whole time to the wall
clock. The estimate is as good as the machine is quiet while it times.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xformer.config.loading import recipe_from_dict
from xformer.config.schema import Recipe
from xformer.events import ignore
from xformer.results import LedgerPlan
from xformer.studies.experiment_spec import Experiment, cooldown_start, load_experiment, run_key
from xformer.studies.ledger import read_spec
from xformer.studies.reuse import training_part
from xformer.tasks import make_task
from xformer.training.budget import calibrate
from xformer.training.device import resolve_runtime

# what changes a run's identity but not what one of its steps costs
PACE_FREE = ("seed", "max_steps", "max_time", "max_epochs", "branch_every", "patience", "lr", "min_lr",
             "warmup_steps", "schedule", "decay_fraction", "decay_shape")


@dataclass
class PlannedRun:
    spec: str
    run: str  # its folder name (CELL-sSEED, -atSTEPS for a cooldown)
    steps: int  # steps it trains (a cooldown: its cooldown only)
    minutes: float  # its time limit (experiment.max_time), 0: steps only
    valid_every: int
    identity: str  # the resolved recipe, decoding aside
    pace: str  # the recipe without what does not change a step's cost
    shared: str = ""  # SPEC/RUN that trains it first, "" when this spec does
    alone: bool = False  # its experiment times its runs: one at a time, with every CPU thread
    recipe: Recipe | None = field(default=None, repr=False)


def planned_runs(spec: Path, experiment: Experiment) -> list[PlannedRun]:
    """Every run the experiment trains, each with the steps it trains."""
    c = experiment.config
    out = []
    for cell in experiment.cells:
        for seed in c.seeds:
            for budget in [0, *c.budgets[:-1]]:
                recipe = experiment.recipe(cell, seed, budget)
                steps = recipe.train.max_steps
                if budget:  # a cooldown: branched from the stable run where its decay starts
                    steps = budget - cooldown_start(budget, recipe.train.decay_fraction)
                out.append(PlannedRun(spec.stem, run_key(cell, seed, budget), steps, c.max_time,
                                      recipe.train.valid_every, _identity(recipe), _pace(recipe), recipe=recipe))
    return out


def plan_ledger(specs: list[Path], *, timed: bool = False, jobs: int = 2, device: str = "cpu",
                overrides: list[str] = (), clock: Callable[[], float] = time.perf_counter,
                emit=ignore) -> LedgerPlan:
    """The runs of `specs` in chain order, what each spec adds, and (timed) the hours it takes."""
    seen: dict[str, str] = {}
    rows, runs = [], []
    for path in specs:
        claim, experiment = read_spec(path)
        if experiment is None:
            rows.append({"spec": path.stem, "blocked": claim.blocked})
            continue
        sets = [o for o in overrides if experiment.reads_corpus() or not o.strip().startswith("data.dataset=")]
        if sets:  # --set: every cell's recipe, or the spec's own (experiment.seeds); the corpus as the chain
            experiment = load_experiment(path, sets)  # passes it, to the specs that read one
        alone = experiment.times_runs()
        mine = planned_runs(path, experiment)
        for run in mine:
            run.alone = alone
            run.shared = seen.get(run.identity, "")
            seen.setdefault(run.identity, f"{run.spec}/{run.run}")
        runs += mine
        new = [r for r in mine if not r.shared]
        rows.append({"spec": path.stem, "cells": len(experiment.cells), "seeds": len(experiment.config.seeds),
                     "runs": len(mine), "new_runs": len(new), "shared_runs": len(mine) - len(new),
                     "new_steps": sum(r.steps for r in new), "new_minutes_limit": sum(r.minutes for r in new),
                     "alone": alone})
    paces = _time_paces([r for r in runs if not r.shared], jobs, device, clock, emit) if timed else {}
    for row in rows:
        if "runs" not in row or not timed:
            continue
        new = [r for r in runs if r.spec == row["spec"] and not r.shared]
        hours = sum(_run_seconds(r, paces[_key(r, jobs)]) for r in new) / 3600
        row["run_hours"] = hours
        row["wall_hours"] = hours if row["alone"] else hours / jobs
    counted = ("runs", "new_runs", "new_steps", *(("run_hours", "wall_hours") if timed else ()))
    total = {k: sum(row.get(k, 0) for row in rows) for k in counted}
    return LedgerPlan(specs=rows, total=total, jobs=jobs, timed=timed,
                      paces=[{"pace_of": seen_first, **pace} for seen_first, pace in _named(paces, runs, jobs)],
                      shared=[{"spec": r.spec, "run": r.run, "trained_by": r.shared} for r in runs if r.shared])


def _run_seconds(run: PlannedRun, pace: dict) -> float:
    """A run's steps and validations at `pace`, within its time limit (a run with no step limit
    takes all of it)."""
    if not run.steps:
        return run.minutes * 60
    seconds = run.steps * pace["step_seconds"] + (run.steps // max(1, run.valid_every) + 1) * pace["valid_seconds"]
    return min(seconds, run.minutes * 60) if run.minutes else seconds


def _time_paces(runs: list[PlannedRun], jobs: int, device: str, clock, emit) -> dict[str, dict]:
    """Seconds a step and a validation take, per distinct pace, with the threads of one of
    `jobs` runs at once."""
    paces: dict[str, dict] = {}
    threads = torch.get_num_threads()
    try:
        for run in runs:
            key = _key(run, jobs)
            if key in paces:
                continue
            torch.set_num_threads(threads if run.alone else max(1, threads // jobs))
            emit("plan", {"message": f"timing {run.spec}/{run.run} ({len(paces) + 1} shapes so far)"})
            recipe = _timed_as(run.recipe)
            task = make_task(recipe)
            task.load(ignore)
            with tempfile.TemporaryDirectory(prefix="xformer-plan-") as scratch:
                task.prepare(Path(scratch), ignore)
                rt = resolve_runtime(device, recipe.train.precision)
                step, valid = calibrate(recipe, task, rt, clock)
            paces[key] = {"step_seconds": step, "valid_seconds": valid, "threads": torch.get_num_threads(),
                               "precision": rt.precision}
    finally:
        torch.set_num_threads(threads)
    return paces


def _key(run: PlannedRun, jobs: int) -> str:
    """What a step of the run costs: its shape, and whether it shares the CPU with jobs - 1 others."""
    return f"{run.pace} alone" if run.alone or jobs == 1 else run.pace


def _named(paces: dict[str, dict], runs: list[PlannedRun], jobs: int):
    """Each timed pace with the first run that has it."""
    for key, pace in paces.items():
        first = next(r for r in runs if _key(r, jobs) == key)
        yield f"{first.spec}/{first.run}", pace


def _timed_as(recipe: Recipe) -> Recipe:
    """The recipe a run's steps are timed with: without its teacher (a distilling cell is timed
    as its student alone) and without a length curriculum (whose first, shortest batches are the
    ones a calibration would time; the run spends most of its steps at data.max_len)."""
    raw = recipe.to_dict()
    raw.pop("distill", None)
    if raw["data"].get("curriculum_lengths"):
        raw["data"] = {**raw["data"], "curriculum_lengths": [], "curriculum_steps": []}
    return recipe_from_dict(raw, [], "plan")


def _identity(recipe: Recipe) -> str:
    return json.dumps(training_part(json.loads(json.dumps(recipe.to_dict()))), sort_keys=True)


def _pace(recipe: Recipe) -> str:
    raw = json.loads(json.dumps(recipe.to_dict()))
    raw["train"] = {k: v for k, v in raw["train"].items() if k not in PACE_FREE}
    raw.pop("eval", None)
    raw.pop("changes", None)
    return json.dumps(raw, sort_keys=True)

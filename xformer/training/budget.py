"""Regularisation that fits the epochs a run will get (`train.regularisation = "budget"`).

How much dropout, label smoothing and subword sampling a model needs depends on how often it
will see each example. The flagship's settings chosen on validation for the ~7 epochs a 2-core
AVX2 CPU gets in 50 minutes (dropout 0.1, no sampling) stop improving halfway through the ~25
epochs an AMX CPU gets in the same time, where the settings chosen for 32 epochs (dropout 0.2,
subword sampling alpha 0.3) did better on validation (docs/results.md). So, with "budget", the
trainer works out the epochs it will train and takes the row of RULE for them:

    a step budget (max_steps, max_epochs)   known up front: max_steps / steps per epoch
    a time budget (max_time)                a short calibration before the real model is built,
                                            inside the budget: CALIBRATION_STEPS training steps of
                                            a throwaway model on real batches and one validation
                                            as a trained model's would run (Task.validate_as_trained:
                                            translations as long as their references), then the
                                            time left at that pace (validation every
                                            valid_every steps included); the RNG is put back after

The earliest limit wins. Epochs are counted in batches of the corpus as the recipe tokenises it
before the rule (the flagship: no subword sampling), the units the study labelled its step
budgets in; a run whose row turns sampling on trains ~15% fewer epochs of its own, longer,
sampled batches than train.json expects. The choice is made once, by process 0 under torchrun,
and written into the run's recipe.toml (the values the model trained with) and train.json's
"regularisation" (the epochs expected, how they were estimated, the row taken); a resumed run
keeps it.

RULE's rows come from the budget study (recipes/studies/flagship_budget.toml, docs/results.md):
best greedy validation BLEU of the flagship's wsd runs at 1,000 / 2,000 / 3,000 / 4,000 steps
(7.5 / 15.0 / 22.6 / 30.1 epochs of 133 steps), at the winning peak rate 1.4e-3, one seed.
Light regularisation ahead at 7.5 epochs (by 4.6) and 15.0 (by 0.6, at the seed spread), heavy
ahead at 22.6 (by 1.5) and 30.1 (by 2.7). The boundary is where heavy-minus-light crosses zero,
interpolated linearly between 15.0 and 22.6 epochs: 17.2, so 17.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable

import torch

from xformer.config.loading import recipe_from_dict
from xformer.config.schema import Recipe
from xformer.events import Event, ignore
from xformer.training.distributed import Cluster
from xformer.training.optim import build_optimizer

KEYS = ("model.dropout", "train.label_smoothing", "data.sampling_alpha")  # what the rule sets
# (fewer than this many epochs, {key: value}); the last row has no upper bound
RULE: list[tuple[float, dict]] = [
    (17.0, {"model.dropout": 0.1, "train.label_smoothing": 0.1, "data.sampling_alpha": 0.0}),
    (math.inf, {"model.dropout": 0.2, "train.label_smoothing": 0.1, "data.sampling_alpha": 0.3}),
]
CALIBRATION_STEPS = 8  # timed, after 2 untimed (allocation, first-call costs)


def row_for(epochs: float) -> dict:
    """RULE's settings for a run of `epochs` epochs."""
    return next(values for below, values in RULE if epochs < below)


def expected_epochs(recipe: Recipe, task, rt, steps_per_epoch: int, seconds_left: float,
                    clock: Callable[[], float]) -> tuple[float, str]:
    """The epochs this run will train, and how that was found (module docstring)."""
    cfg = recipe.train
    found = []
    if cfg.max_steps:
        found.append((cfg.max_steps / steps_per_epoch, f"train.max_steps = {cfg.max_steps}"))
    if cfg.max_epochs:
        found.append((float(cfg.max_epochs), f"train.max_epochs = {cfg.max_epochs}"))
    if cfg.max_time:
        per_step, valid = calibrate(recipe, task, rt, clock)
        seconds_left -= valid  # the calibration's own validation was spent
        pace = per_step + valid / cfg.valid_every
        steps = max(0.0, seconds_left) / pace
        found.append((steps / steps_per_epoch, f"train.max_time = {cfg.max_time:g} min: {per_step:.3f} s a step "
                                               f"and {valid:.1f} s a validation measured, {steps:,.0f} steps left"))
    return min(found)


def calibrate(recipe: Recipe, task, rt, clock: Callable[[], float]) -> tuple[float, float]:
    """Seconds an optimizer step takes (the median of CALIBRATION_STEPS) and one validation
    takes (as a trained model's would run), measured on a throwaway model with the recipe's
    settings; torch's RNG is put back."""
    cfg = recipe.train
    rng = torch.get_rng_state()
    model = task.build_model().to(rt.device)
    optimizer = build_optimizer(model, cfg)
    model.train()
    times = []
    batches = itertools.cycle(task.train_batches.iter_epoch(0))
    for _ in range(2 + CALIBRATION_STEPS):
        group = list(itertools.islice(batches, cfg.accumulate_steps))
        began = clock()
        units = sum(task.units(b) for b in group)
        for batch in group:
            rt.backward(task.loss(model, batch, rt) / units)
        rt.step(optimizer, model, cfg.clip_norm)
        optimizer.zero_grad(set_to_none=True)
        times.append(clock() - began)
    began = clock()
    task.validate_as_trained(model, rt)
    valid = clock() - began
    torch.set_rng_state(rng)
    return statistics.median(times[2:]), valid


def fit_to_budget(recipe: Recipe, task, rt, cluster: Cluster, steps_per_epoch: int, seconds_left: float,
                  clock: Callable[[], float], emit: Event) -> tuple[Recipe, dict]:
    """The recipe with RULE's row for the epochs it will train, and train.json's record of why.
    Process 0 measures and decides; every process trains with its choice."""
    epochs, how = expected_epochs(recipe, task, rt, steps_per_epoch, seconds_left, clock) if cluster.writer \
        else (0.0, "")
    epochs = cluster.from_writer([round(epochs * 1000)], rt.device)[0] / 1000
    values = {k: v for k, v in row_for(epochs).items() if _has(recipe, k)}  # no subword sampling outside translation
    chosen = recipe_from_dict(recipe.to_dict(), [f"{k}={v}" for k, v in values.items()], "train.regularisation")
    record = {"rule": "budget", "expected_epochs": epochs, "estimated_from": how, "chosen": values,
              "was": {k: _get(recipe, k) for k in values}}
    emit("setup", {"message": f"regularisation for ~{epochs:.1f} epochs ({how or 'process 0'}): "
                              + ", ".join(f"{k} = {v:g}" for k, v in values.items())})
    return chosen, record


def fit_run(recipe: Recipe, whole: Recipe, task, rt, cluster: Cluster, seconds_left: float, out_dir,
            clock: Callable[[], float], emit: Event) -> tuple[Recipe, Recipe, dict]:
    """For xformer.train: the recipe and the run's whole recipe (changes included) with the
    settings for the epochs this run will train, the task re-prepared where its batches change
    (subword sampling on or off), and train.json's record."""
    cfg = recipe.train
    per_epoch = -(-len(task.train_batches) // cfg.accumulate_steps)
    fitted, record = fit_to_budget(recipe, task, rt, cluster, per_epoch, seconds_left, clock, emit)
    task.recipe = fitted
    if _has(recipe, "data.sampling_alpha") and recipe.data.sampling_alpha != fitted.data.sampling_alpha:
        task.prepare(out_dir, emit if cluster.writer else ignore)  # the tokenizer is trained already
    return fitted, keep_fitted(whole, fitted), record


def in_hindsight(record: dict | None, epochs: float, stop_reason: str | None, emit: Event) -> dict | None:
    """train.json's record at the end of a run that its time budget ended: the epochs it trained,
    and, where RULE's row for them is not the row chosen (the calibration misjudged the pace), that
    row, with a warning."""
    if not record or record.get("rule") != "budget" or stop_reason != "max_time":
        return record
    row = {k: v for k, v in row_for(epochs).items() if k in record["chosen"]}
    if row == record["chosen"]:
        return {**record, "trained_epochs": epochs}
    emit("warning", {"message": f"regularisation was chosen for ~{record['expected_epochs']:.1f} epochs "
                                f"({record['estimated_from']}), the run trained {epochs:.1f}: the calibration "
                                f"misjudged the pace; for {epochs:.1f} epochs the rule takes "
                                + ", ".join(f"{k} = {v:g}" for k, v in row.items())})
    return {**record, "trained_epochs": epochs, "row_for_trained": row}


def keep_fitted(given: Recipe, saved: Recipe) -> Recipe:
    """A resumed budget run's recipe: the values the run chose (in its recipe.toml) in place of
    the recipe file's, which "budget" replaced."""
    kept = [f"{k}={_get(saved, k)}" for k in KEYS if _has(saved, k)]
    return recipe_from_dict(given.to_dict(), kept, "train.regularisation")


def _get(recipe: Recipe, key: str):
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


def _has(recipe: Recipe, key: str) -> bool:
    section, name = key.split(".")
    return hasattr(getattr(recipe, section), name)

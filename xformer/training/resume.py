"""Where `train --resume` starts, and what it may change.

A run resumes from checkpoints/last, or from checkpoints/previous (the full checkpoint before
it) when last is missing, damaged or not finite: stopped by the NaN guard
(train.max_nonfinite_steps), or holding weights that are NaN or infinite. Resuming from such a
state would only repeat it, whatever the new learning rate; the non-finite last is set aside as
checkpoints/nonfinite_step_N.safetensors, so it never becomes the `previous` of a later run.

A resumed run keeps its [model] and [data] (the weights and batches refer to them), its seed
and accumulate_steps (the batch plan a checkpoint's position refers to). Its [train] and [eval]
values may change: each change is recorded in RUN/recipe.toml as a [[changes]] table with the
step it took effect at (config.Change), and in train.json, so the recipe in the run folder
reproduces the run: a new run of it replays every change at its step (train.run).

A run initialised from another (`train --init-from RUN`, a fine-tune) is a new run folder holding
RUN's tokenizer and RUN/init-from.json: its weights are RUN's checkpoint, its optimizer and step
start afresh.

A branch (`train --branch-from RUN --at-step N`) is a new run folder holding RUN as it stood at
step N (a full checkpoint of that step: train.branch_every keeps them), resumed with the values
given: a wsd run's cooldown from any step of its stable phase, say.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from xformer.config.loading import load_recipe, recipe_at
from xformer.config.schema import CHANGEABLE, FIXED_ON_RESUME, Change, Recipe
from xformer.errors import RunError
from xformer.files import atomic_write_text
from xformer.locks import FolderLock
from xformer.training.budget import keep_fitted
from xformer.training.checkpoint import (
    load_model_weights,
    read_checkpoint,
    read_checkpoint_meta,
    run_checkpoint,
    write_tensors,
)
from xformer.training.run_folder import (
    BRANCHED,
    INITIALISED,
    check_out_dir,
    check_tokenizer,
    clear_run_dir,
    is_run_dir,
    mark_run_dir,
)


@dataclass
class ResumePoint:
    path: Path  # the checkpoint training continues from
    tensors: dict
    meta: dict
    why: str | None  # why not checkpoints/last, when it is previous
    set_aside: Path | None = None  # where a non-finite last goes before training (nonfinite_step_N)

    @property
    def step(self) -> int:
        return self.meta["progress"]["step"]


def has_checkpoint(out_dir: Path) -> bool:
    folder = out_dir / "checkpoints"
    return (folder / "last.safetensors").is_file() or (folder / "previous.safetensors").is_file()


def not_finite(tensors: dict, meta: dict) -> str:
    """Why a full checkpoint is no state to train on from ("" when it is one)."""
    step = meta.get("progress", {}).get("step")
    if meta.get("stop_reason") == "nonfinite":
        return f"stopped by train.max_nonfinite_steps at step {step} (the loss or gradients were not finite)"
    for name, value in tensors.items():  # the weights, and the optimizer's moments that move them
        if name.startswith(("model.", "optim.")) and value.is_floating_point() and not torch.isfinite(value).all():
            return f"{'weights' if name.startswith('model.') else 'optimizer state'} not finite at step {step} " \
                   f"({name.split('.', 1)[1]})"
    return ""


def resume_point(out_dir: Path) -> ResumePoint:
    """The checkpoint --resume continues from (module docstring); a RunError when there is none
    to continue from."""
    folder = out_dir / "checkpoints"
    last, previous = folder / "last.safetensors", folder / "previous.safetensors"
    if not last.is_file() and not previous.is_file():
        raise RunError(f"{out_dir}: nothing to resume (no checkpoints/last.safetensors)")
    again = "train the run again (--overwrite) with a lower train.lr or train.clip_norm = 1.0"
    aside = None  # where a non-finite last goes, named by its step
    try:
        tensors, meta = read_checkpoint(last)
    except RunError as error:  # missing, unreadable or damaged: previous, if there is one
        if not previous.is_file():
            raise
        why = str(error)
    else:
        bad = not_finite(tensors, meta)
        if not bad:
            return ResumePoint(last, tensors, meta, None)
        why = f"{last}: {bad}"
        if not previous.is_file():
            raise RunError(f"{why}, and there is no checkpoints/previous.safetensors to go back to: {again}")
        aside = last.with_name(f"nonfinite_step_{meta['progress']['step']:07d}.safetensors")
    tensors, meta = read_checkpoint(previous)
    worse = not_finite(tensors, meta)
    if worse:
        raise RunError(f"{why}, and {previous} too ({worse}): no finite checkpoint to resume from; {again}")
    return ResumePoint(previous, tensors, meta, why, set_aside=aside)


def set_aside(point: ResumePoint) -> Path | None:
    """Move a non-finite last to point.set_aside (kept); returns where it went."""
    last = point.path.with_name("last.safetensors")
    if point.set_aside is None or not last.is_file():
        return None
    os.replace(last, point.set_aside)
    return point.set_aside


def prepare_run_dir(out_dir: Path, recipe: Recipe, *, resume: bool, overwrite: bool,
                    recipe_path: Path | None = None, check_only: bool = False) -> list[str]:
    """Create RUN, or check that there is a run to resume; never overwrite silently and never
    touch what is not a run's (xformer.training.run_folder). Returns the artefacts removed. check_only
    raises what would be refused and changes nothing."""
    check_out_dir(out_dir, recipe_path, resume=resume)
    if resume and not has_checkpoint(out_dir) and not is_run_dir(out_dir):
        raise RunError(f"{out_dir}: nothing to resume (no checkpoints/last.safetensors)")
    if resume:
        return []  # killed before its first checkpoint: it starts again at step 0, keeping its tokenizer
    removed = clear_run_dir(out_dir, overwrite=overwrite, check_only=check_only)
    if not check_only:
        mark_run_dir(out_dir)
    return removed


def resumed_recipe(out_dir: Path, given: Recipe, point: ResumePoint) -> tuple[Recipe, Change | None]:
    """The recipe a resumed run trains with, changes included, and the change this resume makes
    (None when the values are the run's own). [model], [data], the seed and accumulate_steps
    must be the run's; a [train] or [eval] value that differs from the run's at the resume
    point is a change from that step on. Changes recorded after the resume point (a run gone
    back to an earlier checkpoint) are kept when the recipe given is the run's own, else the
    given values replace them."""
    saved = out_dir / "recipe.toml"
    check_tokenizer(out_dir, point.path, point.meta)
    old = load_recipe(saved)
    if given.train.regularisation == "budget" == old.train.regularisation:  # the run's own choice stands
        given = keep_fitted(given, old)
    for section in ("model", "data", "distill"):
        before, now = old.to_dict().get(section, {}), given.to_dict().get(section, {})
        if before != now:  # another task has other [data] fields: compare over both
            diff = [k for k in dict.fromkeys([*now, *before]) if before.get(k) != now.get(k)]
            raise RunError(f"{saved}: the run was started with different [{section}] values "
                           f"({', '.join(diff)}); resume with the same recipe")
    for key in FIXED_ON_RESUME:  # they fix the batch plan the resume point refers to
        section, name = key.split(".")
        was, now = getattr(getattr(old, section), name), getattr(getattr(given, section), name)
        if was != now:
            raise RunError(f"{saved}: the run was started with {key} = {was}, found {now}; a resumed run must keep it")
    if _values(old) == _values(given):
        return old, None
    step = point.step
    base = _values(recipe_at(old, step))
    now = _values(given)
    unset = sorted(k for k in base.keys() ^ now.keys())
    if unset:
        raise RunError(f"{saved}: {', '.join(unset)} cannot change on resume (set in one of the recipes only)")
    history = [c for c in old.changes if c.step <= step]
    differ = [k for k in now if base[k] != now[k]]
    change = Change(step, {k: now[k] for k in differ}, {k: base[k] for k in differ})
    if history and history[-1].step == step:  # resumed twice at the same step: one change
        merged = history.pop()
        was = {**change.was, **merged.was}
        change = Change(step, {k: v for k, v in {**merged.set, **change.set}.items() if was[k] != v},
                        {k: v for k, v in was.items() if {**merged.set, **change.set}[k] != v})
    recipe = Recipe(**{f.name: getattr(given, f.name) for f in fields(Recipe) if f.name != "changes"},
                    changes=history + ([change] if change.set else []))
    return recipe, change if change.set else None


def _values(recipe: Recipe) -> dict:
    """{"section.key": value} of what a resume may change."""
    tables = recipe.to_dict()
    return {f"{s}.{k}": v for s in CHANGEABLE for k, v in tables.get(s, {}).items()
            if f"{s}.{k}" not in FIXED_ON_RESUME}


def branch_name(step: int) -> str:
    return f"branch_step_{step:07d}.safetensors"


def branch(source: Path, step: int, out_dir: Path, recipe_path: Path | None = None) -> Path:
    """Make out_dir (new, or empty) the run `source` as it stood at optimizer step `step`, for
    --resume to continue: its tokenizer, its recipe as at that step, its metrics up to it, and
    the full checkpoint of that step as last (with the step checkpoints it averages and its best,
    where `source` still has them; a best it no longer has is chosen again among the branch's
    own validations). Returns the checkpoint branched from."""
    if not is_run_dir(source):
        raise RunError(f"{source}: not a run directory (no recipe.toml); --branch-from names a trained run")
    folder = source / "checkpoints"
    found = None
    for candidate in (folder / branch_name(step), folder / "last.safetensors", folder / "previous.safetensors"):
        if candidate.is_file() and read_checkpoint_meta(candidate).get("progress", {}).get("step") == step:
            found = candidate
            break
    if found is None:
        steps = sorted(int(p.stem.rsplit("_", 1)[1]) for p in folder.glob("branch_step_*.safetensors"))
        listed = ", ".join(map(str, steps)) or "none (train.branch_every keeps them)"
        raise RunError(f"{source}: no checkpoint with the optimizer's state at step {step}; branch points: {listed}")
    tensors, meta = read_checkpoint(found)
    bad = not_finite(tensors, meta)
    if bad:
        raise RunError(f"{found}: {bad}; branch from an earlier step")
    prepare_run_dir(out_dir, load_recipe(source / "recipe.toml"), resume=False, overwrite=False,
                    recipe_path=recipe_path)
    shutil.copytree(source / "tokenizer", out_dir / "tokenizer", dirs_exist_ok=True)
    atomic_write_text(out_dir / "recipe.toml", recipe_at(load_recipe(source / "recipe.toml"), step).to_toml())
    metrics = source / "metrics.jsonl"
    if metrics.is_file():
        lines = [line for line in metrics.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line).get("step", 0) <= step]
        atomic_write_text(out_dir / "metrics.jsonl", "".join(line + "\n" for line in lines))
    progress = dict(meta["progress"])
    target = out_dir / "checkpoints"
    target.mkdir(exist_ok=True)
    progress["kept"] = [name for name in progress.get("kept", []) if (folder / name).is_file()]
    for name in progress["kept"]:
        shutil.copyfile(folder / name, target / name)
    best = folder / "best.safetensors"
    if progress.get("best") and best.is_file() and read_checkpoint_meta(best).get("step") == progress["best"]["step"]:
        shutil.copyfile(best, target / "best.safetensors")
    else:
        progress["best"], progress["bad_validations"] = None, 0
    write_tensors(target / "last.safetensors", tensors,
                  {k: v for k, v in {**meta, "progress": progress}.items() if k != "format"})
    atomic_write_text(out_dir / BRANCHED, json.dumps({"source": str(source), "step": step, "checkpoint": found.name},
                                                    indent=2) + "\n")
    return found


# [model] fields a fine-tune may set anew: regularisation and kernels, which shape no weight
FREE_ON_INIT = ("dropout", "attention_dropout", "activation_dropout", "head_dropout", "attention_backend")


def init_from(source: Path, checkpoint: str | None, out_dir: Path, recipe: Recipe,
              recipe_path: Path | None = None) -> Path:
    """Make out_dir (new, or empty) a run that starts from `source`'s weights: its tokenizer
    copied, RUN/init-from.json naming the checkpoint (default: source's eval.checkpoint). The
    recipe's [model] must be source's, dropout and kernels aside. Training then starts at step 0
    with a fresh optimizer (init_weights loads the weights once the model is built), unlike a
    branch, which keeps the optimizer's state and step. Returns the checkpoint."""
    if not is_run_dir(source):
        raise RunError(f"{source}: not a run directory (no recipe.toml); --init-from names a trained or imported run")
    theirs = load_recipe(source / "recipe.toml")
    path = run_checkpoint(source, checkpoint or theirs.eval.checkpoint)
    differ = [f.name for f in fields(recipe.model) if f.name not in FREE_ON_INIT
              and getattr(recipe.model, f.name) != getattr(theirs.model, f.name)]
    if differ:
        raise RunError([f"model.{k}: {source} has {getattr(theirs.model, k)!r}, the recipe "
                        f"{getattr(recipe.model, k)!r}; --init-from needs the same architecture (only dropout and "
                        "attention_backend may differ)" for k in differ])
    tensors, meta = read_checkpoint(path)
    check_tokenizer(source, path, meta)
    bad = not_finite(tensors, meta)
    if bad:
        raise RunError(f"{path}: {bad}; initialise from another checkpoint")
    prepare_run_dir(out_dir, recipe, resume=False, overwrite=False, recipe_path=recipe_path)
    shutil.copytree(source / "tokenizer", out_dir / "tokenizer", dirs_exist_ok=True)
    record = {"source": str(source.resolve()), "checkpoint": path.name, "step": meta.get("step"),
              "sha256": meta.get("sha256")}
    if "imported" in meta:
        record["imported"] = {k: meta["imported"].get(k) for k in ("source", "revision", "licence", "attribution")}
    atomic_write_text(out_dir / INITIALISED, json.dumps(record, indent=2) + "\n")
    return path


def init_weights(model: torch.nn.Module, out_dir: Path) -> dict | None:
    """Load the weights RUN/init-from.json names into a freshly built `model`, if the run has
    one (its record), checking they are still the ones recorded."""
    record_file = out_dir / INITIALISED
    if not record_file.is_file():
        return None
    record = json.loads(record_file.read_text(encoding="utf-8"))
    path = Path(record["source"]) / "checkpoints" / record["checkpoint"]
    tensors, meta = read_checkpoint(path)
    if meta.get("sha256") != record["sha256"]:
        raise RunError(f"{path}: changed since this run was set up to start from it ({out_dir / INITIALISED}); "
                       "start a new run with --init-from")
    load_model_weights(model, tensors, path)
    return record


def start_from_another(cluster, out_dir, recipe: Recipe, emit, *, resume: bool, overwrite: bool, recipe_path,
                       branch_from, at_step: int | None, init, init_checkpoint: str | None) -> bool:
    """A run folder started from another run: `branch_from` as it stood at `at_step` (then
    resumed: returns True), or `init`'s weights and tokenizer (trained from step 0). Else nothing;
    returns whether the run resumes."""
    if branch_from is not None:
        if resume or overwrite or at_step is None:
            raise RunError("--branch-from starts a new run from a step of another: give --at-step, and neither "
                           "--resume nor --overwrite")
        if cluster.writer:
            with FolderLock(Path(out_dir), "train"):
                found = branch(Path(branch_from), at_step, Path(out_dir), Path(recipe_path) if recipe_path else None)
            emit("setup", {"message": f"branched from {found} (step {at_step})"})
        cluster.barrier()
        resume = True
    if init is not None:
        if resume or overwrite or branch_from is not None:
            raise RunError("--init-from starts a new run from another's weights: neither --resume, --overwrite nor "
                           "--branch-from")
        if cluster.writer:
            with FolderLock(Path(out_dir), "train"):
                found = init_from(Path(init), init_checkpoint, Path(out_dir), recipe,
                                  Path(recipe_path) if recipe_path else None)
            emit("setup", {"message": f"weights and tokenizer from {found}"})
        cluster.barrier()
    return resume

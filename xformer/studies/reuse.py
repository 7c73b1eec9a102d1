"""`xformer experiment --reuse DIR`: finding a finished run trained exactly as a cell's run
would be, and copying it in instead of training again (scored again where only how it decodes
differs, or where the spec asks every copy to be timed here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from xformer.config.loading import load_recipe
from xformer.config.schema import Recipe
from xformer.errors import RecipeError, RunError
from xformer.files import atomic_write_text
from xformer.studies.archive import archived_best
from xformer.training.checkpoint import read_checkpoint
from xformer.training.run_folder import run_state

DECODING = ("beam", "lenpen", "checkpoint", "quantize")  # [eval] fields that do not touch training


def finished_runs(folders: list[str | Path], out_dir: Path) -> list[Path]:
    """Every finished run (a recipe.toml beside a train.json of a run that ended) under the
    folders, this experiment's own runs left out."""
    mine = (out_dir / "runs").resolve()
    found = []
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            raise RunError(f"{folder}: --reuse expected a folder of finished runs, found no such folder")
        for recipe in sorted(folder.rglob("recipe.toml")):
            run_dir = recipe.parent
            if run_dir.resolve().parent != mine and run_state(run_dir) == "trained":
                found.append(run_dir)
    return found


def same_run(wanted: dict, finished: list[Path]) -> tuple[Path | None, bool]:
    """The finished run whose resolved recipe is `wanted` (and False), else one trained the same
    way and decoded otherwise (and True: score it again), else (None, False)."""
    wanted = json.loads(json.dumps(wanted))
    trained_alike = None
    for run_dir in finished:
        try:
            theirs = json.loads(json.dumps(load_recipe(run_dir / "recipe.toml").to_dict()))
        except RecipeError:  # a recipe of an older or newer xformer: not the same run
            continue
        if theirs == wanted:
            return run_dir, False
        if trained_alike is None and training_part(theirs) == training_part(wanted) and archived_best(run_dir) is None:
            trained_alike = run_dir  # to score again: an archived run has no weights to score
    return trained_alike, trained_alike is not None


def training_part(recipe: dict) -> dict:
    """A resolved recipe without the [eval] fields that only change how a trained run decodes
    (validation during training is greedy and ignores them)."""
    return {**recipe, "eval": {k: v for k, v in recipe["eval"].items() if k not in DECODING}}


def reused_branch(stable: Path, budget: int, wanted: dict) -> tuple[Path | None, bool]:
    """A cooldown of `budget` steps already branched from the run `stable` was copied from
    (its copied-from.json), trained as `wanted` would be: (its folder, whether to score it again),
    or (None, False). Its recipe records the branch as a change at the cooldown's first step,
    which a recipe asked for anew has not yet, so the two are compared without their changes."""
    provenance = stable / "copied-from.json"
    if not provenance.is_file():
        return None, False
    source = Path(json.loads(provenance.read_text())["source"])
    branch = source.parent / f"{source.name}-at{budget}"
    if run_state(branch) != "trained":
        return None, False
    try:
        theirs = json.loads(json.dumps(load_recipe(branch / "recipe.toml").to_dict()))
    except RecipeError:
        return None, False
    theirs.pop("changes", None)
    wanted = {k: v for k, v in json.loads(json.dumps(wanted)).items() if k != "changes"}
    if theirs == wanted:
        return branch, False
    rescorable = training_part(theirs) == training_part(wanted) and archived_best(branch) is None
    return (branch, True) if rescorable else (None, False)


def copy_run(source: Path, run_dir: Path, rescored: Recipe | None) -> None:
    """A copy of a finished run; with `rescored`, under that recipe and without its scores.
    Every checkpoint is read first (its sha256 checked): a damaged one is refused, naming it,
    before anything is copied."""
    for checkpoint in sorted((source / "checkpoints").glob("*.safetensors")):
        try:
            read_checkpoint(checkpoint)
        except RunError as exc:
            raise RunError(f"--reuse: {exc}; remove that run from the --reuse folders or repair it, and this "
                           "cell's run is trained instead") from None
    # a copy is its own run to the trackers (--report-to): the source's tracker runs are not its
    skip = shutil.ignore_patterns("trackers.json", "wandb", *(("eval", "eval.json") if rescored is not None else ()))
    shutil.copytree(source, run_dir, ignore=skip)
    if rescored is not None:
        atomic_write_text(run_dir / "recipe.toml", rescored.to_toml())
    provenance = {"source": str(source), "rescored": rescored is not None}
    atomic_write_text(run_dir / "copied-from.json", json.dumps(provenance, indent=2))

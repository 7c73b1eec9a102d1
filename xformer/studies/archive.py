"""An experiment's finished runs kept as records small enough to commit, and put back in place
on another machine, so an experiment stopped part way (its machine gone) trains only what no
record holds.

A run folder holds its checkpoints (megabytes each) beside its records (recipe.toml,
train.json with its validation curve, eval.json with the scored checkpoint's identity, the
decoded test set under eval/). Once a cell's run and its curve's cooldowns are trained and
scored, nothing the experiment does with them needs the weights again: the scores, the curve
and the paired tests read the records. archive_runs copies those records, without the
checkpoints (and without the tokenizer, but for the baseline's first run, whose tokenizer
measures the test inputs' lengths), into DEST/<run>/ with an archived.json naming what was
left out and the best checkpoint's identity as it was scored, and DEST/spec.json with the
digests of the spec and recipe they were trained from; restore_runs copies them back, from an
archive of the spec as it is now, into an experiment's runs/ folder, where the experiment reads
them as trained (run_state) and scored (archived_best). A cell whose run or any cooldown is not
finished is not archived: its cooldowns branch from the run's checkpoints. An experiment's spec
is archived and restored by xformer.studies.archive_spec.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from xformer.files import atomic_write_text
from xformer.studies.versions import changed_since
from xformer.tasks.base import checkpoint_identity
from xformer.training.run_folder import run_state

ARCHIVED = "archived.json"
VERSION = "spec.json"  # the spec and recipe digests the archived runs were trained from (ledger.measured_from)
LEFT_OUT = ("checkpoints", "tokenizer", ".lock", "trackers.json", "wandb")


def archive_runs(cells: list[list[str]], out_dir: str | Path, dest: str | Path, version: dict[str, str],
                 tokenizer_of: str) -> list[str]:
    """Copy the records of every finished cell (its run and its cooldowns: one list of run names
    in `cells`, all trained and scored on their final best checkpoint) from OUT/runs into DEST,
    each run once, DEST marked with `version`; only run `tokenizer_of` keeps its tokenizer.
    Returns the runs archived by this call."""
    runs, dest = Path(out_dir) / "runs", Path(dest)
    done = []
    _keep_version(dest, version)
    for keys in cells:
        if not all(_scored(runs / k) for k in keys):
            continue
        for key in keys:
            if not (dest / key / ARCHIVED).is_file():
                _archive_one(runs / key, dest / key, keep_tokenizer=key == tokenizer_of)
                done.append(key)
    return done


def restore_runs(src: str | Path, out_dir: str | Path) -> list[str]:
    """Copy every archived run under SRC into OUT/runs where that run has no folder yet (a run
    trained or begun here is never replaced); returns the runs restored. Whether SRC is of the
    spec as it is now is the caller's to ask (stale_archive; archive_spec.restore_spec does)."""
    src, runs = Path(src), Path(out_dir) / "runs"
    restored = []
    for marker in sorted(src.glob(f"*/{ARCHIVED}")):
        target = runs / marker.parent.name
        if target.exists():
            continue
        runs.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".restoring")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(marker.parent, partial)
        partial.rename(target)  # whole or not at all: a half copy would read as a finished run
        restored.append(target.name)
    return restored


def archived_best(run_dir: Path) -> dict | None:
    """The identity of RUN's best checkpoint as it was when the run was archived ({"name",
    "step", "sha256", "final"}), where its checkpoints were left out; else None."""
    marker = run_dir / ARCHIVED
    if not marker.is_file() or (run_dir / "checkpoints" / "best.safetensors").is_file():
        return None
    return json.loads(marker.read_text())["best"]


def _scored(run_dir: Path) -> bool:
    """Whether RUN is trained and its eval.json scored its final best checkpoint as it is now."""
    if run_state(run_dir) != "trained" or not (run_dir / "eval.json").is_file():
        return False
    if (run_dir / ARCHIVED).is_file():
        return True
    kept = json.loads((run_dir / "eval.json").read_text()).get("card", {}).get("checkpoint", {})
    best = checkpoint_identity(run_dir, "best")[0]
    return bool(kept.get("final")) and kept.get("sha256") == best["sha256"]


def stale_archive(src: Path, version: dict[str, str]) -> bool:
    """Whether the archive at SRC holds runs of another version of a spec or its recipe (their
    digests, as the ledger's records keep them) than `version`: such runs are not this spec's."""
    kept = Path(src) / VERSION
    return kept.is_file() and bool(changed_since(json.loads(kept.read_text()), version))


def _keep_version(dest: Path, version: dict[str, str]) -> None:
    """Mark DEST as the archive of this version of the spec; an archive of an earlier version
    there is moved aside to DEST.<its spec digest> (never deleted)."""
    kept = dest / VERSION
    if kept.is_file() and changed_since(json.loads(kept.read_text()), version):
        old = json.loads(kept.read_text())["spec_sha256"][:12]
        aside, n = dest.with_name(f"{dest.name}.{old}"), 1
        while aside.exists():
            aside, n = dest.with_name(f"{dest.name}.{old}-{n}"), n + 1
        dest.rename(aside)
    if not kept.is_file() or json.loads(kept.read_text()) != version:  # this version's digests, as they are now
        dest.mkdir(parents=True, exist_ok=True)
        atomic_write_text(kept, json.dumps(version, indent=2) + "\n")


def _archive_one(run_dir: Path, target: Path, keep_tokenizer: bool) -> None:
    earlier = json.loads((run_dir / ARCHIVED).read_text()) if (run_dir / ARCHIVED).is_file() else None
    left_out = [n for n in LEFT_OUT if not (keep_tokenizer and n == "tokenizer") and (run_dir / n).exists()]
    left_out = sorted({*left_out, *(earlier["left_out"] if earlier else [])})  # a restored run archived again
    best = earlier["best"] if earlier else checkpoint_identity(run_dir, "best")[0]
    partial = target.with_name(target.name + ".archiving")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(run_dir, partial, ignore=shutil.ignore_patterns(*left_out, ARCHIVED))
    atomic_write_text(partial / ARCHIVED, json.dumps({"left_out": left_out, "best": best}, indent=2) + "\n")
    partial.rename(target)

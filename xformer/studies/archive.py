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
finished is not archived: its cooldowns branch from the run's checkpoints. Experiments that
score a model again from its weights (lengths, inspect_heads, rescore) cannot be archived.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from xformer.errors import RunError
from xformer.files import atomic_write_text
from xformer.tasks.base import checkpoint_identity
from xformer.training.run_folder import run_state

ARCHIVED = "archived.json"
VERSION = "spec.json"  # the spec and recipe digests the archived runs were trained from (ledger.measured_from)
LEFT_OUT = ("checkpoints", "tokenizer", ".lock", "trackers.json", "wandb")


def archive_runs(experiment, out_dir: str | Path, dest: str | Path) -> list[str]:
    """Copy the records of every finished cell of `experiment` (its run and its cooldowns, all
    trained and scored on their final best checkpoint) from OUT/runs into DEST, each run once;
    returns the runs archived by this call."""
    from xformer.studies.experiment import run_key

    c = experiment.config
    if c.lengths or c.inspect_heads or c.rescore:
        raise RunError(f"{experiment.source}: its runs are scored again from their weights "
                       "(lengths, inspect_heads or rescore), so they cannot be archived without them")
    runs, dest = Path(out_dir) / "runs", Path(dest)
    done = []
    _keep_version(dest, _version(experiment))
    for cell in experiment.cells:
        for seed in c.seeds:
            keys = [run_key(cell, seed, b) for b in [0, *c.budgets[:-1]]]
            if not all(_scored(runs / k) for k in keys):
                continue
            for key in keys:
                if (dest / key / ARCHIVED).is_file():
                    continue
                keep_tokenizer = cell == c.baseline and seed == c.seeds[0] and key == keys[0]
                _archive_one(runs / key, dest / key, keep_tokenizer)
                done.append(key)
    return done


def restore_runs(src: str | Path, out_dir: str | Path, experiment=None) -> list[str]:
    """Copy every archived run under SRC into OUT/runs where that run has no folder yet (a run
    trained or begun here is never replaced); returns the runs restored. Given the experiment,
    nothing is restored from an archive of another version of its spec or recipe."""
    src, runs = Path(src), Path(out_dir) / "runs"
    restored = []
    if experiment is not None and stale_archive(src, experiment):
        return restored
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


def stale_archive(src: Path, experiment) -> bool:
    """Whether the archive at SRC holds runs of another version of the experiment's spec or
    recipe (digests as the ledger's records keep them): such runs are not this spec's."""
    kept = Path(src) / VERSION
    return kept.is_file() and json.loads(kept.read_text()) != _version(experiment)


def _version(experiment) -> dict[str, str]:
    from xformer.studies.ledger import measured_from  # the ledger imports the experiment, which imports this

    return measured_from(Path(experiment.source), experiment)


def _keep_version(dest: Path, version: dict[str, str]) -> None:
    """Mark DEST as the archive of this version of the spec; an archive of an earlier version
    there is moved aside to DEST.<its spec digest> (never deleted)."""
    kept = dest / VERSION
    if kept.is_file() and json.loads(kept.read_text()) != version:
        old = json.loads(kept.read_text())["spec_sha256"][:12]
        aside, n = dest.with_name(f"{dest.name}.{old}"), 1
        while aside.exists():
            aside, n = dest.with_name(f"{dest.name}.{old}-{n}"), n + 1
        dest.rename(aside)
    if not kept.is_file():
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


def main(argv: list[str]) -> None:
    """python -m xformer.studies.archive save SPEC OUT DEST | restore SPEC DEST OUT (ledger_chain.sh)."""
    if len(argv) == 4 and argv[0] == "save":
        from xformer.studies.experiment import load_experiment

        done = archive_runs(load_experiment(argv[1]), argv[2], argv[3])
        print(f"{argv[3]}: {len(done)} runs archived" + (f" ({', '.join(done)})" if done else ""))
    elif len(argv) == 4 and argv[0] == "restore":
        from xformer.studies.experiment import load_experiment

        experiment, src, out = load_experiment(argv[1]), Path(argv[2]), Path(argv[3])
        if src.is_dir() and stale_archive(src, experiment):
            print(f"{src}: archived from another version of {argv[1]} or its recipe; nothing restored")
            return
        done = restore_runs(src, out, experiment) if src.is_dir() else []
        print(f"{out}: {len(done)} archived runs restored from {src}")
    else:
        raise SystemExit("usage: python -m xformer.studies.archive save SPEC OUT DEST | restore SPEC DEST OUT")


if __name__ == "__main__":
    import sys

    from xformer.errors import XformerError

    try:
        main(sys.argv[1:])
    except XformerError as error:  # one line, as the CLI says it (a spec that cannot be archived, a bad file)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None

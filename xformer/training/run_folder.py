"""Run directories: what makes a folder xformer's, and what `train --overwrite` may remove.

A run directory is recognised by its marker file RUN/xformer-run.json (written when train or
tokenize creates the run; runs made before the marker are recognised by recipe.toml beside
checkpoints/). Only the artefacts a run writes are ever removed, and only by --overwrite:
anything else a user keeps in the folder stays. A folder that is not a run is never trained
into unless it is empty or holds only a tokenizer/, and neither the current directory (nor a
folder holding it) nor a folder holding the recipe being read can be the run directory.

Every checkpoint records the digest of the run's tokenizer files, so a tokenizer swapped
after training is caught when a checkpoint is loaded rather than decoding garbage. A driver of
many runs (experiment, longrange) asks run_state whether a run is trained, to resume or new.
When the disk fills or memory runs out mid-run, the errors say what in the folder is intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import time
from pathlib import Path

from xformer.errors import RunError
from xformer.locks import LOCK
from xformer.training.checkpoint import read_checkpoint_meta

MARKER = "xformer-run.json"
BRANCHED = "branched-from.json"  # where `train --branch-from` took the run from, and at which step
IMPORTED = "imported-from.json"  # where `xformer import` took the model from (xformer.importing)
INITIALISED = "init-from.json"  # the run and checkpoint `train --init-from` took the first weights from
ARTEFACTS = ("recipe.toml", "tokenizer", "metrics.jsonl", "checkpoints", "train.json", "eval", "eval.json", MARKER,
             "copied-from.json", BRANCHED,  # copied-from: where `experiment --reuse` copied the run from
             IMPORTED, INITIALISED,
             "trackers.json", "tensorboard", "wandb")  # --report-to's (xformer.training.trackers)


def is_run_dir(path: Path) -> bool:
    return (path / MARKER).is_file() or ((path / "recipe.toml").is_file() and (path / "checkpoints").is_dir())


def mark_run_dir(path: Path) -> None:
    """Create `path` if needed and mark it as a run directory (kept if already marked)."""
    path.mkdir(parents=True, exist_ok=True)
    if not (path / MARKER).is_file():
        text = json.dumps({"format": "xformer-run-1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        (path / MARKER).write_text(text + "\n", encoding="utf-8")


def check_out_dir(out_dir: Path, recipe_path: Path | None, *, resume: bool) -> None:
    """Refuse a run directory whose removal or rewriting would take a user's files with it:
    the current directory or one holding it, and a folder holding the recipe being read
    (except a run's own RUN/recipe.toml read to --resume it)."""
    out = out_dir.resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise RunError(f"{out_dir}: is the current directory{' or holds it' if out != cwd else ''}; "
                       "a run needs a directory of its own, e.g. runs/<name>")
    if recipe_path is None:
        return
    source = recipe_path.resolve()
    if out not in source.parents:
        return
    if resume and source == out / "recipe.toml" and is_run_dir(out):
        return
    raise RunError(f"{out_dir}: holds the recipe {recipe_path}, which a run would overwrite or remove; "
                   "train into another directory (the run keeps its resolved recipe as RUN/recipe.toml)")


def clear_run_dir(out_dir: Path, *, overwrite: bool, check_only: bool = False) -> list[str]:
    """Make `out_dir` ready for a new run; returns the artefacts --overwrite removed (with
    check_only, would remove, touching nothing).

    Fine as it is: missing, empty, or only a tokenizer/ (from `xformer tokenize`). A run
    directory needs --overwrite, which removes its artefacts and nothing else; any other
    non-empty folder is refused."""
    if not out_dir.exists():
        return []
    if not out_dir.is_dir():
        raise RunError(f"{out_dir}: is a file, not a directory; choose another --out")
    entries = {p.name for p in out_dir.iterdir()}
    if entries <= {"tokenizer", MARKER, LOCK, INITIALISED}:  # ready to train: tokenize, or --init-from, set it up
        return []
    if not is_run_dir(out_dir):
        raise RunError(f"{out_dir}: not empty and not an xformer run directory (no {MARKER}); "
                       "xformer will not write into it or remove its files: choose another --out")
    if not overwrite:
        raise RunError(f"{out_dir}: run directory exists and is not empty; "
                       "pass --resume to continue it or --overwrite to replace it")
    removed = []
    for name in ARTEFACTS:
        path = out_dir / name
        if check_only:
            if path.exists() or path.is_symlink():
                removed.append(name)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def remove_temporaries(run_dir: Path) -> list[str]:
    """Delete the half-written temporaries (xformer.files.atomic_write's `.NAME.*.tmp`) a killed
    run left in RUN and RUN/checkpoints; returns their names. Nothing else is touched."""
    removed = []
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "tokenizer"):
        if folder.is_dir():
            for path in folder.glob(".*.tmp"):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    removed.append(str(path.relative_to(run_dir)))
    return removed


def tokenizer_digest(run_dir: Path) -> str | None:
    """sha256 over the files of RUN/tokenizer that decide the ids (settings.json aside);
    None when there is none."""
    folder = Path(run_dir) / "tokenizer"
    files = sorted(p for p in folder.glob("*") if p.is_file() and p.name != "settings.json") if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def check_tokenizer(run_dir: Path, checkpoint: Path, meta: dict) -> None:
    """A RunError when `checkpoint` was trained with another tokenizer than RUN/tokenizer
    holds now. Checkpoints older than the record carry none and pass."""
    saved = meta.get("tokenizer")
    if saved is None:
        return
    now = tokenizer_digest(run_dir)
    if now != saved:
        raise RunError(f"{checkpoint}: trained with tokenizer {saved[:12]}, but {Path(run_dir) / 'tokenizer'} "
                       f"is {'missing' if now is None else now[:12]}; the ids would decode as other words "
                       "(restore the run's tokenizer, or retrain)")



def eval_name(split: str, data: str | None, columns: list[list]) -> str:
    """The stem of an evaluation's files in RUN/eval: the split's name for the recipe's own
    corpus; for other data, 'data-<file or folder name>-<digest of its rows>', so results of
    different inputs never share a file (an outside test.jsonl is not the recipe's test split)."""
    if data is None:
        return split
    path = Path(data)
    label = path.stem if path.is_file() else f"{path.name}-{split}"
    digest = hashlib.sha256()
    for column in columns:
        for value in column:
            digest.update(str(value).encode("utf-8") + b"\0")
        digest.update(b"\1")
    return f"data-{label}-{digest.hexdigest()[:10]}"


def tokenizer_dir(run_dir: str | Path) -> Path:
    """RUN/tokenizer: the sentencepiece model(s) or classification encoder a run was trained with."""
    return Path(run_dir) / "tokenizer"


def run_state(run_dir: Path) -> str:
    """What a driver of many runs (longrange, experiment) does with RUN: "trained" (its
    train.json says it ended: score it), "resume" (a checkpoint of a run stopped part way, or
    killed before its summary: --resume finishes it) or "new" (nothing usable, or a run that
    stopped for non-finite losses: train it from scratch)."""
    summary, last = run_dir / "train.json", run_dir / "checkpoints" / "last.safetensors"
    if summary.is_file():
        return "resume" if json.loads(summary.read_text())["stop_reason"] == "interrupted" else "trained"
    if last.is_file() and read_checkpoint_meta(last).get("stop_reason") != "nonfinite":
        return "resume"
    return "new"


def finished_at(out_dir: Path, step: int) -> bool:
    """Whether the run's train.json describes the checkpoint's step: the run ended there
    (rather than being killed between its last checkpoint and its summary)."""
    try:
        return json.loads((out_dir / "train.json").read_text())["steps"] == step
    except (OSError, ValueError, KeyError, TypeError):
        return False


def disk_full_error(exc: OSError, out_dir: Path) -> RunError:
    """The disk filled while the run wrote: what is intact, and how to go on."""
    last = out_dir / "checkpoints" / "last.safetensors"  # written whole or not at all: intact
    kept = f"{last} (step {read_checkpoint_meta(last)['progress']['step']}) is intact; " if last.is_file() else ""
    reason = "no space left on the device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    return RunError(f"{out_dir}: {reason} while writing {exc.filename or 'the run'}; {kept}free some space, "
                    "then --resume continues the run")


def out_of_memory_error(exc: Exception, recipe, device: str, out_dir: Path) -> RunError:
    """Out of memory: what to set so the same step fits, in halves."""
    d, cfg = recipe.data, recipe.train
    last = out_dir / "checkpoints" / "last.safetensors"
    kept = f"{last} is intact; " if last.is_file() else ""
    return RunError(f"out of memory on {device} ({str(exc).splitlines()[0][:160]}); batches hold "
                    f"data.max_tokens = {d.max_tokens} tokens: train with --set data.max_tokens={d.max_tokens // 2} "
                    f"--set train.accumulate_steps={cfg.accumulate_steps * 2} (the same step in halves) into a new "
                    f"--out, since a resumed run keeps its batches; {kept}--resume continues it where memory allows")

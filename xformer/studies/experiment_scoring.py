"""Scoring an experiment's runs (xformer.studies.experiment): each run's test score with its
best-on-validation checkpoint, once, and what a comparison needs beside it: scores at other
lengths, the machine it was made on, a diverged run's empty output, the test inputs' lengths,
the teachers of distilled cells."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from xformer.evaluate import CannotExtrapolate, evaluate_run
from xformer.files import atomic_write_text
from xformer.heads.roles import role_counts
from xformer.studies.archive import archived_best
from xformer.tasks import make_task, parameter_count
from xformer.tasks.base import checkpoint_identity
from xformer.training.checkpoint import read_checkpoint_meta


def score_run(run_dir: Path, cell: str, seed: int, device: str) -> dict:
    """The run's test score with its best-on-validation checkpoint, scored once and kept."""
    trained = json.loads((run_dir / "train.json").read_text())
    summary = run_dir / "eval.json"
    test = json.loads(summary.read_text()) if summary.is_file() else None
    # scored again unless eval.json scored the very tensors `best` holds now, of the finished run
    kept = (test or {}).get("card", {}).get("checkpoint", {})
    best_now = archived_best(run_dir) or checkpoint_identity(run_dir, "best")[0]  # archived: as it was scored
    scored_here = (test is None or test.get("checkpoint") != "best" or not kept.get("final")
                   or kept.get("sha256") != best_now["sha256"])
    if scored_here:
        test = json.loads(evaluate_run(run_dir, checkpoint="best", device=device).to_json())
    provenance = run_dir / "copied-from.json"
    copied = json.loads(provenance.read_text()) if provenance.is_file() else None
    metric = "bleu" if "bleu" in test else "accuracy"
    for kind in ("hypotheses", "predictions"):  # in RUN/eval/, wherever the run was scored (or copied from)
        if test.get(kind):
            test[kind] = str(run_dir / "eval" / Path(test[kind]).name)
    best = trained["best"] or {}
    curve = [[h["step"], h.get(metric)] for h in trained.get("history", []) if h.get("kind") == "valid"]
    # speeds timed in this experiment only: a --reuse copy was trained elsewhere, and decoded
    # elsewhere unless it was scored again
    train_timed = bool(trained.get("loop_seconds")) and copied is None
    decode_timed = copied is None or copied["rescored"] or scored_here
    return {"cell": cell, "seed": seed, "metric": metric, "test": test[metric], "valid": best.get(metric),
            "best_step": best.get("step"), "steps": trained["steps"], "parameters": trained["parameters"],
            "curve": curve,  # [step, validation metric] at every validation: what convergence is judged on
            "train_seconds": trained["train_seconds"], "hypotheses": test.get("hypotheses"),
            # training steps a second, validation excluded (a claim about training speed
            # compares the steps, not how long each model takes to validate)
            "train_steps_per_s": trained["steps"] / trained["loop_seconds"] if train_timed else None,
            "train_others_cpu": trained.get("others_cpu") if train_timed else None,
            # test sentences decoded (translation) or examples classified a second
            "decode_per_s": test.get("sentences_per_s" if metric == "bleu" else "examples_per_s")
            if decode_timed else None,
            "decode_others_cpu": test.get("others_cpu") if decode_timed else None,
            # the decoder's KV cache at its largest (one batch): the model's, wherever it was decoded
            "decode_cache_mb": test.get("kv_cache_mb"),
            "predictions": test.get("predictions"), "copied_from": copied and copied["source"],
            "machine": machine(trained.get("card", {})), "run_dir": str(run_dir)}


def at_lengths(run_dir: Path, lengths: list[int], device: str) -> dict:
    """{"test_at": {length: accuracy}, "cannot": {length: why}} of the run's best checkpoint on
    its task generated at each length (evaluate.at_length): scored once, kept in RUN/eval/; a
    model with no positions that far scores 0 (it cannot answer), with the reason."""
    if not lengths:
        return {}
    scores, cannot = {}, {}
    sha = checkpoint_identity(run_dir, "best")[0]["sha256"]
    for length in lengths:
        kept = run_dir / "eval" / f"test.len{length}.best.json"
        found = json.loads(kept.read_text()) if kept.is_file() else None
        if found is None or found.get("card", {}).get("checkpoint", {}).get("sha256") != sha:
            try:
                found = json.loads(evaluate_run(run_dir, checkpoint="best", device=device, length=length).to_json())
            except CannotExtrapolate as exc:
                scores[str(length)], cannot[str(length)] = 0.0, str(exc)
                continue
        scores[str(length)] = found["accuracy"]
    return {"test_at": scores, **({"cannot": cannot} if cannot else {})}


def head_roles(run_dir: Path, n_examples: int, device: str) -> dict:
    """The heads of the run's best checkpoint with each role, and of the same model at
    initialisation (xformer.heads.roles), counted on `n_examples` validation examples once and
    kept in RUN/heads/roles.json; {} when n_examples is 0."""
    if not n_examples:
        return {}
    kept = run_dir / "heads" / "roles.json"
    sha = checkpoint_identity(run_dir, "best")[0]["sha256"]
    found = json.loads(kept.read_text()) if kept.is_file() else {}
    if found.get("checkpoint_sha256") != sha or found.get("n_examples") != n_examples:
        found = {"checkpoint_sha256": sha, "n_examples": n_examples,
                 "counts": role_counts(run_dir, n_examples, device="cpu" if device == "auto" else device)}
        kept.parent.mkdir(exist_ok=True)
        atomic_write_text(kept, json.dumps(found, indent=2))
    return found["counts"]


def machine(card: dict) -> dict:
    """What a run was made on and with, from its run card: runs of one comparison must agree on
    the device and precision (and, for a timing, on the CPU); the ledger checks (xformer.studies.ledger)."""
    return {"cpu": card.get("cpu"), "device": card.get("device"), "precision": card.get("precision"),
            "torch": card.get("versions", {}).get("torch"), "commit": card.get("git_commit")}


def diverged_at(run_dir: Path) -> int | None:
    """The step where the run stopped because its loss or gradients stayed non-finite, or None."""
    progress = diverged_progress(run_dir)
    return progress["step"] if progress else None


def diverged_progress(run_dir: Path) -> dict | None:
    last = run_dir / "checkpoints" / "last.safetensors"
    if (run_dir / "train.json").is_file() or not last.is_file():
        return None
    meta = read_checkpoint_meta(last)
    return meta["progress"] if meta.get("stop_reason") == "nonfinite" else None


def score_diverged(experiment, run_dir: Path, cell: str, seed: int, step: int) -> dict:
    """A run that diverged translates (classifies) nothing: it is scored as an empty output on
    the test split (BLEU 0; every example wrong), which still pairs with the baseline's run."""
    recipe = experiment.recipe(cell, seed)
    task = make_task(recipe)
    n = len(task.test_input_lengths(run_dir))
    metric, kind, path = task.METRIC, task.OUTPUTS, run_dir / "eval" / f"diverged{task.OUTPUT_SUFFIX}"
    atomic_write_text(path, "\n" * n)
    progress = diverged_progress(run_dir) or {}  # the steps it took until it stopped
    loop, others = progress.get("loop_seconds"), progress.get("others_cpu_seconds")
    return {"cell": cell, "seed": seed, "metric": metric, "test": 0.0, "valid": None, "best_step": None,
            "steps": step, "parameters": parameter_count(recipe), "train_seconds": progress.get("seconds", 0.0),
            "hypotheses": None, "predictions": None, kind: str(path),
            "train_steps_per_s": step / loop if loop else None, "decode_per_s": None,
            "train_others_cpu": others / progress["seconds"] if loop and others is not None else None,
            "decode_others_cpu": None, "decode_cache_mb": None,
            "copied_from": None, "diverged_at": step, "run_dir": str(run_dir)}


def teachers(experiment) -> dict | None:
    """Per distilled cell, its teacher's own test score and steps (its RUN/eval.json and
    train.json), so a student is read beside what it learned from; None without teachers."""
    found = {}
    for cell in experiment.cells:
        teacher = experiment.recipe(cell, experiment.config.seeds[0]).distill.teacher
        if not teacher:
            continue
        scored, trained = (Path(teacher) / name for name in ("eval.json", "train.json"))
        test = json.loads(scored.read_text()) if scored.is_file() else {}
        found[cell] = {"run": str(teacher), "test": test.get("bleu", test.get("accuracy")),
                       "steps": json.loads(trained.read_text())["steps"] if trained.is_file() else None}
    return found or None


def input_lengths(experiment, baseline_run: Path) -> dict:
    """The lengths of the test set's inputs in tokens (translation: source pieces of the
    tokenizer of `baseline_run`, the baseline's first seed), which a claim's preconditions
    compare with (a rank, a window)."""
    c = experiment.config
    recipe = experiment.recipe(c.baseline, c.seeds[0])
    lengths = make_task(recipe).test_input_lengths(baseline_run)
    return {"median_source": float(statistics.median(lengths)), "max_source": max(lengths)}

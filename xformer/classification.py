"""Scoring a trained classifier (Transformer or LSTM): accuracy, loss, confusion matrix.

`evaluate_classification_run` is what `xformer eval RUN` does for a classification run: it
scores a split (default the test split) or any JSONL file/folder with the recipe's text and
label fields, writes RUN/eval/<name>.<checkpoint>.{json,pred} and RUN/eval.json, and returns
the report (keys accuracy, loss, n_examples, labels, confusion for <= 20 classes, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from xformer.checkpoint import atomic_write_text, load_model_weights, read_checkpoint, run_checkpoint
from xformer.config import SYNTHETIC_TASKS, Recipe
from xformer.data.classify import ClassBatches, Examples, TextEncoder, collate_tokens, generated_splits
from xformer.data.corpus import load_split
from xformer.errors import RunError
from xformer.model.build import build_model
from xformer.recipe_io import load_run_recipe
from xformer.rundir import check_tokenizer, eval_name
from xformer.runtime import resolve_runtime
from xformer.tokenize import tokenizer_dir

CONFUSION_MAX_CLASSES = 20


def load_classification_run(run_dir: str | Path, checkpoint: str, device: str = "auto", precision: str = "auto"):
    """(recipe, encoder, labels, model on its device, runtime) of a trained classification run."""
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    encoder, saved = TextEncoder.load(tokenizer_dir(run_dir))
    path = run_checkpoint(run_dir, checkpoint)
    tensors, meta = read_checkpoint(path)
    check_tokenizer(Path(run_dir), path, meta)
    rt = resolve_runtime(device, precision, training=False)
    labels = saved["labels"]
    model = build_model(recipe.model, encoder.vocab_size, n_classes=len(labels), pad_id=0, init=False)
    load_model_weights(model, tensors, path)
    return recipe, encoder, labels, model.to(rt.device).eval(), rt


def predict(model, examples: Examples, max_tokens: int, rt) -> tuple[np.ndarray, float]:
    """Predicted class of every example (in input order) and the summed cross-entropy."""
    predicted = np.zeros(len(examples), dtype=np.int64)
    total = 0.0
    with torch.inference_mode(), rt.autocast():
        for rows in ClassBatches(examples, max_tokens, seed=0, shuffle=False).batches(0):
            rows = np.asarray(rows)
            batch = collate_tokens(examples, rows)
            logits = model(batch["tokens"].to(rt.device)).float()
            total += F.cross_entropy(logits, batch["labels"].to(rt.device), reduction="sum").item()
            predicted[rows] = logits.argmax(-1).cpu().numpy()
    return predicted, total


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, n_classes: int) -> list[list[int]]:
    """counts[true][predicted]."""
    counts = np.bincount(labels * n_classes + predicted, minlength=n_classes * n_classes)
    return counts.reshape(n_classes, n_classes).tolist()


def split_examples(recipe: Recipe, encoder: TextEncoder, labels: list[str], split: str | None,
                   data: str | None) -> tuple[Examples, str]:
    """The examples to score and the name of the report."""
    d = recipe.data
    if d.task in SYNTHETIC_TASKS:
        if data is not None:
            raise RunError(f"--data: a {d.task} run scores its own generated splits (train, valid, test), "
                           "not a file")
        split = split or "test"
        splits = generated_splits(d.task, d.n_train, d.n_valid, d.n_test, d.max_len, d.seed,
                                      d.n_queries, d.n_pairs)
        if split not in splits:
            raise RunError(f"--split {split}: a generated task has the splits train, valid and test")
        return splits[split], split
    from xformer.jobs import encode_examples  # jobs imports the training side; keep it out of import time

    spec = data if data is not None else d.dataset
    split = split or d.test_split
    config = d.dataset_config or None if data is None else None
    raw = load_split(spec, split, [d.text_field, d.label_field], config, complete=True, numeric=(d.label_field,))
    name = eval_name(split, data, [raw[d.text_field], raw[d.label_field]])
    return encode_examples(raw, recipe, encoder, labels), name


def evaluate_classification_run(run_dir: str | Path, *, split: str | None = None, data: str | None = None,
                                checkpoint: str | None = None, device: str = "auto") -> dict:
    checkpoint = checkpoint or load_run_recipe(run_dir).eval.checkpoint
    recipe, encoder, labels, model, rt = load_classification_run(run_dir, checkpoint, device)
    examples, name = split_examples(recipe, encoder, labels, split, data)
    predicted, total = predict(model, examples, recipe.data.max_tokens, rt)
    n = len(examples)
    report = {
        "accuracy": 100.0 * float((predicted == examples.labels).mean()) if n else 0.0,
        "loss": total / max(n, 1), "n_examples": n, "task": recipe.data.task, "split": name,
        "checkpoint": checkpoint, "labels": labels,
        "majority_accuracy": 100.0 * float(np.bincount(examples.labels).max() / n) if n else 0.0,
    }
    if len(labels) <= CONFUSION_MAX_CLASSES:
        report["confusion"] = confusion_matrix(examples.labels, predicted, len(labels))
    out_dir = Path(run_dir) / "eval"
    stem = f"{name}.{checkpoint}"
    report["predictions"] = str(out_dir / f"{stem}.pred")
    atomic_write_text(out_dir / f"{stem}.pred", "".join(labels[p] + "\n" for p in predicted))
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(report, indent=2))
    if data is None and name == recipe.data.test_split:
        atomic_write_text(Path(run_dir) / "eval.json", json.dumps(report, indent=2))  # the recipe's test split only
    return report

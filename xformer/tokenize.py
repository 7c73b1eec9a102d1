"""`xformer tokenize`: train a run's sentencepiece tokenizer, or apply it to text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from xformer.checkpoint import atomic_write_text
from xformer.config import Recipe
from xformer.data.corpus import load_split
from xformer.data.tokenizer import UNK_ID, Side, Tokenizer, train_tokenizer
from xformer.errors import RunError
from xformer.rundir import check_out_dir, mark_run_dir


def tokenizer_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "tokenizer"


SETTINGS = "settings.json"  # the [data] values a tokenizer was trained with, next to it


def tokenizer_settings(recipe: Recipe) -> dict:
    d = recipe.data
    return {"dataset": d.dataset, "train_split": d.train_split, "source_lang": d.source_lang,
            "target_lang": d.target_lang, "tokenizer": d.tokenizer, "vocab_size": d.vocab_size,
            "joint_vocab": d.joint_vocab, "character_coverage": d.character_coverage,
            "byte_fallback": d.byte_fallback, "seed": recipe.train.seed}


def ensure_tokenizer(recipe: Recipe, run_dir: str | Path, train_split=None) -> Tokenizer:
    """The run's tokenizer, trained on the recipe's training split when the run has none yet.

    An existing one must have been trained with the recipe's [data] values (settings.json);
    a tokenizer put there by hand (no settings.json) is taken as it is."""
    d = recipe.data
    directory = tokenizer_dir(run_dir)
    wanted = tokenizer_settings(recipe)
    if directory.is_dir() and any(directory.glob("*.model")):
        saved_path = directory / SETTINGS
        if saved_path.is_file():
            saved = json.loads(saved_path.read_text())
            differ = [k for k in wanted if k not in ("dataset", "seed") and saved.get(k) != wanted[k]]
            if differ:
                found = ", ".join(f"{k} = {saved.get(k)!r}" for k in differ)
                raise RunError(f"{directory}: trained with {found}; the recipe says "
                               f"{', '.join(f'{k} = {wanted[k]!r}' for k in differ)} (retrain it with "
                               "xformer tokenize --overwrite, or use another --out)")
        return Tokenizer.load(directory, d.source_lang, d.target_lang)
    if train_split is None:
        train_split = load_split(d.dataset, d.train_split, [d.source_lang, d.target_lang], d.dataset_config or None)
    tokenizer = train_tokenizer(
        train_split, d.source_lang, d.target_lang, directory, model_type=d.tokenizer, vocab_size=d.vocab_size,
        joint=d.joint_vocab, character_coverage=d.character_coverage, byte_fallback=d.byte_fallback,
        seed=recipe.train.seed,
    )
    atomic_write_text(directory / SETTINGS, json.dumps(wanted, indent=2))
    return tokenizer


def tokenize_recipe(recipe: Recipe, run_dir: str | Path, *, overwrite: bool = False, sample: int = 2000) -> dict:
    """Train the tokenizer of `recipe` into RUN/tokenizer and describe it: vocabulary sizes and,
    on the first `sample` training pairs, pieces per sentence and the share of unknown pieces."""
    _translation_only(recipe)
    directory = tokenizer_dir(run_dir)
    trained = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("*.safetensors"))
    if trained:  # a new tokenizer would give their ids other pieces: eval would decode garbage
        raise RunError(f"{directory}: the run has checkpoints trained with this tokenizer ({', '.join(trained[:3])}"
                       f"{', ...' if len(trained) > 3 else ''}); a new one needs a new run directory (--out)")
    if directory.exists() and any(directory.iterdir()):
        if not overwrite:
            raise RunError(f"{directory}: a tokenizer exists; pass --overwrite to train a new one")
        shutil.rmtree(directory)
    check_out_dir(Path(run_dir), None, resume=False)
    mark_run_dir(Path(run_dir))
    d = recipe.data
    train = load_split(d.dataset, d.train_split, [d.source_lang, d.target_lang], d.dataset_config or None)
    tokenizer = ensure_tokenizer(recipe, run_dir, train)
    head = train.select(range(min(sample, len(train))))
    stats = {"directory": str(directory), "files": [str(f) for f in tokenizer.files], "joint": tokenizer.joint}
    for side, lang in (("source", d.source_lang), ("target", d.target_lang)):
        ids = tokenizer.encode(list(head[lang]), side)
        n = sum(len(s) for s in ids)
        stats[f"{side}_vocab"] = tokenizer.vocab_size(side)
        stats[f"{side}_pieces_per_sentence"] = n / max(1, len(ids))
        stats[f"{side}_unk_rate"] = sum(s.count(UNK_ID) for s in ids) / max(1, n)
    return stats


def apply_tokenizer(recipe: Recipe, run_dir: str | Path, lines: list[str], side: Side) -> list[str]:
    """Lines as space-separated sentencepiece pieces, with the run's tokenizer."""
    _translation_only(recipe)
    d = recipe.data
    tokenizer = Tokenizer.load(tokenizer_dir(run_dir), d.source_lang, d.target_lang)
    return [" ".join(p) for p in tokenizer.pieces(lines, side)]


def _translation_only(recipe: Recipe) -> None:
    if recipe.data.is_classification:
        raise RunError(f"data.task = {recipe.data.task!r}: xformer tokenize is for translation recipes; "
                       "xformer train fits a classification run's encoder itself (RUN/tokenizer/encoder.json)")

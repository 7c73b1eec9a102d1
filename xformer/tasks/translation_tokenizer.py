"""A translation run's tokenizer: trained once on the recipe's training split into
RUN/tokenizer/, with the [data] values it was trained with beside it (settings.json), so a run
or `xformer tokenize` that finds one trained with other values refuses it rather than using it."""

from __future__ import annotations

import json
from pathlib import Path

from xformer.config.schema import Recipe
from xformer.data.tokenizer import Tokenizer, train_tokenizer
from xformer.errors import RunError
from xformer.files import atomic_write_text
from xformer.training.run_folder import tokenizer_dir

SETTINGS = "settings.json"  # the [data] values a tokenizer was trained with, next to it

# what a tokenizer's settings.json meant by a key it was written without (an older xformer's)
SETTINGS_BEFORE = {"train_limit": 0}


def tokenizer_settings(recipe: Recipe) -> dict:
    d = recipe.data
    return {"dataset": d.dataset, "train_split": d.train_split, "train_limit": d.train_limit,
            "source_lang": d.source_lang, "target_lang": d.target_lang, "tokenizer": d.tokenizer,
            "vocab_size": d.vocab_size,
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
            saved = {**SETTINGS_BEFORE, **saved}
            differ = [k for k in wanted if k not in ("dataset", "seed") and saved.get(k) != wanted[k]]
            if differ:
                found = ", ".join(f"{k} = {saved.get(k)!r}" for k in differ)
                raise RunError(f"{directory}: trained with {found}; the recipe says "
                               f"{', '.join(f'{k} = {wanted[k]!r}' for k in differ)} (retrain it with "
                               "xformer tokenize --overwrite, or use another --out)")
        return Tokenizer.load(directory, d.source_lang, d.target_lang)
    if train_split is None:
        train_split = d.load_train([d.source_lang, d.target_lang])
    tokenizer = train_tokenizer(
        train_split, d.source_lang, d.target_lang, directory, model_type=d.tokenizer, vocab_size=d.vocab_size,
        joint=d.joint_vocab, character_coverage=d.character_coverage, byte_fallback=d.byte_fallback,
        seed=recipe.train.seed,
    )
    atomic_write_text(directory / SETTINGS, json.dumps(wanted, indent=2))
    return tokenizer

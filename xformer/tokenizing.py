"""`xformer tokenize`: train a translation run's sentencepiece tokenizer, or apply it to text."""

from __future__ import annotations

import shutil
from pathlib import Path

from xformer.config.schema import Recipe
from xformer.data.tokenizer import UNK_ID, Side, Tokenizer
from xformer.errors import RunError
from xformer.results import TokenizeResult
from xformer.tasks.translation import TranslationData
from xformer.tasks.translation_tokenizer import ensure_tokenizer
from xformer.training.run_folder import check_out_dir, mark_run_dir, tokenizer_dir


def tokenize_recipe(recipe: Recipe, run_dir: str | Path, *, overwrite: bool = False,
                    sample: int = 2000) -> TokenizeResult:
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
            raise RunError(f"{directory}: a tokenizer exists; overwrite it (xformer tokenize --overwrite) to train "
                           "a new one")
        shutil.rmtree(directory)
    check_out_dir(Path(run_dir), None, resume=False)
    mark_run_dir(Path(run_dir))
    d = recipe.data
    train = d.load_train([d.source_lang, d.target_lang])
    tokenizer = ensure_tokenizer(recipe, run_dir, train)
    head = train.select(range(min(sample, len(train))))
    stats = {"directory": str(directory), "files": [str(f) for f in tokenizer.files], "joint": tokenizer.joint}
    for side, lang in (("source", d.source_lang), ("target", d.target_lang)):
        ids = tokenizer.encode(list(head[lang]), side)
        n = sum(len(s) for s in ids)
        stats[f"{side}_vocab"] = tokenizer.vocab_size(side)
        stats[f"{side}_pieces_per_sentence"] = n / max(1, len(ids))
        stats[f"{side}_unk_rate"] = sum(s.count(UNK_ID) for s in ids) / max(1, n)
    return TokenizeResult(**stats)


def apply_tokenizer(recipe: Recipe, run_dir: str | Path, lines: list[str], side: Side) -> list[str]:
    """Lines as space-separated sentencepiece pieces, with the run's tokenizer."""
    _translation_only(recipe)
    d = recipe.data
    tokenizer = Tokenizer.load(tokenizer_dir(run_dir), d.source_lang, d.target_lang)
    return [" ".join(p) for p in tokenizer.pieces(lines, side)]


def _translation_only(recipe: Recipe) -> None:
    if not isinstance(recipe.data, TranslationData):
        raise RunError(f"data.task = {recipe.data.task!r}: xformer tokenize is for translation recipes; "
                       "xformer train fits a classification run's encoder itself (RUN/tokenizer/encoder.json)")

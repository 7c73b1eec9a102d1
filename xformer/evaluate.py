"""Evaluation: validation during training, and scoring a finished run (beam search, sacreBLEU).

`evaluate_run` decodes a split of the recipe's corpus (or any JSONL file / folder with the
recipe's language fields) with the chosen checkpoint, writes the hypotheses and scores (bleu,
bleu_lc, chrf, signature, n_sentences, ...) to RUN/eval/<name>.*, named so that different
inputs never share a file (rundir.eval_name), copies the scores of the recipe's test split to
RUN/eval.json, and returns the same dict.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xformer.checkpoint import atomic_write_text, load_model_weights, read_checkpoint, run_checkpoint
from xformer.config import Recipe
from xformer.data.batching import collate_source
from xformer.data.corpus import load_split
from xformer.data.tokenizer import PAD_ID, Tokenizer
from xformer.decode import beam_search, greedy_decode
from xformer.errors import RunError
from xformer.metrics import translation_scores
from xformer.model.build import build_model
from xformer.model.transformer import Seq2Seq
from xformer.optim import sequence_loss
from xformer.recipe_io import load_run_recipe
from xformer.rundir import check_tokenizer, eval_name
from xformer.runtime import Runtime, resolve_runtime


def build_translation_model(recipe: Recipe, tokenizer: Tokenizer) -> Seq2Seq:
    """The recipe's Seq2Seq sized by the tokenizer actually trained (sentencepiece may give
    fewer pieces than data.vocab_size on a small corpus)."""
    return build_model(recipe.model, tokenizer.vocab_size("source"),
                       tgt_vocab_size=tokenizer.vocab_size("target"), pad_id=PAD_ID)


def translate_ids(
    model: Seq2Seq, sources: list[list[int]], recipe: Recipe, rt: Runtime, *, beam: int | None = None,
    lenpen: float | None = None, on_batch: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Decode token-id sources (no EOS) in length-sorted batches of eval.batch_sentences;
    beam 1 is greedy. Returns hypotheses in input order, without BOS/EOS."""
    cfg = recipe.eval
    beam = cfg.beam if beam is None else beam
    lenpen = cfg.lenpen if lenpen is None else lenpen
    limit = recipe.model.max_positions - 1  # room for EOS
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    was_training = model.training
    model.eval()
    with torch.inference_mode(), rt.autocast():
        for start in range(0, len(order), cfg.batch_sentences):
            idx = order[start : start + cfg.batch_sentences]
            src = collate_source([sources[i][:limit] for i in idx]).to(rt.device)
            a, b = cfg.max_len_a, min(cfg.max_len_b, limit)
            if beam == 1:
                hyps = greedy_decode(model, src, max_len_a=a, max_len_b=b)
            else:
                hyps = beam_search(model, src, beam=beam, lenpen=lenpen, max_len_a=a, max_len_b=b)
            for i, h in zip(idx, hyps, strict=True):
                out[i] = h[:limit]
            if on_batch:
                on_batch(len(idx))
    model.train(was_training)
    return out


def validate(model, tokenizer, valid_batches, valid_data, refs, recipe: Recipe, rt: Runtime,
             with_bleu: bool = True) -> dict:
    """Validation loss (token NLL, no label smoothing) and, with_bleu, cased sacreBLEU and chrF
    of greedy translations of the validation sources."""
    model.eval()
    total, tokens = 0.0, 0
    limit = recipe.model.max_positions  # a longer validation pair is scored on its first positions
    with torch.inference_mode(), rt.autocast():
        for batch in valid_batches.iter_epoch(0):
            src, tgt_in, tgt_out = (batch[k][:, :limit].to(rt.device) for k in ("src", "tgt_in", "tgt_out"))
            keep = tgt_out.ne(PAD_ID)
            total += sequence_loss(model(src, tgt_in, keep=keep), tgt_out[keep], PAD_ID).item()
            tokens += int(keep.sum())
    scores = {"loss": total / tokens, "ppl": math.exp(min(total / tokens, 50))}
    if with_bleu:
        started = time.perf_counter()
        ids = translate_ids(model, list(valid_data["src_ids"]), recipe, rt, beam=1)
        hyps = tokenizer.decode(ids, "target")
        bleu = translation_scores(hyps, refs)
        scores.update(bleu=bleu["bleu"], chrf=bleu["chrf"], decode_seconds=time.perf_counter() - started)
    return scores


def load_translation_run(run_dir: str | Path, checkpoint: str, device: str = "auto", precision: str = "auto"):
    """(recipe, tokenizer, model on its device, runtime) of a trained run."""
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    tokenizer = Tokenizer.load(run_dir / "tokenizer", recipe.data.source_lang, recipe.data.target_lang)
    path = run_checkpoint(run_dir, checkpoint)
    tensors, meta = read_checkpoint(path)
    check_tokenizer(Path(run_dir), path, meta)
    rt = resolve_runtime(device, precision, training=False)
    model = build_translation_model(recipe, tokenizer)
    load_model_weights(model, tensors, path)
    return recipe, tokenizer, model.to(rt.device).eval(), rt


def evaluate_run(
    run_dir: str | Path, *, split: str | None = None, data: str | None = None, beam: int | None = None,
    lenpen: float | None = None, checkpoint: str | None = None, device: str = "auto",
    on_progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Translate a split (default: the recipe's test split) or `data` and score it.
    Writes RUN/eval/<name>.<checkpoint>.beam<N>.{hyp,json}; returns the scores. A
    classification run is scored by classification.evaluate_classification_run instead."""
    saved = load_run_recipe(run_dir)
    if saved.data.is_classification:
        from xformer.classification import evaluate_classification_run

        return evaluate_classification_run(run_dir, split=split, data=data, checkpoint=checkpoint, device=device)
    checkpoint = checkpoint or saved.eval.checkpoint
    recipe, tokenizer, model, rt = load_translation_run(run_dir, checkpoint, device)
    d = recipe.data
    spec = data if data is not None else d.dataset
    split = split or d.test_split
    config = d.dataset_config or None if data is None else None  # a Hub configuration names the recipe's corpus
    raw = load_split(spec, split, [d.source_lang, d.target_lang], config, complete=True)
    sources = tokenizer.encode(list(raw[d.source_lang]), "source")
    beam = recipe.eval.beam if beam is None else beam
    lenpen = recipe.eval.lenpen if lenpen is None else lenpen
    done = 0

    def tick(n):
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, len(sources))

    started = time.perf_counter()
    hyps = tokenizer.decode(translate_ids(model, sources, recipe, rt, beam=beam, lenpen=lenpen, on_batch=tick),
                            "target")
    seconds = time.perf_counter() - started
    scores = translation_scores(hyps, list(raw[d.target_lang]))
    name = eval_name(split, data, [raw[d.source_lang], raw[d.target_lang]])
    out_dir = Path(run_dir) / "eval"
    stem = f"{name}.{checkpoint}.beam{beam}.lenpen{lenpen:g}"
    report = {**scores, "data": spec, "split": split if data is None else None, "checkpoint": checkpoint,
              "beam": beam, "lenpen": lenpen, "decode_seconds": seconds,
              "sentences_per_s": len(hyps) / max(seconds, 1e-9), "hypotheses": str(out_dir / f"{stem}.hyp")}
    atomic_write_text(out_dir / f"{stem}.hyp", "".join(h + "\n" for h in hyps))
    atomic_write_text(out_dir / f"{stem}.json", json.dumps(report, indent=2))
    if data is None and split == d.test_split:  # RUN/eval.json: the recipe's own test split only
        atomic_write_text(Path(run_dir) / "eval.json", json.dumps(report, indent=2))
    return report


def translate_lines(run_dir: str | Path, lines: list[str], *, checkpoint: str | None = None,
                    beam: int | None = None, lenpen: float | None = None, device: str = "auto",
                    on_warning: Callable[[str], None] | None = None) -> list[str]:
    """Translate raw sentences with a trained run; the recipe's [eval] settings by default.
    A blank line stays blank (nothing is decoded for it); a line longer than the model's
    positions is translated from its first model.max_positions - 1 pieces, and `on_warning`
    is told which line was cut."""
    saved = load_run_recipe(run_dir)
    if saved.data.is_classification:
        raise RunError(f"{run_dir}: a {saved.data.task} classification run; translate needs a translation run")
    checkpoint = checkpoint or saved.eval.checkpoint
    recipe, tokenizer, model, rt = load_translation_run(run_dir, checkpoint, device)
    sources = tokenizer.encode(lines, "source")
    limit = recipe.model.max_positions - 1  # room for EOS
    for number, ids in enumerate(sources, start=1):
        if len(ids) > limit and on_warning:
            on_warning(f"line {number}: {len(ids)} pieces, more than the model's {limit} positions; "
                       f"translated its first {limit} pieces")
    kept = [i for i, ids in enumerate(sources) if ids]
    hyps = translate_ids(model, [sources[i] for i in kept], recipe, rt, beam=beam, lenpen=lenpen) if kept else []
    out = [""] * len(lines)
    for i, text in zip(kept, tokenizer.decode(hyps, "target"), strict=True):
        out[i] = text
    return out

"""inspect-heads' view of a translation run (TranslationTask.subject): the model, a sample of
pairs batched by length, the token frequencies of the training corpus (for rare-word heads),
the sites' query and key tokens, and the loss and BLEU that head importance is measured by.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from xformer.data.batching import collate
from xformer.data.corpus import load_split
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from xformer.generation.decode import translate_ids
from xformer.metrics import translation_scores
from xformer.tasks.base import SiteTokens, Subject, mark_pad, site_space
from xformer.training.losses import sequence_loss


def translation_subject(task, model, rt, run_dir: Path, *, split: str | None, data: str | None,
                        n_examples: int) -> TranslationSubject:
    """The opened model (fp32) and the first n_examples pairs of `split` (default: the
    validation split) or of `data`, with the token frequencies of the training corpus."""
    recipe, d = task.recipe, task.recipe.data
    fields = [d.source_lang, d.target_lang]
    config = d.dataset_config or None if data is None else None
    raw = load_split(data if data is not None else d.dataset, split or d.valid_split, fields, config)
    raw = raw.select(range(min(n_examples, len(raw))))
    limit = recipe.model.max_positions - 1
    sources = [s[:limit] for s in task.tokenizer.encode(list(raw[d.source_lang]), "source")]
    targets = [t[:limit] for t in task.tokenizer.encode(list(raw[d.target_lang]), "target")]
    train = d.load_train(fields)
    frequency = {side: _counts(task.tokenizer.encode(list(train[lang]), side), task.tokenizer.vocab_size(side))
                 for side, lang in (("source", d.source_lang), ("target", d.target_lang))}
    subject = TranslationSubject(model, recipe, rt, task.tokenizer, sources, targets, list(raw[d.target_lang]),
                                 frequency, task=task)
    subject.run_dir = run_dir
    return subject


class TranslationSubject(Subject):
    """inspect-heads' view of a translation run: encoder, decoder and cross-attention sites."""

    kind = "translation"
    metric_names = ("loss", "bleu")
    special_ids = frozenset({BOS_ID, EOS_ID})

    def __init__(self, model, recipe, rt, tokenizer, sources, targets, references, frequency, task=None):
        self.tokenizer, self.sources, self.targets, self.references = tokenizer, sources, targets, references
        token_text = {side: tokenizer.vocabulary(side) for side in ("source", "target")}
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        batches, size = [], max(1, 4096 // max(1, max(len(s) for s in sources) if sources else 1))
        for start in range(0, len(order), size):
            rows = order[start:start + size]
            batches.append({**collate([(sources[i], targets[i]) for i in rows]), "rows": rows})
        super().__init__(model, recipe, rt, batches, token_text, frequency, task)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["src"].to(self.rt.device), batch["tgt_in"].to(self.rt.device))

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        tgt_out = batch["tgt_out"].to(self.rt.device)
        logits = self.forward(batch)
        return sequence_loss(logits, tgt_out, PAD_ID), int(tgt_out.ne(PAD_ID).sum())

    def site_tokens(self, site: str, batch: dict) -> SiteTokens:
        src, tgt = mark_pad(batch["src"], PAD_ID), mark_pad(batch["tgt_in"], PAD_ID)
        space = site_space(site)
        if space == "encoder":
            return SiteTokens(src, src)
        if space == "decoder":
            return SiteTokens(tgt, tgt)
        return SiteTokens(tgt, src)

    def score(self, metric: str, examples=None) -> float:
        if metric == "loss":
            return self.mean_loss()
        sources, references = examples if examples is not None else (self.sources, self.references)
        beam = 1 if examples is None else None  # greedy for ranking, the recipe's beam on held-out data
        hyps = self.tokenizer.decode(translate_ids(self.model, sources, self.recipe, self.rt, beam=beam), "target")
        return translation_scores(hyps, references)["bleu"]

    def held_out(self, split: str | None):
        d = self.recipe.data
        name = split or d.test_split
        raw = load_split(d.dataset, name, [d.source_lang, d.target_lang], d.dataset_config or None)
        return (self.tokenizer.encode(list(raw[d.source_lang]), "source"), list(raw[d.target_lang])), name


def _counts(ids: list[list[int]], size: int) -> np.ndarray:
    flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int64)
    return np.bincount(flat, minlength=size)

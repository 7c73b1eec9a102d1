"""What `xformer inspect-heads` analyses: a trained run's model, a fixed set of its inputs, and
how to score it, for a translation run and a classification run alike.

A Subject hands the analysis batches (dicts of tensors), runs the model on one of them, and
says for every attention site which tokens its queries and keys are, so statistics can ask
"is this key a special token, punctuation, the rarest word of the sentence?" without knowing
the task.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from xformer.config import SYNTHETIC_TASKS
from xformer.data.batching import collate
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from xformer.errors import RunError
from xformer.optim import sequence_loss
from xformer.recipe_io import load_run_recipe

SPACES = ("encoder", "decoder", "cross")  # query x key spaces: src x src, tgt x tgt, tgt x src


@dataclass
class SiteTokens:
    """Token ids of a site's queries (B, T) and keys (B, S), with -1 at positions that do not
    exist (padding) and -2 at the classifier's CLS slot."""

    queries: torch.Tensor
    keys: torch.Tensor


def site_space(site: str) -> str:
    """encoder.<i>.self_attn -> "encoder", decoder.<i>.self_attn -> "decoder", *.cross_attn -> "cross"."""
    if site.endswith("cross_attn"):
        return "cross"
    return site.split(".", 1)[0]


class Subject:
    """Base: subclasses pass model, recipe, runtime, batches, token texts and corpus
    frequencies, and implement forward(), loss_sum(), site_tokens() and score()."""

    kind: str
    metric_names: tuple[str, ...]
    special_ids: frozenset[int]

    def __init__(self, model, recipe, rt, batches: list[dict], token_text: dict[str, list[str]],
                 frequency: dict[str, np.ndarray]):
        self.model, self.recipe, self.rt, self.batches = model, recipe, rt, batches
        self.token_text = token_text  # side ("source"/"target") -> piece of every id
        self.frequency = frequency  # side -> training-corpus count of every id
        self.punct = {side: np.array([_is_punct(t) for t in texts]) for side, texts in token_text.items()}

    def forward(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        """Summed loss over the batch and what it is averaged over (target tokens, examples)."""
        raise NotImplementedError

    def site_tokens(self, site: str, batch: dict) -> SiteTokens:
        raise NotImplementedError

    def side(self, site: str, role: str) -> str:
        """The vocabulary side of a site's queries or keys ("source" or "target")."""
        space = site_space(site)
        if space == "encoder" or (space == "cross" and role == "key"):
            return "source"
        return "target"

    def mean_loss(self) -> float:
        total, count = 0.0, 0
        with torch.no_grad(), self.rt.autocast():
            for batch in self.batches:
                loss, n = self.loss_sum(batch)
                total, count = total + loss.item(), count + n
        return total / max(count, 1)

    def score(self, metric: str, examples=None) -> float:
        """`metric` over the analysis examples (loss: lower is better; bleu/accuracy: higher)."""
        raise NotImplementedError


class TranslationSubject(Subject):
    kind = "translation"
    metric_names = ("loss", "bleu")
    special_ids = frozenset({BOS_ID, EOS_ID})

    def __init__(self, model, recipe, rt, tokenizer, sources, targets, references, frequency):
        self.tokenizer, self.sources, self.targets, self.references = tokenizer, sources, targets, references
        token_text = {side: tokenizer.vocabulary(side) for side in ("source", "target")}
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        batches, size = [], max(1, 4096 // max(1, max(len(s) for s in sources) if sources else 1))
        for start in range(0, len(order), size):
            rows = order[start:start + size]
            batches.append({**collate([(sources[i], targets[i]) for i in rows]), "rows": rows})
        super().__init__(model, recipe, rt, batches, token_text, frequency)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["src"].to(self.rt.device), batch["tgt_in"].to(self.rt.device))

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        tgt_out = batch["tgt_out"].to(self.rt.device)
        logits = self.forward(batch)
        return sequence_loss(logits, tgt_out, PAD_ID), int(tgt_out.ne(PAD_ID).sum())

    def site_tokens(self, site: str, batch: dict) -> SiteTokens:
        src, tgt = _mark_pad(batch["src"]), _mark_pad(batch["tgt_in"])
        space = site_space(site)
        if space == "encoder":
            return SiteTokens(src, src)
        if space == "decoder":
            return SiteTokens(tgt, tgt)
        return SiteTokens(tgt, src)

    def score(self, metric: str, examples=None) -> float:
        if metric == "loss":
            return self.mean_loss()
        from xformer.evaluate import translate_ids  # decoding imports the model side
        from xformer.metrics import translation_scores

        sources, references = examples if examples is not None else (self.sources, self.references)
        beam = 1 if examples is None else None  # greedy for ranking, the recipe's beam on held-out data
        hyps = self.tokenizer.decode(translate_ids(self.model, sources, self.recipe, self.rt, beam=beam), "target")
        return translation_scores(hyps, references)["bleu"]


class ClassificationSubject(Subject):
    kind = "classification"
    metric_names = ("loss", "accuracy")
    special_ids = frozenset()  # the CLS slot is marked in site_tokens, not by an id

    def __init__(self, model, recipe, rt, encoder, examples, frequency):
        from xformer.data.classify import ClassBatches, collate_tokens

        self.examples = examples
        token_text = {"source": [encoder.token(i) for i in range(encoder.vocab_size)]}
        self.cls = recipe.model.pooling == "cls"
        plan = ClassBatches(examples, min(recipe.data.max_tokens, 8192), seed=0, shuffle=False).batches(0)
        batches = [{**collate_tokens(examples, np.asarray(rows)), "rows": list(rows)} for rows in plan]
        super().__init__(model, recipe, rt, batches, token_text, frequency)

    def side(self, site: str, role: str) -> str:
        return "source"

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["tokens"].to(self.rt.device))

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        logits = self.forward(batch)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(logits, batch["labels"].to(self.rt.device), reduction="sum"), len(batch["labels"])

    def site_tokens(self, site: str, batch: dict) -> SiteTokens:
        tokens = _mark_pad(batch["tokens"])
        if self.cls:
            tokens = torch.cat([torch.full_like(tokens[:, :1], -2), tokens], dim=1)
        return SiteTokens(tokens, tokens)

    def score(self, metric: str, examples=None) -> float:
        if metric == "loss":
            return self.mean_loss()
        from xformer.classification import predict

        examples = self.examples if examples is None else examples
        predicted, _ = predict(self.model, examples, self.recipe.data.max_tokens, self.rt)
        return 100.0 * float((predicted == examples.labels).mean())


def load_subject(run_dir: str | Path, *, split: str | None, data: str | None, n_examples: int,
                 checkpoint: str | None = None, device: str = "auto") -> Subject:
    """The run's model (fp32: statistics and gradients want full precision) and the first
    n_examples of `split` (default: the recipe's validation split) or of `data`."""
    subject = _load_subject(run_dir, split, data, n_examples, checkpoint, device)
    subject.run_dir = Path(run_dir)
    return subject


def _load_subject(run_dir, split, data, n_examples, checkpoint, device) -> Subject:
    saved = load_run_recipe(run_dir)
    checkpoint = checkpoint or saved.eval.checkpoint
    if saved.model.arch == "lstm":
        raise RunError(f"{run_dir}: an LSTM run has no attention heads to inspect")
    if saved.data.is_classification:
        from xformer.classification import load_classification_run, split_examples
        from xformer.data.classify import Examples

        recipe, encoder, labels, model, rt = load_classification_run(run_dir, checkpoint, device, "fp32")
        examples, _ = split_examples(recipe, encoder, labels, split or _valid_split(recipe), data)
        train, _ = split_examples(recipe, encoder, labels, "train", None) if data is None else (examples, None)
        frequency = {"source": np.bincount(train.ids, minlength=encoder.vocab_size)}
        n = min(n_examples, len(examples))
        head = Examples.from_pairs([(examples.sequence(i), int(examples.labels[i])) for i in range(n)])
        return ClassificationSubject(model, recipe, rt, encoder, head, frequency)
    from xformer.data.corpus import load_split
    from xformer.evaluate import load_translation_run

    recipe, tokenizer, model, rt = load_translation_run(run_dir, checkpoint, device, "fp32")
    d = recipe.data
    fields = [d.source_lang, d.target_lang]
    config = d.dataset_config or None if data is None else None
    raw = load_split(data if data is not None else d.dataset, split or d.valid_split, fields, config)
    raw = raw.select(range(min(n_examples, len(raw))))
    limit = recipe.model.max_positions - 1
    sources = [s[:limit] for s in tokenizer.encode(list(raw[d.source_lang]), "source")]
    targets = [t[:limit] for t in tokenizer.encode(list(raw[d.target_lang]), "target")]
    train = load_split(d.dataset, d.train_split, fields, d.dataset_config or None)
    frequency = {side: _counts(tokenizer.encode(list(train[lang]), side), tokenizer.vocab_size(side))
                 for side, lang in (("source", d.source_lang), ("target", d.target_lang))}
    return TranslationSubject(model, recipe, rt, tokenizer, sources, targets, list(raw[d.target_lang]), frequency)


def _valid_split(recipe) -> str:
    return "valid" if recipe.data.task in SYNTHETIC_TASKS else recipe.data.valid_split


def _counts(ids: list[list[int]], size: int) -> np.ndarray:
    flat = np.fromiter((t for seq in ids for t in seq), dtype=np.int64)
    return np.bincount(flat, minlength=size)


def _mark_pad(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.masked_fill(tokens.eq(PAD_ID), -1)


def _is_punct(piece: str) -> bool:
    text = piece.replace("\u2581", "").strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)

"""What the training loop needs from a task, so that one loop (train.run) trains every model.

A job loads and encodes its data, builds its model, turns a batch into a summed loss, and
validates:

    job = make_job(recipe)
    job.load(emit)                   # read or generate the raw splits (fails before RUN is touched)
    job.prepare(run_dir, emit)       # tokenizer/encoder in RUN/tokenizer, encoded splits, batches
    model = job.build_model()
    loss = job.loss(model, batch, rt)  # summed over the batch: divided by job.units(batch)
    job.tokens(batch)                  # tokens it trained on, for tokens/s
    scores = job.validate(model, rt)                   # {"loss": ..., and "bleu" or "accuracy"}
    job.curriculum_steps             # steps of shorter examples first: not validated (0: none)

TranslationJob: sentencepiece pairs, label-smoothed token NLL averaged per target token,
validation loss and greedy BLEU. ClassificationJob: generated tasks or a text+label corpus,
cross-entropy averaged per sequence, validation loss and accuracy; `tokens` counts input
tokens, so tokens/s compares a Transformer and an LSTM on the same data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from xformer.classification import predict
from xformer.config import SYNTHETIC_TASKS, Recipe, TrainConfig
from xformer.data.batching import BatchIterator, SampledBatchIterator
from xformer.data.classify import (
    ClassBatches,
    Examples,
    StagedBatches,
    TextEncoder,
    curriculum_examples,
    fit_vocab,
    generated_splits,
    task_encoder,
)
from xformer.data.corpus import encode_split, load_split
from xformer.data.tokenizer import PAD_ID, train_tokenizer
from xformer.errors import DataError, RunError
from xformer.evaluate import build_translation_model, validate
from xformer.model.build import build_model
from xformer.optim import rdrop_kl, sequence_loss
from xformer.tokenize import ensure_tokenizer, tokenizer_dir

Event = Callable[[str, dict], None]


def translation_loss(model, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, rt, train: TrainConfig,
                     index_rows: bool) -> torch.Tensor:
    """Summed label-smoothed NLL of tgt_out; `index_rows`: project only the real target
    positions (the model returns (N, V)) instead of masking pad in (B, T, V). With
    train.rdrop_alpha > 0 the batch runs twice (two dropout masks) and the loss is the mean of
    the two NLLs plus alpha / 2 times rdrop_kl: fairseq's R-Drop criterion divided by 2 (the
    same optimum at the usual loss scale)."""
    alpha = train.rdrop_alpha
    if alpha > 0:
        src, tgt_in, tgt_out = (torch.cat([x, x]) for x in (src, tgt_in, tgt_out))
    keep = tgt_out.ne(PAD_ID) if index_rows else None
    with rt.autocast():
        logits = model(src, tgt_in, keep=keep)
    target = tgt_out[keep] if keep is not None else tgt_out
    loss = sequence_loss(logits, target, PAD_ID, train.label_smoothing)
    if alpha == 0:
        return loss
    # indexed rows are copy 1's real positions, then copy 2's, in the same order
    real = None if index_rows else tgt_out.chunk(2)[0].ne(PAD_ID)
    return loss / 2 + alpha / 2 * rdrop_kl(logits, real)


def make_job(recipe: Recipe):
    return ClassificationJob(recipe) if recipe.data.is_classification else TranslationJob(recipe)


def load_training_splits(recipe: Recipe, fields: list[str], emit: Event, numeric: tuple[str, ...] | None = None):
    """The raw train and validation splits of a corpus, with `fields`; a single file cannot be
    both (it would validate on the training data). With `numeric` (classification: the label
    field), every row must hold every field (load_split's `complete`)."""
    d = recipe.data
    if Path(d.dataset).expanduser().is_file():
        raise DataError(f"data.dataset: {d.dataset} is a single file; training needs a folder or Hub id with "
                        f"'{d.train_split}' and '{d.valid_split}' splits")
    emit("setup", {"message": f"loading {d.dataset} ({d.train_split}, {d.valid_split})"})
    config = d.dataset_config or None
    strict = {} if numeric is None else {"complete": True, "numeric": numeric}
    return (load_split(d.dataset, d.train_split, fields, config, **strict),
            load_split(d.dataset, d.valid_split, fields, config, **strict))


class TranslationJob:
    curriculum_steps = 0

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def load(self, emit: Event) -> None:
        d = self.recipe.data
        self.train_raw, self.valid_raw = load_training_splits(self.recipe, [d.source_lang, d.target_lang], emit)

    def prepare(self, run_dir: Path, emit: Event) -> None:
        recipe, d = self.recipe, self.recipe.data
        if not tokenizer_dir(run_dir).is_dir():
            emit("setup", {"message": f"training a {d.vocab_size}-piece {d.tokenizer} sentencepiece model"})
        self.tokenizer = ensure_tokenizer(recipe, run_dir, self.train_raw)
        emit("setup", {"message": "tokenizing"})
        self.valid_data = encode_split(self.valid_raw, self.tokenizer, d.source_lang, d.target_lang)
        if d.sampling_alpha > 0:  # the training pairs are encoded afresh every epoch
            emit("setup", {"message": f"sampling segmentations every epoch (alpha {d.sampling_alpha}, "
                                      f"nbest {d.sampling_nbest})"})
            self.train_batches = SampledBatchIterator(self.train_raw, self.tokenizer, d.source_lang, d.target_lang,
                                                      d.max_tokens, seed=recipe.train.seed, alpha=d.sampling_alpha,
                                                      nbest=d.sampling_nbest, max_len=d.max_len)
        else:
            train = encode_split(self.train_raw, self.tokenizer, d.source_lang, d.target_lang, max_len=d.max_len)
            self.train_batches = BatchIterator(train, max_tokens=d.max_tokens, seed=recipe.train.seed)
        if len(self.train_batches) == 0:
            raise DataError(f"{d.dataset}: no training pair has 1 to data.max_len = {d.max_len} pieces on both sides")
        self.valid_batches = BatchIterator(self.valid_data, max_tokens=d.max_tokens, seed=recipe.train.seed,
                                           shuffle=False)
        self.refs = list(self.valid_raw[d.target_lang])

    def build_model(self):
        return build_translation_model(self.recipe, self.tokenizer)

    @staticmethod
    def units(batch: dict) -> int:
        return batch["n_tgt_tokens"]

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["n_tgt_tokens"]

    def loss(self, model, batch: dict, rt) -> torch.Tensor:
        """Summed label-smoothed NLL over the batch's target tokens (translation_loss)."""
        src, tgt_in, tgt_out = (batch[k].to(rt.device, non_blocking=True) for k in ("src", "tgt_in", "tgt_out"))
        # On the CPU, project only real target positions (the largest matmul); on CUDA the
        # boolean index would cost a host sync per batch, so pad is masked instead.
        return translation_loss(model, src, tgt_in, tgt_out, rt, self.recipe.train, index_rows=rt.device.type == "cpu")

    def validate(self, model, rt) -> dict:
        return validate(model, self.tokenizer, self.valid_batches, self.valid_data, self.refs, self.recipe, rt,
                        with_bleu=self.recipe.best_metric == "bleu")


class ClassificationJob:
    curriculum_steps = 0

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def load(self, emit: Event) -> None:
        d = self.recipe.data
        if d.task in SYNTHETIC_TASKS:
            emit("setup", {"message": f"generating {d.task} at length {d.max_len} (data.seed {d.seed})"})
            self.generated = generated_splits(d.task, d.n_train, d.n_valid, d.n_test, d.max_len, d.seed,
                                      d.n_queries, d.n_pairs)
            return
        self.train_raw, self.valid_raw = load_training_splits(self.recipe, [d.text_field, d.label_field], emit,
                                                              numeric=(d.label_field,))

    def prepare(self, run_dir: Path, emit: Event) -> None:
        d = self.recipe.data
        directory = tokenizer_dir(run_dir)
        check_encoder(self.recipe, directory)
        if d.task in SYNTHETIC_TASKS:
            self.encoder, self.n_classes = task_encoder(d.task)
            self.labels = [str(c) for c in range(self.n_classes)]
            train, valid = self.generated["train"], self.generated["valid"]
        else:
            self.encoder, self.labels = fit_or_load_encoder(self.recipe, directory, self.train_raw, emit)
            self.n_classes = len(self.labels)
            emit("setup", {"message": "tokenizing"})
            train = encode_examples(self.train_raw, self.recipe, self.encoder, self.labels)
            valid = encode_examples(self.valid_raw, self.recipe, self.encoder, self.labels)
        if not (directory / "encoder.json").is_file():
            self.encoder.save(directory, {"labels": self.labels, "settings": encoder_settings(self.recipe)})
        seed = self.recipe.train.seed
        self.train_batches = ClassBatches(train, d.max_tokens, seed=seed)
        curriculum = d.curriculum()  # only generated tasks may have one (config rule)
        if curriculum:
            accumulate = self.recipe.train.accumulate_steps
            stages = [(ClassBatches(curriculum_examples(d.task, d.n_train, length, d.seed, d.n_queries, d.n_pairs),
                                    d.max_tokens, seed=seed), steps * accumulate) for length, steps in curriculum]
            emit("setup", {"message": "length curriculum: " + ", ".join(f"{k} steps at {n}" for n, k in curriculum)
                           + f", then {d.max_len}"})
            self.train_batches = StagedBatches(stages, self.train_batches)
            self.curriculum_steps = sum(k for _, k in curriculum)
        self.valid = valid

    def build_model(self):
        return build_model(self.recipe.model, self.encoder.vocab_size, n_classes=self.n_classes, pad_id=0)

    @staticmethod
    def units(batch: dict) -> int:
        return batch["n_examples"]

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["n_tokens"]

    def loss(self, model, batch: dict, rt) -> torch.Tensor:
        """Summed cross-entropy over the batch's sequences (with train.rdrop_alpha: R-Drop, as
        TranslationJob.loss)."""
        tokens, labels = batch["tokens"].to(rt.device, non_blocking=True), batch["labels"].to(rt.device)
        alpha = self.recipe.train.rdrop_alpha
        if alpha > 0:
            tokens, labels = torch.cat([tokens, tokens]), torch.cat([labels, labels])
        with rt.autocast():
            logits = model(tokens)  # (B, C)
        smoothing = self.recipe.train.label_smoothing
        loss = F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=smoothing)
        if alpha == 0:
            return loss
        return loss / 2 + alpha / 2 * rdrop_kl(logits)

    def validate(self, model, rt) -> dict:
        was_training = model.training
        model.eval()
        predicted, total = predict(model, self.valid, self.recipe.data.max_tokens, rt)
        model.train(was_training)
        n = max(len(self.valid), 1)
        return {"loss": total / n, "accuracy": 100.0 * float((predicted == self.valid.labels).sum()) / n}


def fit_or_load_encoder(recipe: Recipe, directory: Path, train_raw, emit: Event) -> tuple[TextEncoder, list[str]]:
    """The run's encoder and label list: read from RUN/tokenizer, else fitted on the training split."""
    d = recipe.data
    if (directory / "encoder.json").is_file():
        encoder, saved = TextEncoder.load(directory)
        return encoder, saved["labels"]
    texts = train_raw[d.text_field]
    labels = sorted({_label(v) for v in train_raw[d.label_field]}, key=_label_order)
    if len(labels) < 2:
        raise DataError(f"{d.dataset}: field {d.label_field!r} of split '{d.train_split}' has "
                        f"{len(labels)} distinct value(s); a classifier needs at least 2")
    if d.tokenizer in ("unigram", "bpe"):
        emit("setup", {"message": f"training a {d.vocab_size}-piece {d.tokenizer} sentencepiece model"})
        spm = train_tokenizer(train_raw, d.text_field, d.text_field, directory, model_type=d.tokenizer,
                              vocab_size=d.vocab_size, joint=True, character_coverage=d.character_coverage,
                              byte_fallback=d.byte_fallback, seed=recipe.train.seed)
        encoder = TextEncoder(d.tokenizer, None, spm)
    elif d.tokenizer == "byte":
        encoder = TextEncoder("byte")
    else:
        encoder = TextEncoder(d.tokenizer, fit_vocab(texts, d.tokenizer, d.vocab_size))
    encoder.save(directory, {"labels": labels, "settings": encoder_settings(recipe)})
    return encoder, labels


def encoder_settings(recipe: Recipe) -> dict:
    """What an encoder in RUN/tokenizer was made from; a run may only reuse one made the same way."""
    d = recipe.data
    keys = ("task", "dataset", "dataset_config", "text_field", "label_field", "train_split", "tokenizer",
            "vocab_size", "character_coverage", "byte_fallback")
    return {k: getattr(d, k) for k in keys} if d.task == "classification" else {"task": d.task}


def check_encoder(recipe: Recipe, directory: Path) -> None:
    """A RunError when RUN/tokenizer holds an encoder made with other [data] values."""
    path = directory / "encoder.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text()).get("settings", {})
    wanted = encoder_settings(recipe)
    differ = [k for k in wanted if saved.get(k) != wanted[k]]
    if differ:
        found = ", ".join(f"data.{k} = {saved.get(k)!r}" for k in differ)
        raise RunError(f"{directory}: its encoder was made with {found}; the recipe says "
                       f"{', '.join(f'{wanted[k]!r}' for k in differ)} (use another --out)")


def encode_examples(split, recipe: Recipe, encoder: TextEncoder, labels: list[str]) -> Examples:
    """A text+label split -> Examples (texts truncated to data.max_len tokens)."""
    d = recipe.data
    index = {label: i for i, label in enumerate(labels)}
    ids = encoder.encode(split[d.text_field], d.max_len)
    classes = []
    for row, value in enumerate(split[d.label_field]):
        label = _label(value)
        if label not in index:
            known = ", ".join(labels[:10]) + (", ..." if len(labels) > 10 else "")
            raise DataError(f"{d.dataset} (split '{split.split}'), row {row + 1}: {d.label_field} = {value!r} never "
                            f"occurs in training (known: {known})")
        classes.append(index[label])
    return Examples.from_pairs(list(zip(ids, classes, strict=True)))


def _label(value) -> str:
    if value is None:
        raise DataError("a label is missing (null)")
    return json.dumps(value) if not isinstance(value, str) else value


def _label_order(label: str):
    """Numeric labels in numeric order (so 0..C-1 keep their ids), then the rest as text."""
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)

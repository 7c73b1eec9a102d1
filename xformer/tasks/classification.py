"""data.task = "classification": a corpus with a text and a label field, one label per text,
learned by a Transformer classifier or the LSTM baseline.

ClassificationTask is also the base of the generated tasks (tasks/generated.py): training
loss is cross-entropy averaged per sequence (R-Drop optional), validation reports loss and
accuracy, `tokens` counts input tokens (so tokens/s compares a Transformer and an LSTM on the
same data). `xformer eval` writes accuracy, loss, the majority-class baseline and (for up to 20
classes) the confusion matrix to RUN/eval/<name>.<checkpoint>.{json,pred}.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from xformer.config.schema import Recipe
from xformer.data.classify import ClassBatches, Examples, TextEncoder, collate_tokens, fit_vocab
from xformer.data.corpus import load_split
from xformer.data.tokenizer import train_tokenizer
from xformer.errors import DataError, RunError
from xformer.events import Event
from xformer.files import atomic_write_text
from xformer.metrics import accuracy, confusion_matrix
from xformer.results import ClassificationEval, EvalView
from xformer.tasks.base import CorpusData, EvalRequest, SiteTokens, Subject, Task, load_training_splits, mark_pad
from xformer.training.cpuload import OtherLoad
from xformer.training.device import Runtime
from xformer.training.losses import rdrop_kl
from xformer.training.run_folder import eval_name, tokenizer_dir

CONFUSION_MAX_CLASSES = 20
PAD_ID = 0  # every classification encoder pads with 0


@dataclass
class ClassificationData(CorpusData):
    """[data] of a text classification corpus: which fields hold the text and the label."""

    METRICS: ClassVar[tuple[str, ...]] = ("accuracy",)
    ARCHS: ClassVar[tuple[str, ...]] = ("classifier", "lstm")

    text_field: str = "text"
    label_field: str = "label"

    def fields(self) -> list[str]:
        return [self.text_field, self.label_field]


class ClassificationTask(Task):
    """A text+label corpus; subclasses replace where the examples come from."""

    Data = ClassificationData
    encoder: TextEncoder | None = None
    labels: list[str] | None = None

    # ------------------------------------------------------------ training
    def load(self, emit: Event) -> None:
        d = self.recipe.data
        self.train_raw, self.valid_raw = load_training_splits(d, [d.text_field, d.label_field], emit,
                                                              numeric=(d.label_field,))

    def prepare(self, run_dir: Path, emit: Event) -> None:
        directory = tokenizer_dir(run_dir)
        check_encoder(directory, self.encoder_settings())
        train, self.valid = self.prepare_examples(directory, emit)
        if not (directory / "encoder.json").is_file():
            self.encoder.save(directory, {"labels": self.labels, "settings": self.encoder_settings()})
        self.train_batches = self.training_batches(train, emit)

    def prepare_examples(self, directory: Path, emit: Event) -> tuple[Examples, Examples]:
        """The encoder and labels (fitted, or read from RUN/tokenizer) and the encoded
        training and validation examples."""
        self.encoder, self.labels = fit_or_load_encoder(self.recipe, directory, self.train_raw, emit)
        emit("setup", {"message": "tokenizing"})
        return self.encode(self.train_raw), self.encode(self.valid_raw)

    def training_batches(self, train: Examples, emit: Event):
        return ClassBatches(train, self.recipe.data.max_tokens, seed=self.recipe.train.seed)

    def encoder_settings(self) -> dict:
        """What an encoder in RUN/tokenizer was made from; a run may only reuse one made the same way."""
        d = self.recipe.data
        keys = ("task", "dataset", "dataset_config", "text_field", "label_field", "train_split", "train_limit",
                "tokenizer", "vocab_size", "character_coverage", "byte_fallback")
        return {k: getattr(d, k) for k in keys}

    def model_sizes(self) -> dict:
        """The encoder's vocabulary and the training split's labels; before there are any, the
        recipe's data.vocab_size (258 for bytes) and 2 classes."""
        if self.encoder is None:
            d = self.recipe.data
            return {"vocab_size": 258 if d.tokenizer == "byte" else d.vocab_size, "n_classes": 2, "pad_id": PAD_ID}
        return {"vocab_size": self.encoder.vocab_size, "n_classes": len(self.labels), "pad_id": PAD_ID}

    def units(self, batch: dict) -> int:
        return batch["n_examples"]

    def tokens(self, batch: dict) -> int:
        return batch["n_tokens"]

    def loss(self, model, batch: dict, rt: Runtime) -> torch.Tensor:
        """Summed cross-entropy over the batch's sequences (with train.rdrop_alpha: R-Drop, as
        the translation loss)."""
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

    def validate(self, model, rt: Runtime) -> dict:
        was_training = model.training
        model.eval()
        predicted, total = predict_classes(model, self.valid, self.recipe.data.max_tokens, rt)
        model.train(was_training)
        return {"loss": total / max(len(self.valid), 1), "accuracy": accuracy(predicted, self.valid.labels)}

    # ------------------------------------------------------------ a trained run
    def load_vocabulary(self, run_dir: Path) -> None:
        self.encoder, saved = TextEncoder.load(tokenizer_dir(run_dir))
        self.labels = saved["labels"]

    def examples(self, split: str | None, data: str | None) -> tuple[Examples, str]:
        """The examples to score (default: the test split) and the name of the report."""
        d = self.recipe.data
        split = split or d.test_split
        raw = self._raw(split, data)
        return self.encode(raw), eval_name(split, data, [raw[d.text_field], raw[d.label_field]])

    def _raw(self, split: str | None, data: str | None):
        d = self.recipe.data
        spec = data if data is not None else d.dataset
        config = d.dataset_config or None if data is None else None
        return load_split(spec, split or d.test_split, [d.text_field, d.label_field], config, complete=True,
                          numeric=(d.label_field,))

    def view(self, result: ClassificationEval, run: str) -> EvalView:
        """What `xformer eval` shows a person of a score of this task."""
        rows = {"accuracy": result.accuracy, "majority_accuracy": result.majority_accuracy, "loss": result.loss,
                "n_examples": result.n_examples, "examples/s": result.examples_per_s, "checkpoint": result.checkpoint}
        view = EvalView(f"{run}: {result.task} {result.split}", rows, notes=[f"predictions: {result.predictions}"])
        if result.confusion is not None:
            view.grids.append(("confusion (rows: true, columns: predicted)", result.labels,
                               [[label, *row] for label, row in zip(result.labels, result.confusion, strict=True)]))
        if result.paired:
            paired, p = result.paired, result.paired.outcome
            view.paired = (f"McNemar's exact test against {paired.baseline}", {
                "accuracy": f"{paired.accuracy:.2f}", "baseline accuracy": f"{paired.baseline_accuracy:.2f}",
                "difference": f"{p.difference:+.2f} +- {p.difference_interval:.2f} (95%)",
                "right only here / only in the baseline": f"{p.wins} / {p.losses}",
                "p-value": f"{p.p_value:.4f}"}, [])
        return view

    def scored_set(self, split: str | None, data: str | None) -> list[tuple]:
        """The examples `evaluate` scores (default: the test split) as (text, gold label) pairs,
        in order: two runs of one task scored the same set when these are equal."""
        d = self.recipe.data
        raw = self._raw(split, data)
        return [(str(text), _label(value)) for text, value in zip(raw[d.text_field], raw[d.label_field], strict=True)]

    def train_split(self) -> str:
        return self.recipe.data.train_split

    def valid_split(self) -> str:
        return self.recipe.data.valid_split

    def test_split(self) -> str:
        return self.recipe.data.test_split

    def evaluate(self, run_dir: Path, request: EvalRequest) -> ClassificationEval:
        if request.ctranslate2:
            raise RunError(f"--ctranslate2: CTranslate2 decodes translation models; {run_dir} is a "
                           f"{self.recipe.data.task} run (data.task)")
        checkpoint = request.checkpoint or self.recipe.eval.checkpoint
        quantize = request.quantize or self.recipe.eval.quantize or None  # --quantize, else the recipe's
        model, rt = self.open_run(run_dir, checkpoint, request.device, quantize=quantize)
        examples, name = self.examples(request.split, request.data)
        if request.length is not None:  # generated at another length than the run's: its own files
            name = f"{name}.len{request.length}"
        started, others = time.perf_counter(), OtherLoad()
        predicted, total = predict_classes(model, examples, self.recipe.data.max_tokens, rt)
        seconds, others_cpu = time.perf_counter() - started, others.cores()
        n = len(examples)
        out_dir = Path(run_dir) / "eval"
        stem = f"{name}.{checkpoint}{'.' + quantize if quantize else ''}"
        result = ClassificationEval(
            accuracy=accuracy(predicted, examples.labels), loss=total / max(n, 1), n_examples=n,
            task=self.recipe.data.task, split=name, checkpoint=checkpoint, labels=self.labels,
            majority_accuracy=100.0 * float(np.bincount(examples.labels).max() / n) if n else 0.0,
            predictions=str(out_dir / f"{stem}.pred"), quantize=quantize,
            eval_seconds=seconds, examples_per_s=n / max(seconds, 1e-9), others_cpu=others_cpu,
            confusion=(confusion_matrix(predicted, examples.labels, len(self.labels))
                       if len(self.labels) <= CONFUSION_MAX_CLASSES else None))
        result.card, result.warnings = self.eval_card(run_dir, rt, request.split or self.test_split(), request.data,
                                                    checkpoint, others_cpu)
        atomic_write_text(out_dir / f"{stem}.pred", "".join(self.labels[p] + "\n" for p in predicted))
        atomic_write_text(out_dir / f"{stem}.json", result.to_json())
        if request.data is None and name == self.test_split() and quantize == (self.recipe.eval.quantize or None):
            # RUN/eval.json: the recipe's test split, decoded as the recipe says (eval.quantize included)
            atomic_write_text(Path(run_dir) / "eval.json", result.to_json())
        return result

    def subject(self, run_dir: Path, *, split: str | None, data: str | None, n_examples: int,
                checkpoint: str, device: str) -> ClassificationSubject:
        if self.recipe.model.arch == "lstm":
            raise RunError(f"{run_dir}: an LSTM run has no attention heads to inspect")
        model, rt = self.open_run(run_dir, checkpoint, device, "fp32")
        examples, _ = self.examples(split or self.valid_split(), data)
        train, _ = self.examples(self.train_split(), None) if data is None else (examples, None)
        frequency = {"source": np.bincount(train.ids, minlength=self.encoder.vocab_size)}
        n = min(n_examples, len(examples))
        head = Examples.from_pairs([(examples.sequence(i), int(examples.labels[i])) for i in range(n)])
        subject = ClassificationSubject(model, self.recipe, rt, self.encoder, head, frequency, task=self)
        subject.run_dir = Path(run_dir)
        return subject

    def encode(self, split) -> Examples:
        """A text+label split -> Examples (texts truncated to data.max_len tokens)."""
        d = self.recipe.data
        index = {label: i for i, label in enumerate(self.labels)}
        ids = self.encoder.encode(split[d.text_field], d.max_len)
        classes = []
        for row, value in enumerate(split[d.label_field]):
            label = _label(value)
            if label not in index:
                known = ", ".join(self.labels[:10]) + (", ..." if len(self.labels) > 10 else "")
                raise DataError(f"{d.dataset} (split '{split.split}'), row {row + 1}: {d.label_field} = {value!r} "
                                f"never occurs in training (known: {known})")
            classes.append(index[label])
        return Examples.from_pairs(list(zip(ids, classes, strict=True)))


class ClassificationSubject(Subject):
    """inspect-heads' view of a Transformer classifier: encoder sites only, CLS marked -2."""

    kind = "classification"
    metric_names = ("loss", "accuracy")

    def __init__(self, model, recipe, rt, encoder, examples, frequency, task=None):
        self.examples = examples
        token_text = {"source": [encoder.token(i) for i in range(encoder.vocab_size)]}
        self.cls = recipe.model.pooling == "cls"
        plan = ClassBatches(examples, min(recipe.data.max_tokens, 8192), seed=0, shuffle=False).batches(0)
        batches = [{**collate_tokens(examples, np.asarray(rows)), "rows": list(rows)} for rows in plan]
        super().__init__(model, recipe, rt, batches, token_text, frequency, task)

    def side(self, site: str, role: str) -> str:
        return "source"

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["tokens"].to(self.rt.device))

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        logits = self.forward(batch)
        if logits.dtype in (torch.float16, torch.bfloat16):  # fp32 at least; a float64 test model stays float64
            logits = logits.float()
        return F.cross_entropy(logits, batch["labels"].to(self.rt.device), reduction="sum"), len(batch["labels"])

    def site_tokens(self, site: str, batch: dict) -> SiteTokens:
        tokens = mark_pad(batch["tokens"], PAD_ID)
        if self.cls:
            tokens = torch.cat([torch.full_like(tokens[:, :1], -2), tokens], dim=1)
        return SiteTokens(tokens, tokens)

    def score(self, metric: str, examples=None) -> float:
        if metric == "loss":
            return self.mean_loss()
        examples = self.examples if examples is None else examples
        predicted, _ = predict_classes(self.model, examples, self.recipe.data.max_tokens, self.rt)
        return accuracy(predicted, examples.labels)

    def held_out(self, split: str | None):
        return self.task.examples(split, None)


def predict_classes(model, examples: Examples, max_tokens: int, rt: Runtime) -> tuple[np.ndarray, float]:
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
    return encoder, labels


def check_encoder(directory: Path, wanted: dict) -> None:
    """A RunError when RUN/tokenizer holds an encoder made with other [data] values than `wanted`
    (the task's encoder_settings())."""
    path = directory / "encoder.json"
    if not path.is_file():
        return
    saved = {"train_limit": 0, **json.loads(path.read_text()).get("settings", {})}  # an older encoder's: all rows
    differ = [k for k in wanted if saved.get(k) != wanted[k]]
    if differ:
        found = ", ".join(f"data.{k} = {saved.get(k)!r}" for k in differ)
        raise RunError(f"{directory}: its encoder was made with {found}; the recipe says "
                       f"{', '.join(f'{wanted[k]!r}' for k in differ)} (use another --out)")


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

"""What every task gives the training loop, evaluation and head inspection.

A task is one value of `data.task`: it owns the [data] table's fields (a DataConfig subclass),
loads and encodes the examples, builds the model they need, turns a batch into a loss, and
scores a model. train.run, evaluate.evaluate_run and heads.inspect_heads ask the task; none of
them branches on which task it is.

    task = make_task(recipe)                 # xformer.tasks
    task.load(emit)                          # the raw splits (fails before RUN is touched)
    task.prepare(run_dir, emit)              # tokenizer/encoder in RUN/tokenizer, task.train_batches
    model = task.build_model()
    loss = task.loss(model, batch, rt)       # summed over the batch; divided by task.units(batch)
    task.tokens(batch)                       # tokens it trained on, for tokens/s
    scores = task.validate(model, rt)        # {"loss": ..., and the task's METRICS}
    task.curriculum_steps                    # steps of shorter examples first: not validated

    model, rt = task.open_run(run_dir, checkpoint, device)   # a trained run's model and vocabulary
    task.evaluate(run_dir, EvalRequest(...)) -> TranslationEval | ClassificationEval
    task.predict(run_dir, lines, ...)        # translations, or predicted labels
    task.subject(run_dir, ...) -> Subject    # what inspect-heads analyses

A fourth task is one new module with a DataConfig subclass and a Task subclass, and one line
in xformer.tasks.TASKS (tests/test_tasks_api.py adds one that way).
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from xformer.config.schema import DataConfig, Recipe
from xformer.config.strict import positive
from xformer.data.corpus import load_split
from xformer.errors import DataError, RunError
from xformer.events import Event
from xformer.generation.quantize import quantize_model
from xformer.locks import describe, holder
from xformer.model.build import build_model
from xformer.significance import McNemar, mcnemar, right_or_wrong
from xformer.training.checkpoint import load_model_weights, read_checkpoint, read_checkpoint_meta, run_checkpoint
from xformer.training.cpuload import busy
from xformer.training.device import Runtime, resolve_runtime
from xformer.training.run_card import RunCard, data_fingerprints, run_card
from xformer.training.run_folder import check_tokenizer

# sentencepiece models (translation, classification) or fixed schemes (classification only)
Tokenization = Literal["unigram", "bpe", "char", "byte", "whitespace"]


@dataclass
class CorpusData(DataConfig):
    """[data] of a task read from a corpus: a Hub id ("bentrevett/multi30k") or a local folder
    or file (JSONL, TSV, parallel text), its splits, and how its text is tokenized."""

    dataset: str = "bentrevett/multi30k"
    dataset_config: str = ""  # a Hub dataset's configuration, e.g. "de-en" for wmt14; "" for none
    train_split: str = "train"
    train_limit: int = 0  # train on the split's first N rows (a smaller scale of the same corpus); 0: all
    valid_split: str = "validation"
    test_split: str = "test"
    tokenizer: Tokenization = "unigram"
    vocab_size: int = 8000
    character_coverage: float = 1.0
    byte_fallback: bool = False

    def fields(self) -> list[str]:
        """The columns every row holds (each task's table says which)."""
        raise NotImplementedError

    def training_rows(self, rows):
        """The rows of the training split a run trains on (and its tokenizer learns from): the
        first train_limit of them, or all."""
        if self.train_limit and self.train_limit < len(rows):
            return rows.select(range(self.train_limit))
        return rows

    def load_train(self, fields: list[str], **strict):
        """The training split as a run sees it (training_rows)."""
        return self.training_rows(load_split(self.dataset, self.train_split, fields, self.dataset_config or None,
                                             **strict))

    def fingerprints(self) -> dict[str, str]:
        return data_fingerprints(self.dataset, self.fields())

    def problems(self) -> list[str]:
        out = super().problems() + positive(self, "vocab_size")
        if self.train_limit < 0:
            out.append(f"data.train_limit: expected 0 (the whole split) or a number of rows, found {self.train_limit}")
        if not 0 < self.character_coverage <= 1:
            out.append(f"data.character_coverage: expected a number in (0, 1], found {self.character_coverage}")
        return out


@dataclass
class EvalRequest:
    """What `xformer eval` asks of a run; None means the recipe's value."""

    split: str | None = None
    data: str | None = None  # a JSONL file or folder with the recipe's fields, instead of a split
    checkpoint: str | None = None
    device: str = "auto"
    beam: int | None = None  # translation only
    lenpen: float | None = None  # translation only
    quantize: str | None = None  # "int8": dynamic int8 Linear layers on the CPU (xformer/generation/quantize.py)
    ctranslate2: str | None = None  # decode with CTranslate2 from this exported directory (translation only)
    on_progress: Any = None  # Callable[[done, total], None]
    length: int | None = None  # a generated task's examples at this length (evaluate.at_length made the recipe)


class Task:
    """Base of every task; see the module docstring for the protocol."""

    Data: ClassVar[type[DataConfig]]
    curriculum_steps: int = 0
    train_batches: Any = None

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    # ------------------------------------------------------------ training
    def load(self, emit: Event) -> None:
        raise NotImplementedError

    def prepare(self, run_dir: Path, emit: Event) -> None:
        raise NotImplementedError

    def model_sizes(self) -> dict:
        """build_model's vocabulary and output arguments: from the data once prepared or opened,
        else what the recipe says (for `xformer check` and parameter counts)."""
        raise NotImplementedError

    def build_model(self, *, init: bool = True, model_config=None):
        return build_model(model_config or self.recipe.model, **self.model_sizes(), init=init)

    def units(self, batch: dict) -> int:
        raise NotImplementedError

    def tokens(self, batch: dict) -> int:
        raise NotImplementedError

    def loss(self, model, batch: dict, rt: Runtime) -> torch.Tensor:
        raise NotImplementedError

    def validate(self, model, rt: Runtime) -> dict:
        raise NotImplementedError

    def validate_as_trained(self, model, rt: Runtime) -> dict:
        """A validation that costs what a trained model's does, for the time budget's calibration
        on an untrained model (xformer/training/budget.py); where the cost does not depend on
        what the model predicts, the validation itself."""
        return self.validate(model, rt)

    # ------------------------------------------------------------ a trained run
    def load_vocabulary(self, run_dir: Path) -> None:
        """Read RUN/tokenizer (the tokenizer or encoder the run was trained with)."""
        raise NotImplementedError

    def open_run(self, run_dir: str | Path, checkpoint: str, device: str = "auto",
                 precision: str = "auto", quantize: str | None = None):
        """(model on its device in eval mode, runtime) of a trained run's checkpoint, its Linear
        layers quantized with `quantize` ("int8", CPU only: then in fp32 around them)."""
        run_dir = Path(run_dir)
        self.load_vocabulary(run_dir)
        path = run_checkpoint(run_dir, checkpoint)
        tensors, meta = read_checkpoint(path)
        check_tokenizer(run_dir, path, meta)
        rt = resolve_runtime(device, "fp32" if quantize else precision, training=False)
        model = self.build_model(init=False)
        load_model_weights(model, tensors, path)
        model = model.to(rt.device).eval()
        return (quantize_model(model, quantize, rt.device) if quantize else model), rt

    def eval_card(self, run_dir: str | Path, rt: Runtime | None, split: str, data: str | None,
                  checkpoint: str, others_cpu: float | None = None) -> tuple[RunCard, list]:
        """The run card of an evaluation of `split` (or of the file or folder `data`) with
        `checkpoint`, and what it warns of: the checkpoint is not the run's final one (still
        training, or stopped part way), the split's files differ from the ones training
        fingerprinted, other processes took CPU while it was timed (`others_cpu` cores).
        card.checkpoint: its name, step, tensor sha256 and whether it is final."""
        d = self.recipe.data
        prints = data_fingerprints(data, d.fields()) if data is not None else d.fingerprints()
        mine = next(iter(prints.values()), None) if data is not None else prints.get(split)
        card = run_card(self.recipe, rt, {split if data is None else str(data): mine} if mine else {})
        card.checkpoint, unfinished = checkpoint_identity(Path(run_dir), checkpoint)
        warnings = [unfinished] if unfinished else []
        trained_file = Path(run_dir) / "train.json"
        if data is None and mine and trained_file.is_file():
            trained = json.loads(trained_file.read_text()).get("card", {}).get("data", {}).get(split)
            if trained and trained != mine:
                warnings.append(f"{d.dataset} split '{split}': the files differ from the ones training read "
                                f"(fingerprint {mine}, training's {trained})")
        if busy(others_cpu):
            warnings.append(f"timed while other processes took {others_cpu:.2f} CPU cores: the speed is below what "
                            "this machine does alone")
        return card, warnings

    def evaluate(self, run_dir: Path, request: EvalRequest):
        raise NotImplementedError

    # ------------------------------------------------------------ paired comparisons of two runs
    EXPORTS: ClassVar[bool] = False  # whether `xformer export` can write its runs as a MarianMTModel
    UNIT: ClassVar[str] = "example"  # what one item of the scored set is, in messages
    SCORED: ClassVar[str] = "examples"  # what the scored set holds, in messages
    OUTPUTS: ClassVar[str] = "predictions"  # the eval result's field (and record key) naming its output file
    OUTPUT_SUFFIX: ClassVar[str] = ".pred"  # that file's suffix: one predicted label a line
    METRIC: ClassVar[str] = "accuracy"  # the test score's key in the eval result

    def test_input_lengths(self, run_dir: Path) -> list[int]:
        """The length in tokens of every input of the test split, with `run_dir`'s vocabulary."""
        self.load_vocabulary(run_dir)
        return [int(n) for n in self.examples(None, None)[0].lens]

    def scored_set(self, split: str | None, data: str | None) -> list:
        """The items `evaluate` scores (default: the test split), in order, as a paired test
        compares them: two runs of one task scored the same set when these are equal."""
        raise NotImplementedError

    def paired_set(self, request: EvalRequest | None = None) -> list:
        """What a paired test needs to be the same in two runs: the set the split or file of
        `request` holds (default: the test split)."""
        request = request or EvalRequest()
        return self.scored_set(request.split, request.data)

    def paired_test(self, outputs: str | Path, baseline_outputs: str | Path, scored: list) -> McNemar:
        """The paired test of two runs' output files (OUTPUTS) on the set both scored: McNemar's
        exact test on which (input, gold label) pairs each got right (xformer.significance)."""
        gold = [label for _, label in scored]
        return mcnemar(right_or_wrong(outputs, gold), right_or_wrong(baseline_outputs, gold))

    def first_difference(self, own: list, other: list) -> str:
        """Where two scored sets first differ, for the message that refuses to pair them."""
        if len(own) != len(other):
            return f"{len(other)} against {len(own)} {self.UNIT}s"
        i = next(i for i, (a, b) in enumerate(zip(own, other, strict=True)) if a != b)
        if own[i][1] != other[i][1]:
            return f"{self.UNIT} {i + 1}: label {other[i][1]!r} against {own[i][1]!r}"
        return f"{self.UNIT} {i + 1}: the same label, another input"

    def view(self, result, run: str):
        """What `xformer eval` shows a person of `result`, a score of this task (xformer.results.EvalView)."""
        raise NotImplementedError

    def pairing_hint(self) -> str:
        """How to score two runs on one set."""
        return "pass the same --data to compare them"

    def predict(self, run_dir: Path, lines: list[str], **options) -> list[str]:
        raise RunError(f"{run_dir}: a {self.recipe.data.task} run; translate needs a translation run")

    def subject(self, run_dir: Path, *, split: str | None, data: str | None, n_examples: int,
                checkpoint: str, device: str) -> Subject:
        raise RunError(f"{run_dir}: data.task = {self.recipe.data.task!r} has no attention heads to inspect")


def load_training_splits(data: CorpusData, fields: list[str], emit: Event, numeric: tuple[str, ...] | None = None):
    """The raw train and validation splits of a corpus, with `fields`; a single file cannot be
    both (it would validate on the training data). Every validation row must hold every field
    (load_split's `complete`), and so must every training row with `numeric` (classification:
    the label field); a translation pair missing a side is dropped from training instead."""
    if Path(data.dataset).expanduser().is_file():
        raise DataError(f"data.dataset: {data.dataset} is a single file; training needs a folder or Hub id with "
                        f"'{data.train_split}' and '{data.valid_split}' splits")
    emit("setup", {"message": f"loading {data.dataset} ({data.train_split}, {data.valid_split})"})
    config = data.dataset_config or None
    strict = {} if numeric is None else {"complete": True, "numeric": numeric}
    # validation is a measurement: a missing reference would be scored as an empty sentence
    return (data.load_train(fields, **strict),
            load_split(data.dataset, data.valid_split, fields, config, complete=True, numeric=numeric or ()))


# ---------------------------------------------------------------- what inspect-heads analyses

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
    """A trained run's model, a fixed set of its inputs in batches (dicts of tensors), and how to
    score it; each task's subclass says for every attention site which tokens its queries and
    keys are, so statistics can ask "is this key a special token, punctuation, the rarest word
    of the sentence?" without knowing the task."""

    kind: ClassVar[str] = ""
    metric_names: ClassVar[tuple[str, ...]] = ()  # what heads can be ranked by (loss first)
    special_ids: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, model, recipe: Recipe, rt: Runtime, batches: list[dict], token_text: dict[str, list[str]],
                 frequency: dict[str, np.ndarray], task: Task | None = None):
        self.model, self.recipe, self.rt, self.batches, self.task = model, recipe, rt, batches, task
        self.token_text = token_text  # side ("source"/"target") -> piece of every id
        self.frequency = frequency  # side -> training-corpus count of every id
        self.punct = {side: np.array([_is_punct(t) for t in texts]) for side, texts in token_text.items()}
        self.run_dir: Path | None = None

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
        """`metric` over the analysis examples, or over `examples` (held_out's)."""
        raise NotImplementedError

    def held_out(self, split: str | None) -> tuple[Any, str]:
        """The examples a pruning curve is measured on (default: the test split) and their name."""
        raise NotImplementedError

    def model_sizes(self) -> dict:
        return self.task.model_sizes()


def mark_pad(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    return tokens.masked_fill(tokens.eq(pad_id), -1)


def _is_punct(piece: str) -> bool:
    text = piece.replace("\u2581", "").strip()
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def checkpoint_identity(run_dir: Path, checkpoint: str) -> tuple[dict, str]:
    """{"name", "step", "sha256", "final"} of RUN's checkpoint, and why it is not the trained
    run's final one ("" when it is): a score of it would go stale when training goes on."""
    path = run_dir / "checkpoints" / f"{checkpoint}.safetensors"
    meta = read_checkpoint_meta(path) if path.is_file() else {}
    step = meta.get("progress", {}).get("step", meta.get("step"))
    summary = run_dir / "train.json"
    writer = holder(run_dir)
    if writer is not None:
        why = f"the run is still training ({describe(writer)})"
    elif not summary.is_file() and "imported" not in meta:  # an imported model is final as it came
        why = "the run has not finished (no train.json: stopped before its end)"
    elif summary.is_file() and json.loads(summary.read_text()).get("stop_reason") == "interrupted":
        why = "the run was stopped part way (--resume finishes it)"
    else:
        why = ""
    identity = {"name": checkpoint, "step": step, "sha256": meta.get("sha256"), "final": not why}
    if "imported" in meta:  # where the model came from, its licence and attribution (xformer.importing)
        identity["imported"] = {k: meta["imported"].get(k) for k in ("source", "revision", "licence", "attribution")}
    return identity, (f"{run_dir}: checkpoint '{checkpoint}' (step {step}) is not the run's final one: {why}; "
                      "this score is of the checkpoint as it is now" if why else "")


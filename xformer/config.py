"""Recipes: TOML files with [model] [data] [train] [eval] tables, loaded into strict dataclasses.

Strict means: an unknown key is an error with a "did you mean" hint; a value of the wrong type
is an error naming the key and the expected type; a parameter that belongs to a variant that
is switched off (say `model.pooling` on a seq2seq model) is an error rather than silently
ignored; cross-field rules (`d_model % n_heads == 0`, ...) are checked. Every problem is
collected and reported together in one `RecipeError`.

Derived values (`head_dim`, `kv_heads`) are properties, so they are never written into a
saved recipe and a saved recipe reloads to an equal `Recipe`.

Reading a recipe file and its `--set` overrides into a Recipe is xformer/recipe_io.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from xformer.data.tasks import RECALL_N_KEYS
from xformer.sites import pruned_heads_problems
from xformer.strict import (
    non_negative,
    only_when,
    positive,
    probability,
    section_to_dict,
    toml_value,
)

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - Python 3.10
    pass

# One Literal per variant axis; each has a dict of implementations next to its modules
# (POSITIONAL in model/positional.py, NORMS in model/norms.py, ...), and a test checks
# that every word here has an entry there.
Arch = Literal["seq2seq", "classifier", "lstm"]
Positional = Literal["sinusoidal", "learned", "rope"]
NormPosition = Literal["post", "pre"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["relu", "gelu"]
AttentionBackend = Literal["sdpa", "explicit"]
TieEmbeddings = Literal["none", "decoder", "all"]
# "cls", "mean" and "last" for the Transformer classifier; "last", "mean" and "max" for the LSTM
Pooling = Literal["cls", "mean", "last", "max"]
Task = Literal["translation", "listops", "recall", "classification"]
# sentencepiece models (translation, classification) or fixed schemes (classification only)
Tokenization = Literal["unigram", "bpe", "char", "byte", "whitespace"]
Optimizer = Literal["adam", "adamw"]
Schedule = Literal["inverse_sqrt", "cosine", "linear", "constant"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
CheckpointChoice = Literal["best", "last", "averaged"]
BestMetric = Literal["auto", "bleu", "accuracy", "loss"]

SYNTHETIC_TASKS = ("listops", "recall")
CORPUS_TASKS = ("translation", "classification")
TRANSFORMER_POOLING = ("cls", "mean", "last")
LSTM_POOLING = ("last", "mean", "max")


@dataclass
class ModelConfig:
    """[model]: the architecture. Defaults are Vaswani et al. 2017 base (arXiv:1706.03762)."""

    SECTION: ClassVar[str] = "model"

    arch: Arch = "seq2seq"
    d_model: int = 512
    n_heads: int = 8
    # None means n_heads (MHA); 1 is MQA (arXiv:1911.02150); in between is GQA (arXiv:2305.13245).
    n_kv_heads: int | None = None
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = field(default=6, metadata=only_when("arch", "seq2seq"))
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # DropHead (Zhou et al. 2020, arXiv:2004.13342): each attention head's output is dropped with
    # this probability per training example, the survivors rescaled by H / (heads kept).
    head_dropout: float = field(default=0.0, metadata=only_when("arch", "seq2seq", "classifier"))
    positional: Positional = "sinusoidal"
    max_positions: int = 1024
    norm_position: NormPosition = "post"
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    activation: Activation = "relu"
    attention_backend: AttentionBackend = "sdpa"
    scale_embeddings: bool = True
    tie_embeddings: TieEmbeddings = field(default="decoder", metadata=only_when("arch", "seq2seq"))
    pooling: Pooling = field(default="mean", metadata=only_when("arch", "classifier", "lstm"))
    # The LSTM baseline (arch = "lstm"): embeddings of d_model, lstm_layers layers of lstm_hidden
    # units; lstm_hidden = 0 sizes it to the parameter count of the Transformer classifier that
    # the same table describes (d_model, n_heads, d_ff, n_encoder_layers, ...).
    lstm_hidden: int = field(default=0, metadata=only_when("arch", "lstm"))
    lstm_layers: int = field(default=1, metadata=only_when("arch", "lstm"))
    bidirectional: bool = field(default=True, metadata=only_when("arch", "lstm"))
    # Heads removed by `xformer inspect-heads --save-pruned`: "SITE:HEAD" entries, SITE one of
    # encoder.<i>.self_attn, decoder.<i>.self_attn, decoder.<i>.cross_attn, HEAD the original index.
    pruned_heads: list[str] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def problems(self) -> list[str]:
        out = positive(self, "d_model", "n_heads", "d_ff", "n_encoder_layers", "max_positions")
        if self.arch == "seq2seq":
            out += positive(self, "n_decoder_layers")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            out.append(f"model.n_kv_heads: expected a positive integer, found {self.n_kv_heads}")
        out += probability(self, "dropout", "attention_dropout", "activation_dropout", "head_dropout")
        if self.norm_eps <= 0:
            out.append(f"model.norm_eps: expected a positive number, found {self.norm_eps}")
        if self.n_heads > 0 and self.d_model % self.n_heads:
            out.append(
                f"model.d_model: expected a multiple of model.n_heads = {self.n_heads}, "
                f"found {self.d_model}"
            )
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            out.append(
                f"model.n_kv_heads: expected a divisor of model.n_heads = {self.n_heads}, "
                f"found {self.kv_heads}"
            )
        if self.arch == "classifier" and self.pooling not in TRANSFORMER_POOLING:
            out.append(f"model.pooling: the Transformer classifier pools by 'cls', 'mean' or 'last', "
                       f"found {self.pooling!r}")
        if self.arch == "lstm":
            if self.pooling not in LSTM_POOLING:
                out.append(f"model.pooling: the LSTM pools by 'last', 'mean' or 'max', found {self.pooling!r}")
            out += positive(self, "lstm_layers") + non_negative(self, "lstm_hidden")
        if self.positional == "sinusoidal" and self.n_heads > 0 and self.d_model % 2:
            out.append(
                f"model.d_model: sinusoidal positions need an even d_model, found {self.d_model}"
            )
        out += pruned_heads_problems(self)
        if self.positional == "rope" and self.n_heads > 0 and self.d_model % self.n_heads == 0 and self.head_dim % 2:
            out.append(
                f"model.d_model: rotary positions need an even head dimension (d_model / n_heads), "
                f"found {self.head_dim}"
            )
        return out


@dataclass
class DataConfig:
    """[data]: where the examples come from, how they are tokenized and batched.

    task "translation": sentence pairs from a corpus (Hub id or local JSONL/TSV/parallel text);
    "classification": a corpus with a text and a label field; "listops" and "recall": generated
    from data.seed (xformer/data/tasks.py), data.max_len long. max_len means: translation pairs
    longer are dropped, classification texts are truncated, ListOps lengths lie strictly between
    max_len // 4 and max_len (LRA), recall sequences have max_len tokens.
    """

    SECTION: ClassVar[str] = "data"

    task: Task = "translation"
    # A Hub id ("bentrevett/multi30k") or a local folder or file (JSONL, TSV, parallel text).
    dataset: str = field(default="bentrevett/multi30k", metadata=only_when("task", *CORPUS_TASKS))
    # a Hub dataset's configuration, e.g. "de-en" for wmt14; "" for none
    dataset_config: str = field(default="", metadata=only_when("task", *CORPUS_TASKS))
    source_lang: str = field(default="de", metadata=only_when("task", "translation"))
    target_lang: str = field(default="en", metadata=only_when("task", "translation"))
    text_field: str = field(default="text", metadata=only_when("task", "classification"))
    label_field: str = field(default="label", metadata=only_when("task", "classification"))
    train_split: str = field(default="train", metadata=only_when("task", *CORPUS_TASKS))
    valid_split: str = field(default="validation", metadata=only_when("task", *CORPUS_TASKS))
    test_split: str = field(default="test", metadata=only_when("task", *CORPUS_TASKS))
    # generated tasks: split sizes and the seed of the data (train.seed seeds the model)
    n_train: int = field(default=20000, metadata=only_when("task", *SYNTHETIC_TASKS))
    n_valid: int = field(default=1000, metadata=only_when("task", *SYNTHETIC_TASKS))
    n_test: int = field(default=1000, metadata=only_when("task", *SYNTHETIC_TASKS))
    seed: int = field(default=0, metadata=only_when("task", *SYNTHETIC_TASKS))
    n_pairs: int = field(default=8, metadata=only_when("task", "recall"))  # key-value bindings to recall from
    n_queries: int = field(default=4, metadata=only_when("task", "recall"))
    # a length curriculum (generated tasks): train curriculum_steps[i] optimizer steps on examples
    # of length curriculum_lengths[i] first, in order, then at max_len; stages not shorter than
    # max_len are skipped, so one recipe serves a whole length sweep
    curriculum_lengths: list[int] = field(default_factory=list, metadata=only_when("task", *SYNTHETIC_TASKS))
    curriculum_steps: list[int] = field(default_factory=list, metadata=only_when("task", *SYNTHETIC_TASKS))
    tokenizer: Tokenization = field(default="unigram", metadata=only_when("task", *CORPUS_TASKS))
    vocab_size: int = field(default=8000, metadata=only_when("task", *CORPUS_TASKS))
    joint_vocab: bool = field(default=True, metadata=only_when("task", "translation"))
    character_coverage: float = field(default=1.0, metadata=only_when("task", *CORPUS_TASKS))
    byte_fallback: bool = field(default=False, metadata=only_when("task", *CORPUS_TASKS))
    # Subword regularization (Kudo 2018, arXiv:1804.10959): with sampling_alpha > 0 each training
    # epoch re-segments the training pairs, sampled from the unigram lattice's probabilities raised
    # to alpha, over the sampling_nbest best segmentations (-1 = all), reproducibly from
    # (train.seed, epoch) in any process (xformer.data.sampling). Unigram tokenizers only.
    # Validation, eval and translate always use the single best segmentation.
    sampling_alpha: float = field(default=0.0, metadata=only_when("task", "translation"))
    sampling_nbest: int = field(default=-1, metadata=only_when("task", "translation"))
    max_len: int = 256
    max_tokens: int = 4096  # padded tokens per batch, source or target side, whichever is larger

    def problems(self) -> list[str]:
        out = positive(self, "vocab_size", "max_len", "max_tokens", "n_train", "n_valid", "n_test", "n_queries",
                           "n_pairs")
        if not 0 < self.character_coverage <= 1:
            out.append(
                "data.character_coverage: expected a number in (0, 1], "
                f"found {self.character_coverage}"
            )
        if self.task == "translation" and self.source_lang == self.target_lang:
            out.append(
                "data.target_lang: expected a language other than data.source_lang, "
                f"found {self.target_lang!r} for both"
            )
        if self.task == "translation" and self.tokenizer not in ("unigram", "bpe"):
            out.append(f"data.tokenizer: translation uses sentencepiece 'unigram' or 'bpe', found {self.tokenizer!r}")
        if not 0 <= self.sampling_alpha <= 1:
            out.append(f"data.sampling_alpha: expected a number in [0, 1] (0: no sampling), "
                       f"found {self.sampling_alpha}")
        if self.sampling_alpha > 0 and self.tokenizer == "bpe":
            out.append("data.sampling_alpha: subword sampling needs data.tokenizer = 'unigram', found 'bpe' "
                       "(sentencepiece's BPE-dropout draws differ from process to process, so runs would not "
                       "repeat); use a unigram tokenizer or sampling_alpha = 0")
        if self.sampling_nbest != -1 and self.sampling_nbest < 2:
            out.append(f"data.sampling_nbest: expected -1 (all segmentations) or at least 2, "
                       f"found {self.sampling_nbest}")
        out += self._curriculum_problems()
        if self.task == "listops" and self.max_len < 8:
            out.append(f"data.max_len: ListOps needs lengths strictly between max_len // 4 and max_len; "
                       f"expected at least 8, found {self.max_len}")
        if self.task == "recall" and not self.n_queries <= self.n_pairs <= RECALL_N_KEYS:
            out.append(f"data.n_pairs: expected data.n_queries = {self.n_queries} <= n_pairs <= {RECALL_N_KEYS} "
                       f"(the distinct keys), found {self.n_pairs}")
        if self.task == "recall" and self.max_len < 2 * self.n_pairs + self.n_queries:
            out.append(f"data.max_len: recall needs {self.n_pairs} pairs and {self.n_queries} queries; "
                       f"expected at least {2 * self.n_pairs + self.n_queries}, found {self.max_len}")
        return out

    def _curriculum_problems(self) -> list[str]:
        lengths, steps = self.curriculum_lengths, self.curriculum_steps
        if len(lengths) != len(steps):
            return [f"data.curriculum_steps: expected one step count per curriculum length ({len(lengths)}), "
                    f"found {len(steps)}"]
        if any(n <= 0 for n in lengths + steps):
            return [f"data.curriculum_lengths / curriculum_steps: expected positive integers, "
                    f"found {lengths} / {steps}"]
        if any(a >= b for a, b in zip(lengths, lengths[1:], strict=False)):
            return [f"data.curriculum_lengths: expected increasing lengths, found {lengths}"]
        return []

    def curriculum(self) -> list[tuple[int, int]]:
        """The (length, optimizer steps) stages that apply at this max_len."""
        return [(n, k) for n, k in zip(self.curriculum_lengths, self.curriculum_steps, strict=True) if n < self.max_len]

    @property
    def is_classification(self) -> bool:
        return self.task != "translation"


@dataclass
class TrainConfig:
    """[train]: optimisation, schedule and stopping rules."""

    SECTION: ClassVar[str] = "train"

    seed: int = 1
    optimizer: Optimizer = "adamw"
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Schedule = "inverse_sqrt"
    warmup_steps: int = 4000
    label_smoothing: float = 0.1
    # R-Drop (Liang et al. 2021): each batch runs twice (two dropout masks) and alpha weighs the
    # symmetric KL between the two output distributions; 0 disables it. Costs ~2x per step.
    rdrop_alpha: float = 0.0
    clip_norm: float = 0.0  # 0 disables gradient clipping
    accumulate_steps: int = 1  # gradient accumulation: batches per optimizer step
    max_steps: int = 0  # 0: no step limit
    max_epochs: int = 0  # 0: no epoch limit
    max_time: float = 0.0  # minutes of training; 0: no time limit
    valid_every: int = 1000  # optimizer steps between validations
    patience: int = 0  # validations without improvement before stopping; 0 disables
    # what picks the best checkpoint: validation BLEU (greedy), accuracy or loss; auto is BLEU
    # for translation and accuracy for classification
    best_metric: BestMetric = "auto"
    average_last: int = 5  # checkpoints averaged into the "averaged" model
    # auto: bf16 (or fp16 + scaler) on CUDA; on the CPU bf16 where it multiplies bf16 natively
    # (AMX, AVX512-BF16), else fp32 (xformer.runtime)
    precision: Precision = "auto"
    log_every: int = 50
    log_seconds: float = 30.0  # also log when this many seconds passed since the last line; 0: steps only

    def problems(self) -> list[str]:
        out = positive(self, "lr", "adam_eps", "accumulate_steps", "valid_every", "log_every")
        out += non_negative(
            self, "weight_decay", "warmup_steps", "clip_norm", "max_steps", "max_epochs",
            "max_time", "patience", "average_last", "rdrop_alpha", "log_seconds",
        )
        out += probability(self, "label_smoothing")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(f"train.betas: expected two numbers in [0, 1), found {self.betas}")
        if self.max_steps == 0 and self.max_epochs == 0 and self.max_time == 0:
            out.append(
                "train.max_steps: expected at least one of train.max_steps, train.max_epochs, "
                "train.max_time to be positive, found all three 0"
            )
        if self.schedule in ("cosine", "linear") and self.max_steps == 0:
            out.append(f"train.schedule: {self.schedule!r} decays to 0 at train.max_steps, "
                       "which must be positive, found 0")
        return out


@dataclass
class EvalConfig:
    """[eval]: decoding and scoring."""

    SECTION: ClassVar[str] = "eval"

    beam: int = 5
    lenpen: float = 1.0  # length penalty: scores are divided by length ** lenpen
    max_len_a: float = 1.2  # hypotheses stop at max_len_a * source length + max_len_b
    max_len_b: int = 10
    checkpoint: CheckpointChoice = "best"
    batch_sentences: int = 128

    def problems(self) -> list[str]:
        return positive(self, "beam", "batch_sentences") + non_negative(
            self, "lenpen", "max_len_a", "max_len_b"
        )


SECTIONS: dict[str, type] = {cls.SECTION: cls for cls in (ModelConfig, DataConfig, TrainConfig, EvalConfig)}


@dataclass
class Recipe:
    """A whole recipe: the four tables."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def problems(self) -> list[str]:
        out = self.model.problems() + self.data.problems()
        out += self.train.problems() + self.eval.problems()
        return out + self.cross_section_problems()

    def cross_section_problems(self) -> list[str]:
        out = []
        if self.model.arch == "seq2seq" and self.model.tie_embeddings == "all" and not self.data.joint_vocab:
            out.append(
                "model.tie_embeddings: 'all' shares one embedding between both languages and "
                "needs data.joint_vocab = true, found false"
            )
        if self.model.arch != "lstm" and self.data.max_len + 1 > self.model.max_positions:  # + 1: BOS, EOS or CLS
            out.append(f"data.max_len: expected at most model.max_positions - 1 = {self.model.max_positions - 1}, "
                       f"found {self.data.max_len}")
        if self.eval.checkpoint == "averaged" and self.train.average_last == 0:
            out.append("eval.checkpoint: 'averaged' needs train.average_last > 0, found 0")
        if self.model.arch != "seq2seq" and self.data.task == "translation":
            out.append(
                f"model.arch: data.task = 'translation' needs 'seq2seq', found {self.model.arch!r}"
            )
        if self.model.arch == "seq2seq" and self.data.task != "translation":
            out.append(f"model.arch: data.task = {self.data.task!r} classifies; expected 'classifier' or 'lstm', "
                       "found 'seq2seq'")
        metric = self.train.best_metric
        if metric == "bleu" and self.data.task != "translation":
            out.append(f"train.best_metric: 'bleu' scores translations; data.task = {self.data.task!r} "
                       "expects 'accuracy' or 'loss'")
        if metric == "accuracy" and self.data.task == "translation":
            out.append("train.best_metric: 'accuracy' scores classifiers; translation expects 'bleu' or 'loss'")
        return out

    @property
    def best_metric(self) -> str:
        """train.best_metric with "auto" resolved."""
        if self.train.best_metric != "auto":
            return self.train.best_metric
        return "accuracy" if self.data.is_classification else "bleu"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Stored fields only (no properties), leaving out fields of switched-off variants."""
        return {name: section_to_dict(getattr(self, name)) for name in SECTIONS}

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml(), encoding="utf-8")

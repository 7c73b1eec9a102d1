"""Recipes: TOML files with [model] [data] [train] [eval] tables, loaded into strict dataclasses.

Strict means: an unknown key is an error with a "did you mean" hint; a value of the wrong type
is an error naming the key and the expected type; a parameter that belongs to a variant that
is switched off (say `model.pooling` on a seq2seq model) is an error rather than silently
ignored; cross-field rules (`d_model % n_heads == 0`, ...) are checked. Every problem is
collected and reported together in one `RecipeError`.

Derived values (`head_dim`, `kv_heads`) are properties, so they are never written into a
saved recipe and a saved recipe reloads to an equal `Recipe`.

Reading a recipe file and its `--set` overrides into a Recipe is xformer/config/loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

# The [model] table and its variant axes (model_table.py), re-exported: recipes are read here
from xformer.config.model_table import (  # noqa: F401
    FFN,
    LSTM_POOLING,
    PATTERN_RULES,
    QKV,
    TRANSFORMER_POOLING,
    Arch,
    AttentionBackend,
    AttentionPattern,
    Downsample,
    ModelConfig,
    Norm,
    NormPosition,
    Pooling,
    Positional,
    TieEmbeddings,
)
from xformer.config.strict import (
    non_negative,
    only_when,
    positive,
    probability,
    section_to_dict,
    toml_value,
)

# One Literal a variant axis of the training, data and eval tables (the model's: model_table.py)
Optimizer = Literal["adam", "adamw"]
Schedule = Literal["inverse_sqrt", "cosine", "linear", "constant", "wsd"]
DecayShape = Literal["1-sqrt", "linear"]
Regularisation = Literal["recipe", "budget"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
CheckpointChoice = Literal["best", "last", "averaged"]
EvalQuantize = Literal["", "int8"]  # xformer/generation/quantize.py's QUANTIZE, or "" for none
BestMetric = Literal["auto", "bleu", "accuracy", "loss"]


@dataclass
class DataConfig:
    """[data]: the fields every task has. Each value of data.task has its own table class that
    extends this one with the task's fields (xformer/tasks/: TranslationData, ...), so a field
    of another task is refused by name. max_len means, per task: translation pairs longer are
    dropped, classification texts are truncated, ListOps lengths lie strictly between
    max_len // 4 and max_len (LRA), recall sequences have max_len tokens.
    """

    SECTION: ClassVar[str] = "data"
    # what the task's validation reports besides the loss (train.best_metric may name them; the
    # first is what "auto" means), and the model.arch values that can learn it
    METRICS: ClassVar[tuple[str, ...]] = ()
    ARCHS: ClassVar[tuple[str, ...]] = ()
    DISTILLS: ClassVar[bool] = False  # whether a [distill] teacher can teach this task's models

    task: str = "translation"  # a key of xformer.tasks.TASKS
    max_len: int = 256
    max_tokens: int = 4096  # padded tokens per batch, source or target side, whichever is larger

    def problems(self) -> list[str]:
        out = positive(self, "max_len", "max_tokens")
        if type(self) is DataConfig:  # Recipe() without a data table, built in Python
            out.append(f"data: a bare DataConfig has no {self.task} fields; use the task's own table class, "
                       f"xformer.tasks.TASKS[{self.task!r}].Data")
        return out

    def fingerprints(self) -> dict[str, str]:
        """Split name -> fingerprint of the data files it reads (xformer.training.run_card); none for
        data a task generates from the recipe's own fields."""
        return {}

    def recipe_problems(self, recipe: Recipe) -> list[str]:
        """Rules that tie this table to the others (model.arch, train.best_metric)."""
        out = []
        arch, task = recipe.model.arch, self.task
        if self.ARCHS and arch not in self.ARCHS:
            expected = " or ".join(repr(a) for a in self.ARCHS)
            out.append(f"model.arch: data.task = {task!r} needs {expected}, found {arch!r}")
        metric = recipe.train.best_metric
        if metric not in ("auto", "loss") and metric not in self.METRICS:
            expected = " or ".join(repr(m) for m in (*self.METRICS, "loss"))
            out.append(f"train.best_metric: data.task = {task!r} validates by {expected}, found {metric!r}")
        return out


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
    # wsd (warmup, stable, decay; Hagele et al. 2024, arXiv:2405.18392): the rate stays at lr
    # until the last decay_fraction of the run, then cools down to min_lr, shaped 1 - sqrt (their
    # best) or linear. The run's end is the first of max_steps, max_epochs' last step and, under
    # max_time, the step the trainer expects the time to end at (xformer.training.optim.WsdPlan); with
    # train.patience, validation that stops improving starts the cooldown instead of stopping
    decay_fraction: float = field(default=0.2, metadata=only_when("schedule", "wsd"))
    min_lr: float = field(default=0.0, metadata=only_when("schedule", "wsd"))
    decay_shape: DecayShape = field(default="1-sqrt", metadata=only_when("schedule", "wsd"))
    label_smoothing: float = 0.1
    # recipe: model.dropout, train.label_smoothing and data.sampling_alpha as written; budget:
    # chosen from the epochs the run will train (a step budget's, or a time budget's from a
    # short calibration inside it), written into the run's recipe.toml and explained in
    # train.json (xformer.training.budget)
    regularisation: Regularisation = "recipe"
    # R-Drop (Liang et al. 2021): each batch runs twice (two dropout masks) and alpha weighs the
    # symmetric KL between the two output distributions; 0 disables it. Costs ~2x per step.
    rdrop_alpha: float = 0.0
    clip_norm: float = 0.0  # 0 disables gradient clipping
    # a step whose loss or gradients are not finite is skipped (counted in metrics.jsonl as
    # "skipped"); this many in a row stop the run with what to try
    max_nonfinite_steps: int = 10
    accumulate_steps: int = 1  # gradient accumulation: batches per optimizer step
    max_steps: int = 0  # 0: no step limit
    max_epochs: int = 0  # 0: no epoch limit
    max_time: float = 0.0  # minutes of training; 0: no time limit
    valid_every: int = 1000  # optimizer steps between validations
    patience: int = 0  # validations without improvement before stopping; 0 disables
    # what picks the best checkpoint: validation BLEU (greedy), accuracy or loss; auto is BLEU
    # for translation and accuracy for classification (the task's first metric)
    best_metric: BestMetric = "auto"
    average_last: int = 5  # checkpoints averaged into the "averaged" model
    # auto: bf16 (or fp16 + scaler) on CUDA; on the CPU bf16 where it multiplies bf16 natively
    # (AMX, AVX512-BF16), else fp32 (xformer.training.device)
    precision: Precision = "auto"
    log_every: int = 50
    log_seconds: float = 30.0  # also log when this many seconds passed since the last line; 0: steps only
    # the CPU dropout mask (model/dropout.py), the fused label-smoothed loss (losses.py) and the
    # fused Adam update (optim.py); false trains with torch's nn.Dropout, F.cross_entropy and the
    # per-tensor Adam, the references they are tested against
    fast_paths: bool = True
    # torch.compile the training forward (inductor, dynamic shapes), tried on the first batch
    # before training; where compiling fails the run goes on without it and says why. Off by
    # default: on the CPUs measured it was slower than eager (docs/results.md).
    compile: bool = False
    # every this many steps a checkpoint with the optimizer's state is kept as
    # checkpoints/branch_step_N (never removed): `train --branch-from RUN --at-step N` starts a
    # new run from there (a wsd run's cooldown, say); 0 keeps none
    branch_every: int = 0

    def problems(self) -> list[str]:
        out = positive(self, "lr", "adam_eps", "accumulate_steps", "valid_every", "log_every")
        out += non_negative(
            self, "weight_decay", "warmup_steps", "clip_norm", "max_nonfinite_steps", "max_steps", "max_epochs",
            "max_time", "patience", "average_last", "rdrop_alpha", "log_seconds", "min_lr", "branch_every",
        )
        out += probability(self, "label_smoothing")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(f"train.betas: expected two numbers in [0, 1), found {self.betas}")
        if self.max_steps == 0 and self.max_epochs == 0 and self.max_time == 0:
            out.append(
                "train.max_steps: expected at least one of train.max_steps, train.max_epochs, "
                "train.max_time to be positive, found all three 0"
            )
        if self.schedule == "wsd":
            if not 0 < self.decay_fraction <= 1:
                out.append(f"train.decay_fraction: expected a share of the run in (0, 1], found {self.decay_fraction}")
            if self.min_lr > self.lr:
                out.append(f"train.min_lr: expected at most train.lr = {self.lr}, found {self.min_lr}")
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
    quantize: EvalQuantize = ""  # "int8": decode with dynamic int8 Linear layers (CPU), as `eval --quantize`;
    # left out of saved recipes when "" (so runs from before it reload unchanged)

    def problems(self) -> list[str]:
        return positive(self, "beam", "batch_sentences") + non_negative(
            self, "lenpen", "max_len_a", "max_len_b"
        )


DistillKind = Literal["word", "sequence"]


@dataclass
class DistillConfig:
    """[distill]: knowledge distillation from a trained translation run, the teacher (Hinton et al.
    2015, arXiv:1503.02531; Kim & Rush 2016, arXiv:1606.07947). The student shares the teacher's
    tokenizer (copied into its run directory). Left out of saved recipes when there is no teacher.

    word      each target token's loss is (1 - alpha) * the label-smoothed NLL of the reference
              + alpha * T^2 * KL(teacher || student), both distributions at temperature T
    sequence  the student trains on the teacher's beam translations of the training sources
              (written once into TEACHER/distilled/ and reused), validated on the references
    """

    SECTION: ClassVar[str] = "distill"

    teacher: str = ""  # the teacher's run directory; "" trains on the references alone
    kind: DistillKind = "sequence"
    checkpoint: CheckpointChoice = "best"  # the teacher's
    alpha: float = field(default=0.5, metadata=only_when("kind", "word"))
    temperature: float = field(default=1.0, metadata=only_when("kind", "word"))
    beam: int | None = field(default=None, metadata=only_when("kind", "sequence"))  # None: the teacher's eval.beam
    lenpen: float | None = field(default=None, metadata=only_when("kind", "sequence"))  # None: its eval.lenpen

    def problems(self) -> list[str]:
        out = probability(self, "alpha") + positive(self, "temperature")
        if not self.teacher and self != DistillConfig():
            out.append("distill.teacher: expected the teacher's run directory (the other [distill] keys "
                       "apply only with a teacher), found nothing")
        if self.beam is not None and self.beam <= 0:
            out.append(f"distill.beam: expected a positive integer, found {self.beam}")
        if self.lenpen is not None and self.lenpen < 0:
            out.append(f"distill.lenpen: expected zero or more, found {self.lenpen}")
        return out


SECTIONS: dict[str, type] = {cls.SECTION: cls for cls in (ModelConfig, DataConfig, TrainConfig, EvalConfig,
                                                          DistillConfig)}


# what `train --resume` may change in a run (recorded as a Change); the rest fixes the model,
# its data or the batch plan a checkpoint's position refers to
CHANGEABLE = ("train", "eval")
FIXED_ON_RESUME = ("train.seed", "train.accumulate_steps")


@dataclass
class Change:
    """[[changes]]: values `train --resume` changed, in effect from optimizer step `step` on.
    The recipe's tables hold the values after the last change; `was` holds those before, so
    Recipe.at(step) is the recipe as it stood at any step, and a run of the recipe replays it."""

    step: int
    set: dict[str, Any]  # "section.key" -> the value from `step` on
    was: dict[str, Any]  # "section.key" -> the value before

    def describe(self) -> str:
        return ", ".join(f"{k} {toml_value(self.was.get(k))} -> {toml_value(v)}" for k, v in self.set.items())


@dataclass
class Recipe:
    """A whole recipe: the four tables, and the changes a resumed run made to them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    changes: list[Change] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = self.model.problems() + self.data.problems()
        out += self.train.problems() + self.eval.problems() + self.distill.problems()
        return out + self.cross_section_problems()

    def cross_section_problems(self) -> list[str]:
        out = []
        if self.model.arch != "lstm" and self.data.max_len + 1 > self.model.max_positions:  # + 1: BOS, EOS or CLS
            out.append(f"data.max_len: expected at most model.max_positions - 1 = {self.model.max_positions - 1}, "
                       f"found {self.data.max_len}")
        if self.eval.checkpoint == "averaged" and self.train.average_last == 0:
            out.append("eval.checkpoint: 'averaged' needs train.average_last > 0, found 0")
        if self.distill.teacher:
            if not self.data.DISTILLS:
                out.append(f"distill.teacher: distillation is for translation, found data.task = {self.data.task!r}")
            if self.distill.kind == "word" and self.train.rdrop_alpha > 0:
                out.append("distill.kind: 'word' does not combine with train.rdrop_alpha > 0; set one of them")
        return out + self.data.recipe_problems(self)

    @property
    def best_metric(self) -> str:
        """train.best_metric with "auto" resolved."""
        if self.train.best_metric != "auto":
            return self.train.best_metric
        return self.data.METRICS[0] if self.data.METRICS else "loss"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Stored fields only (no properties), leaving out fields of switched-off variants."""
        out = {name: section_to_dict(getattr(self, name)) for name in SECTIONS
               if name != "distill" or self.distill.teacher}
        if not self.eval.quantize:
            del out["eval"]["quantize"]
        if not out["model"].get("output_bias", True):  # off: recipes written before the field read the same
            del out["model"]["output_bias"]
        if self.changes:
            out["changes"] = [{"step": c.step, "set": dict(c.set), "was": dict(c.was)} for c in self.changes]
        return out

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            if section == "changes":
                continue
            lines.append(f"[{section}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
            lines.append("")
        for change in self.changes:
            lines += [f"[[changes]]  # train --resume from step {change.step}: {change.describe()}",
                      f"step = {change.step}", f"set = {toml_value(change.set)}", f"was = {toml_value(change.was)}", ""]
        return "\n".join(lines)

    def next_change(self, step: int) -> int | None:
        """The step of the first change after `step`, if any."""
        return min((c.step for c in self.changes if c.step > step), default=None)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml(), encoding="utf-8")

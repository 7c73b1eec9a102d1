"""data.task = "listops" and "recall": classification data generated from data.seed
(xformer/data/generators.py), with a fixed vocabulary, so a length sweep needs no corpus.

Splits are "train", "valid" and "test", generated each from its own seed; a length
curriculum (data.curriculum_lengths / curriculum_steps) trains on shorter examples first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from xformer.config.schema import DataConfig
from xformer.config.strict import positive
from xformer.data.classify import (
    ClassBatches,
    Examples,
    StagedBatches,
    curriculum_examples,
    generated_splits,
    task_encoder,
)
from xformer.data.generators import GENERATORS, RECALL_N_KEYS, SPLITS
from xformer.errors import RunError
from xformer.events import Event
from xformer.tasks.classification import PAD_ID, ClassificationTask


@dataclass
class GeneratedData(DataConfig):
    """[data] of a generated task: split sizes, the seed of the data (train.seed seeds the
    model) and an optional length curriculum."""

    METRICS: ClassVar[tuple[str, ...]] = ("accuracy",)
    ARCHS: ClassVar[tuple[str, ...]] = ("classifier", "lstm")

    task: str = "listops"
    n_train: int = 20000
    n_valid: int = 1000
    n_test: int = 1000
    seed: int = 0
    # a length curriculum: train curriculum_steps[i] optimizer steps on examples of length
    # curriculum_lengths[i] first, in order, then at max_len; stages not shorter than max_len
    # are skipped, so one recipe serves a whole length sweep
    curriculum_lengths: list[int] = field(default_factory=list)
    curriculum_steps: list[int] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = super().problems() + positive(self, "n_train", "n_valid", "n_test")
        lengths, steps = self.curriculum_lengths, self.curriculum_steps
        if len(lengths) != len(steps):
            out.append(f"data.curriculum_steps: expected one step count per curriculum length ({len(lengths)}), "
                       f"found {len(steps)}")
        elif any(n <= 0 for n in lengths + steps):
            out.append(f"data.curriculum_lengths / curriculum_steps: expected positive integers, "
                       f"found {lengths} / {steps}")
        elif any(a >= b for a, b in zip(lengths, lengths[1:], strict=False)):
            out.append(f"data.curriculum_lengths: expected increasing lengths, found {lengths}")
        return out

    def curriculum(self) -> list[tuple[int, int]]:
        """The (length, optimizer steps) stages that apply at this max_len."""
        return [(n, k) for n, k in zip(self.curriculum_lengths, self.curriculum_steps, strict=True) if n < self.max_len]

    def generator_options(self) -> dict:
        return {}


@dataclass
class ListOpsData(GeneratedData):
    def problems(self) -> list[str]:
        out = super().problems()
        if self.max_len < 8:
            out.append(f"data.max_len: ListOps needs lengths strictly between max_len // 4 and max_len; "
                       f"expected at least 8, found {self.max_len}")
        return out


@dataclass
class RecallData(GeneratedData):
    task: str = "recall"
    n_pairs: int = 8  # key-value bindings to recall from
    n_queries: int = 4
    # where the pairs sit: "start" (first: the lookup reaches further back as inputs grow) or
    # "end" (just before the query: the same distance back at every length)
    bindings: Literal["start", "end"] = "start"

    def problems(self) -> list[str]:
        out = super().problems() + positive(self, "n_queries", "n_pairs")
        if not self.n_queries <= self.n_pairs <= RECALL_N_KEYS:
            out.append(f"data.n_pairs: expected data.n_queries = {self.n_queries} <= n_pairs <= {RECALL_N_KEYS} "
                       f"(the distinct keys), found {self.n_pairs}")
        if self.max_len < 2 * self.n_pairs + self.n_queries:
            out.append(f"data.max_len: recall needs {self.n_pairs} pairs and {self.n_queries} queries; "
                       f"expected at least {2 * self.n_pairs + self.n_queries}, found {self.max_len}")
        return out

    def generator_options(self) -> dict:
        return {"n_queries": self.n_queries, "n_pairs": self.n_pairs, "bindings": self.bindings}


class GeneratedTask(ClassificationTask):
    """A classifier on generated examples; the encoder is the generator's vocabulary."""

    Data = GeneratedData

    def __init__(self, recipe):
        super().__init__(recipe)
        self.encoder, n_classes = task_encoder(recipe.data.task)
        self.labels = [str(c) for c in range(n_classes)]

    def scored_set(self, split: str | None, data: str | None) -> list[tuple]:
        """The generated examples `evaluate` scores as (token ids, gold label) pairs."""
        examples, _ = self.examples(split, data)
        return [(tuple(examples.sequence(i)), self.labels[label]) for i, label in enumerate(examples.labels)]

    def pairing_hint(self) -> str:
        return "generate both with the same [data] settings (seed, n_test, max_len, the task's own)"

    def splits(self) -> dict[str, Examples]:
        d = self.recipe.data
        return generated_splits(d.task, d.n_train, d.n_valid, d.n_test, d.max_len, d.seed,
                                tuple(sorted(d.generator_options().items())))

    def load(self, emit: Event) -> None:
        d = self.recipe.data
        emit("setup", {"message": f"generating {d.task} at length {d.max_len} (data.seed {d.seed})"})
        self.generated = self.splits()

    def prepare_examples(self, directory: Path, emit: Event) -> tuple[Examples, Examples]:
        return self.generated["train"], self.generated["valid"]

    def training_batches(self, train: Examples, emit: Event):
        d, seed = self.recipe.data, self.recipe.train.seed
        batches = ClassBatches(train, d.max_tokens, seed=seed)
        curriculum = d.curriculum()
        if not curriculum:
            return batches
        accumulate = self.recipe.train.accumulate_steps
        options = d.generator_options()
        stages = [(ClassBatches(curriculum_examples(d.task, d.n_train, length, d.seed, **options), d.max_tokens,
                                seed=seed), steps * accumulate) for length, steps in curriculum]
        emit("setup", {"message": "length curriculum: " + ", ".join(f"{k} steps at {n}" for n, k in curriculum)
                       + f", then {d.max_len}"})
        self.curriculum_steps = sum(k for _, k in curriculum)
        return StagedBatches(stages, batches)

    def encoder_settings(self) -> dict:
        return {"task": self.recipe.data.task}

    def model_sizes(self) -> dict:
        return {"vocab_size": self.encoder.vocab_size, "n_classes": len(self.labels), "pad_id": PAD_ID}

    def load_vocabulary(self, run_dir: Path) -> None:
        pass  # the generator's vocabulary, fixed

    def examples(self, split: str | None, data: str | None) -> tuple[Examples, str]:
        if data is not None:
            raise RunError(f"data: a {self.recipe.data.task} run scores its own generated splits "
                           f"({', '.join(SPLITS)}), not a file")
        split = split or "test"
        if split not in SPLITS:
            raise RunError(f"split {split}: a generated task has the splits {', '.join(SPLITS)}")
        return self.splits()[split], split

    def train_split(self) -> str:
        return "train"

    def valid_split(self) -> str:
        return "valid"

    def test_split(self) -> str:
        return "test"


class ListOpsTask(GeneratedTask):
    Data = ListOpsData


class RecallTask(GeneratedTask):
    Data = RecallData


assert set(GENERATORS) == {"listops", "recall"}  # one task class per generator above

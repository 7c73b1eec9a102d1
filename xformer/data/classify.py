"""Data for sequence classification: encoders, encoded splits and token-budget batches.

Examples come either from a generated task (data/generators.py: ListOps, associative recall) or
from a corpus with a text field and a label field (JSONL, local or Hub), which is how LRA Text
(byte-level IMDb) or a user's own task comes in. A corpus is tokenized by

    char        one id per character seen in training (the data.vocab_size - 2 most frequent)
    byte        one id per UTF-8 byte (256 + pad + unk), no vocabulary to learn: LRA's Text
    whitespace  one id per whitespace-separated word (the vocab_size - 2 most frequent)
    unigram/bpe a sentencepiece model trained on the training texts

Ids: 0 is padding and 1 unknown for every encoder (the task vocabularies keep 0 = "<pad>").
Texts longer than data.max_len tokens are truncated to their first max_len tokens, as LRA does;
an empty text is one unknown token.
Labels are mapped to classes 0..C-1 in sorted order of the training split's label values;
a validation or test label never seen in training is an error.

Batches follow the translation batcher (data/batching.py): sorted by length, cut so that
B * (longest + 1) <= max_tokens (the + 1 is the CLS position), shuffled per (seed, epoch).

    tokens  (B, S)  ids, right-padded with 0
    labels  (B,)    class indices
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from xformer.data.batching import token_batches
from xformer.data.generators import GENERATORS, split_seed
from xformer.data.tokenizer import Tokenizer
from xformer.errors import DataError
from xformer.files import atomic_write_text

PAD_ID, UNK_ID = 0, 1
ENCODER_FILE = "encoder.json"


@dataclass
class Examples:
    """An encoded split: every sequence's ids concatenated (int32), their lengths and labels."""

    ids: np.ndarray  # (sum of lens,) int32
    lens: np.ndarray  # (N,) int64
    labels: np.ndarray  # (N,) int64

    def __post_init__(self):
        self.starts = np.concatenate([[0], np.cumsum(self.lens)[:-1]]).astype(np.int64)

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Sequence[int], int]]) -> Examples:
        lens = np.fromiter((len(ids) for ids, _ in pairs), dtype=np.int64, count=len(pairs))
        flat = np.fromiter((t for ids, _ in pairs for t in ids), dtype=np.int32, count=int(lens.sum()))
        labels = np.fromiter((label for _, label in pairs), dtype=np.int64, count=len(pairs))
        return cls(flat, lens, labels)

    def __len__(self) -> int:
        return len(self.lens)

    def sequence(self, i: int) -> list[int]:
        return self.ids[self.starts[i]:self.starts[i] + self.lens[i]].tolist()


def collate_tokens(examples: Examples, rows: np.ndarray) -> dict:
    """Rows of `examples` -> {"tokens": (B, S) LongTensor right-padded with 0, "labels": (B,),
    "n_tokens": real tokens, "n_examples": B}."""
    lens = examples.lens[rows]
    width = max(1, int(lens.max()) if len(lens) else 1)
    out = np.full((len(rows), width), PAD_ID, dtype=np.int64)
    ends = np.cumsum(lens)
    flat = examples.ids[np.repeat(examples.starts[rows] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends)
                                                                                          else 0)]
    out[np.arange(width) < lens[:, None]] = flat
    return {"tokens": torch.from_numpy(out), "labels": torch.from_numpy(examples.labels[rows]),
            "n_tokens": int(lens.sum()), "n_examples": len(rows)}


class ClassBatches:
    """Token-budget batches over Examples, one epoch at a time (the classification twin of
    data.batching.BatchIterator, with the same resume contract: iter_epoch(epoch, skip))."""

    def __init__(self, examples: Examples, max_tokens: int, *, seed: int, shuffle: bool = True):
        self.examples, self.max_tokens, self.seed, self.shuffle = examples, max_tokens, seed, shuffle
        self._len: int | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        lens = self.examples.lens
        # token_batches adds one position per side (EOS/BOS there, the CLS vector here)
        return token_batches(lens, np.zeros_like(lens), self.max_tokens, shuffle=self.shuffle, seed=self.seed,
                             epoch=epoch)

    def iter_epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        for rows in self.batches(epoch)[skip:]:
            yield collate_tokens(self.examples, np.asarray(rows))

    def __len__(self) -> int:
        if self._len is None:
            self._len = len(self.batches(0))
        return self._len


class StagedBatches:
    """A length curriculum in front of the training batches (sequence-length warmup, Li et al.
    2022, arXiv:2108.06084): the first epoch opens with each stage in turn, `n` batches of that
    stage's own shorter examples (its epochs cycled, each reshuffled), then runs `final`'s first
    epoch; later epochs are `final`'s alone. Same resume contract as ClassBatches: iter_epoch
    (epoch, skip) skips the first `skip` batches of the epoch, stages included."""

    def __init__(self, stages: Sequence[tuple[ClassBatches, int]], final: ClassBatches):
        self.stages, self.final = list(stages), final

    def iter_epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        if epoch == 0:
            for stage, n in self.stages:
                if skip >= n:
                    skip -= n
                    continue
                yield from _cycled(stage, n, skip)
                skip = 0
        yield from self.final.iter_epoch(epoch, skip)

    def __len__(self) -> int:
        """Batches of epoch 0 (the curriculum's and the first full epoch's); later epochs have len(final)."""
        return sum(n for _, n in self.stages) + len(self.final)


def _cycled(batches: ClassBatches, n: int, skip: int) -> Iterator[dict]:
    """Batches skip..n-1 of `batches` read epoch after epoch."""
    per_epoch = len(batches)
    for index in range(skip, n):
        epoch, within = divmod(index, per_epoch)
        if index == skip or within == 0:
            rows = batches.batches(epoch)
        yield collate_tokens(batches.examples, np.asarray(rows[within]))


# ---------------------------------------------------------------- encoders


class TextEncoder:
    """Text -> ids for a classification corpus, or the fixed vocabulary of a generated task.

    kind "task", "char", "whitespace": `vocab` lists every token by id; "byte": fixed;
    "unigram"/"bpe": a sentencepiece model in the same directory (data/tokenizer.py)."""

    def __init__(self, kind: str, vocab: list[str] | None = None, spm=None):
        self.kind, self.vocab, self._spm = kind, vocab, spm
        self._index = {tok: i for i, tok in enumerate(vocab)} if vocab is not None else None

    @property
    def vocab_size(self) -> int:
        if self.kind == "byte":
            return 258
        if self._spm is not None:
            return self._spm.vocab_size("source")
        return len(self.vocab)

    def encode(self, texts: Sequence[str | None], max_len: int) -> list[list[int]]:
        """Ids of each text, cut to max_len; an empty or missing text is [UNK_ID] (a sequence
        of no tokens would leave nothing to pool)."""
        texts = ["" if t is None else t for t in texts]
        if self.kind == "byte":
            encoded = [[b + 2 for b in t.encode("utf-8")[:max_len]] for t in texts]
        elif self._spm is not None:
            encoded = [ids[:max_len] for ids in self._spm.encode(texts, "source")]
        else:
            index = self._index
            split = list if self.kind == "char" else str.split
            encoded = [[index.get(tok, UNK_ID) for tok in split(t)[:max_len]] for t in texts]
        return [ids or [UNK_ID] for ids in encoded]

    def token(self, i: int) -> str:
        """The readable token of id i (for attention maps and error messages)."""
        if self.kind == "byte":
            return {PAD_ID: "<pad>", UNK_ID: "<unk>"}.get(i, repr(bytes([i - 2]))[2:-1])
        if self._spm is not None:
            return self._spm._model("source").id_to_piece(i)
        return self.vocab[i]

    def save(self, directory: Path, extra: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / ENCODER_FILE, json.dumps({"kind": self.kind, "vocab": self.vocab, **extra}))

    @classmethod
    def load(cls, directory: Path) -> tuple[TextEncoder, dict]:
        path = directory / ENCODER_FILE
        if not path.is_file():
            raise DataError(f"{directory}: no {ENCODER_FILE} (not a classification run's tokenizer)")
        saved = json.loads(path.read_text())
        spm = None
        if saved["kind"] in ("unigram", "bpe"):
            spm = Tokenizer.load(directory, "text", "text")
        return cls(saved["kind"], saved.get("vocab"), spm), saved


def fit_vocab(texts: Sequence[str | None], kind: str, vocab_size: int) -> list[str]:
    """The vocabulary of a "char" or "whitespace" encoder: pad, unk, then the vocab_size - 2
    most frequent tokens of `texts` (ties in first-seen order, so it is deterministic)."""
    counts: Counter[str] = Counter()
    split = list if kind == "char" else str.split
    for t in texts:
        counts.update(split(t or ""))
    return ["<pad>", "<unk>"] + [tok for tok, _ in counts.most_common(max(0, vocab_size - 2))]


# ---------------------------------------------------------------- generated tasks


@lru_cache(maxsize=8)
def generated_splits(task: str, n_train: int, n_valid: int, n_test: int, max_len: int, seed: int,
                     options: tuple[tuple[str, int], ...] = ()) -> dict[str, Examples]:
    """Train / valid / test Examples of a generated task, each split from its own seed derived
    from data.seed; `options`: the generator's own arguments as sorted (name, value) pairs
    (cached: a sweep's runs at one length share them)."""
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    return {split: _generate(task, n, max_len, split_seed(seed, split), dict(options), "data.max_len = ")
            for split, n in sizes.items()}


def curriculum_examples(task: str, n: int, length: int, seed: int, **options: int) -> Examples:
    """A curriculum stage's training examples: the task generated at a shorter `length`, from a
    stream of its own (seeded by data.seed and the length, so no stage repeats the train split)."""
    stage_seed = int(np.random.SeedSequence([seed, 0, length]).generate_state(1)[0])
    return _generate(task, n, length, stage_seed, options, "data.curriculum_lengths: ")


def _generate(task: str, n: int, length: int, seed: int, options: dict, where: str) -> Examples:
    """n examples of a generated task; a length it cannot be generated at is a DataError naming `where`."""
    try:
        return Examples.from_pairs(GENERATORS[task][1](n, length, seed, **options))
    except ValueError as exc:
        raise DataError(f"{where}{length}: {exc}") from None


def task_encoder(task: str) -> tuple[TextEncoder, int]:
    """The fixed vocabulary and number of classes of a generated task."""
    spec = GENERATORS[task][0]()
    return TextEncoder("task", spec.vocab), spec.n_classes

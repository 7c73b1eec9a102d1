"""Sentencepiece tokenizers (Kudo & Richardson 2018, arXiv:1808.06226) for translation.

One model shared by both languages (joint, the usual choice when the scripts overlap and the
embeddings are tied) or one model per language. A tokenizer lives in a directory as

    spm.model                      joint
    spm.<source>.model  spm.<target>.model   separate

or, for a model trained elsewhere (xformer import), as

    source.spm  target.spm  vocab.json     two models, one vocabulary: vocab.json numbers the
                                           pieces either model produces (MarianTokenizer's layout)

Every model is trained with the same special ids (and an imported vocab.json is renumbered to
them), so the model, the batcher and the decoder can use the constants below without asking the
tokenizer:

    PAD_ID = 0   UNK_ID = 1   BOS_ID = 2   EOS_ID = 3

`encode` adds neither BOS nor EOS: that is the batcher's job (data/batching.py), so encoded
corpora hold only the sentence's own pieces.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import datasets
import numpy as np
import sentencepiece as spm

from xformer.data.sampling import UnigramSampler
from xformer.errors import DataError
from xformer.files import atomic_write_bytes

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
VOCABULARY = "vocab.json"  # an imported tokenizer's numbering of the pieces (module docstring)
Side = Literal["source", "target"]

_DROPPED_ON_DECODE = frozenset((PAD_ID, BOS_ID, EOS_ID))
# Sentencepiece splits EM work across its threads and the split changes the model, so a
# fixed count (its own default) rather than os.cpu_count() keeps a seed's model the same
# on every machine.
_TRAIN_THREADS = 16
_QUIET = 2  # sentencepiece log level: errors only; training otherwise prints hundreds of lines


class Tokenizer:
    """Source and target sentencepiece models (the same object twice when `joint`)."""

    def __init__(self, source: spm.SentencePieceProcessor, target: spm.SentencePieceProcessor,
                 files: list[Path], *, joint: bool, vocabulary: list[str] | None = None):
        self._models = {"source": source, "target": target}
        self.files = files
        self.joint = joint  # one vocabulary for both sides
        # an imported vocab.json: the piece of every id, in id order, and its inverse (None: the
        # sentencepiece models' own ids)
        self._pieces = vocabulary
        self._ids = {piece: i for i, piece in enumerate(vocabulary)} if vocabulary is not None else None
        # Identifies the vocabularies (not the paths): encoded corpora are cached under it.
        protos = [source.serialized_model_proto()] if source is target else [
            source.serialized_model_proto(), target.serialized_model_proto()]
        if vocabulary is not None:
            protos.append("\n".join(vocabulary).encode("utf-8"))
        self.digest = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in protos)).hexdigest()

    @classmethod
    def load(cls, directory: str | Path, source_lang: str, target_lang: str) -> Tokenizer:
        """Read `spm.model`, or `spm.<source_lang>.model` and `spm.<target_lang>.model`, from
        `directory`. DataError naming the path when it is missing or not a usable model."""
        directory = Path(directory)
        if (directory / VOCABULARY).is_file():
            return cls._load_mapped(directory)
        joint_file = directory / "spm.model"
        source_file = directory / f"spm.{source_lang}.model"
        target_file = directory / f"spm.{target_lang}.model"
        if joint_file.exists():
            if source_file.exists() or target_file.exists():
                raise DataError(
                    f"{directory}: holds both a joint spm.model and per-language spm.<lang>.model files; "
                    "remove the ones not meant"
                )
            model = _load_model(joint_file)
            return cls(model, model, [joint_file], joint=True)
        if not source_file.exists() and not target_file.exists():
            raise DataError(
                f"{joint_file}: no such file (nor {source_file.name} and {target_file.name}); "
                "train a tokenizer first"
            )
        for path in (source_file, target_file):
            if not path.exists():
                raise DataError(f"{path}: no such file; separate vocabularies need one model per language")
        return cls(_load_model(source_file), _load_model(target_file), [source_file, target_file], joint=False)

    @classmethod
    def _load_mapped(cls, directory: Path) -> Tokenizer:
        """source.spm and target.spm segment, vocab.json numbers the pieces (module docstring)."""
        path = directory / VOCABULARY
        try:
            table = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: not JSON ({exc})") from None
        ids = sorted(table.values()) if isinstance(table, dict) and all(
            type(i) is int for i in table.values()) else None
        if ids != list(range(len(ids or []))) or len(table) < 4:
            raise DataError(f"{path}: expected an object numbering its pieces 0 to N-1, each id once")
        pieces = [""] * len(table)
        for piece, i in table.items():
            pieces[i] = piece
        files = [directory / "source.spm", directory / "target.spm"]
        for file in files:
            if not file.is_file():
                raise DataError(f"{file}: no such file; a vocab.json needs source.spm and target.spm beside it")
        source, target = (_load_model(f, special=False) for f in files)
        if files[0].read_bytes() == files[1].read_bytes():
            target = source
        return cls(source, target, files, joint=True, vocabulary=pieces)

    def encode(self, texts: Sequence[str | None], side: Side) -> list[list[int]]:
        """Piece ids of each text, without BOS/EOS: a list of B lists of varying length.
        A missing text (None, a null in JSON) encodes as empty."""
        if self._ids is None:
            return self._model(side).encode([t or "" for t in texts], out_type=int)
        return [[self._ids.get(p, UNK_ID) for p in seq] for seq in self.pieces(texts, side)]

    def sampler(self, texts: Sequence[str | None], side: Side, *, alpha: float, nbest: int = -1) -> UnigramSampler:
        """Sampled segmentations of `texts` (subword regularization, Kudo 2018, arXiv:1804.10959),
        drawn with numpy generators, so a seed gives the same pieces in every process; see
        xformer.data.sampling for why not sentencepiece's own sampler. Unigram models only."""
        if self._ids is not None:
            raise DataError("data.sampling_alpha: subword sampling needs the sentencepiece model's own ids; this "
                            "tokenizer numbers its pieces by vocab.json (an imported model): set sampling_alpha = 0")
        return UnigramSampler(self._model(side), texts, alpha=alpha, nbest=nbest)

    def pieces(self, texts: Sequence[str | None], side: Side) -> list[list[str]]:
        """The pieces themselves ('▁Ein', '▁Hund', ...), for looking at what encode does."""
        return self._model(side).encode([t or "" for t in texts], out_type=str)

    def decode(self, ids: Sequence[Sequence[int]], side: Side) -> list[str]:
        """Detokenized text of each id sequence. Pad, BOS and EOS are dropped first (a padded
        (B, T) batch decodes as is); UNK decodes to sentencepiece's ' ⁇ '. Accepts lists or a
        (B, T) tensor / array."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        kept = [[i for i in seq if i not in _DROPPED_ON_DECODE] for seq in ids]
        if self._pieces is None:
            return self._model(side).decode(kept)
        # a piece the side's model lacks passes through as written: "▁" made " ", as MarianTokenizer does
        model = self._model(side)
        return [model.decode_pieces([self._pieces[i] for i in seq]).replace("\u2581", " ").strip() for seq in kept]

    def piece(self, i: int, side: Side) -> str:
        """The piece string of id i."""
        return self._model(side).id_to_piece(i) if self._pieces is None else self._pieces[i]

    def vocab_size(self, side: Side) -> int:
        return self._model(side).get_piece_size() if self._pieces is None else len(self._pieces)

    def vocabulary(self, side: Side) -> list[str]:
        """The piece of every id, in id order."""
        if self._pieces is not None:
            return list(self._pieces)
        model = self._model(side)
        return [model.id_to_piece(i) for i in range(model.get_piece_size())]

    def _model(self, side: Side) -> spm.SentencePieceProcessor:
        if side not in self._models:
            raise ValueError(f"side must be 'source' or 'target', not {side!r}")
        return self._models[side]

    def __repr__(self) -> str:
        sizes = "/".join(str(self.vocab_size(s)) for s in ("source", "target"))
        return f"Tokenizer({'joint' if self.joint else 'separate'}, vocab {sizes}, {[str(f) for f in self.files]})"


def train_tokenizer(
    split: datasets.Dataset, source_lang: str, target_lang: str, directory: str | Path, *,
    model_type: Literal["unigram", "bpe"], vocab_size: int, joint: bool, character_coverage: float,
    byte_fallback: bool, max_sentences: int = 2_000_000, seed: int = 1,
) -> Tokenizer:
    """Train sentencepiece on the `source_lang` and `target_lang` columns of `split` and write
    the model(s) into `directory` (see the module docstring), replacing any tokenizer there.

    Each model sees at most `max_sentences` sentences: when the split is larger, a random
    subset of rows drawn with `seed` (a joint model takes both sides of max_sentences / 2
    rows). Sentences stream from the Arrow table in batches, so a large corpus is never a
    Python list. The same split, arguments and seed give byte-identical model files.

    A `vocab_size` the corpus cannot fill is a DataError suggesting a smaller one, rather
    than sentencepiece's `hard_vocab_limit=False`, which would quietly train a smaller
    vocabulary than the recipe says.
    """
    found = split.column_names
    for lang in (source_lang, target_lang):
        if lang not in found:
            raise DataError(f"{_describe(split)}: no field {lang!r} (found: {', '.join(found)})")
    directory = Path(directory)
    if joint:
        plan = {directory / "spm.model": [source_lang, target_lang]}
        stale = [directory / f"spm.{source_lang}.model", directory / f"spm.{target_lang}.model"]
    else:
        plan = {directory / f"spm.{lang}.model": [lang] for lang in (source_lang, target_lang)}
        stale = [directory / "spm.model"]
    # Train every model before writing any, so a failure leaves the directory as it was.
    protos = {}
    for path, columns in plan.items():
        sentences = _sentences(split, columns, max_sentences, seed)
        protos[path] = _train_one(sentences, model_type=model_type, vocab_size=vocab_size,
                                  character_coverage=character_coverage, byte_fallback=byte_fallback, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    for path, proto in protos.items():
        atomic_write_bytes(path, proto)
    for path in stale:  # else Tokenizer.load would find two tokenizers
        path.unlink(missing_ok=True)
    return Tokenizer.load(directory, source_lang, target_lang)


def _train_one(sentences: Iterator[str], *, model_type: str, vocab_size: int, character_coverage: float,
               byte_fallback: bool, seed: int) -> bytes:
    """One sentencepiece model, as the bytes of its .model file."""
    spm.set_random_generator_seed(seed)
    spm.set_min_log_level(_QUIET)
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=buffer, model_type=model_type, vocab_size=vocab_size,
            character_coverage=character_coverage, byte_fallback=byte_fallback,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            input_sentence_size=0,  # the rows were already sampled; use them all
            num_threads=_TRAIN_THREADS, minloglevel=_QUIET,
        )
    except RuntimeError as exc:
        raise DataError(_training_problem(str(exc), model_type, vocab_size)) from None
    return buffer.getvalue()


def _training_problem(message: str, model_type: str, vocab_size: int) -> str:
    """sentencepiece's check failures ('INTERNAL: src/...cc(744) [...] Vocabulary size too
    high (8000). Please set it to a value <= 5005.') as one line about the recipe field."""
    too_high = re.search(r"Vocabulary size too high.*<= (\d+)", message)
    if too_high:
        return (f"data.vocab_size: {vocab_size} is more pieces than this corpus yields for a {model_type} model "
                f"(at most {too_high.group(1)}); set a smaller one, e.g. --set data.vocab_size={too_high.group(1)}")
    too_low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_low:
        return (f"data.vocab_size: {vocab_size} is fewer pieces than the corpus has characters ({too_low.group(2)} "
                "needed); raise data.vocab_size or lower data.character_coverage")
    if "!sentences_.empty()" in message:
        return "data.dataset: the training split has no non-empty sentences to train a tokenizer on"
    text = message.split("] ", 1)[-1].strip() or message.strip()
    reason = text.splitlines()[0] if text else "no message"
    return f"data.vocab_size: sentencepiece could not train a {model_type} model of {vocab_size} pieces: {reason}"


def _sentences(split: datasets.Dataset, columns: list[str], max_sentences: int, seed: int) -> Iterator[str]:
    """The non-empty texts of `columns`, from at most max_sentences / len(columns) rows."""
    n_rows = min(len(split), max(1, max_sentences // len(columns)))
    if n_rows < len(split):
        rng = np.random.default_rng(seed)
        # Sorted, so the subset is read front to back rather than in random order.
        split = split.select(np.sort(rng.choice(len(split), size=n_rows, replace=False)))
    for batch in split.select_columns(columns).iter(batch_size=1000):
        for column in columns:
            yield from (text for text in batch[column] if text)


def _load_model(path: Path, special: bool = True) -> spm.SentencePieceProcessor:
    """The sentencepiece model at `path`; with `special`, one of xformer's special ids."""
    model = spm.SentencePieceProcessor()
    try:
        model.Load(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: cannot read as a sentencepiece model ({reason})") from None
    found = (model.pad_id(), model.unk_id(), model.bos_id(), model.eos_id())
    if special and found != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise DataError(
            f"{path}: special ids pad/unk/bos/eos are {'/'.join(map(str, found))}, expected "
            f"{PAD_ID}/{UNK_ID}/{BOS_ID}/{EOS_ID}; train it with xformer's train_tokenizer"
        )
    return model


def _describe(split: datasets.Dataset) -> str:
    """A name for a split in an error (load_split has already named the file, if any)."""
    return f"split '{split.split}'" if split.split else "the split"

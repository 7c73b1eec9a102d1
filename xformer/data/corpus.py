"""Parallel corpora as `datasets` splits: loading (Hub id, folder or file) and encoding.

`data.dataset` names one of

    a Hub id           "bentrevett/multi30k"      datasets.load_dataset(spec)
    a local folder     JSONL / JSON               train.jsonl val.jsonl test.jsonl
                       TSV with a header line     train.tsv dev.tsv ...
                       parallel plain text        train.de train.en valid.de valid.en ...
                       anything else datasets infers (parquet, csv, ...)
    a local file       corpus.jsonl / .json / .tsv: one split, named after the file stem

Split names in a folder follow datasets' own rules (val/valid/dev -> validation, ...), so a
folder and its Hub twin give the same DatasetDict. Every failure is a DataError with one line
naming the file (or spec) and the problem. Loading goes through datasets' builders, so
splits are Arrow tables memory-mapped from its cache, and encoding is cached alongside them.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import logging
import re
from pathlib import Path

import datasets
import numpy as np
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

from xformer.data.rows import (
    check_columns,
    check_complete,
    check_text_columns,
    count_lines,
    expected,
    first_bad_json_line,
    first_line,
    is_blank,
)
from xformer.data.tokenizer import Tokenizer
from xformer.errors import DataError

_JSON_SUFFIXES = (".jsonl", ".json")
_HUB_HINT = "pass a local copy with --set data.dataset=PATH"
_ENCODED = datasets.Features({
    "src_ids": datasets.Sequence(datasets.Value("int32")),
    "tgt_ids": datasets.Sequence(datasets.Value("int32")),
    "src_len": datasets.Value("int32"),
    "tgt_len": datasets.Value("int32"),
})
_ENCODING_VERSION = "1"  # bump when encode_split's output changes for the same inputs


class _Source:
    """One split's local files and their format: json, tsv or text (parallel plain text)."""

    def __init__(self, name: str, files: list[Path], kind: str):
        self.name, self.files, self.kind = name, files, kind
        self.where = ", ".join(map(str, files)) if len(files) <= 2 else f"{files[0]} (and {len(files) - 1} more)"


def load_corpus(spec: str, fields: list[str], config: str | None = None) -> datasets.DatasetDict:
    """Every split of `spec`, each checked to have the columns `fields` (e.g. ["de", "en"]).
    `config` names a Hub dataset's configuration (wmt14 has "de-en", ...)."""
    sources, _ = _sources(spec, fields)
    if sources is None:
        corpus = _load_whole(spec, config)
        corpus = datasets.DatasetDict({name: _lift_translation(split, fields) for name, split in corpus.items()})
        for name, split in corpus.items():
            check_columns(split, f"{spec} (split '{name}')", fields, "rows")
        return corpus
    return datasets.DatasetDict({name: _load_source(source, fields) for name, source in sources.items()})


def local_files(spec: str, fields: list[str]) -> dict[str, list[Path]] | None:
    """Split name -> the local files it is read from; None for a Hub id (datasets fetches those)."""
    sources, _ = _sources(spec, fields)
    return None if sources is None else {name: source.files for name, source in sources.items()}


def load_split(spec: str, split: str, fields: list[str], config: str | None = None, *, complete: bool = False,
               numeric: tuple[str, ...] = ()) -> datasets.Dataset:
    """One split of `spec`, checked to have the columns `fields`. A single file is its own
    split whatever `split` says, so `--set data.dataset=newstest2014.jsonl` evaluates on it.
    Pairs kept in one nested `translation` column ({"de": ..., "en": ...}, the layout of the
    Hub's wmt14 and iwslt2017) become one column per language.

    `complete`: every row must hold every field as a string (or a number, for the `numeric`
    fields), checked before anything is decoded; the first row that does not is a DataError
    naming its file and line (a row number for the Hub). Evaluation asks for it: a missing
    reference or source would otherwise be scored as an empty sentence."""
    sources, single_file = _sources(spec, fields)
    if sources is None:
        corpus = _load_whole(spec, config)
        if split not in corpus:
            raise DataError(_no_split(spec, split, list(corpus)))
        rows = _lift_translation(corpus[split], fields)
        check_columns(rows, f"{spec} (split '{split}')", fields, "rows")
        if complete:
            check_complete(rows, f"{spec} (split '{split}')", fields, numeric)
        return rows
    if single_file:
        (source,) = sources.values()
    elif split in sources:
        source = sources[split]
    else:
        raise DataError(_no_split(spec, split, list(sources)))
    if not complete or source.kind != "json":
        rows = _load_source(source, fields)
        if complete:
            check_complete(rows, source.where, fields, numeric)
        return rows
    # Line by line, so that every message names its line: syntax and types before datasets
    # reads the file, missing values after it has found the columns (a field absent from
    # every row is better said as one).
    for check in (dict(complete=False), dict(complete=True)):
        for path in source.files:
            problem = first_bad_json_line(path, fields, numeric=numeric, **check)
            if problem:
                raise DataError(problem)
        if not check["complete"]:
            rows = _load_source(source, fields)
    return rows


def encode_split(
    split: datasets.Dataset, tokenizer: Tokenizer, source_lang: str, target_lang: str, *,
    max_len: int | None = None, num_proc: int | None = None,
) -> datasets.Dataset:
    """The split as piece ids: int32 list columns `src_ids`, `tgt_ids` (no BOS/EOS) and int
    columns `src_len`, `tgt_len`; the text columns are dropped. A missing text (null) encodes
    as empty. With `max_len`, pairs empty on either side or longer than max_len pieces on
    either side are dropped.

    The result is cached by datasets under a fingerprint of the split, the tokenizer's model
    bytes and the arguments, so a second run reads it back and a retrained tokenizer
    re-encodes.
    """
    for lang in (source_lang, target_lang):
        if lang not in split.column_names:
            raise DataError(f"split '{split.split}': no field {lang!r} (found: {', '.join(split.column_names)})")
    fingerprint = _fingerprint(split._fingerprint, tokenizer.digest, source_lang, target_lang, _ENCODING_VERSION)
    encoded = split.map(
        _EncodePairs(tokenizer, source_lang, target_lang), batched=True, remove_columns=split.column_names,
        features=_ENCODED, num_proc=num_proc, new_fingerprint=fingerprint, desc=f"Encoding {split.split or ''}",
    )
    if max_len is None:
        return encoded
    kept = encoded.filter(
        _within, fn_kwargs={"max_len": max_len}, batched=True, input_columns=["src_len", "tgt_len"],
        num_proc=num_proc, new_fingerprint=_fingerprint(encoded._fingerprint, "max_len", max_len),
        desc=f"Dropping pairs over {max_len} pieces",
    )
    if len(kept) == len(encoded):
        return encoded
    # filter only writes a list of kept rows; rows read through it come back one Arrow chunk
    # each, so write the kept rows out contiguously (cached too) for the batcher.
    return kept.flatten_indices(num_proc=num_proc, new_fingerprint=_fingerprint(kept._fingerprint, "flat"))


class _EncodePairs:
    """The map function: a class rather than a closure so num_proc workers can pickle it
    (sentencepiece processors pickle as their model bytes)."""

    def __init__(self, tokenizer: Tokenizer, source_lang: str, target_lang: str):
        self.tokenizer, self.source_lang, self.target_lang = tokenizer, source_lang, target_lang

    def __call__(self, batch: dict) -> dict:
        src = self.tokenizer.encode(batch[self.source_lang], "source")
        tgt = self.tokenizer.encode(batch[self.target_lang], "target")
        return {"src_ids": src, "tgt_ids": tgt, "src_len": [len(s) for s in src], "tgt_len": [len(t) for t in tgt]}


def _within(src_len: list[int], tgt_len: list[int], max_len: int) -> list[bool]:
    src, tgt = np.asarray(src_len), np.asarray(tgt_len)
    return ((src > 0) & (tgt > 0) & (src <= max_len) & (tgt <= max_len)).tolist()


def _fingerprint(*parts) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:32]


# -- finding the files ---------------------------------------------------------------------

def _sources(spec: str, fields: list[str]) -> tuple[dict[str, _Source] | None, bool]:
    """The local files of each split and whether `spec` is a single file; None for a Hub id
    or a folder whose format only datasets knows."""
    path = Path(spec).expanduser()
    if path.is_file():
        kind = "json" if path.suffix in _JSON_SUFFIXES else "tsv" if path.suffix == ".tsv" else None
        if kind is None:
            raise DataError(
                f"{path}: unsupported file type {path.suffix!r}, expected .jsonl, .json or .tsv "
                "(parallel plain text goes in a folder as <split>.<lang> files)"
            )
        name = re.sub(r"\W+", "_", path.stem).strip("_") or "data"  # datasets wants \w+ split names
        return {name: _Source(name, [path], kind)}, True
    if path.is_dir():
        return _folder_sources(path, fields), False
    if path.exists():
        raise DataError(f"{path}: neither a file nor a folder")
    if _looks_like_path(spec):
        raise DataError(f"{spec}: no such file or folder")
    return None, False


def _looks_like_path(spec: str) -> bool:
    """A Hub id is 'name' or 'owner/name'; anything else that does not exist was meant as a path."""
    return (spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1
            or Path(spec).suffix in (*_JSON_SUFFIXES, ".tsv"))


def _folder_sources(folder: Path, fields: list[str]) -> dict[str, _Source] | None:
    try:
        split_files = DataFilesDict.from_patterns(get_data_patterns(str(folder)), str(folder))
    except EmptyDatasetError:
        raise DataError(f"{folder}: no data files (expected e.g. train.jsonl, train.tsv or train.{fields[0]})") \
            from None
    except PermissionError as exc:
        raise DataError(f"{folder}: cannot read ({exc.strerror})") from None
    sources = {}
    for split_name, files in split_files.items():
        name, files = str(split_name), [Path(f) for f in files]
        kinds = {
            "json": [f for f in files if f.suffix in _JSON_SUFFIXES],
            "tsv": [f for f in files if f.suffix == ".tsv"],
            "text": [f for f in files if f.suffix[1:] in fields],
        }
        found = [kind for kind, matched in kinds.items() if matched]
        if len(found) > 1:
            names = ", ".join(f.name for kind in found for f in kinds[kind])
            raise DataError(f"{folder}: split '{name}' has files in {len(found)} formats ({names}); keep one")
        if found:
            sources[name] = _Source(name, kinds[found[0]], found[0])
    # No JSON, TSV or parallel text at all: leave the folder to datasets (parquet, csv, ...).
    return sources or None


def _no_split(spec: str, split: str, found: list[str]) -> str:
    aliases = {"val": "validation", "valid": "validation", "dev": "validation", "eval": "test"}
    hint = ""
    if aliases.get(split) in found:
        hint = f"; files named {split}.* load as split '{aliases[split]}'"
    return f"{spec}: no split {split!r} (found: {', '.join(found)}){hint}"


# -- loading -------------------------------------------------------------------------------

def _load_source(source: _Source, fields: list[str]) -> datasets.Dataset:
    for path in source.files:
        if is_blank(path):
            raise DataError(f"{path}: empty, expected {expected(source.kind, fields)}")
    if source.kind == "text":
        split = _load_parallel_text(source, fields)
    else:
        split = _lift_translation(_build(source, fields), fields)
    check_columns(split, source.where, fields, source.kind)
    check_text_columns(split, source.files, source.where, source.kind, fields)
    return split


def _lift_translation(split: datasets.Dataset, fields: list[str]) -> datasets.Dataset:
    """A nested `translation` column holding every field -> one column per field; else as is."""
    if all(f in split.column_names for f in fields) or "translation" not in split.column_names:
        return split
    feature = split.features["translation"]
    languages = getattr(feature, "languages", None) or (list(feature) if isinstance(feature, dict) else [])
    if not all(f in languages for f in fields):
        return split  # check_columns names the missing field
    return split.map(lambda batch: {f: [pair[f] for pair in batch["translation"]] for f in fields},
                     batched=True, remove_columns=["translation"], desc="Flattening translation pairs")


def _build(source: _Source, fields: list[str]) -> datasets.Dataset:
    files = {source.name: [str(f) for f in source.files]}
    if source.kind == "json":
        options = {}
    else:  # Translation text is full of quotes and words like "NA": read every cell verbatim.
        with source.files[0].open(encoding="utf-8", errors="replace") as f:
            header = f.readline().rstrip("\r\n").split("\t")
        options = dict(sep="\t", quoting=csv.QUOTE_NONE, na_filter=False, keep_default_na=False,
                       features=datasets.Features({column: datasets.Value("string") for column in header}))
    try:
        with _datasets_errors_silenced():
            return datasets.load_dataset("csv" if source.kind == "tsv" else "json", data_files=files,
                                         split=source.name, **options)
    except datasets.exceptions.DatasetGenerationError as exc:
        raise DataError(_unreadable(source, exc, fields)) from None
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):  # datasets' words for a split of 0 rows
            raise
        raise DataError(f"{source.where}: empty, expected {expected(source.kind, fields)}") from None


@contextlib.contextmanager
def _datasets_errors_silenced():
    """datasets logs a file it cannot read before raising; the DataError we raise says it in
    one line, so the log line would only repeat it, less clearly."""
    logger = datasets.utils.logging.get_logger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _unreadable(source: _Source, exc: Exception, fields: list[str]) -> str:
    """One line for a file datasets could not read: for JSON, the first bad line found by
    re-reading the files with `json` (only on this failure path, so loading stays cheap)."""
    cause = exc.__cause__ or exc
    if source.kind == "json":
        for path in source.files:
            problem = first_bad_json_line(path, fields)
            if problem:
                return problem
        return f"{source.where}: cannot read as JSON lines ({first_line(cause)})"
    return f"{source.where}: not valid TSV ({first_line(cause)})"


def _load_parallel_text(source: _Source, fields: list[str]) -> datasets.Dataset:
    """`<split>.<lang>` files, one sentence a line, as one column per language."""
    by_lang = {lang: [f for f in source.files if f.suffix == f".{lang}"] for lang in fields}
    present = next(files[0] for files in by_lang.values() if files)
    for lang, files in by_lang.items():
        if not files:
            names = ", ".join(f.name for f in source.files)
            raise DataError(
                f"{present.with_suffix('.' + lang)}: no such file; parallel text needs one file per "
                f"language (found: {names})"
            )
        if len(files) > 1:
            raise DataError(f"{source.where}: {len(files)} .{lang} files for split '{source.name}', expected one")
    columns = []
    for lang, (path,) in by_lang.items():
        try:
            with _datasets_errors_silenced():
                column = datasets.load_dataset("text", data_files={source.name: [str(path)]}, split=source.name)
        except datasets.exceptions.DatasetGenerationError as exc:
            raise DataError(f"{path}: cannot read as UTF-8 text ({first_line(exc.__cause__ or exc)})") from None
        columns.append((path, column.rename_column("text", lang)))
    (first, first_rows), *rest = columns
    for path, rows in rest:
        if len(rows) != len(first_rows):
            raise DataError(
                f"{first}: {count_lines(len(first_rows))} but {path} has {count_lines(len(rows))}; "
                "parallel files must align line by line"
            )
    return datasets.concatenate_datasets([rows for _, rows in columns], axis=1)


def _load_whole(spec: str, config: str | None = None) -> datasets.DatasetDict:
    """A Hub id, or a local folder in a format only datasets knows."""
    local = Path(spec).expanduser().is_dir()
    try:
        return datasets.load_dataset(str(Path(spec).expanduser()) if local else spec, config)
    except Exception as exc:  # network, missing repo, auth, bad files: all the user's to fix
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        if local:
            raise DataError(f"{spec}: cannot load ({reason})") from None
        raise DataError(f"data.dataset: cannot load '{spec}' from the Hugging Face Hub ({reason}); {_HUB_HINT}") \
            from None

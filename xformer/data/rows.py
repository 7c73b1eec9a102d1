"""Checks of a corpus's rows and files, each failure one DataError line naming the file (and
line, where a line-by-line read can find it), what was found and what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from xformer.errors import DataError


def check_text_columns(split: datasets.Dataset, files: list[Path], where: str, kind: str, fields: list[str]) -> None:
    """Each field a column of valid UTF-8 strings (Arrow's JSON reader keeps numbers as numbers
    and passes invalid bytes through, to fail far from the file); one C++ pass a column, and
    only on failure a line-by-line read to name the line."""
    import pyarrow as pa

    for field in fields:
        column = split.data.column(field)
        found = column.type
        problem = None
        if not (pa.types.is_string(found) or pa.types.is_large_string(found) or pa.types.is_null(found)):
            problem = f"field {field!r} holds {found} values, expected strings"
        else:
            try:
                column.validate(full=True)
            except pa.ArrowInvalid as exc:
                problem = f"field {field!r}: {first_line(exc)}"
        if problem:
            lines = [first_bad_json_line(path, fields) for path in files] if kind == "json" else []
            raise DataError(next((line for line in lines if line), f"{where}: {problem}"))


def first_bad_json_line(path: Path, fields: list[str], *, complete: bool = False,
                        numeric: tuple[str, ...] = ()) -> str | None:
    """The first line of a JSON-lines file that is not UTF-8, not JSON, not an object or holds
    a field of the wrong type (missing or null too, when `complete`), as "PATH:LINE: ..."."""
    with path.open("rb") as f:
        first = f.read(4096).lstrip()[:1]
    if first == b"[":
        return None  # one JSON document, not JSON lines: datasets' message is all we have
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start})"
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})"
            if not isinstance(row, dict):
                return f"{path}:{number}: expected a JSON object, found {type(row).__name__}"
            for field in fields:
                value = row.get(field)
                if value is None and complete:
                    return f"{path}:{number}: field {field!r} is {'null' if field in row else 'missing'}, " \
                           f"expected {wanted(field, numeric)}"
                if not (value is None or isinstance(value, str) or is_number(value) and field in numeric):
                    return f"{path}:{number}: field {field!r} is a {type(value).__name__}, " \
                           f"expected {wanted(field, numeric)}"
    return None


def wanted(field: str, numeric: tuple[str, ...]) -> str:
    return "a string or a number" if field in numeric else "a string"


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_complete(split: datasets.Dataset, where: str, fields: list[str], numeric: tuple[str, ...]) -> None:
    """Every row holds every field (what a line-by-line check cannot see: the Hub, TSV, text)."""
    for field in fields:
        for index, value in enumerate(split[field]):
            if value is None or not (isinstance(value, str) or is_number(value) and field in numeric):
                found = "null" if value is None else f"a {type(value).__name__}"
                raise DataError(f"{where}: row {index + 1}: field {field!r} is {found}, "
                                f"expected {wanted(field, numeric)}")


def check_columns(split: datasets.Dataset, where: str, fields: list[str], kind: str) -> None:
    if len(split) == 0:
        raise DataError(f"{where}: empty, expected {expected(kind, fields)}")
    for field in fields:
        if field not in split.column_names:
            raise DataError(f"{where}: no field {field!r} (found: {', '.join(split.column_names)})")


def expected(kind: str, fields: list[str]) -> str:
    named = ", ".join(fields)
    return {
        "json": f"JSONL lines with fields {named}",
        "tsv": f"a header line naming the columns ({named}) and tab-separated rows",
        "text": "one sentence a line",
    }.get(kind, f"rows with fields {named}")


def is_blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (it stops reading at the first text)."""
    try:
        with path.open("rb") as f:
            return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None


def count_lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__

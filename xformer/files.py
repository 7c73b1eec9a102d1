"""Writing files so that a reader never sees half of one: a temporary file (or folder) in the
same folder, renamed over the target (atomic on POSIX and Windows)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None], *, previous: str | Path | None = None) -> None:
    """Call write(tmp) on a temporary path beside `path`, then rename it to `path`. With
    `previous`, the file `path` held is renamed to `previous` first, once the new one is
    complete: a kill between the two renames leaves `previous`, never nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a run directory is often shared
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if exc.filename is None or ".tmp" not in str(exc.filename):
            raise
        # the temporary file is ours, not the user's: the error names the file being written
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_folder(folder: str | Path, fill: Callable[[Path], None]) -> Path:
    """Call fill(staging) on a new temporary folder beside `folder` (which must be missing or
    empty), then rename it to `folder`: a reader, or a kill, never finds it half-written."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        fill(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes 0700
        if folder.exists():
            folder.rmdir()  # empty, or this refuses
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def finite_json(value, *, indent: int | None = None) -> str:
    """JSON that every reader parses: a NaN or infinite number (a diverged loss, say) is written
    as null, and each dict holding one gains "nonfinite": {key: "nan" | "inf" | "-inf"}, saying
    which values were not numbers and what they were (json.dumps would write bare NaN)."""
    return json.dumps(_finite(value), indent=indent, ensure_ascii=False, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        bad = {k: str(v).lower() for k, v in value.items() if isinstance(v, float) and not math.isfinite(v)}
        out = {k: _finite(v) for k, v in value.items()}
        return {**out, "nonfinite": {**out.get("nonfinite", {}), **bad}} if bad else out
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


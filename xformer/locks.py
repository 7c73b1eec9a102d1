"""One writer a folder at a time: an exclusive lock on FOLDER/.lock for as long as a command
writes to a run (train, distill, average) or a grid (experiment, longrange).

The lock is fcntl.flock on an open file, so the operating system releases it when the holder
dies, SIGKILL included: a stale .lock file never blocks anyone, and is never deleted (deleting
it would let a third process lock a fresh inode while the second still holds the old one). The
holder writes its pid, host, command and start time into the file, for the refusal message.
Readers (eval, translate, inspect-heads) take no lock; `holder(folder)` tells them a run is
still being written, so they can say so. Where fcntl is missing (Windows) nothing is locked.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from xformer.errors import RunError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK = ".lock"


class FolderLock:
    """`with FolderLock(folder, "train"):` holds FOLDER/.lock or raises RunError at once, naming
    the process that holds it. A folder created only to hold the lock is removed again on exit
    when nothing else was written into it."""

    def __init__(self, folder: str | Path, command: str):
        self.folder, self.command = Path(folder), command
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> FolderLock:
        if fcntl is None:
            return self
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found = _read(fd)
                os.close(fd)
                raise _refusal(self.folder, found) from None
            try:
                if os.stat(self.folder / LOCK).st_ino == os.fstat(fd).st_ino:
                    break  # the file still at the path: not one a leaving holder just removed
            except FileNotFoundError:
                pass
            os.close(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "argv": [Path(sys.argv[0]).name, *sys.argv[1:]], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        if self._created and {p.name for p in self.folder.iterdir()} == {LOCK}:
            (self.folder / LOCK).unlink()  # still held: nobody else can have it
            os.close(self._fd)
            self._fd = None
            try:
                self.folder.rmdir()
            except OSError:
                pass
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing releases the lock
        self._fd = None


def holder(folder: str | Path) -> dict | None:
    """The record of the process writing to `folder` now ({"pid", "host", "command", ...}), or
    None when nobody holds its lock."""
    path = Path(folder) / LOCK
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_free(folder: str | Path) -> None:
    """Raise the refusal FolderLock would raise when another process writes to `folder` (a
    read-only check, for before the folder may be created)."""
    found = holder(folder)
    if found is not None:
        raise _refusal(Path(folder), found)


def _refusal(folder: Path, found: dict | None) -> RunError:
    return RunError(f"{folder}: {describe(found)} is writing to it; wait until it ends or stop it "
                    "(nothing was changed here)")


def describe(record: dict | None) -> str:
    """'xformer train (pid 123 on host, since ...)' for a lock record."""
    if not record:
        return "another process"
    return (f"xformer {record.get('command', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}, "
            f"since {record.get('started', '?')})")


def _read(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        return None

"""An experiment's wall time, kept across the sittings it takes (a stop, a resume, another
machine), so the ledger can say what each claim cost to measure.

OUT/sittings.json lists one entry per `xformer experiment` call that got to work: when it
started, the seconds it has run so far, --jobs, the cores and CPU it had, and how it ended
("finished", "stopped", or null while running or when the process was killed: its seconds then
stand at the last run that started or ended). Runs copied by --reuse cost no time here, nor
does the time the call stood stopped (`kill -STOP` while a test suite runs; the experiment
passes a clock that leaves it out, xformer.training.pauses).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from xformer.files import atomic_write_text
from xformer.training.run_card import cpu_name

SITTINGS = "sittings.json"


class Sitting:
    """This call's entry in OUT/sittings.json, written at most every `every` seconds (tick) and
    when the call ends (end)."""

    def __init__(self, out_dir: Path, jobs: int, *, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.every, self.clock = Path(out_dir) / SITTINGS, every, clock
        self.start, self.written = clock(), None
        self.entry = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": 0.0,
                      "jobs": jobs, "cores": os.cpu_count(), "cpu": cpu_name(), "ended": None}

    def tick(self) -> None:
        if self.written is None or self.clock() - self.written >= self.every:
            self._write()

    def end(self, how: str) -> None:
        """Record how the call ended; a call refused before its first event leaves no entry."""
        self.entry["ended"] = how
        if self.written is not None or how == "finished":
            self._write()

    def _write(self) -> None:
        now = self.clock()
        self.entry["seconds"] = round(now - self.start, 1)
        earlier = [s for s in read_sittings(self.path.parent) if s["started"] != self.entry["started"]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps([*earlier, self.entry], indent=2) + "\n")
        self.written = now


def read_sittings(folder: Path) -> list[dict]:
    path = Path(folder) / SITTINGS
    return json.loads(path.read_text()) if path.is_file() else []


def merge_sittings(src: Path, dest: Path) -> None:
    """Add SRC's sittings to DEST's (the folders' sittings.json), each sitting once: an archive
    and the experiment folder it is restored into each keep every machine's."""
    theirs, mine = read_sittings(src), read_sittings(dest)
    by_start = {}
    for sitting in [*mine, *theirs]:  # the same sitting in both: the copy that ran longer is the later one
        kept = by_start.get(sitting["started"])
        if kept is None or sitting["seconds"] > kept["seconds"]:
            by_start[sitting["started"]] = sitting
    if theirs and list(by_start.values()) != mine:
        Path(dest).mkdir(parents=True, exist_ok=True)
        merged = sorted(by_start.values(), key=lambda s: s["started"])
        atomic_write_text(Path(dest) / SITTINGS, json.dumps(merged, indent=2) + "\n")


def wall_time(folder: Path) -> dict | None:
    """The experiment's wall time over its sittings: {"minutes", "sittings", "jobs", "cores",
    "cpus"}; None where none were recorded (experiments run before sittings were kept)."""
    sittings = read_sittings(folder)
    if not sittings:
        return None
    return {"minutes": round(sum(s["seconds"] for s in sittings) / 60, 1), "sittings": len(sittings),
            "jobs": sorted({s["jobs"] for s in sittings}), "cores": sorted({s["cores"] for s in sittings}),
            "cpus": sorted({s["cpu"] for s in sittings})}

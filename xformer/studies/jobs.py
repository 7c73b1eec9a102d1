"""Processes side by side (`xformer experiment --jobs`, `xformer bench quality --jobs`): each a
fresh interpreter with its stderr in a log file, started, polled and stopped as one set, so no
stop signal or failure leaves one running with nothing to read it.

    jobs = Jobs()
    jobs.start(key, [sys.executable, "-m", "xformer.studies.experiment", fields], log, env)
    for job in jobs.ended():      # those that exited since the last call
        if job.process.returncode != 0: raise RunError(f"...: {job.last_line()}; see {job.log}")
    jobs.stop()                    # SIGTERM to the rest, each then stops as `xformer train` does

What a failure means is the caller's: the experiment stops at the first, the benchmark lets the
runs in flight finish.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """A process in flight: what the caller calls it, the process, its stderr's file."""

    key: object
    process: subprocess.Popen
    log: Path
    began: float = field(default_factory=time.perf_counter)

    def last_line(self) -> str:
        """The last non-blank line of its stderr (the error a failed run ended with), else its exit status."""
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        lines = [x for x in text.splitlines() if x.strip()]
        return lines[-1] if lines else f"exit status {self.process.returncode}"


class Jobs:
    """The processes in flight, by key."""

    def __init__(self) -> None:
        self._running: dict[object, Job] = {}

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._running.values()))

    def start(self, key: object, argv: list[str], log: Path, env: dict, *, append: bool = False) -> Job:
        """Start `argv` with `env`, its stdout discarded and its stderr written to `log`
        (appended to, with `append`: a run resumed across calls keeps one log)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a" if append else "w") as stderr:  # the child keeps its own descriptor
            process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        job = self._running[key] = Job(key, process, log)
        return job

    def ended(self) -> list[Job]:
        """The jobs that have exited since the last call, no longer in flight."""
        done = [job for job in self._running.values() if job.process.poll() is not None]
        for job in done:
            del self._running[job.key]
        return done

    def stop(self) -> None:
        """SIGTERM to every job still running, then wait for them all; none is left in flight."""
        for job in self._running.values():
            if job.process.poll() is None:
                job.process.send_signal(signal.SIGTERM)
        for job in self._running.values():
            job.process.wait()
        self._running.clear()

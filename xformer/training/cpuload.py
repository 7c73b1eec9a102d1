"""How much of the CPU other processes took while xformer timed something.

A speed measured while another job runs on the same cores is slower without saying so (on a
2-core machine a test suite beside a training run halves both). Every timing xformer records
(training steps, decoding, classifying) carries `others_cpu`: the mean number of cores that other
processes (and the hypervisor, as steal time) kept busy beyond the ones this process left idle,
read from /proc/stat over the CPUs this process may run on. 0 on a quiet machine; None where
/proc/stat is not there (macOS, Windows), the timing lasted under a second, or the run trained
in several processes (torch.distributed: the others are its own).

    cores allowed   A = len(os.sched_getaffinity(0))
    spare           A - torch.get_num_threads()        (cores this process does not try to use)
    others          busy(A) + steal(A) - this process's CPU time
    others_cpu      max(0, others - spare * wall) / wall
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")
BUSY_OVER = 0.25  # cores: a timing with more taken by others was made on a busy machine
# /proc/stat counts in clock ticks (10 ms a CPU): below a second a few stray ticks read as a
# busy machine, so shorter timings say nothing (a speed that short says little anyway)
MIN_SECONDS = 1.0


def _allowed_cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds spent on `cpus` by anything (user, nice, system, irq, softirq, steal) since boot."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The CPU other processes took from this one, span by span: `take()` returns the seconds
    of CPU taken since the last take (or since creation) and starts the next span."""

    def __init__(self):
        self.cpus = _allowed_cpus()
        self.available = _busy_seconds(self.cpus) is not None
        self._start()

    def _start(self) -> None:
        self._busy, self._own, self._wall = _busy_seconds(self.cpus), time.process_time(), time.perf_counter()

    def take(self) -> float:
        """Seconds of CPU that others used beyond this process's spare cores (0.0 when unknown)."""
        busy, own, wall = _busy_seconds(self.cpus), time.process_time(), time.perf_counter()
        taken = 0.0
        if busy is not None and self._busy is not None:
            spare = max(0, len(self.cpus) - torch.get_num_threads())
            others = (busy - self._busy) - (own - self._own)
            taken = max(0.0, others - spare * (wall - self._wall))
        self._busy, self._own, self._wall = busy, own, wall
        return taken

    def cores(self) -> float | None:
        """Mean cores taken by others since the last take; None where not measurable, or when
        the span was shorter than MIN_SECONDS. Starts the next span."""
        wall = time.perf_counter() - self._wall
        taken = self.take()
        return taken / wall if self.available and wall >= MIN_SECONDS else None


def busy(others_cpu: float | None) -> bool:
    """Whether a timing was made while other processes took more than BUSY_OVER cores."""
    return others_cpu is not None and others_cpu > BUSY_OVER

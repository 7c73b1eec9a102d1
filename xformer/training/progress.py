"""What a training run carries from step to step and across a resume: its Progress, the open
log line of metrics.jsonl, and the signals that stop it at a step boundary.

Everything here is checkpointed at a step boundary, so a run killed at any moment and resumed
from its last checkpoint writes the metrics.jsonl an uninterrupted run writes (the timing
fields `seconds` and `tokens_per_s` aside, and with train.log_seconds = 0: a line placed by
the clock depends on the machine's speed, resumed or not).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xformer.files import atomic_write_text, finite_json


@dataclass
class Progress:
    """Everything that must survive a resume besides tensors."""

    step: int = 0
    epoch: int = 0  # 0-based epoch in progress
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    seconds: float = 0.0
    paused_seconds: float = 0.0  # stopped (SIGSTOP, Ctrl-Z), left out of every time here (xformer.training.pauses)
    compute_seconds: float = 0.0
    data_seconds: float = 0.0
    loop_seconds: float = 0.0
    others_cpu_seconds: float = 0.0  # CPU other processes took from this run (xformer.training.cpuload)
    tokens: int = 0
    skipped_steps: int = 0  # steps whose loss or gradients were not finite, so not taken
    peak_memory_mb: float = 0.0
    best: dict | None = None
    bad_validations: int = 0
    kept: list[str] = field(default_factory=list)  # step checkpoints, oldest first
    history: list[dict] = field(default_factory=list)
    log_line: dict = field(default_factory=dict)  # the sums of the log line still open (LogLine.state)
    # a wsd run's cooldown, frozen when it starts (steps; 0: not started) and the limit it ends by
    decay_start: int = 0
    decay_end: int = 0
    decay_limit: str = ""
    regularisation: dict | None = None  # what train.regularisation = "budget" chose, and why (xformer.training.budget)


class LogLine:
    """The sums behind the next `train` line of metrics.jsonl. Losses and skip counts stay on
    the device (no host sync per step); `state` reads them at a checkpoint, and a resumed run
    continues the line from there rather than starting a shorter one."""

    def __init__(self, device: torch.device, saved: dict | None = None, timer: Callable[[], float] = time.perf_counter):
        saved = saved or {}

        def tensor(key: str) -> torch.Tensor:
            return torch.tensor(float(saved.get(key, 0.0)), dtype=torch.float32, device=device)

        self.loss, self.skipped, self.skipped_units = tensor("loss"), tensor("skipped"), tensor("skipped_units")
        self.skipped_run = tensor("skipped_run")  # consecutive skips
        self.units, self.tokens = int(saved.get("units", 0)), int(saved.get("tokens", 0))
        self.started = timer() - float(saved.get("seconds", 0.0))  # `timer`: the clock `now` is read from

    def add(self, step_loss: torch.Tensor, skipped: torch.Tensor, units: int, tokens: int) -> None:
        """One optimizer step: its summed loss, 1.0 if it was skipped (not finite), its sizes."""
        self.loss = self.loss + torch.where(skipped.bool(), 0.0, step_loss)
        self.units += units
        self.tokens += tokens
        self.skipped, self.skipped_units = self.skipped + skipped, self.skipped_units + skipped * units
        self.skipped_run = (self.skipped_run + skipped) * skipped  # 0 after a taken step

    def due(self, step: int, every: int, seconds: float, now: float) -> bool:
        """By steps, and by time so that a slow machine shows a first line within a minute."""
        return step % every == 0 or bool(seconds and now - self.started >= seconds)

    def close(self, now: float) -> tuple[dict, int]:
        """The line's fields (loss None when every step was skipped) and its skip count; the
        sums start again."""
        taken = self.units - float(self.skipped_units)
        fields = {"loss": float(self.loss) / taken if taken else None,
                  "tokens_per_s": self.tokens / max(now - self.started, 1e-9)}
        skipped = int(self.skipped)
        self.loss, self.skipped, self.skipped_units = (torch.zeros_like(self.loss) for _ in range(3))
        self.units, self.tokens, self.started = 0, 0, now
        return fields, skipped

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (a validation, a checkpoint) out of the line's tokens/s."""
        self.started += seconds

    def state(self, now: float) -> dict:
        return {"loss": float(self.loss), "skipped": float(self.skipped),
                "skipped_units": float(self.skipped_units), "skipped_run": float(self.skipped_run),
                "units": self.units, "tokens": self.tokens, "seconds": now - self.started}


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(finite_json(record) + "\n")


def truncate_metrics(path: Path, step: int) -> tuple[list[dict], int]:
    """On resume, drop records logged after the checkpoint (they are about to be redone) and a
    line cut short by a kill. Returns the records kept and the last step the file held (-1:
    none), which a run's trackers were sent as well (xformer.training.trackers)."""
    keep, logged_to = [], -1
    if path.is_file():
        lines = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
                logged_to = max(logged_to, record["step"])
                if record["step"] <= step:
                    keep.append(record)
                    lines.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        atomic_write_text(path, "".join(line + "\n" for line in lines))
    return keep, logged_to


# Ctrl-C, `kill`, and a closed terminal or dropped ssh session (SIGHUP, where the OS has it)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopSignals:
    """Ctrl-C / SIGTERM / SIGHUP during training: finish the current step, checkpoint, stop,
    so that --resume continues exactly. A second signal acts at once (the default handler).
    Nested (a run inside an experiment's grid), the signal reaches the enclosing StopSignals as
    well, so the grid stops after the run and a second signal still acts at once."""

    def __init__(self):
        self.received: list[int] = []
        self.previous = {}

    @property
    def name(self) -> str:
        """The first signal received, e.g. 'SIGTERM'; '' when none was."""
        return signal.Signals(self.received[0]).name if self.received else ""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received.append(signum)
        previous = self.previous[signum]
        signal.signal(signum, previous)
        if isinstance(getattr(previous, "__self__", None), StopSignals):
            previous(signum, frame)  # an enclosing stop (a grid of runs) learns of it too: it stops after this run

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

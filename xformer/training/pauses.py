"""The time a run's process stood stopped (SIGSTOP or Ctrl-Z, then SIGCONT), left out of its
clocks: a run paused for half an hour while a test suite runs should neither spend half an hour
of its time budget nor report half an hour of training.

A stop cannot be caught, but it shows twice: a thread that wakes every quarter second finds a
gap in its own wake-ups, and the process receives SIGCONT when it goes on. A gap counts as a
pause only when a SIGCONT landed inside it (or within SLACK seconds after it: the Python-level
handler runs when the main thread next executes bytecode), so a thread merely starved of the
CPU or the GIL is not mistaken for one. Short stops (under LEAST seconds) are not looked for.
A continuation handled before the thread has seen its gap waits for it; one handled within
SLACK of an unconfirmed starved gap would be taken for that one's (the stop then goes uncounted).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

TICK = 0.25  # seconds between the thread's wake-ups
LEAST = 1.0  # a gap this much longer than a tick is a candidate
SLACK = 5.0  # how late after a gap its SIGCONT may be handled


def settle(gaps: list[tuple[float, float]], continued: list[float], tick: float = TICK) -> tuple[float, int]:
    """The seconds stopped in `gaps` (the thread's (last wake-up, next wake-up) around each long
    silence) that a SIGCONT in `continued` confirms, and how many such gaps. A continuation
    confirms the latest gap that began before it, if it came no later than SLACK after that gap
    ended; both leave their lists, the rest stay for later."""
    seconds, found = 0.0, 0
    for when in list(continued):
        candidates = [gap for gap in gaps if gap[0] < when <= gap[1] + SLACK]
        if not candidates:
            continue
        before, after = max(candidates)
        seconds += max(0.0, after - before - tick)  # the stop began within a tick of `before`
        found += 1
        gaps.remove((before, after))
        continued.remove(when)
    return seconds, found


class Pauses:
    """`with Pauses() as pauses:` watches the process for stops; `pauses.seconds` is the time
    stopped so far and `pauses.leave_out(clock)` a clock that does not advance while stopped.
    Off the main thread (where no signal handler can be set) nothing is found: 0 seconds."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now  # real seconds; the clocks given to leave_out may be others (tests inject them)
        self.stops = 0
        self._seconds = 0.0
        self._gaps: list[tuple[float, float]] = []
        self._continued: list[float] = []
        self._lock = threading.RLock()  # the SIGCONT handler may run while the main thread holds it
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous = None

    @property
    def seconds(self) -> float:
        with self._lock:
            seconds, found = settle(self._gaps, self._continued)
            self._seconds += seconds
            self.stops += found
            return self._seconds

    def leave_out(self, clock: Callable[[], float]) -> Callable[[], float]:
        """`clock` minus the seconds stopped."""
        return lambda: clock() - self.seconds

    def __enter__(self) -> Pauses:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCONT"):
            self._previous = signal.signal(signal.SIGCONT, self._continue)
            signal.siginterrupt(signal.SIGCONT, False)  # blocking calls in C code restart, as with no handler
            self._thread = threading.Thread(target=self._watch, name="xformer-pauses", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        last = self.now()
        while not self._quit.wait(TICK):
            now = self.now()
            if now - last > TICK + LEAST:
                with self._lock:
                    self._gaps.append((last, now))
            last = now

    def _continue(self, signum, frame) -> None:
        with self._lock:
            self._continued.append(self.now())
        if callable(self._previous):  # an enclosing handler (another run's watch) hears it too
            self._previous(signum, frame)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._quit.set()
            self._thread.join()
            signal.signal(signal.SIGCONT, self._previous if self._previous is not None else signal.SIG_DFL)
            signal.siginterrupt(signal.SIGCONT, False)
            self._thread = None

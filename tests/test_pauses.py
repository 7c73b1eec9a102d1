"""The time a run stood stopped (SIGSTOP, then SIGCONT) left out of its clocks
(xformer.training.pauses): the matching of gaps to continuations, a real stop of a real
process, and the trainer's times with the stops taken out, carried across a resume."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import launch, train_command
from tests.test_kill import TINY as PROCESS_TINY
from tests.test_train import tiny_recipe
from xformer.train import run
from xformer.training import pauses as pauses_module
from xformer.training.pauses import SLACK, TICK, Pauses, settle


def test_a_gap_counts_only_with_a_continuation_inside_it_or_just_after_it():
    gaps = [(10.0, 20.0), (30.0, 31.5), (50.0, 60.0)]
    continued = [19.0, 60.0 + SLACK - 1]  # the second handled late, within the slack
    seconds, found = settle(gaps, continued, tick=0.25)
    assert found == 2 and seconds == pytest.approx((20 - 10 - 0.25) + (60 - 50 - 0.25))
    assert gaps == [(30.0, 31.5)] and continued == []  # a starved thread's gap with no SIGCONT: not a pause
    assert settle(gaps, [31.5 + SLACK + 1]) == (0.0, 0)  # too late to be this gap's
    gaps, continued = [(0.0, 5.0), (6.0, 9.0)], [8.0]
    assert settle(gaps, continued, tick=0.0) == (3.0, 1) and gaps == [(0.0, 5.0)]  # the gap it fell in


def test_two_stops_each_confirmed_by_their_own_continuation():
    gaps, continued = [(0.0, 5.0), (6.0, 9.0)], [9.0, 4.0]
    assert settle(gaps, continued, tick=0.0) == (8.0, 2) and gaps == [] and continued == []


CHILD = """
import sys, time
from xformer.training.pauses import Pauses
with Pauses() as pauses:
    print("ready", flush=True)
    sys.stdin.readline()
    time.sleep(1.0)  # a few wake-ups after the stop
    print(pauses.seconds, pauses.stops, flush=True)
"""


def test_a_real_stop_of_the_process_is_counted():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(2 * TICK)
        began = time.perf_counter()
        child.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        child.send_signal(signal.SIGCONT)
        stopped = time.perf_counter() - began
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    seconds, stops = out.split()
    assert int(stops) == 1
    assert stopped - TICK - 0.1 <= float(seconds) <= stopped + 1.0


class FakePauses(Pauses):
    """Reports `stopped[0]` seconds, as if the process had stood stopped that long."""

    stopped = [0.0]

    @property
    def seconds(self) -> float:
        return self.stopped[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def steady_clock(monkeypatch):
    """The trainer's clock, a second a reading, and the seconds FakePauses says it stood stopped
    (the clock runs on through a stop)."""
    from xformer import train as trainer

    def install():
        readings = iter(range(10**6))
        monkeypatch.setattr(trainer, "clock", lambda: float(next(readings)) + FakePauses.stopped[0])
        FakePauses.stopped = [0.0]
    monkeypatch.setattr(trainer, "Pauses", FakePauses)
    return install


def test_the_trainer_leaves_the_stopped_seconds_out_and_a_resume_keeps_them(corpus, tmp_path, steady_clock):
    extra = ["train.max_steps=8", "train.valid_every=4", "train.log_every=1", "train.log_seconds=0"]
    steady_clock()
    straight = run(tiny_recipe(corpus, *extra), tmp_path / "a", device="cpu")
    assert straight.paused_seconds == 0.0

    def stop_at_3(kind, payload):
        if kind in ("tick", "step") and payload["step"] == 3:
            FakePauses.stopped[0] = 100.0

    steady_clock()
    stopped = run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", on_event=stop_at_3)
    assert stopped.paused_seconds == 100.0
    assert stopped.train_seconds == straight.train_seconds  # the clock ran 100 s further: left out
    seconds = [json.loads(line)["seconds"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < b - a < 100 for a, b in itertools.pairwise(seconds)), seconds  # no log line holds the stop

    def interrupt_at_6(kind, payload):
        stop_at_3(kind, payload)
        if kind in ("tick", "step") and payload["step"] == 5:
            os.kill(os.getpid(), signal.SIGINT)

    steady_clock()
    assert run(tiny_recipe(corpus, *extra), tmp_path / "c", device="cpu", on_event=interrupt_at_6).steps == 6
    steady_clock()  # a new process: nothing stopped in it
    resumed = run(tiny_recipe(corpus, *extra), tmp_path / "c", device="cpu", resume=True)
    assert resumed.steps == 8 and resumed.paused_seconds == 100.0
    assert json.loads((tmp_path / "c" / "train.json").read_text())["paused_seconds"] == 100.0


def test_a_training_process_stopped_and_continued_reports_the_stop(corpus, tmp_path):
    """`kill -STOP`, three seconds, `kill -CONT`, then SIGTERM: train.json says how long the run
    stood stopped, and its train_seconds do not hold them."""
    out = tmp_path / "r"
    began = time.perf_counter()
    process = launch(train_command(PROCESS_TINY, corpus, out, "train.max_steps=100000", "train.log_every=1",
                                   "train.valid_every=100000"))
    metrics = out / "metrics.jsonl"

    def lines() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 300
        while lines() < n:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.01)

    try:
        wait_for(1)
        stop = time.perf_counter()
        process.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        process.send_signal(signal.SIGCONT)
        stopped = time.perf_counter() - stop
        wait_for(lines() + 2)  # it trains on
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=300)
    finally:
        process.kill()
    wall = time.perf_counter() - began
    result = json.loads((out / "train.json").read_text())
    assert result["stop_reason"] == "interrupted"
    assert stopped - pauses_module.TICK - 0.1 <= result["paused_seconds"] <= stopped + 1.0
    assert result["train_seconds"] <= wall - result["paused_seconds"]

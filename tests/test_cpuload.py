"""The CPU other processes take while xformer times something: a real competing process is
seen, this process's own work is not, and a machine without /proc/stat says it cannot tell."""

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.test_train import tiny_recipe
from xformer import cpuload
from xformer.cpuload import OtherLoad, busy
from xformer.train import run

pytestmark = pytest.mark.skipif(not cpuload.PROC_STAT.is_file(), reason="/proc/stat is Linux's")


@pytest.fixture
def every_core_mine():
    """This process claims every allowed core, so nothing others do is on spare cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(len(cpuload._allowed_cpus()))
    yield
    torch.set_num_threads(before)


def quiet_span(seconds: float = 1.0) -> float:
    meter = OtherLoad()
    time.sleep(seconds)
    return meter.cores()


def test_a_competing_process_is_counted(every_core_mine):
    background = quiet_span()  # whatever else this machine runs already
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        meter = OtherLoad()
        time.sleep(2.0)
        crowded = meter.cores()
    finally:
        spinner.kill()
        spinner.wait()
    assert crowded > background + 0.5  # one spinning core, less what the clock ticks lose
    assert busy(crowded)


def test_this_process_own_work_is_not_counted(every_core_mine):
    background = quiet_span()
    meter = OtherLoad()
    stop = time.perf_counter() + 2.0
    while time.perf_counter() < stop:  # a whole core of this process's own
        pass
    assert meter.cores() < background + 0.5


def test_cores_left_spare_absorb_what_others_use():
    if len(cpuload._allowed_cpus()) < 2:
        pytest.skip("needs two cores")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a core or more left spare for the spinner
    try:
        background = quiet_span()
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            meter = OtherLoad()
            time.sleep(2.0)
            assert meter.cores() < background + 0.5
        finally:
            spinner.kill()
            spinner.wait()
    finally:
        torch.set_num_threads(before)


def test_a_run_trained_beside_spinning_processes_records_them(corpus, tmp_path, every_core_mine):
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cpuload._allowed_cpus()]
    try:
        time.sleep(0.3)
        result = run(tiny_recipe(corpus, "train.max_steps=20", "train.valid_every=10"), tmp_path / "r", device="cpu")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert result.train_seconds >= cpuload.MIN_SECONDS and busy(result.others_cpu)
    assert json.loads((tmp_path / "r" / "train.json").read_text())["others_cpu"] == result.others_cpu


def test_a_span_too_short_for_the_clock_ticks_says_nothing():
    meter = OtherLoad()
    time.sleep(0.1)
    assert meter.cores() is None  # ten ticks a CPU at most: a stray one would read as 0.1 cores
    assert meter.available


def test_without_proc_stat_nothing_is_claimed(monkeypatch, tmp_path):
    monkeypatch.setattr(cpuload, "PROC_STAT", tmp_path / "absent")
    meter = OtherLoad()
    assert not meter.available and meter.cores() is None and meter.take() == 0.0
    assert not busy(None)

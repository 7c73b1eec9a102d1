"""Processes side by side (xformer/studies/jobs.py), with real child interpreters."""

import sys
import time

from xformer.studies.jobs import Jobs


def _wait_for(jobs: Jobs, n: int, timeout: float = 60.0) -> list:
    ended, deadline = [], time.monotonic() + timeout
    while len(ended) < n and time.monotonic() < deadline:
        ended += jobs.ended()
        time.sleep(0.05)
    return ended


def test_an_ended_job_leaves_the_set_with_its_exit_status_and_its_stderrs_last_line(tmp_path):
    jobs = Jobs()
    jobs.start("ok", [sys.executable, "-c", "import sys; print('working', file=sys.stderr)"], tmp_path / "ok.log", {})
    jobs.start("bad", [sys.executable, "-c", "import sys; print('first', file=sys.stderr); "
                                             "print('data.max_tokens: expected > 0', file=sys.stderr); sys.exit(2)"],
               tmp_path / "logs" / "bad.log", {})
    ended = {job.key: job for job in _wait_for(jobs, 2)}
    assert len(jobs) == 0 and set(ended) == {"ok", "bad"}
    assert ended["ok"].process.returncode == 0 and ended["bad"].process.returncode == 2
    assert ended["bad"].last_line() == "data.max_tokens: expected > 0"
    assert jobs.ended() == []  # each is reported once


def test_a_job_that_writes_nothing_is_reported_by_its_exit_status(tmp_path):
    jobs = Jobs()
    jobs.start("quiet", [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "quiet.log", {})
    (job,) = _wait_for(jobs, 1)
    assert job.last_line() == "exit status 3"


def test_stop_ends_every_job_in_flight_and_leaves_none(tmp_path):
    jobs = Jobs()
    sleepers = [jobs.start(i, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / f"{i}.log", {})
                for i in range(2)]
    assert len(jobs) == 2 and all(job.process.poll() is None for job in jobs)
    jobs.stop()
    assert len(jobs) == 0 and all(job.process.poll() is not None for job in sleepers)


def test_append_keeps_what_an_earlier_call_logged_and_a_new_log_starts_empty(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("the first sitting\n")
    jobs = Jobs()
    jobs.start("a", [sys.executable, "-c", "import sys; print('the second', file=sys.stderr)"], log, {}, append=True)
    _wait_for(jobs, 1)
    assert log.read_text().splitlines() == ["the first sitting", "the second"]
    jobs.start("b", [sys.executable, "-c", "import sys; print('alone', file=sys.stderr)"], log, {})
    _wait_for(jobs, 1)
    assert log.read_text().splitlines() == ["alone"]

"""An experiment's wall time across sittings (xformer.studies.sittings), with an injected clock."""

import json

from xformer.studies.sittings import SITTINGS, Sitting, merge_sittings, wall_time


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_sitting_is_written_at_its_first_event_then_at_most_every_interval_and_at_its_end(tmp_path):
    clock = Clock()
    sitting = Sitting(tmp_path, jobs=2, every=60, clock=clock)
    assert not (tmp_path / SITTINGS).exists()
    clock.now += 5
    sitting.tick()
    assert json.loads((tmp_path / SITTINGS).read_text())[0]["seconds"] == 5.0
    clock.now += 30
    sitting.tick()  # inside the interval: not written
    assert json.loads((tmp_path / SITTINGS).read_text())[0]["seconds"] == 5.0
    clock.now += 40
    sitting.tick()
    assert json.loads((tmp_path / SITTINGS).read_text())[0]["seconds"] == 75.0
    clock.now += 1
    sitting.end("stopped")
    [entry] = json.loads((tmp_path / SITTINGS).read_text())
    assert (entry["seconds"], entry["ended"], entry["jobs"]) == (76.0, "stopped", 2)


def test_a_call_refused_before_its_first_event_leaves_no_sitting(tmp_path):
    Sitting(tmp_path, jobs=1, clock=Clock()).end("stopped")
    assert not (tmp_path / SITTINGS).exists()


def test_sittings_add_up_and_merge_across_folders_each_once(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    for folder, started, seconds in ((here, "2026-01-01T00:00:00+00:00", 600.0),
                                     (there, "2026-01-02T00:00:00+00:00", 1200.0)):
        folder.mkdir()
        (folder / SITTINGS).write_text(json.dumps([{"started": started, "seconds": seconds, "jobs": 2, "cores": 2,
                                                    "cpu": "x", "ended": "stopped"}]))
    assert wall_time(tmp_path / "nowhere") is None
    merge_sittings(there, here)
    merge_sittings(there, here)  # again: nothing added twice
    merge_sittings(here, there)
    for folder in (here, there):
        wall = wall_time(folder)
        assert (wall["minutes"], wall["sittings"], wall["jobs"], wall["cores"]) == (30.0, 2, [2], [2])


def test_an_older_copy_of_a_sitting_never_replaces_a_later_one(tmp_path):
    """An archive committed mid-run holds a sitting at the seconds it had then; restored into the
    experiment's folder, where the same sitting ran on, it must not take those seconds back."""
    archive, out = tmp_path / "archive", tmp_path / "out"
    started = "2026-01-01T00:00:00+00:00"
    for folder, seconds, ended in ((archive, 600.0, None), (out, 4800.0, "finished")):
        folder.mkdir()
        (folder / SITTINGS).write_text(json.dumps([{"started": started, "seconds": seconds, "jobs": 1, "cores": 2,
                                                    "cpu": "x", "ended": ended}]))
    merge_sittings(archive, out)
    assert wall_time(out)["minutes"] == 80.0
    merge_sittings(out, archive)  # and the archive takes the later copy
    assert wall_time(archive)["minutes"] == 80.0
    assert json.loads((archive / SITTINGS).read_text())[0]["ended"] == "finished"

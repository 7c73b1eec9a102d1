"""One writer a run folder: a second `xformer train` into a folder another process is training
refuses at once and names the holder, whether fresh, --resume or --overwrite, and changes
nothing; eval beside the training run says it is still training; SIGKILL of the holder frees
the folder. Real processes, killed for real."""

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.processes import launch, run_once, train_command
from xformer.errors import RunError
from xformer.locks import LOCK, FolderLock, holder
from xformer.training.checkpoint import read_checkpoint_meta

pytestmark = pytest.mark.skipif(os.name != "posix", reason="flock is POSIX's")

TINY = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.warmup_steps=10",
        "train.lr=3e-3", 'train.precision="fp32"', "eval.beam=1", "eval.batch_sentences=16", "train.log_every=5",
        "train.valid_every=10", "train.average_last=2", "train.max_time=0.0"]


def wait_for(ready, process, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()
            and p.name != "metrics.jsonl" and "checkpoints" not in p.parts}


def test_a_second_writer_is_refused_while_the_first_trains_and_sigkill_frees_the_folder(corpus, tmp_path):
    out = tmp_path / "run"
    first = launch(train_command(TINY, corpus, out, "train.max_steps=100000"))  # trains until killed
    try:
        wait_for(lambda: (out / "checkpoints" / "best.safetensors").is_file(), first)
        held = holder(out)
        assert held["pid"] == first.pid and held["host"] == socket.gethostname() and held["command"] == "train"
        recipe_before = (out / "recipe.toml").read_text()
        before = snapshot(out)
        for extra in ([], ["--resume"], ["--overwrite"]):
            second = run_once(train_command(TINY, corpus, out, "train.max_steps=3", "train.lr=1e-3") + extra)
            assert second.returncode == 2, (extra, second.stderr)
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and f"{out}: xformer train (pid {first.pid} on " in lines[0], lines
            assert "is writing to it" in lines[0]
        assert (out / "recipe.toml").read_text() == recipe_before and snapshot(out) == before
        scored = run_once(["eval", str(out), "--checkpoint", "best", "--split", "validation", "--json"])
        assert scored.returncode == 0, scored.stderr
        assert f"the run is still training (xformer train (pid {first.pid}" in scored.stderr
        card = json.loads(scored.stdout)["card"]["checkpoint"]  # the score says which tensors, and that
        assert card["name"] == "best" and not card["final"] and len(card["sha256"]) == 64  # they may change
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert holder(out) is None  # the OS released the lock with the process; the file stays
    assert (out / LOCK).is_file()
    step = read_checkpoint_meta(out / "checkpoints" / "last.safetensors")["progress"]["step"]
    resumed = run_once(train_command(TINY, corpus, out, "train.max_steps=100000") + ["--resume", "--max-steps",
                                                                                    str(step + 2)])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "train.json").read_text())["steps"] == step + 2
    assert holder(out) is None


def test_the_lock_is_exclusive_within_a_process_too_and_a_folder_made_for_nothing_is_removed(tmp_path):
    folder = tmp_path / "new"
    with FolderLock(folder, "train"):
        assert holder(folder)["pid"] == os.getpid()
        with pytest.raises(RunError, match=rf"{folder}: xformer train \(pid {os.getpid()} on .*is writing to it"):
            with FolderLock(folder, "average"):
                pass
    assert not folder.exists()  # made only to hold the lock, nothing written: gone again
    kept = tmp_path / "kept"
    with FolderLock(kept, "train"):
        (kept / "metrics.jsonl").write_text("")
    assert holder(kept) is None and sorted(p.name for p in kept.iterdir()) == [LOCK, "metrics.jsonl"]

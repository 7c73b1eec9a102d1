"""Data-parallel training on torch.distributed: two gloo processes started by torchrun, as a
user starts them, against one process on the same global batch; a process that dies; a batch
plan that cannot be shared."""

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.processes import launch, run_once, train_command
from xformer.training.checkpoint import read_checkpoint

# no dropout: each process draws its own masks, so only dropout-free runs can agree tensor for tensor
TINY = ["train.schedule=inverse_sqrt", "train.regularisation=recipe",  # the mechanics tested, not the recipe's choice
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=256", "train.warmup_steps=4",
        "train.lr=3e-3", "model.dropout=0.0", 'train.precision="fp32"', "eval.beam=2", "eval.batch_sentences=16",
        "train.log_every=2", "train.valid_every=4", "train.average_last=2", "train.log_seconds=0",
        "train.max_time=0.0", "train.clip_norm=1.0"]


def command(corpus: Path, out: Path, *extra: str) -> list[str]:
    return train_command(TINY, corpus, out, *extra)


def torchrun(args: list[str], processes: int = 2) -> subprocess.Popen:
    return launch(args, processes)


def test_two_gloo_processes_train_what_one_process_trains_on_the_same_global_batch(corpus, tmp_path):
    """train.accumulate_steps = 2: one process accumulates two batches a step, two processes
    take one each and sum their gradients. An epoch is 27 batches, so step 14 holds one batch
    and process 1 none. After 16 steps (validations, step checkpoints, clipping, the averaged
    model included) the weights agree to 1e-5, the logged losses too, and only process 0
    wrote: one line per record in metrics.jsonl."""
    extra = ["train.accumulate_steps=2", "train.max_steps=16", "data.max_tokens=1024", "train.log_every=1"]
    single = run_once(command(corpus, tmp_path / "one", *extra))
    assert single.returncode == 0, single.stderr
    pair = torchrun(command(corpus, tmp_path / "two", *extra))
    _, err = pair.communicate(timeout=300)
    assert pair.returncode == 0, err
    for name in ("last", "averaged"):
        a, _ = read_checkpoint(tmp_path / "one" / "checkpoints" / f"{name}.safetensors")
        b, _ = read_checkpoint(tmp_path / "two" / "checkpoints" / f"{name}.safetensors")
        for key in (k for k in a if k.startswith("model.")):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=f"{name} {key}")

    def losses(run_dir: Path) -> list[tuple]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [(r["kind"], r["step"], r["loss"]) for r in map(json.loads, lines)]

    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [r[:2] for r in two] == [r[:2] for r in one]
    assert [r[2] for r in two] == pytest.approx([r[2] for r in one], rel=1e-5)
    epochs = {json.loads(line)["epoch"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()}
    assert epochs == {1, 2}  # across the epoch's end, where the last step had one batch
    summary = json.loads((tmp_path / "two" / "train.json").read_text())
    assert summary["card"]["processes"] == 2
    assert summary["others_cpu"] is None  # the other process is the run's own, not another job
    # torchrun's workers run the xformer command, which tunes glibc malloc in each of them
    assert summary["card"]["allocator"]["tuned"] == (platform.libc_ver()[0] == "glibc")


def test_a_process_that_dies_stops_the_others_and_the_run_resumes(corpus, tmp_path):
    """SIGKILL to process 1 mid-run: torchrun ends the job (nothing waits for the dead peer),
    and `--resume` under torchrun continues from process 0's last checkpoint to the end."""
    out = tmp_path / "r"
    job = torchrun(command(corpus, out, "train.accumulate_steps=2", "train.max_steps=400"))
    deadline = time.monotonic() + 240
    checkpoint = out / "checkpoints" / "last.safetensors"
    while time.monotonic() < deadline and not checkpoint.is_file():
        time.sleep(0.05)
    assert checkpoint.is_file(), "no checkpoint within 240 s"
    children = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(pid) for pid in children if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text()]
    assert len(workers) == 1, children
    os.kill(workers[0], 9)
    job.communicate(timeout=120)  # a hang would fail here
    assert job.returncode != 0
    resumed = torchrun(command(corpus, out, "train.accumulate_steps=2", "train.max_steps=12") + ["--resume"])
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 or "already stopped by train.max_steps" in err, err


def test_a_step_that_cannot_be_shared_is_refused_with_one_line(corpus, tmp_path):
    """Three batches a step cannot be dealt to two processes: one line says what to set,
    before anything is written."""
    job = torchrun(command(corpus, tmp_path / "r", "train.accumulate_steps=3", "train.max_steps=2"))
    _, err = job.communicate(timeout=180)
    assert job.returncode != 0
    assert "train.accumulate_steps = 3 with 2 processes" in err and "must be a multiple of 2" in err
    ours = err.split("torch/distributed/elastic")[0]  # what follows is torchrun's own report
    assert "Traceback" not in ours
    assert not (tmp_path / "r").exists()


def test_a_time_budgeted_wsd_run_under_torchrun_plans_its_cooldown_once_for_every_process(corpus, tmp_path):
    """Under a time budget the cooldown is planned from process 0's clock and shared, every step
    until it begins, so the processes take the same rates and the run ends on one step: the job
    finishes, stopped by its planned time, the window frozen in the checkpoint."""
    out = tmp_path / "wsd"
    job = torchrun(command(corpus, out, "train.accumulate_steps=2", "train.schedule=wsd", "train.max_time=0.15",
                           "train.decay_fraction=0.5", "train.valid_every=1000"))
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    summary = json.loads((out / "train.json").read_text())
    progress = read_checkpoint(out / "checkpoints" / "last.safetensors")[1]["progress"]
    assert summary["stop_reason"] == "max_time" and summary["card"]["processes"] == 2
    if progress["decay_end"]:  # the cooldown began before the deadline: it was planned for it
        assert progress["decay_limit"] == "max_time" and progress["decay_start"] < progress["decay_end"]

"""Deaths a run survives: SIGKILL at moments chosen by a seeded draw and by what the run is
doing (before its first checkpoint, in the middle of writing one), SIGTERM from a scheduler,
a second Ctrl-C. Real processes, killed for real; the resumed run must end with the tensors and
the metrics.jsonl of a run never interrupted."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.processes import RECIPE, launch, train_command
from tests.test_experiment import SPEC
from xformer.training.checkpoint import read_checkpoint
from xformer.training.progress import truncate_metrics

TINY = ["train.schedule=inverse_sqrt", "train.regularisation=recipe",  # the mechanics tested, not the recipe's choice
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.warmup_steps=10",
        "train.lr=3e-3", "model.dropout=0.3", 'train.precision="fp32"', "eval.beam=2", "eval.batch_sentences=16",
        # log lines that straddle checkpoints (valid_every is no multiple of log_every); none by the clock
        "train.log_every=3", "train.valid_every=10", "train.average_last=2", "train.log_seconds=0",
        "train.max_time=0.0"]
TIMING = ("seconds", "tokens_per_s", "decode_seconds")  # how fast, not what: they differ between any two runs


def start(corpus: Path, out: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    return launch(train_command(TINY, corpus, out, *extra) + (["--resume"] if resume else []))


def kill_when(process: subprocess.Popen, ready, timeout: float = 120.0) -> bool:
    """SIGKILL `process` as soon as ready() holds (polled every millisecond); False when it
    ended first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if ready():
            process.kill()
            process.wait()
            return True
        time.sleep(0.001)
    process.communicate()
    return False


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def assert_same_tensors(a_dir: Path, b_dir: Path, name: str) -> None:
    a, _ = read_checkpoint(a_dir / "checkpoints" / f"{name}.safetensors")
    b, _ = read_checkpoint(b_dir / "checkpoints" / f"{name}.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (name, key)


def test_sigkill_at_any_moment_then_resume_ends_as_the_uninterrupted_run(corpus, tmp_path):
    """Four kills: while it starts (no checkpoint yet: --resume begins at step 0), while it
    writes its first checkpoint (the temporary file beside last.safetensors exists), after a
    drawn number of metrics lines, and at a drawn moment; then --resume runs to the end. The
    weights, optimizer, RNG and averaged model are bitwise the uninterrupted run's, and so is
    metrics.jsonl (timing fields aside)."""
    straight = start(corpus, tmp_path / "a", "train.max_steps=30")
    out, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err
    draw = random.Random(7)
    b = tmp_path / "b"
    checkpoints = b / "checkpoints"
    lines = draw.randint(2, 6)
    moments = [
        lambda: (b / "xformer-run.json").is_file(),  # the run directory exists, nothing trained yet
        lambda: checkpoints.is_dir() and any(p.suffix == ".tmp" for p in checkpoints.iterdir()),
        lambda: (b / "metrics.jsonl").is_file() and len((b / "metrics.jsonl").read_text().splitlines()) >= lines,
    ]
    killed = []
    for index, ready in enumerate(moments):
        process = start(corpus, b, "train.max_steps=30", resume=index > 0)
        killed.append(kill_when(process, ready))
    process = start(corpus, b, "train.max_steps=30", resume=True)
    moment = time.monotonic() + draw.uniform(1.0, 6.0)
    killed.append(kill_when(process, lambda: time.monotonic() >= moment))
    assert killed[:2] == [True, True], killed  # those two moments always come before the end
    if not (b / "train.json").is_file():
        final = start(corpus, b, "train.max_steps=30", resume=True)
        out, err = final.communicate(timeout=300)
        assert final.returncode == 0, err
    for name in ("last", "averaged"):
        assert_same_tensors(tmp_path / "a", b, name)
    assert records(b) == records(tmp_path / "a")
    assert not list(b.rglob("*.tmp"))  # the temporary the second kill cut short is gone
    summary = json.loads((b / "train.json").read_text())
    assert summary["steps"] == 30 and summary["stop_reason"] == "max_steps"


def test_a_kill_between_the_last_checkpoint_and_the_summary_is_finished_by_resume(corpus, tmp_path):
    """Killed after its final checkpoint, before the averaged model and train.json: --resume
    writes those (rather than refusing a run that has reached max_steps)."""
    from xformer.config.loading import load_recipe
    from xformer.train import run

    recipe = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=20"])
    run(recipe, tmp_path / "a", device="cpu")
    b = tmp_path / "b"
    run(recipe, b, device="cpu")
    (b / "train.json").unlink()
    (b / "checkpoints" / "averaged.safetensors").unlink()
    finished = run(recipe, b, device="cpu", resume=True)
    assert finished.steps == 20 and (b / "train.json").is_file()
    assert_same_tensors(tmp_path / "a", b, "averaged")
    assert records(b) == records(tmp_path / "a")


def test_a_line_cut_short_and_lines_after_the_checkpoint_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 3}\n{"kind": "valid", "step": 5}\n{"kind": "train", "step": 6}\n'
                    '{"kind": "tra\xff')
    truncate_metrics(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3, 5]


def test_sigterm_checkpoints_at_a_step_boundary_and_exits_0(corpus, tmp_path):
    """A scheduler's SIGTERM: the run finishes its step, checkpoints, prints how to resume and
    exits 0."""
    out = tmp_path / "r"
    process = start(corpus, out, "train.max_steps=100000", "train.log_every=1")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "continue with: xformer train" in stderr and "--resume" in stderr
    _, meta = read_checkpoint(out / "checkpoints" / "last.safetensors")
    assert meta["stop_reason"] == "interrupted" and meta["progress"]["step"] >= 2


def test_a_second_signal_goes_to_the_handler_before_the_run(tmp_path):
    """The first SIGTERM is noted for the step boundary; the second reaches the handler that
    was there before training (by default: the process ends at once)."""
    from xformer.training.progress import StopSignals

    before = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))
    try:
        with StopSignals() as stops:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stops.received == [signal.SIGTERM] and before == []
            os.kill(os.getpid(), signal.SIGTERM)
            assert stops.received == [signal.SIGTERM] and before == [signal.SIGTERM]
        assert stops.name == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_while_the_command_loads_exits_130_without_a_traceback():
    """The interrupt is delivered inside the import of the CLI (torch and the rest), where it
    lands when a user presses Ctrl-C in the first seconds."""
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, signal, sys, time

        class Interrupt:  # an import hook: the signal arrives while xformer_cli.main loads
            def find_spec(self, name, path=None, target=None):
                if name == "xformer_cli.main":
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(30)
                return None

        sys.meta_path.insert(0, Interrupt())
        sys.argv = ["xformer", "--version"]
        from xformer_cli.entry import main
        main()
    """)
    # as from a terminal: a shell that started pytest in the background hands its children SIGINT ignored
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr


def test_out_of_memory_says_what_to_set_and_leaves_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    """An allocation that fails mid-run (raised here where CUDA would raise it, this machine
    having no GPU): one line naming data.max_tokens and the values to try; the last
    checkpoint is byte for byte the one written before."""
    from xformer.config.loading import load_recipe
    from xformer.errors import RunError
    from xformer.tasks.translation import TranslationTask
    from xformer.train import run

    recipe = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=10"])
    out = tmp_path / "r"
    run(recipe, out, device="cpu")
    last = out / "checkpoints" / "last.safetensors"
    before = last.read_bytes()
    loss, calls = TranslationTask.loss, []

    def fails_on_the_third(self, model, batch, rt):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss(self, model, batch, rt)

    monkeypatch.setattr(TranslationTask, "loss", fails_on_the_third)
    longer = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=20"])
    with pytest.raises(RunError, match=r"out of memory on cpu \(CUDA out of memory.*data.max_tokens = 512 "
                                       r"tokens: train with --set data.max_tokens=256 --set train.accumulate_steps=2"):
        run(longer, out, device="cpu", resume=True)
    assert last.read_bytes() == before



def test_an_experiment_stops_on_sigterm_with_exit_0_and_a_rerun_finishes_it(corpus, tmp_path):
    """SIGTERM while an experiment's first run trains: that run checkpoints, no other run
    starts, the command exits 0 (as train does; Ctrl-C would be 130); the same command again
    finishes the experiment from there."""
    spec = tmp_path / "spec.toml"  # test_experiment's two cells, one seed, runs long enough to stop in
    spec.write_text(SPEC.replace("seeds = [1, 2]", "seeds = [1]").replace("max_steps = 6", "max_steps = 40")
                    .replace("train.valid_every=3", "train.valid_every=10"))
    sets = [a for value in [*TINY, f"data.dataset={json.dumps(str(corpus))}"] for a in ("--set", value)]
    args = ["experiment", str(spec), *sets, "--out", str(tmp_path / "out"), "--device", "cpu"]
    experiment = launch(args)
    first, second = tmp_path / "out" / "runs" / "heads_1-s1", tmp_path / "out" / "runs" / "heads_2-s1"
    deadline = time.monotonic() + 300
    while not (first / "checkpoints" / "last.safetensors").is_file():
        assert experiment.poll() is None and time.monotonic() < deadline, experiment.communicate()[1][-2000:]
        time.sleep(0.01)
    experiment.send_signal(signal.SIGTERM)
    _, err = experiment.communicate(timeout=300)
    assert experiment.returncode == 0, err[-2000:]
    assert "stopped by SIGTERM; run the same command again" in err
    assert (first / "checkpoints" / "last.safetensors").is_file() and not second.exists()
    assert not (tmp_path / "out" / "results.json").exists()
    again = launch(args)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["steps"] for r in results["runs"]] == [40, 40]
    # both sittings count in the experiment's wall time, each as it ended
    sittings = json.loads((tmp_path / "out" / "sittings.json").read_text())
    assert [s["ended"] for s in sittings] == ["stopped", "finished"] and all(s["seconds"] > 0 for s in sittings)


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs mounted for the test (root and a kernel that allows it), else skipped."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)], capture_output=True)
    except OSError as error:  # no mount command at all
        pytest.skip(f"cannot mount a small filesystem here: {error}")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_stops_train_with_one_line_exit_2_and_the_last_checkpoint_intact(corpus, small_disk):
    out = small_disk / "run"
    full = launch(train_command(TINY, corpus, out, "train.max_steps=400", "train.average_last=5"))
    _, err = full.communicate(timeout=600)
    assert full.returncode == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert "no space left on the device while writing" in lines[-1] and str(out) in lines[-1], lines[-3:]
    assert "Traceback" not in err and "SafetensorError" not in err
    last = out / "checkpoints" / "last.safetensors"
    if last.is_file():  # the checkpoint before the disk filled: whole, and it says which step
        _, meta = read_checkpoint(last)
        assert f"{last} (step {meta['progress']['step']}) is intact" in lines[-1]
    assert not list(out.rglob(".*.tmp"))  # no half-written temporary left behind

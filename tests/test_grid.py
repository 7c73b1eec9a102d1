"""Driving a grid of runs: each run trained to its budget from whatever state an earlier attempt
left, and a grid folder's settings pinned so that a rerun with others is refused."""

import json
from pathlib import Path

import pytest

from xformer.config.loading import load_recipe
from xformer.errors import RunError
from xformer.studies.grid import pin, train_to_end

RECALL = Path(__file__).resolve().parents[1] / "recipes" / "longrange" / "recall_transformer.toml"
TINY = ["data.n_train=64", "data.n_valid=16", "data.n_test=16", "data.max_len=32", "data.curriculum_lengths=[]",
        "data.curriculum_steps=[]", "train.valid_every=1000", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
        "train.max_steps=6", "train.log_every=1"]


def test_pin_writes_once_keeps_a_same_rerun_and_refuses_another(tmp_path):
    path = tmp_path / "grid.json"
    pin(path, {"seeds": [1, 2], "steps": 10}, "other settings")
    written = path.read_text()
    assert json.loads(written) == {"seeds": [1, 2], "steps": 10}
    pin(path, {"seeds": [1, 2], "steps": 10}, "other settings")  # the same grid again: kept as it was
    assert path.read_text() == written
    with pytest.raises(RunError, match=r"grid\.json: other settings"):
        pin(path, {"seeds": [1, 2, 3], "steps": 10}, "other settings")
    # as_now reads the saved settings as today's code would write them
    pin(path, {"seeds": [1, 2], "steps": 10, "added": 0}, "other settings", as_now=lambda old: {**old, "added": 0})


def test_a_run_is_trained_once_resumed_when_cut_short_and_left_alone_when_done(tmp_path):
    recipe, run_dir, seen = load_recipe(RECALL, TINY), tmp_path / "run", []
    train_to_end(recipe, run_dir, device="cpu", on_fraction=seen.append)
    summary = json.loads((run_dir / "train.json").read_text())
    assert summary["steps"] == 6 and summary["stop_reason"] == "max_steps"
    assert seen and seen == sorted(seen) and seen[-1] == pytest.approx(1.0)

    before, seen = (run_dir / "train.json").stat().st_mtime_ns, []
    train_to_end(recipe, run_dir, device="cpu", on_fraction=seen.append)  # trained: nothing to do
    assert seen == [] and (run_dir / "train.json").stat().st_mtime_ns == before

    (run_dir / "train.json").unlink()  # killed after its last checkpoint, before its summary
    first_steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if r["kind"] == "train"]
    train_to_end(recipe, run_dir, device="cpu", on_fraction=seen.append)
    assert json.loads((run_dir / "train.json").read_text())["steps"] == 6
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == first_steps
    assert all(f == pytest.approx(1.0) for f in seen)  # resumed at step 6: no step trained again from step 1

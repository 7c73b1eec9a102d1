"""Classification end to end through the CLI (generated tasks and a user's JSONL corpus), and
the Transformer-vs-LSTM sweep: outputs, consistency of its numbers, and resuming."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from xformer.config.loading import load_recipe
from xformer.errors import RunError
from xformer.studies.grid import GridStopped
from xformer.studies.longrange import load_sweep, throughput_at_length
from xformer.train import run
from xformer.training.checkpoint import read_checkpoint
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECALL = ROOT / "recipes" / "longrange" / "recall_transformer.toml"
TINY = ["data.max_len=24", "data.n_train=400", "data.n_valid=60", "data.n_test=60", "data.max_tokens=1024",
        "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "train.max_time=0.0", "train.valid_every=10",
        "train.log_every=5", "train.warmup_steps=5"]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_train_then_eval_a_recall_classifier(tmp_path):
    out = tmp_path / "recall"
    sets = [x for s in TINY + ["train.max_steps=30"] for x in ("--set", s)]
    result = invoke("train", RECALL, "--out", out, *sets, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 30 and "best valid accuracy" in summary
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < losses[0]
    result = invoke("eval", out, "--split", "valid", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    best = json.loads((out / "train.json").read_text())["best"]
    assert report["accuracy"] == pytest.approx(best["accuracy"])  # eval agrees with validation during training
    confusion = np.array(report["confusion"])
    assert confusion.shape == (16, 16) and confusion.sum() == 60
    assert report["accuracy"] == pytest.approx(100 * np.trace(confusion) / 60)
    predictions = (out / "eval" / "valid.best.pred").read_text().split()
    assert len(predictions) == 60 and set(predictions) <= set(report["labels"])
    scored = invoke("eval", out, "--data", tmp_path)  # a generated task has no files to score
    assert scored.exit_code == 2
    assert scored.output.strip().startswith("--data: a recall run scores its own generated splits")
    scored = invoke("eval", out, "--split", "nope")
    assert scored.exit_code == 2 and scored.output.strip().startswith("--split nope: a generated task has the splits")
    assert runner.invoke(app, ["translate", str(out)], input="x\n").exit_code == 2
    engine = invoke("eval", out, "--ctranslate2", tmp_path)  # a translation engine: refused, not ignored
    assert engine.exit_code == 2 and "--ctranslate2: CTranslate2 decodes translation models" in engine.stderr
    assert runner.invoke(app, ["tokenize", str(RECALL), "--out", str(tmp_path / "t")]).exit_code == 2


def test_lstm_run_resumes_exactly(tmp_path):
    recipe = load_recipe(RECALL, TINY + ["model.arch=lstm", "model.pooling=last", "model.lstm_hidden=16",
                                         "train.max_steps=20"])
    whole = run(recipe, tmp_path / "whole", device="cpu")
    first = load_recipe(RECALL, TINY + ["model.arch=lstm", "model.pooling=last", "model.lstm_hidden=16",
                                        "train.max_steps=10"])
    run(first, tmp_path / "split", device="cpu")
    resumed = run(recipe, tmp_path / "split", device="cpu", resume=True)
    assert resumed.steps == whole.steps == 20
    a, _ = read_checkpoint(tmp_path / "whole" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "split" / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        if not key.startswith("rng."):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_run_cut_inside_its_length_curriculum_resumes_exactly(tmp_path):
    curriculum = TINY + ["data.curriculum_lengths=[8, 16]", "data.curriculum_steps=[4, 3]", "train.valid_every=5"]
    whole = run(load_recipe(RECALL, curriculum + ["train.max_steps=12"]), tmp_path / "whole", device="cpu")
    run(load_recipe(RECALL, curriculum + ["train.max_steps=5"]), tmp_path / "split", device="cpu")
    resumed = run(load_recipe(RECALL, curriculum + ["train.max_steps=12"]), tmp_path / "split", device="cpu",
                  resume=True)
    assert resumed.steps == whole.steps == 12
    records = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "valid"] == [10, 12]  # none inside the curriculum
    a, _ = read_checkpoint(tmp_path / "whole" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "split" / "checkpoints" / "last.safetensors")
    for key in a:
        if not key.startswith("rng."):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.fixture
def reviews(tmp_path) -> Path:
    folder = tmp_path / "reviews"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = {"pos": ["good", "great", "fine", "lovely"], "neg": ["bad", "awful", "poor", "dull"]}
    for split, n in (("train", 200), ("validation", 40), ("test", 40)):
        rows = []
        for _ in range(n):
            label = str(rng.choice(["pos", "neg"]))
            rows.append({"review": " ".join(rng.choice(words[label] + ["the", "film", "was"], size=6)),
                         "sentiment": label})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def user_recipe(tmp_path, reviews, tokenizer) -> Path:
    path = tmp_path / f"reviews_{tokenizer}.toml"
    path.write_text(f"""
[model]
arch = "classifier"
d_model = 32
n_heads = 2
d_ff = 64
n_encoder_layers = 1
dropout = 0.0
pooling = "mean"
max_positions = 129
[data]
task = "classification"
dataset = {json.dumps(str(reviews))}
text_field = "review"
label_field = "sentiment"
tokenizer = "{tokenizer}"
vocab_size = 50
max_len = 128
max_tokens = 1024
[train]
lr = 3e-3
warmup_steps = 5
label_smoothing = 0.0
max_steps = 40
valid_every = 20
""")
    return path


@pytest.mark.parametrize("tokenizer", ["whitespace", "char", "byte"])
def test_a_user_jsonl_corpus_trains_and_scores(tmp_path, reviews, tokenizer):
    out = tmp_path / "run"
    assert invoke("train", user_recipe(tmp_path, reviews, tokenizer), "--out", out).exit_code == 0
    report = json.loads(invoke("eval", out, "--json").stdout)
    assert report["labels"] == ["neg", "pos"] and report["n_examples"] == 40
    if tokenizer == "whitespace":  # a bag of telling words: easy once trained
        assert report["accuracy"] >= 90
    bad = reviews / "test_unseen.jsonl"
    bad.write_text(json.dumps({"review": "good", "sentiment": "meh"}) + "\n")
    result = runner.invoke(app, ["eval", str(out), "--data", str(bad)])
    assert result.exit_code == 2
    assert "sentiment = 'meh' never occurs in training" in result.output and "Traceback" not in result.output


def test_a_missing_label_field_is_one_line(tmp_path, reviews):
    path = user_recipe(tmp_path, reviews, "char")
    path.write_text(path.read_text().replace('label_field = "sentiment"', 'label_field = "stars"'))
    result = runner.invoke(app, ["train", str(path), "--out", str(tmp_path / "r")])
    last = result.output.strip().splitlines()[-1]  # after the setup messages
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert last.endswith("train.jsonl: no field 'stars' (found: review, sentiment)")


def test_a_row_without_its_label_is_named_by_file_and_line(tmp_path, reviews):
    path = user_recipe(tmp_path, reviews, "char")
    train_file = reviews / "train.jsonl"
    lines = train_file.read_text().splitlines()
    broken = tmp_path / "broken"
    shutil.copytree(reviews, broken)
    (broken / "train.jsonl").write_text("\n".join(lines[:4] + ['{"review": "fine", "sentiment": null}'] + lines[4:])
                                        + "\n")
    path.write_text(path.read_text().replace(str(reviews), str(broken)))
    result = runner.invoke(app, ["train", str(path), "--out", str(tmp_path / "r")])
    last = result.output.strip().splitlines()[-1]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert last.endswith("train.jsonl:5: field 'sentiment' is null, expected a string or a number"), last


def test_throughput_at_a_length_leaves_out_the_curriculum_steps(tmp_path):
    recipe = load_recipe(RECALL, ["data.max_len=64", "train.log_every=10",
                                  "data.curriculum_lengths=[16, 32, 64]", "data.curriculum_steps=[20, 10, 5]"])
    rates = {10: 900.0, 20: 800.0, 30: 700.0, 40: 600.0, 50: 100.0, 60: 300.0}  # stages: 30 steps (64 skipped)
    lines = [{"kind": "train", "step": k, "tokens_per_s": v} for k, v in rates.items()]
    lines.append({"kind": "valid", "step": 60})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trained = {"tokens": 5000, "loop_seconds": 10.0}
    # from step 41 on (the interval ending at 40 straddles the switch): tokens over time
    assert throughput_at_length(tmp_path, recipe, trained) == pytest.approx(2 / (1 / 100 + 1 / 300))
    plain = load_recipe(RECALL, ["data.max_len=64", "data.curriculum_lengths=[]", "data.curriculum_steps=[]"])
    assert throughput_at_length(tmp_path, plain, trained) == pytest.approx(6 / sum(1 / v for v in rates.values()))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")  # nothing logged after the curriculum
    assert throughput_at_length(tmp_path, recipe, trained) == 500.0


def write_sweep(tmp_path, lengths, seeds, steps) -> Path:
    for name, arch in (("t.toml", ["model.arch=classifier"]), ("l.toml", ["model.arch=lstm", "model.pooling=last"])):
        recipe = load_recipe(RECALL, TINY + arch + [f"train.max_steps={steps}", "train.valid_every=3"])
        recipe.save(tmp_path / name)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f'[sweep]\ntransformer = "t.toml"\nlstm = "l.toml"\nlengths = {lengths}\nseeds = {seeds}\n'
                     f"max_steps = {steps}\n")
    return sweep


def test_the_sweep_writes_consistent_outputs_and_resumes(tmp_path):
    sweep = write_sweep(tmp_path, [24, 32], [1, 2], 6)
    out = tmp_path / "out"
    result = invoke("longrange", sweep, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    comparison = json.loads((out / "comparison.json").read_text())
    assert len(comparison["rows"]) == 8 and len(comparison["summary"]) == 4
    for group in comparison["summary"]:
        rows = [r for r in comparison["rows"] if r["model"] == group["model"] and r["length"] == group["length"]]
        assert group["accuracy_mean"] == pytest.approx(np.mean([r["test_accuracy"] for r in rows]))
        assert group["accuracy_std"] == pytest.approx(np.std([r["test_accuracy"] for r in rows], ddof=1))
        assert group["tokens_per_s"] > 0 and group["parameters"] == rows[0]["parameters"]
    t = [g for g in comparison["summary"] if g["model"] == "transformer"][0]
    lstm = [g for g in comparison["summary"] if g["model"] == "lstm"][0]
    assert abs(lstm["parameters"] - t["parameters"]) / t["parameters"] < 0.10  # matched
    md = (out / "comparison.md").read_text()
    assert f"{t['accuracy_mean']:.2f} +- {t['accuracy_std']:.2f}" in md and "Who wins where" in md
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resuming: finished rows are kept; a lost row is the only one trained again.
    row = out / "rows" / "lstm-L32-s2.json"
    kept = (out / "rows" / "transformer-L24-s1.json").stat().st_mtime_ns
    row.unlink()
    result = invoke("longrange", sweep, "--out", out, "--device", "cpu")
    assert result.exit_code == 0 and "7 done already" in result.output
    assert row.is_file() and (out / "rows" / "transformer-L24-s1.json").stat().st_mtime_ns == kept
    # Other settings in the same directory are refused, not mixed in.
    sweep.write_text(sweep.read_text().replace("max_steps = 6", "max_steps = 7"))
    result = runner.invoke(app, ["longrange", str(sweep), "--out", str(out)])
    assert result.exit_code == 2 and "other recipes or budget" in result.output


def test_an_interrupted_sweep_resumes_the_cut_run_and_rescores_a_trained_one(tmp_path):
    import os
    import signal

    from xformer.studies.longrange import load_sweep, run_sweep

    sweep = load_sweep(write_sweep(tmp_path, [24], [1], 9))
    out = tmp_path / "out"

    pressed = []

    def interrupt_lstm(kind, payload):
        if kind == "row_progress" and payload["index"] == 1 and payload["fraction"] > 0.4 and not pressed:
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # one Ctrl-C: the run stops at a step boundary

    with pytest.raises(GridStopped) as stopped:
        run_sweep(sweep, out, device="cpu", on_event=interrupt_lstm)
    assert stopped.value.signal == "SIGINT"
    assert (out / "rows" / "transformer-L24-s1.json").is_file() and not (out / "rows" / "lstm-L24-s1.json").exists()
    # the transformer's row file is lost too, but its run finished: it is scored again, not retrained
    (out / "rows" / "transformer-L24-s1.json").unlink()
    trained = (out / "runs" / "transformer-L24-s1" / "checkpoints" / "best.safetensors").stat().st_mtime_ns
    events = []
    comparison = run_sweep(sweep, out, device="cpu", on_event=lambda kind, payload: events.append((kind, payload)))
    starts = {p["key"]: p["resume"] for kind, p in events if kind == "row_start"}
    assert starts == {"transformer-L24-s1": False, "lstm-L24-s1": True}
    assert (out / "runs" / "transformer-L24-s1" / "checkpoints" / "best.safetensors").stat().st_mtime_ns == trained
    assert [r["steps"] for r in comparison.rows] == [9, 9]


def test_a_stop_on_a_runs_last_step_stops_the_sweep_before_the_next_run(tmp_path):
    """SIGTERM that lands as the first row's last step runs: the row ends as trained, yet the
    sweep stops there instead of starting the next row (the signal is not swallowed)."""
    import os
    import signal

    from xformer.studies.longrange import load_sweep, run_sweep

    sweep = load_sweep(write_sweep(tmp_path, [24], [1], 6))
    out, starts = tmp_path / "out", []

    def on_event(kind, payload):
        if kind == "row_start":
            starts.append(payload["key"])
        if kind == "row_progress" and payload["index"] == 0 and payload["fraction"] >= 1.0 and len(starts) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(GridStopped) as stopped:
        run_sweep(sweep, out, device="cpu", on_event=on_event)
    assert stopped.value.signal == "SIGTERM" and starts == ["transformer-L24-s1"]
    assert json.loads((out / "runs" / "transformer-L24-s1" / "train.json").read_text())["steps"] == 6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_a_single_file_corpus_cannot_train(tmp_path, reviews):
    path = user_recipe(tmp_path, reviews, "char")
    path.write_text(path.read_text().replace(json.dumps(str(reviews)), json.dumps(str(reviews / "train.jsonl"))))
    result = runner.invoke(app, ["train", str(path), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "is a single file" in result.output  # else it would validate on train


def test_an_encoder_made_from_other_data_is_refused(tmp_path):
    from xformer.errors import RunError
    from xformer.tasks import make_task
    from xformer.tasks.classification import check_encoder

    recall = make_task(load_recipe(RECALL))
    encoder_dir = tmp_path / "tokenizer"
    encoder_dir.mkdir()
    (encoder_dir / "encoder.json").write_text(json.dumps({"kind": "task", "vocab": [], "labels": [],
                                                              "settings": recall.encoder_settings()}))
    check_encoder(encoder_dir, recall.encoder_settings())  # the same task: fine
    listops = make_task(load_recipe(ROOT / "recipes" / "longrange" / "listops_transformer.toml"))
    with pytest.raises(RunError, match="data.task = 'recall'"):
        check_encoder(encoder_dir, listops.encoder_settings())


def test_a_sweep_length_the_task_cannot_have_is_refused_before_training(tmp_path):
    sweep = write_sweep(tmp_path, [24, 4], [1], 3)  # the recipe's recall needs 2 pairs + 1 query = 5 tokens
    result = runner.invoke(app, ["longrange", str(sweep), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "at length 4" in result.output and "expected at least 5" in result.output
    assert not (tmp_path / "out").exists()


def test_a_sweep_pinned_before_a_field_existed_still_resumes(tmp_path):
    """sweep.json of an older version lacks fields added since (at their defaults): the same sweep."""
    from xformer.studies.longrange import _pin_sweep

    sweep = load_sweep(write_sweep(tmp_path, [24], [1], 3))
    out = tmp_path / "out"
    out.mkdir()
    _pin_sweep(sweep, out)
    pinned = json.loads((out / "sweep.json").read_text())
    for recipe in pinned["recipes"].values():
        del recipe["train"]["fast_paths"]  # as an older xformer wrote it
    (out / "sweep.json").write_text(json.dumps(pinned))
    _pin_sweep(sweep, out)  # no error
    pinned["recipes"]["lstm"]["train"]["lr"] = 0.5
    (out / "sweep.json").write_text(json.dumps(pinned))
    with pytest.raises(RunError, match="started with other recipes"):
        _pin_sweep(sweep, out)


def test_a_sweep_trains_each_named_variant_of_the_transformer(tmp_path):
    sweep = write_sweep(tmp_path, [24], [1], 3)
    sweep.write_text(sweep.read_text() + '\n[sweep.variants]\nwindowed = {attention = "sliding_window", window = 4}\n'
                     'alibi = {positional = "alibi"}\n')
    out = tmp_path / "out"
    result = invoke("longrange", sweep, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["models"] == ["transformer", "windowed", "alibi", "lstm"]
    assert [r["model"] for r in comparison["rows"]] == comparison["models"]
    trained = {m: load_recipe(out / "runs" / f"{m}-L24-s1" / "recipe.toml").model for m in comparison["models"]}
    assert (trained["windowed"].attention, trained["windowed"].window) == ("sliding_window", 4)
    assert trained["alibi"].positional == "alibi" and trained["transformer"].attention == "full"
    assert trained["windowed"].d_model == trained["transformer"].d_model  # the rest is the transformer's recipe
    md = (out / "comparison.md").read_text()
    assert "windowed acc %" in md and "  - alibi: " in md

    for bad, expected in (('w = {attention = "sliding_window", windo = 4}',
                           "sweep.variants.w: model.windo: unknown key"),
                          ('lstm = {positional = "alibi"}', "sweep.variants.lstm: expected a name"),
                          ('w = {attention = "sliding_window", window = 0}', "sweep.variants.w: model.window")):
        sweep.write_text(sweep.read_text().split("[sweep.variants]")[0] + f"[sweep.variants]\n{bad}\n")
        result = runner.invoke(app, ["longrange", str(sweep), "--out", str(tmp_path / "other")])
        assert result.exit_code == 2 and expected in result.output, result.output


def test_a_sweep_may_set_every_run_s_batch_and_validation_interval(tmp_path):
    from xformer.studies.longrange import row_recipe

    sweep = write_sweep(tmp_path, [24], [1], 3)
    sweep.write_text(sweep.read_text() + "max_tokens = 512\nvalid_every = 7\n")
    loaded = load_sweep(sweep)
    for model in loaded.models:
        recipe = row_recipe(loaded, model, 24, 1)
        assert (recipe.data.max_tokens, recipe.train.valid_every) == (512, 7)
    sweep.write_text(sweep.read_text().replace("valid_every = 7", "valid_every = -1"))
    result = runner.invoke(app, ["longrange", str(sweep)])
    assert result.exit_code == 2 and "sweep.valid_every: expected a number >= 0, found -1" in result.output

"""End to end on a slice of Multi30k: train, resume, evaluate, translate, tokenize; through the
core and through the CLI. Tiny models, a few dozen steps: seconds, not minutes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from xformer.config.loading import load_recipe
from xformer.errors import RunError
from xformer.evaluate import evaluate_run
from xformer.results import TranslationEval
from xformer.train import run
from xformer.training.checkpoint import read_checkpoint, read_checkpoint_meta
from xformer.training.device import resolve_runtime
from xformer.training.optim import learning_rate
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
TINY = ["train.schedule=inverse_sqrt", "train.regularisation=recipe",  # the mechanics tested, not the recipe's choice
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.warmup_steps=10",
        "train.lr=3e-3", "train.log_every=5", "train.valid_every=10", "train.average_last=2",
        "train.max_time=0.0", "eval.beam=2", "eval.batch_sentences=16"]
runner = CliRunner()


def tiny_recipe(corpus, *extra):
    return load_recipe(RECIPE, TINY + [f"data.dataset={json.dumps(str(corpus))}", *extra])


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    result = run(tiny_recipe(corpus, "train.max_steps=40"), out, device="cpu")
    return out, result


def test_training_writes_a_complete_run_and_loss_falls(trained):
    out, result = trained
    assert result.steps == 40 and result.stop_reason == "max_steps"
    for name in ("recipe.toml", "metrics.jsonl", "train.json", "tokenizer/spm.model", "checkpoints/last.safetensors",
                 "checkpoints/best.safetensors", "checkpoints/averaged.safetensors"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000030.safetensors",
                                                                            "step_0000040.safetensors"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.0
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [10, 20, 30, 40]
    assert valid[-1]["loss"] < valid[0]["loss"]
    assert {"bleu", "chrf", "ppl"} <= set(valid[0])


@pytest.mark.parametrize("variant", [["data.sampling_alpha=0.0", 'train.precision="fp32"'],
                                     ["data.sampling_alpha=0.3", 'train.precision="bf16"'],
                                     ["model.head_dropout=0.3", 'train.precision="fp32"']],
                         ids=["one-best-fp32", "sampled-bf16", "drophead-fp32"])
def test_resume_equals_uninterrupted(corpus, tmp_path, variant):
    extra = ["model.dropout=0.3", "train.max_steps=20", *variant]
    straight = run(tiny_recipe(corpus, *extra), tmp_path / "a", device="cpu")
    run(tiny_recipe(corpus, "model.dropout=0.3", "train.max_steps=10", *variant), tmp_path / "b", device="cpu")
    resumed = run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", resume=True)
    assert resumed.steps == straight.steps == 20
    a, _ = read_checkpoint(tmp_path / "a" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "b" / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # records after the checkpoint were dropped, not duplicated


def xformer(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-c", "from xformer_cli.main import app; app()", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_sampled_run_repeats_and_resumes_exactly_across_processes(corpus, tmp_path):
    """Subword sampling is a function of (seed, epoch) in any process: a run stopped at step 10
    and resumed by another process ends with the tensors of an uninterrupted run in a third
    (sentencepiece's own sampler, salted per process, parted them by step 5)."""
    sets = [arg for value in TINY + [f"data.dataset={json.dumps(str(corpus))}", "data.sampling_alpha=0.3",
                                     "model.dropout=0.3"] for arg in ("--set", value)]
    common = [str(RECIPE), *sets, "--precision", "fp32"]
    straight = xformer("train", *common, "--max-steps", "20", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    first = xformer("train", *common, "--max-steps", "10", "--out", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr
    resumed = xformer("train", *common, "--max-steps", "20", "--out", str(tmp_path / "b"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, _ = read_checkpoint(tmp_path / "a" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "b" / "checkpoints" / "last.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_precision_and_its_reason_are_recorded_and_logs_come_by_time(corpus, tmp_path):
    """train.json says which precision "auto" chose and why; with a step interval no run
    reaches, log_seconds still writes a line for every step that outlasts it."""
    result = run(tiny_recipe(corpus, "train.max_steps=6", "train.log_every=1000", "train.log_seconds=1e-6"),
                 tmp_path / "r", device="cpu")
    summary = json.loads((tmp_path / "r" / "train.json").read_text())
    assert summary["precision"] == result.precision and summary["precision_reason"].startswith("auto: ")
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_the_fast_paths_train_what_the_plain_paths_train(corpus, tmp_path):
    """train.fast_paths = false swaps in nn.Dropout and F.cross_entropy: without dropout (the
    masks draw differently) the two runs agree to float rounding, step by step."""
    losses = {}
    for fast in (True, False):
        out = tmp_path / f"fast_{fast}"
        run(tiny_recipe(corpus, "train.max_steps=10", "train.log_every=1", "model.dropout=0.0",
                        f"train.fast_paths={str(fast).lower()}"), out, device="cpu")
        losses[fast] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                        if json.loads(line)["kind"] == "train"]
    assert len(losses[True]) == 10 and losses[True] == pytest.approx(losses[False], rel=1e-4)


def _train_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


def test_a_compiler_that_fails_leaves_the_run_training_eagerly(corpus, tmp_path, monkeypatch):
    """train.compile with a compiler that raises: a warning names it, and the run trains the
    same tensors as a run without train.compile (the trial on the first batch left no trace)."""
    import xformer.training.compiling

    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(xformer.training.compiling, "BACKEND", broken)
    events = []
    extra = ["train.max_steps=6", "model.dropout=0.3"]
    run(tiny_recipe(corpus, *extra, "train.compile=true"), tmp_path / "c", device="cpu",
        on_event=lambda kind, payload: events.append((kind, payload)))
    run(tiny_recipe(corpus, *extra), tmp_path / "e", device="cpu")
    warnings = [p["message"] for k, p in events if k == "warning"]
    assert any("train.compile: torch.compile failed" in w and "no C++ compiler here" in w for w in warnings), warnings
    a, _ = read_checkpoint(tmp_path / "c" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "e" / "checkpoints" / "last.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_a_compiled_run_trains_what_an_eager_run_trains(corpus, tmp_path):
    """train.compile with inductor: without dropout (compiled masks draw differently) the
    losses follow the eager run's to float rounding."""
    losses = {}
    for compiled in (True, False):
        out = tmp_path / f"compiled_{compiled}"
        run(tiny_recipe(corpus, "train.max_steps=5", "train.log_every=1", "model.dropout=0.0",
                        f"train.compile={str(compiled).lower()}"), out, device="cpu")
        losses[compiled] = _train_losses(out)
    assert len(losses[True]) == 5 and losses[True] == pytest.approx(losses[False], rel=1e-3)


def _plant(checkpoint: Path, value: float, prefix: str = "model.") -> str:
    """Fill the first 2-D tensor named `prefix`... of a checkpoint with `value` (its digest
    rewritten, so it reads as sound); returns the tensor's name."""
    from xformer.training.checkpoint import write_tensors

    tensors, meta = read_checkpoint(checkpoint)
    name = next(k for k in tensors if k.startswith(prefix) and tensors[k].dim() == 2)
    tensors[name].fill_(value)
    write_tensors(checkpoint, tensors, {k: v for k, v in meta.items() if k != "format"})
    return name


def test_a_run_that_goes_nonfinite_skips_steps_then_stops_and_resumes_from_before_it(corpus, tmp_path):
    """Weights of 1e30 (finite, but attention scores overflow) make every step's loss NaN: each
    step is skipped (the weights stay as they were, the skips are in metrics.jsonl), and after
    train.max_nonfinite_steps in a row the run stops with one line. --resume then goes back to
    the checkpoint before the one the guard wrote (which it keeps, named by its step), rather
    than continuing a state that can only repeat the same NaN."""
    out = tmp_path / "r"
    run(tiny_recipe(corpus, "train.max_steps=6", "train.valid_every=3"), out, device="cpu")
    last = out / "checkpoints" / "last.safetensors"
    name = _plant(last, 1e30)
    planted, _ = read_checkpoint(last)
    recipe = tiny_recipe(corpus, "train.max_steps=30", "train.valid_every=3", "train.max_nonfinite_steps=3",
                         "train.log_every=1")
    with pytest.raises(RunError, match=r"not finite for 4 steps in a row, up to step 10; lower train.lr"):
        run(recipe, out, device="cpu", resume=True)
    after, meta_after = read_checkpoint(last)
    assert meta_after["progress"]["step"] == 10 and meta_after["stop_reason"] == "nonfinite"
    assert torch.equal(after[name], planted[name])  # skipped steps changed nothing

    def strict(text: str):  # NaN / Infinity are not JSON: a reader in another language would fail
        return json.loads(text, parse_constant=lambda word: pytest.fail(f"bare {word} in JSON"))

    records = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["kind"] == "train" and r["step"] > 6]
    assert [r["skipped"] for r in resumed] == [1, 1, 1, 1] and all(r["loss"] is None for r in resumed)
    sets = [arg for value in TINY + [f"data.dataset={json.dumps(str(corpus))}", "train.max_nonfinite_steps=2",
                                     "train.valid_every=3", "train.log_every=1"]
            for arg in ("--set", value)]
    again = runner.invoke(app, ["train", str(RECIPE), *sets, "--max-steps", "30", "--out", str(out), "--resume"])
    # from checkpoints/previous (step 6, the planted one): 7, 8 and 9 skipped
    assert again.exit_code == 2 and "not finite for 3 steps in a row, up to step 9" in again.output, again.output
    said = " ".join(again.output.split())  # rich wraps at the terminal's width, where a path's length puts it
    assert "stopped by train.max_nonfinite_steps at step 10" in said and "(step 6)" in said
    assert "Traceback" not in again.output
    assert read_checkpoint(out / "checkpoints" / "nonfinite_step_0000010.safetensors")[1]["stop_reason"] == "nonfinite"
    records = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train" and r["step"] > 6] == [7, 8, 9]  # redone, once


def test_resume_goes_back_past_non_finite_weights_and_refuses_when_nothing_is_finite(corpus, tmp_path):
    """A last checkpoint holding NaN weights or optimizer moments is no state to train from:
    --resume continues from checkpoints/previous, ending as a run never interrupted from there
    would; with previous gone too it refuses in one line, exit 2."""
    extra = ["train.valid_every=3", "model.dropout=0.3"]
    out = tmp_path / "r"
    run(tiny_recipe(corpus, *extra, "train.max_steps=6"), out, device="cpu")
    _plant(out / "checkpoints" / "last.safetensors", float("nan"), prefix="optim.")
    resumed = run(tiny_recipe(corpus, *extra, "train.max_steps=9"), out, device="cpu", resume=True)
    straight = tmp_path / "straight"
    run(tiny_recipe(corpus, *extra, "train.max_steps=3"), straight, device="cpu")
    run(tiny_recipe(corpus, *extra, "train.max_steps=9"), straight, device="cpu", resume=True)
    assert resumed.steps == 9
    a, _ = read_checkpoint(straight / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(out / "checkpoints" / "last.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
    for checkpoint in ("last", "previous"):
        _plant(out / "checkpoints" / f"{checkpoint}.safetensors", float("nan"))
    sets = [arg for value in TINY + [f"data.dataset={json.dumps(str(corpus))}", *extra] for arg in ("--set", value)]
    refused = runner.invoke(app, ["train", str(RECIPE), *sets, "--max-steps", "12", "--out", str(out), "--resume"])
    assert refused.exit_code == 2 and "no finite checkpoint to resume from" in refused.stderr, refused.output
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_change_on_resume_is_recorded_with_its_step_and_a_run_of_the_saved_recipe_replays_it(corpus, tmp_path):
    """--resume --set train.lr=... --max-steps ...: recipe.toml holds the new values and a
    [[changes]] table with the step they took effect at, train.json lists it, and training the
    run's own recipe.toml into a new folder reproduces the run: the same weights, the same
    validations."""
    extra = ["train.valid_every=2", "model.dropout=0.3", "train.log_every=1"]
    out = tmp_path / "r"
    run(tiny_recipe(corpus, *extra, "train.max_steps=3"), out, device="cpu")
    saved = out / "recipe.toml"
    sets = ["--set", "train.lr=1e-3", "--max-steps", "7"]
    resumed = runner.invoke(app, ["train", str(saved), *sets, "--out", str(out), "--resume", "--device", "cpu"])
    assert resumed.exit_code == 0, resumed.output
    assert "from step 3: train.lr 0.003 -> 0.001, train.max_steps 3 -> 7" in resumed.output
    recorded = load_recipe(saved)
    assert recorded.train.lr == 1e-3 and recorded.train.max_steps == 7
    assert [(c.step, c.set, c.was) for c in recorded.changes] == [
        (3, {"train.lr": 1e-3, "train.max_steps": 7}, {"train.lr": 3e-3, "train.max_steps": 3})]
    assert json.loads((out / "train.json").read_text())["changes"] == [
        {"step": 3, "set": {"train.lr": 1e-3, "train.max_steps": 7}, "was": {"train.lr": 3e-3, "train.max_steps": 3}}]
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
           if r["kind"] == "train"}
    again = runner.invoke(app, ["train", str(saved), "--out", str(out), "--resume", "--device", "cpu"])
    assert again.exit_code == 2 and "already stopped by train.max_steps" in again.output  # no second change
    replay = tmp_path / "replay"
    result = run(load_recipe(saved), replay, device="cpu")
    assert result.steps == 7 and result.stop_reason == "max_steps"
    a, _ = read_checkpoint(out / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(replay / "checkpoints" / "last.safetensors")
    for key in a:
        if key.startswith(("model.", "optim.")):
            assert torch.equal(a[key], b[key]), key
    records = {name: [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
               for name, run_dir in (("resumed", out), ("replay", replay))}
    valid = {name: [(r["step"], r["loss"]) for r in rs if r["kind"] == "valid"] for name, rs in records.items()}
    assert valid["resumed"] == valid["replay"] and [s for s, _ in valid["replay"]] == [2, 3, 4, 6, 7]
    assert {r["step"]: r["lr"] for r in records["replay"] if r["kind"] == "train"} == lrs
    assert lrs[3] == pytest.approx(learning_rate(3, tiny_recipe(corpus, *extra, "train.max_steps=3").train))
    assert load_recipe(replay / "recipe.toml") == recorded


def test_resume_refuses_a_different_model(corpus, trained):
    out, _ = trained
    with pytest.raises(RunError, match=r"different \[model\] values \(d_model\)"):
        run(tiny_recipe(corpus, "model.d_model=64", "train.max_steps=50"), out, device="cpu", resume=True)


def test_a_run_is_never_overwritten_silently(corpus, trained):
    out, _ = trained
    with pytest.raises(RunError, match="exists and is not empty; pass --resume .* or --overwrite"):
        run(tiny_recipe(corpus, "train.max_steps=1"), out, device="cpu")


def test_evaluate_writes_scores_and_hypotheses(trained, corpus):
    out, _ = trained
    report = evaluate_run(out, checkpoint="last", device="cpu")
    assert isinstance(report, TranslationEval) and report.n_sentences == 40
    assert "case:mixed" in report.signature
    saved = json.loads((out / "eval.json").read_text())
    assert saved == report.to_dict()  # the file holds exactly the returned result
    hyps = Path(report.hypotheses).read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 40


def test_train_and_eval_write_a_run_card_and_eval_says_when_the_data_changed(trained, corpus, tmp_path):
    """train.json and eval JSONs carry the run card: versions, seed, device and precision, and
    the sha256 of each split's files; eval warns when its split's files are not training's."""
    import hashlib
    import shutil

    out, _ = trained
    card = json.loads((out / "train.json").read_text())["card"]
    # the precision auto picked on this machine (bf16 where the CPU has it natively, else fp32)
    assert card["precision"] == resolve_runtime("cpu", "auto").precision and card["precision_reason"].startswith("auto")
    assert card["seed"] == 1 and card["recipe"]["data"]["vocab_size"] == 300
    assert set(card["versions"]) == {"xformer", "torch", "sacrebleu", "sentencepiece", "datasets"}
    assert card["versions"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    for split, name in (("train", "train.jsonl"), ("validation", "val.jsonl"), ("test", "test.jsonl")):
        digest = hashlib.sha256(name.encode() + b"\0" + (corpus / name).read_bytes()).hexdigest()[:16]
        assert card["data"][split] == digest, split
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    report = evaluate_run(copy, checkpoint="last", device="cpu")
    # (a warning that other processes slowed the timing depends on the machine, not on the run)
    assert [w for w in report.warnings if not w.startswith("timed while")] == []
    assert report.card.data == {"test": card["data"]["test"]}
    summary = json.loads((copy / "train.json").read_text())
    summary["card"]["data"]["test"] = "0" * 16  # as if the test file had changed since training
    (copy / "train.json").write_text(json.dumps(summary))
    report = evaluate_run(copy, checkpoint="last", device="cpu")
    warned = [w for w in report.warnings if not w.startswith("timed while")]
    assert len(warned) == 1 and "split 'test': the files differ from the ones training read" in warned[0]
    shown = runner.invoke(app, ["eval", str(copy), "--checkpoint", "last", "--device", "cpu"])
    assert shown.exit_code == 0 and "warning: " in shown.output and "differ from the ones training read" in shown.output
    meta = read_checkpoint_meta(copy / "checkpoints" / "last.safetensors")
    assert report.card.checkpoint == {"name": "last", "step": 40, "sha256": meta["sha256"], "final": True}
    (copy / "train.json").unlink()  # as if training had not ended: the score may go stale
    report = evaluate_run(copy, checkpoint="last", device="cpu")
    assert not report.card.checkpoint["final"]
    assert any("checkpoint 'last' (step 40) is not the run's final one" in w for w in report.warnings)


def test_cli_eval_translate_and_errors(trained, corpus, tmp_path):
    out, _ = trained
    result = runner.invoke(app, ["eval", str(out), "--checkpoint", "best", "--beam", "1", "--json",
                                 "--data", str(corpus / "val.jsonl")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["n_sentences"] == 40

    result = runner.invoke(app, ["translate", str(out), "--beam", "1"], input="Ein Hund läuft.\nZwei Männer.\n")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2

    missing = runner.invoke(app, ["eval", str(out), "--checkpoint", "nope"])
    assert missing.exit_code == 2
    assert "nope.safetensors: no such checkpoint (found: averaged, best, last" in missing.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"de": "Hallo"}\n', encoding="utf-8")
    result = runner.invoke(app, ["eval", str(out), "--data", str(bad)])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "'en'" in result.stderr


def test_cli_train_bad_data_exits_2_with_one_line(corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("")
    cases = {
        "data.source_lang=xx": "no field 'xx'",
        f"data.dataset={json.dumps(str(empty))}": "train.jsonl: empty, expected JSONL lines",
        f"data.dataset={json.dumps(str(tmp_path / 'absent'))}": "absent",
    }
    for override, expected in cases.items():
        args = ["train", str(RECIPE), "--out", str(tmp_path / "r"), "--max-steps", "1"]
        for item in TINY + [f"data.dataset={json.dumps(str(corpus))}", override]:
            args += ["--set", item]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (override, result.output)
        lines = result.stderr.strip().splitlines()  # progress notes, then the one error line
        assert expected in lines[-1], (override, lines)
        assert "Traceback" not in result.output


def test_cli_tokenize_then_train_reuses_the_tokenizer(corpus, tmp_path):
    out = tmp_path / "run"
    sets = []
    for item in TINY + [f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=2"]:
        sets += ["--set", item]
    result = runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(out), *sets])
    assert result.exit_code == 0, result.output
    model = (out / "tokenizer" / "spm.model").read_bytes()
    again = runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(out), *sets])
    assert again.exit_code == 2 and "--overwrite" in again.stderr
    pieces = runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(out), "--apply", "-", *sets],
                           input="Ein Hund läuft.\n")
    assert pieces.exit_code == 0 and "▁" in pieces.stdout
    latin1 = tmp_path / "latin1.de"
    latin1.write_bytes("Ein Hund.\nZwei Männer.\n".encode("latin-1"))
    for source, given in ((str(latin1), None), ("-", latin1.read_bytes())):  # a file, and stdin
        bad = runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(out), "--apply", source, *sets], input=given)
        assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0, bad.output
        assert f"{latin1 if source != '-' else 'stdin'}:2: not UTF-8" in bad.stderr
    result = runner.invoke(app, ["train", str(RECIPE), "--out", str(out), *sets])
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer" / "spm.model").read_bytes() == model


def test_a_damaged_checkpoint_is_refused_not_unpickled(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x80\x04 not a checkpoint")
    with pytest.raises(RunError, match="not a readable safetensors checkpoint"):
        read_checkpoint(path)


class _Payload:
    """Unpickling this touches a file: the proof that a loader executed pickled code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_planted_in_every_checkpoint_is_never_executed(trained, tmp_path):
    """Every checkpoint of a run replaced by a torch.save'd payload (torch's own format, a
    pickle inside a zip): eval of each, translate, average, inspect-heads and --resume each
    exit 2 with one line naming the file, and the payload never runs."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    marker = tmp_path / "executed"
    names = sorted(p.stem for p in (out / "checkpoints").glob("*.safetensors"))
    for name in names:
        torch.save(_Payload(marker), out / "checkpoints" / f"{name}.safetensors")
    commands = [["eval", str(out), "--checkpoint", name, "--device", "cpu"] for name in names]
    commands += [["translate", str(out), "--checkpoint", "best", "--device", "cpu"],
                 ["average", str(out), "--last", "2"],
                 ["inspect-heads", str(out), "--checkpoint", "best", "--out", str(tmp_path / "h"), "--device", "cpu"],
                 ["train", str(out / "recipe.toml"), "--out", str(out), "--resume", "--max-steps", "60"]]
    for args in commands:
        result = runner.invoke(app, args, input="Ein Hund.\n")
        assert result.exit_code == 2, (args, result.output)
        assert "safetensors" in result.output and "Traceback" not in result.output, (args, result.output)
        assert not marker.exists(), args


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated"])
def test_a_damaged_last_checkpoint_is_named_and_resume_falls_back_to_the_previous_one(corpus, tmp_path, damage):
    """One flipped bit in the tensor data (the sha256 in the metadata catches it) or a file cut
    in half: eval says so in one line, and --resume continues from checkpoints/previous (the
    last before it), ending with the tensors of a run never interrupted."""
    import struct

    extra = ["train.valid_every=5", "model.dropout=0.3"]
    run(tiny_recipe(corpus, *extra, "train.max_steps=15"), tmp_path / "straight", device="cpu")
    out = tmp_path / "r"
    run(tiny_recipe(corpus, *extra, "train.max_steps=10"), out, device="cpu")
    last = out / "checkpoints" / "last.safetensors"
    assert read_checkpoint(out / "checkpoints" / "previous.safetensors")[1]["progress"]["step"] == 5
    data = bytearray(last.read_bytes())
    if damage == "flipped-byte":
        start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]  # the tensors follow the JSON header
        data[start + 1000] ^= 0x04
    else:
        data = data[: len(data) // 2]
    last.write_bytes(bytes(data))
    with pytest.raises(RunError, match="damaged" if damage == "flipped-byte" else "not a readable"):
        read_checkpoint(last)
    shown = runner.invoke(app, ["eval", str(out), "--checkpoint", "last", "--device", "cpu"])
    assert shown.exit_code == 2 and "last.safetensors" in shown.output and "Traceback" not in shown.output
    events = []
    resumed = run(tiny_recipe(corpus, *extra, "train.max_steps=15"), out, device="cpu", resume=True,
                  on_event=lambda kind, payload: events.append((kind, payload)))
    assert resumed.steps == 15
    assert any("resuming from" in p["message"] and "previous.safetensors (step 5)" in p["message"]
               for k, p in events if k == "warning")
    a, _ = read_checkpoint(tmp_path / "straight" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(last)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("signame", "at"), [("SIGINT", 4), ("SIGTERM", 6), ("SIGHUP", 6)],
                         ids=["ctrl-c", "sigterm-on-a-validation-step", "sighup-on-a-validation-step"])
def test_a_signal_stops_at_a_step_boundary_and_resumes_exactly(corpus, tmp_path, signame, at):
    """Ctrl-C, kill and a closed terminal stop with a checkpoint; one that lands on a
    validation step still validates and keeps that step's checkpoint, so the averaged model
    at the end is the uninterrupted run's."""
    import os
    import signal

    extra = ["model.dropout=0.3", "train.max_steps=12", "train.valid_every=6"]
    straight = run(tiny_recipe(corpus, *extra), tmp_path / "a", device="cpu")

    def interrupt(kind, payload):  # while step `at` runs: after step at - 1's event
        if kind in ("tick", "step") and payload["step"] == at - 1:
            os.kill(os.getpid(), getattr(signal, signame))

    stopped = run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", on_event=interrupt)
    assert (stopped.stop_reason, stopped.steps) == ("interrupted", at)
    resumed = run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", resume=True)
    assert resumed.steps == straight.steps == 12
    assert [r["step"] for r in resumed.history] == [r["step"] for r in straight.history] == [6, 12]
    for name in ("last", "averaged"):
        a, _ = read_checkpoint(tmp_path / "a" / "checkpoints" / f"{name}.safetensors")
        b, _ = read_checkpoint(tmp_path / "b" / "checkpoints" / f"{name}.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def test_a_wsd_run_resumed_inside_its_cooldown_ends_as_the_uninterrupted_one(corpus, tmp_path):
    """The cooldown window is frozen in the checkpoint: a run stopped in the middle of it and
    resumed ends with the uninterrupted run's tensors, its rate the formula's at every step."""
    import os
    import signal

    from tests.test_optim import naive_wsd

    extra = ["model.dropout=0.3", "train.max_steps=12", "train.schedule=wsd", "train.warmup_steps=2",
             "train.decay_fraction=0.5", "train.log_every=1", "train.min_lr=1e-4"]
    straight = run(tiny_recipe(corpus, *extra), tmp_path / "a", device="cpu")

    def interrupt(kind, payload):
        if kind in ("tick", "step") and payload["step"] == 8:
            os.kill(os.getpid(), signal.SIGINT)

    assert run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", on_event=interrupt).steps == 9
    resumed = run(tiny_recipe(corpus, *extra), tmp_path / "b", device="cpu", resume=True)
    assert resumed.steps == straight.steps == 12 and resumed.stop_reason == "max_steps"
    a, _ = read_checkpoint(tmp_path / "a" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "b" / "checkpoints" / "last.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    rates = [r["lr"] for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert rates == pytest.approx([naive_wsd(s, 3e-3, 2, 6, 12, 1e-4, "1-sqrt") for s in range(1, 13)])


def test_a_time_budget_with_wsd_ends_its_cooldown_at_the_deadline(corpus, tmp_path, monkeypatch):
    """Under train.max_time the trainer estimates the last step from the measured speed and
    cools down into it: with a clock that runs at a steady pace (injected), the run stops by
    its time budget within a step or two of both the deadline and its cooldown's planned end,
    the rate near min_lr."""
    import itertools

    from xformer import train as trainer

    ticks = itertools.count()
    monkeypatch.setattr(trainer, "clock", lambda: next(ticks) * 0.25)  # each reading, a quarter second on
    out = tmp_path / "r"
    result = run(tiny_recipe(corpus, "train.schedule=wsd", "train.max_time=0.25", "train.warmup_steps=2",
                             "train.decay_fraction=0.3", "train.log_every=1", "train.valid_every=1000"),
                 out, device="cpu")
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    plan = read_checkpoint_meta(out / "checkpoints" / "last.safetensors")["progress"]
    assert result.stop_reason == "max_time" and plan["decay_limit"] == "max_time", plan
    assert plan["decay_end"] > plan["decay_start"] > 2
    pace = records[-1]["seconds"] - records[-2]["seconds"]  # one step's time on this clock
    assert abs(records[-1]["step"] - plan["decay_end"]) <= 2
    assert 15 - 2 * pace <= records[-1]["seconds"] <= 15 + pace
    assert records[-1]["lr"] < 0.35 * 3e-3 and records[plan["decay_start"] - 1]["lr"] == 3e-3


def test_a_branch_cooling_down_from_a_step_of_a_stable_run_equals_a_run_planned_to_cool_there(corpus, tmp_path):
    """One wsd run (16 steps, cooling from step 12) keeps a branch point every 4 steps; a branch
    from its step 8 with max_steps 11 (a 25% cooldown, from step 8) ends with the tensors of a
    run trained for 11 steps from scratch, records the change, and names where it came from."""
    extra = ["model.dropout=0.3", "train.schedule=wsd", "train.warmup_steps=2", "train.decay_fraction=0.25",
             "train.valid_every=4"]
    stable = tmp_path / "stable"
    run(tiny_recipe(corpus, *extra, "train.max_steps=16", "train.branch_every=4"), stable, device="cpu")
    points = sorted(p.name for p in (stable / "checkpoints").glob("branch_step_*"))
    assert points == [f"branch_step_{s:07d}.safetensors" for s in (4, 8, 12, 16)]
    fresh = tmp_path / "fresh"
    run(tiny_recipe(corpus, *extra, "train.max_steps=11"), fresh, device="cpu")
    branched = runner.invoke(app, ["train", str(stable / "recipe.toml"), "--out", str(tmp_path / "b"),
                                   "--branch-from", str(stable), "--at-step", "8", "--max-steps", "11",
                                   "--set", "train.branch_every=0", "--device", "cpu"])
    assert branched.exit_code == 0, branched.output
    a, _ = read_checkpoint(fresh / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(tmp_path / "b" / "checkpoints" / "last.safetensors")
    for key in a:
        if key.startswith(("model.", "optim.")):
            assert torch.equal(a[key], b[key]), key
    recorded = load_recipe(tmp_path / "b" / "recipe.toml")
    assert [(c.step, c.set) for c in recorded.changes] == [(8, {"train.max_steps": 11, "train.branch_every": 0})]
    assert json.loads((tmp_path / "b" / "branched-from.json").read_text())["step"] == 8
    missing = runner.invoke(app, ["train", str(stable / "recipe.toml"), "--out", str(tmp_path / "c"),
                                  "--branch-from", str(stable), "--at-step", "6", "--device", "cpu"])
    assert missing.exit_code == 2 and "no checkpoint with the optimizer's state at step 6" in missing.stderr
    assert "branch points: 4, 8, 12, 16" in missing.stderr and not (tmp_path / "c").exists()


def test_resuming_a_finished_run_is_refused(trained, corpus):
    out, _ = trained
    with pytest.raises(RunError, match="already stopped by train.max_steps; raise that limit"):
        run(tiny_recipe(corpus, "train.max_steps=40"), out, device="cpu", resume=True)


def test_overwrite_only_replaces_run_directories(corpus, tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(RunError, match="not an xformer run directory"):
        run(tiny_recipe(corpus, "train.max_steps=1"), tmp_path, device="cpu", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_an_existing_tokenizer_must_match_the_recipe(trained, corpus, tmp_path):
    from xformer.tasks.translation_tokenizer import ensure_tokenizer

    out, _ = trained
    with pytest.raises(RunError, match="trained with vocab_size = 300; the recipe says vocab_size = 400"):
        ensure_tokenizer(tiny_recipe(corpus, "data.vocab_size=400", "train.max_steps=1"), out)


def test_a_train_limit_trains_exactly_as_a_corpus_cut_to_that_many_rows(corpus, tmp_path):
    """data.train_limit = N is the corpus with its first N training rows: the tokenizer and every
    weight equal a run on a copy whose train.jsonl holds only those rows. Its tokenizer records
    the limit, so a run without it cannot reuse it, and an older settings.json (no such key)
    still means the whole split."""
    from xformer.errors import RecipeError
    from xformer.tasks.translation_tokenizer import ensure_tokenizer

    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("val", "test"):
        (cut / f"{name}.jsonl").write_bytes((corpus / f"{name}.jsonl").read_bytes())
    rows = (corpus / "train.jsonl").read_text(encoding="utf-8").splitlines()
    (cut / "train.jsonl").write_text("\n".join(rows[:150]) + "\n", encoding="utf-8")

    limited = tiny_recipe(corpus, "data.train_limit=150", "train.max_steps=6", "model.dropout=0.0")
    run(limited, tmp_path / "limited", device="cpu")
    run(tiny_recipe(cut, "train.max_steps=6", "model.dropout=0.0"), tmp_path / "whole", device="cpu")
    spm = "tokenizer/spm.model"
    assert (tmp_path / "limited" / spm).read_bytes() == (tmp_path / "whole" / spm).read_bytes()
    a = read_checkpoint(tmp_path / "limited/checkpoints/last.safetensors")[0]
    b = read_checkpoint(tmp_path / "whole/checkpoints/last.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    settings = tmp_path / "limited/tokenizer/settings.json"
    assert json.loads(settings.read_text())["train_limit"] == 150
    with pytest.raises(RunError, match="trained with train_limit = 150; the recipe says train_limit = 0"):
        ensure_tokenizer(tiny_recipe(corpus, "train.max_steps=1"), tmp_path / "limited")
    older = json.loads(settings.read_text())
    del older["train_limit"]
    settings.write_text(json.dumps(older))
    ensure_tokenizer(tiny_recipe(corpus, "train.max_steps=1"), tmp_path / "limited")  # whole split: accepted
    with pytest.raises(RecipeError, match="data.train_limit: expected 0 .* found -1"):
        tiny_recipe(corpus, "data.train_limit=-1")


def test_averaging_is_the_elementwise_mean_and_keeps_ties(tmp_path):
    from xformer.config.schema import ModelConfig
    from xformer.model.build import build_model
    from xformer.training.checkpoint import average_checkpoints, load_model_weights, save_checkpoint

    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, tie_embeddings="all")
    a, b = build_model(cfg, 30), build_model(cfg, 30)
    save_checkpoint(tmp_path / "a.safetensors", a, meta={})
    save_checkpoint(tmp_path / "b.safetensors", b, meta={})
    mean = build_model(cfg, 30, init=False)
    load_model_weights(mean, average_checkpoints([tmp_path / "a.safetensors", tmp_path / "b.safetensors"]))
    for (name, pa), pb, pm in zip(a.named_parameters(), b.parameters(), mean.parameters(), strict=True):
        torch.testing.assert_close(pm, (pa + pb) / 2, msg=name)
    assert mean.output.weight is mean.encoder.embed.embedding.weight


def test_average_command_reproduces_the_trainers_average_and_never_overwrites(trained):
    out, _ = trained
    result = runner.invoke(app, ["average", str(out), "--last", "2", "--name", "avg2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == [30, 40]
    mine, meta = read_checkpoint(out / "checkpoints" / "avg2.safetensors")
    trainers, _ = read_checkpoint(out / "checkpoints" / "averaged.safetensors")
    assert mine.keys() == trainers.keys() and meta["recipe"]["train"]["average_last"] == 2
    for key in mine:
        torch.testing.assert_close(mine[key], trainers[key], rtol=0, atol=0, msg=key)
    again = runner.invoke(app, ["average", str(out), "--last", "2", "--name", "avg2"])
    assert again.exit_code == 2 and "exists" in again.output
    more = runner.invoke(app, ["average", str(out), "--last", "3"])
    assert more.exit_code == 2 and "2 step checkpoints kept, last = 3" in more.output
    for name in ("../../outside", "sub/avg", ".hidden", "best"):  # never outside RUN/checkpoints, never over its own
        refused = runner.invoke(app, ["average", str(out), "--last", "2", "--name", name])
        assert refused.exit_code == 2 and f"--name {name!r}: expected a plain file name" in refused.stderr, name
    assert not (out.parent / "outside.safetensors").exists() and not (out / "outside.safetensors").exists()
    scored = runner.invoke(app, ["eval", str(out), "--checkpoint", "avg2", "--split", "validation", "--json"])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["checkpoint"] == "avg2"


def test_a_batch_budget_the_longest_pair_does_not_fit_is_refused_naming_it(corpus, tmp_path):
    result = runner.invoke(app, ["train", str(RECIPE), *[a for s in TINY for a in ("--set", s)],
                                 "--set", f"data.dataset={json.dumps(str(corpus))}", "--set", "data.max_tokens=1",
                                 "--max-steps", "1", "--out", str(tmp_path / "r"), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("data.max_tokens = 1: the longest training pair") and "expected data.max_tokens >= " in line
    needed = int(line.split("expected data.max_tokens >= ")[1].split(",")[0])
    fits = runner.invoke(app, ["train", str(RECIPE), *[a for s in TINY for a in ("--set", s)],
                               "--set", f"data.dataset={json.dumps(str(corpus))}", "--set", f"data.max_tokens={needed}",
                               "--max-steps", "1", "--out", str(tmp_path / "r2"), "--device", "cpu"])
    assert fits.exit_code == 0, fits.output  # the least budget it asked for is enough


def test_a_non_finite_validation_is_never_the_best_and_is_written_as_valid_json(corpus, tmp_path):
    """Validation of a model gone NaN: recorded with null and what it was, never saved as best,
    neither as the first validation nor after a finite one."""
    from xformer.training.progress import Progress
    from xformer.training.state import validate_and_save

    recipe = tiny_recipe(corpus, "train.average_last=0", "train.max_steps=3")
    nan = float("nan")
    scores = iter([{"loss": nan, "bleu": nan}, {"loss": 3.0, "bleu": 1.0}, {"loss": nan, "bleu": nan}])
    task = type("Task", (), {"validate": lambda self, model, rt: next(scores)})()
    model, progress, out = torch.nn.Linear(2, 2), Progress(), tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    metric = recipe.best_metric
    for step in (1, 2, 3):
        progress.step = step
        validate_and_save(model, recipe, task, resolve_runtime("cpu", "fp32"), progress, out,
                          lambda kind, payload: None, lambda: 0.0, {})
        best = out / "checkpoints" / "best.safetensors"
        assert (best.is_file() and read_checkpoint_meta(best)["step"]) == (False if step == 1 else 2), (step, metric)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda word: pytest.fail(f"bare {word} in JSON")) for line in lines]
    assert [r["best"] for r in records] == [False, True, False]
    assert records[0]["loss"] is None and records[0]["nonfinite"] == {"loss": "nan", "bleu": "nan"}


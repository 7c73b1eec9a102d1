"""train.regularisation = "budget": dropout, label smoothing and subword sampling chosen from the
epochs a run will train, recorded in recipe.toml and train.json, kept on resume."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from xformer.config.loading import load_recipe
from xformer.train import run
from xformer.training.budget import RULE, in_hindsight, row_for
from xformer.training.checkpoint import read_checkpoint
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
# big batches: the 600 training pairs of the corpus fixture are a few steps an epoch
TINY = ["train.schedule=inverse_sqrt", "train.regularisation=recipe",  # the mechanics tested, not the recipe's choice
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=4096", "train.warmup_steps=4",
        "train.lr=3e-3", "train.log_every=1", "train.valid_every=1000", "train.average_last=1",
        "train.max_time=0.0", "eval.beam=2", "eval.batch_sentences=16", "train.best_metric=loss"]


def recipe(corpus, *extra):
    return load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", *extra])


def tensors(folder: Path) -> dict:
    found, _ = read_checkpoint(folder / "checkpoints" / "last.safetensors")
    return {k: v for k, v in found.items() if k.startswith(("model.", "optim."))}


def test_the_rule_has_one_row_for_every_budget():
    assert row_for(7.0) == RULE[0][1] and row_for(0.5) == RULE[0][1]
    assert row_for(RULE[0][0]) == RULE[1][1] and row_for(1e6) == RULE[-1][1]
    assert row_for(7.0)["model.dropout"] < row_for(30.0)["model.dropout"]  # more epochs, more regularisation
    assert row_for(30.0)["data.sampling_alpha"] > 0 == row_for(7.0)["data.sampling_alpha"]


def test_a_step_budget_chooses_from_its_epochs_and_trains_as_if_the_values_were_written(corpus, tmp_path):
    """max_steps over steps per epoch, known before the model is built. A long budget takes the
    second row (dropout, subword sampling): the run writes those values into its recipe.toml,
    explains them in train.json, and ends with the tensors of a run given them in the recipe."""
    short = run(recipe(corpus, "train.max_steps=2", "train.regularisation=budget"), tmp_path / "short", device="cpu")
    per_epoch = round(2 / short.regularisation["expected_epochs"])
    assert short.regularisation["chosen"] == RULE[0][1] and "train.max_steps = 2" in \
        short.regularisation["estimated_from"]
    steps = per_epoch * int(RULE[0][0]) + per_epoch  # past the boundary
    long = run(recipe(corpus, f"train.max_steps={steps}", "train.regularisation=budget"), tmp_path / "long",
               device="cpu")
    record = json.loads((tmp_path / "long" / "train.json").read_text())["regularisation"]
    assert record["expected_epochs"] == pytest.approx(steps / per_epoch, abs=1e-3)
    assert record["chosen"] == RULE[1][1] and record["was"]["model.dropout"] == 0.1
    saved = load_recipe(tmp_path / "long" / "recipe.toml")
    assert (saved.model.dropout, saved.data.sampling_alpha, saved.train.regularisation) == (0.2, 0.3, "budget")
    written = [f"{k}={v}" for k, v in RULE[1][1].items()]
    run(recipe(corpus, f"train.max_steps={steps}", *written), tmp_path / "written", device="cpu")
    a, b = tensors(tmp_path / "long"), tensors(tmp_path / "written")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert long.steps == steps


def test_a_time_budget_calibrates_inside_it_and_leaves_no_trace(corpus, tmp_path, monkeypatch):
    """Under max_time the epochs come from timed steps of a throwaway model and one validation,
    on the run's clock (injected: each reading a tenth of a second on). The calibration's
    readings come out of the budget, and the run ends with the tensors of a run that trained as
    many steps with the chosen values written, so the throwaway model drew nothing from the RNG."""
    from xformer import train as trainer

    ticks = itertools.count()
    monkeypatch.setattr(trainer, "clock", lambda: next(ticks) * 0.1)
    timed = run(recipe(corpus, "train.max_time=0.05", "train.regularisation=budget"), tmp_path / "timed",
                device="cpu")
    record = timed.regularisation
    assert "train.max_time = 0.05 min" in record["estimated_from"] and "a validation measured" in \
        record["estimated_from"]
    assert timed.stop_reason == "max_time" and 0 < record["expected_epochs"]
    assert record["chosen"] == row_for(record["expected_epochs"])
    assert record["trained_epochs"] == timed.epochs  # told in hindsight, beside what was expected
    monkeypatch.setattr(trainer, "clock", lambda: 0.0)
    written = [f"{k}={v}" for k, v in record["chosen"].items()]
    run(recipe(corpus, f"train.max_steps={timed.steps}", *written), tmp_path / "steps", device="cpu")
    a, b = tensors(tmp_path / "timed"), tensors(tmp_path / "steps")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_time_budget_that_trained_another_rows_epochs_says_so_in_hindsight():
    """A calibration that misjudged the pace (seen: 6.6 s a step measured, 0.66 in the run) chose
    the row for 3.4 epochs in a run that trained 34: train.json names the row for 34, and the
    run warns. A run its budget did not end (a step budget, an interrupted run) is left alone."""
    light, heavy = (row_for(e) for e in (3.0, 34.0))
    record = {"rule": "budget", "expected_epochs": 3.4, "estimated_from": "train.max_time = 50 min: ...",
              "chosen": light, "was": light}
    said = []
    told = in_hindsight(record, 34.0, "max_time", lambda kind, data: said.append((kind, data["message"])))
    assert told["row_for_trained"] == heavy != light and told["trained_epochs"] == 34.0
    assert len(said) == 1 and said[0][0] == "warning" and "trained 34.0" in said[0][1]
    assert "row_for_trained" not in in_hindsight(record, 3.9, "max_time", lambda *_: None)
    assert in_hindsight(record, 34.0, "max_steps", lambda *_: None) == record
    assert in_hindsight(record, 34.0, "interrupted", lambda *_: None) == record
    assert in_hindsight(None, 34.0, "max_time", lambda *_: None) is None


@pytest.mark.parametrize("eos_bias", [1e4, -1e4])
def test_the_calibration_validates_as_long_as_the_references_whatever_the_model_says(corpus, tmp_path, eos_bias):
    """An untrained model ends every translation at once or never, so its validation cost said
    nothing of a trained model's. The calibration's validation decodes each validation source
    to its reference's length: one decoder row a piece and one for the EOS, whichever it is."""
    from xformer.tasks import make_task
    from xformer.training.device import resolve_runtime

    task = make_task(recipe(corpus, "train.best_metric=bleu", "train.max_steps=1"))
    task.load(lambda *_: None)
    task.prepare(tmp_path, lambda *_: None)
    model, rt = task.build_model().eval(), resolve_runtime("cpu", "fp32")
    decode, rows = model.decode, []

    def steered(prev, *rest):
        logits = decode(prev, *rest)
        logits[..., 3] += eos_bias  # EOS
        rows.append(prev.size(0))
        return logits

    model.decode = steered
    scores = task.validate_as_trained(model, rt)
    assert sum(rows) == sum(len(ids) + 1 for ids in task.valid_data["tgt_ids"])
    assert 0 <= scores["bleu"] <= 100 and scores["loss"] > 0
    rows.clear()
    task.validate(model, rt)  # the validation itself follows the model: all at once, or to max_len
    assert sum(rows) == len(task.refs) if eos_bias > 0 else sum(rows) > 2 * len(task.refs)


def test_a_resumed_budget_run_keeps_its_choice_from_the_recipe_file(corpus, tmp_path):
    """The recipe file says dropout 0.1 and "budget"; the run chose 0.2 (and subword sampling).
    Resuming it from the same file with a raised limit is not a change of [model] or [data]: it
    goes on with what it chose, and its train.json still says why."""
    file = tmp_path / "recipe.toml"
    file.write_text(recipe(corpus, "train.regularisation=budget", "train.max_steps=1").to_toml())
    first = run(recipe(corpus, "train.max_steps=2", "train.regularisation=budget"), tmp_path / "r", device="cpu")
    per_epoch = round(2 / first.regularisation["expected_epochs"])
    steps = per_epoch * int(RULE[0][0]) + per_epoch
    out = tmp_path / "long"
    made = CliRunner().invoke(app, ["train", str(file), "--out", str(out), "--max-steps", str(steps),
                                    "--device", "cpu"])
    assert made.exit_code == 0, made.output
    assert load_recipe(out / "recipe.toml").model.dropout == 0.2
    resumed = CliRunner().invoke(app, ["train", str(file), "--out", str(out), "--resume", "--max-steps",
                                       str(steps + 2), "--device", "cpu"])
    assert resumed.exit_code == 0, resumed.output
    saved = load_recipe(out / "recipe.toml")
    assert saved.model.dropout == 0.2 and saved.data.sampling_alpha == 0.3
    assert [c.set for c in saved.changes] == [{"train.max_steps": steps + 2}]  # the limit only
    record = json.loads((out / "train.json").read_text())
    assert record["steps"] == steps + 2 and record["regularisation"]["chosen"]["model.dropout"] == 0.2

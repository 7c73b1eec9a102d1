"""Paired significance between two runs on one test set: sacreBLEU's paired bootstrap, wired
so that its numbers are the runs' own scores, and refused where the comparison means nothing."""

import json
import re

import pytest
import sacrebleu
from typer.testing import CliRunner

from tests.test_train import tiny_recipe
from xformer.errors import DataError
from xformer.significance import paired_bleu
from xformer.train import run
from xformer_cli.main import app

runner = CliRunner()
REFS = ["A dog runs through the park .", "Two men play football on the beach .", "A cat sleeps on a red mat .",
        "A woman rides a bicycle down the street .", "Children are playing in the snow ."] * 12


def test_the_scores_are_sacrebleus_and_a_clear_gap_is_significant():
    worse = [" ".join(r.split()[: len(r.split()) // 2]) for r in REFS]
    better = [r if i % 3 else w for i, (r, w) in enumerate(zip(REFS, worse, strict=True))]
    got = paired_bleu(better, worse, REFS)
    assert got.bleu == pytest.approx(sacrebleu.corpus_bleu(better, [REFS]).score)
    assert got.baseline_bleu == pytest.approx(sacrebleu.corpus_bleu(worse, [REFS]).score)
    assert got.difference == pytest.approx(got.bleu - got.baseline_bleu) and got.difference > 10
    assert got.p_value < 0.01 and got.samples == 1000
    assert got.baseline_mean - got.baseline_interval <= got.baseline_bleu <= (
        got.baseline_mean + got.baseline_interval + 1.0)
    assert "bs:1000" in got.signature
    assert paired_bleu(better, worse, REFS) == got  # sacreBLEU's fixed seed: the same p-value every time


def test_identical_outputs_are_no_difference_and_a_mismatch_is_refused():
    same = paired_bleu(REFS[::-1], REFS[::-1], REFS)
    assert same.difference == 0.0 and same.p_value == 1.0
    # two different outputs that both score 0 (two diverged models): no gap in any resample
    nothing = paired_bleu(["zzz qqq"] * 60, ["xxx yyy www"] * 60, REFS)
    assert nothing.bleu == nothing.baseline_bleu == 0.0 and nothing.p_value == 1.0
    with pytest.raises(DataError, match="59 hypotheses, 60 baseline hypotheses and 60 references"):
        paired_bleu(REFS[:-1], REFS, REFS)


@pytest.fixture(scope="module")
def two_runs(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair")
    for name, steps in (("short", 4), ("long", 30)):
        run(tiny_recipe(corpus, f"train.max_steps={steps}", "train.valid_every=1000", "train.average_last=0"),
            folder / name, device="cpu")
    return folder / "long", folder / "short"


def test_eval_baseline_reports_both_runs_own_scores_and_writes_the_comparison(two_runs):
    system, baseline = two_runs
    alone = runner.invoke(app, ["eval", str(baseline), "--beam", "1", "--device", "cpu", "--json"])
    assert alone.exit_code == 0, alone.output
    paired = runner.invoke(app, ["eval", str(system), "--beam", "1", "--device", "cpu", "--baseline",
                                 str(baseline), "--json"])
    assert paired.exit_code == 0, paired.output
    report = json.loads(paired.stdout)
    p = report["paired"]
    assert p["bleu"] == pytest.approx(report["bleu"])
    assert p["baseline_bleu"] == pytest.approx(json.loads(alone.stdout)["bleu"])
    assert 0 < p["p_value"] <= 1 and p["baseline"] == str(baseline)
    # one flat object, its keys in the order eval JSONs have always had them
    assert list(p) == ["baseline", "baseline_checkpoint", "baseline_beam", "test", "samples", "bleu", "baseline_bleu",
                       "difference", "p_value", "mean", "interval", "baseline_mean", "baseline_interval", "signature"]
    written = list((system / "eval").glob("*.vs-short.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["p_value"] == p["p_value"]
    shown = runner.invoke(app, ["eval", str(system), "--beam", "1", "--device", "cpu", "--baseline", str(baseline)])
    assert shown.exit_code == 0 and "paired bootstrap against" in shown.output and "p-value" in shown.output


def test_a_baseline_on_another_test_set_is_refused_in_one_line(two_runs, corpus, tmp_path):
    system, baseline = two_runs
    other = tmp_path / "half.jsonl"
    other.write_text("\n".join((corpus / "test.jsonl").read_text().splitlines()[:20]) + "\n")
    # the baseline decodes --data too, so both see the same set: allowed
    same = runner.invoke(app, ["eval", str(system), "--data", str(other), "--beam", "1", "--device", "cpu",
                               "--baseline", str(baseline), "--json"])
    assert same.exit_code == 0 and json.loads(same.stdout)["paired"]["baseline_bleu"] >= 0
    # a baseline whose recipe names another corpus, with another test split
    import shutil

    shutil.copytree(corpus, tmp_path / "corpus")
    (tmp_path / "corpus" / "test.jsonl").write_text(other.read_text())
    moved = tmp_path / "moved"
    shutil.copytree(baseline, moved)
    recipe = (moved / "recipe.toml").read_text()
    (moved / "recipe.toml").write_text(recipe.replace(json.dumps(str(corpus)), json.dumps(str(tmp_path / "corpus"))))
    bad = runner.invoke(app, ["eval", str(system), "--beam", "1", "--device", "cpu", "--baseline", str(moved)])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "its test set has other references" in bad.stderr and "(20 against 40 sentences)" in bad.stderr
    nothing = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(tmp_path / "none")])
    assert nothing.exit_code == 2 and "Traceback" not in nothing.output


def test_mcnemar_is_the_exact_binomial_on_the_disagreements():
    """Against every assignment of the discordant examples written out: the two-sided p is the
    share of equally likely outcomes at least as lopsided as the one seen."""
    import itertools

    from xformer.significance import mcnemar

    correct = [True] * 7 + [False] * 2 + [True] * 5 + [False] * 3   # 7 wins, 2 losses, 8 ties
    baseline = [False] * 7 + [True] * 2 + [True] * 5 + [False] * 3
    got = mcnemar(correct, baseline)
    assert (got.wins, got.losses) == (7, 2)
    n, seen = 9, abs(7 - 2)
    outcomes = list(itertools.product([0, 1], repeat=n))
    naive = sum(abs(2 * sum(o) - n) >= seen for o in outcomes) / len(outcomes)
    assert got.p_value == pytest.approx(naive)
    assert got.difference == pytest.approx(100 * (12 - 7) / 17)
    assert mcnemar(correct, correct).p_value == 1.0
    with pytest.raises(DataError, match="17 predictions against 16"):
        mcnemar(correct, baseline[:-1])


def test_mcnemars_interval_is_196_standard_errors_of_the_mean_paired_difference():
    """The 95% interval of the accuracy difference, against the standard error of the mean of
    the per-example differences (right - wrong in {-1, 0, 1}) computed directly, and by hand."""
    import numpy as np

    from xformer.significance import mcnemar

    rng = np.random.default_rng(0)
    correct = rng.random(400) < 0.7
    baseline = np.where(rng.random(400) < 0.8, correct, ~correct)  # disagree on ~20% of the examples
    got = mcnemar(correct.tolist(), baseline.tolist())
    differences = correct.astype(float) - baseline.astype(float)
    assert got.difference_interval == pytest.approx(100 * 1.96 * np.sqrt(differences.var() / 400))
    # 3 wins, 1 loss, 6 ties: d = 0.2, variance of the differences 4/10 - 0.2^2 = 0.36
    by_hand = mcnemar([True] * 3 + [False] + [True] * 6, [False] * 3 + [True] * 7)
    assert by_hand.difference_interval == pytest.approx(100 * 1.96 * (0.36 / 10) ** 0.5)
    assert by_hand.difference_interval == pytest.approx(37.19, abs=0.01)
    assert mcnemar([True, False], [True, False]).difference_interval == 0.0


def test_a_predictions_file_of_another_length_is_refused(tmp_path):
    from xformer.significance import right_or_wrong

    pred = tmp_path / "test.best.pred"
    pred.write_text("1\n2\n")
    assert right_or_wrong(pred, ["1", "3"]) == [True, False]
    with pytest.raises(DataError, match=r"test.best.pred: 2 predictions for 3 examples"):
        right_or_wrong(pred, ["1", "2", "3"])


@pytest.fixture(scope="module")
def two_classifiers(tmp_path_factory):
    """Two tiny recall runs on one generated test set: one trained 12 steps, one 2."""
    from pathlib import Path

    from xformer.config.loading import load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "longrange" / "recall_transformer.toml"
    tiny = ["data.n_train=64", "data.n_valid=32", "data.n_test=48", "data.max_len=32", "data.curriculum_lengths=[]",
            "data.curriculum_steps=[]", "train.valid_every=1000", "model.d_model=16", "model.d_ff=32",
            "model.n_heads=2", "train.lr=3e-3"]
    folder = tmp_path_factory.mktemp("classifiers")
    for name, steps in (("long", 12), ("short", 2)):
        run(load_recipe(recipe, [*tiny, f"train.max_steps={steps}"]), folder / name, device="cpu")
    run(load_recipe(recipe, [*tiny, "train.max_steps=2", "data.seed=7"]), folder / "other", device="cpu")
    run(load_recipe(recipe, [*tiny, "train.max_steps=2", "data.n_test=40"]), folder / "fewer", device="cpu")
    return folder


def test_eval_baseline_pairs_classification_runs_by_mcnemar_on_their_own_predictions(two_classifiers):
    system, baseline = two_classifiers / "long", two_classifiers / "short"
    alone = runner.invoke(app, ["eval", str(baseline), "--device", "cpu", "--json"])
    assert alone.exit_code == 0, alone.output
    alone = json.loads(alone.stdout)
    paired = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(baseline), "--json"])
    assert paired.exit_code == 0, paired.output
    report = json.loads(paired.stdout)
    p = report["paired"]
    assert (p["accuracy"], p["baseline_accuracy"]) == (report["accuracy"], alone["accuracy"])
    assert list(p) == ["baseline", "baseline_checkpoint", "accuracy", "baseline_accuracy", "test", "wins", "losses",
                       "difference", "p_value", "difference_interval"]
    # McNemar's counts from the two prediction files and the generated test set's labels
    from xformer.config.loading import load_run_recipe
    from xformer.tasks import make_task

    gold = [label for _, label in make_task(load_run_recipe(system)).scored_set(None, None)]
    mine = (system / "eval" / "test.best.pred").read_text().splitlines()
    theirs = (baseline / "eval" / "test.best.pred").read_text().splitlines()
    assert len(gold) == len(mine) == len(theirs) == 48
    wins = sum(m == g != t for m, t, g in zip(mine, theirs, gold, strict=True))
    losses = sum(t == g != m for m, t, g in zip(mine, theirs, gold, strict=True))
    assert (p["wins"], p["losses"]) == (wins, losses)
    assert p["difference"] == pytest.approx(report["accuracy"] - alone["accuracy"]) and 0 < p["p_value"] <= 1
    assert json.loads((system / "eval" / "test.best.vs-short.json").read_text())["p_value"] == p["p_value"]
    shown = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(baseline)])
    assert shown.exit_code == 0 and "McNemar's exact test against" in shown.output and "p-value" in shown.output


def test_a_classification_baseline_on_other_examples_or_another_task_is_refused(two_classifiers, two_runs):
    system = two_classifiers / "long"
    other = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(two_classifiers / "other")])
    assert other.exit_code == 2 and "Traceback" not in other.output
    assert "its test set has other examples" in other.stderr
    assert "the same [data] settings (seed, n_test" in other.stderr
    assert re.search(r"\(example \d+: (label '\d+' against '\d+'|the same label, another input)\)", other.stderr)
    scored = (system / "eval" / "test.best.pred").stat().st_mtime_ns
    fewer = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(two_classifiers / "fewer")])
    assert fewer.exit_code == 2 and "(40 against 48 examples)" in fewer.stderr
    # refused before either run was scored
    assert not (two_classifiers / "fewer" / "eval.json").exists()
    assert (system / "eval" / "test.best.pred").stat().st_mtime_ns == scored
    translation = runner.invoke(app, ["eval", str(system), "--device", "cpu", "--baseline", str(two_runs[0])])
    assert translation.exit_code == 2 and "Traceback" not in translation.output
    assert "a translation run; a recall run compares with a recall run" in translation.stderr

"""Paired significance between two runs on one test set: sacreBLEU's paired bootstrap, wired
so that its numbers are the runs' own scores, and refused where the comparison means nothing."""

import json

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
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(better, [REFS]).score)
    assert got["baseline_bleu"] == pytest.approx(sacrebleu.corpus_bleu(worse, [REFS]).score)
    assert got["difference"] == pytest.approx(got["bleu"] - got["baseline_bleu"]) and got["difference"] > 10
    assert got["p_value"] < 0.01 and got["samples"] == 1000
    assert got["baseline_mean"] - got["baseline_interval"] <= got["baseline_bleu"] <= (
        got["baseline_mean"] + got["baseline_interval"] + 1.0)
    assert "bs:1000" in got["signature"]
    assert paired_bleu(better, worse, REFS) == got  # sacreBLEU's fixed seed: the same p-value every time


def test_identical_outputs_are_no_difference_and_a_mismatch_is_refused():
    same = paired_bleu(REFS[::-1], REFS[::-1], REFS)
    assert same["difference"] == 0.0 and same["p_value"] == 1.0
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
    assert (got["wins"], got["losses"]) == (7, 2)
    n, seen = 9, abs(7 - 2)
    outcomes = list(itertools.product([0, 1], repeat=n))
    naive = sum(abs(2 * sum(o) - n) >= seen for o in outcomes) / len(outcomes)
    assert got["p_value"] == pytest.approx(naive)
    assert got["difference"] == pytest.approx(100 * (12 - 7) / 17)
    assert mcnemar(correct, correct)["p_value"] == 1.0
    with pytest.raises(DataError, match="17 predictions against 16"):
        mcnemar(correct, baseline[:-1])

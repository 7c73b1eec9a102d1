"""The claims ledger: each check's verdict from per-seed differences and paired tests, the
claim's verdict from its checks, and `xformer claims` writing docs/claims.md from real
experiment folders or, where a folder is gone, from the records it kept."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_experiment import recall_spec
from xformer.claims import Check, describe, judge, verdict
from xformer.ledger import ledger_problems, read_spec
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def results(tests: dict[str, list[float]], p: dict[str, list[float]], baseline: str = "base") -> dict:
    """An experiment's results.json as the ledger reads it: per-seed test scores and, per cell
    but the baseline, each seed's paired p-value."""
    seeds = list(range(1, len(tests[baseline]) + 1))
    cells = [{"cell": c} if c == baseline else
             {"cell": c, "paired": [{"seed": s, "p_value": v} for s, v in zip(seeds, p[c], strict=True)]}
             for c in tests]
    runs = [{"cell": c, "seed": s, "test": t} for c, scores in tests.items()
            for s, t in zip(seeds, scores, strict=True)]
    return {"baseline": baseline, "seeds": seeds, "cells": cells, "runs": runs}


BASE = [10.0, 12.0]  # mean 11: 1% is 0.11, 15% is 1.65


@pytest.mark.parametrize(("scores", "p", "check", "expected"), [
    # better: both seeds up, both significant, mean +1 >= 5% of 11 (0.55)
    ([11.0, 13.0], [0.01, 0.02], Check("x", "better", percent=5), "supported"),
    # ... but one seed not significant: not shown
    ([11.0, 13.0], [0.01, 0.20], Check("x", "better", percent=5), "inconclusive"),
    # ... both up and significant, but the claimed 15% (1.65) is above every seed's +1.0, and
    # the mean's standard error is 0 (both +1): short of the claim
    ([11.0, 13.0], [0.01, 0.02], Check("x", "better", percent=15), "contradicted"),
    # ... the other way in both seeds, significantly
    ([9.0, 11.5], [0.01, 0.04], Check("x", "better"), "contradicted"),
    # ... the seeds disagree
    ([10.5, 11.0], [0.03, 0.03], Check("x", "better"), "inconclusive"),
    # better by 0.5 to 1% (0.055 to 0.11): +1 in both seeds is far more than claimed
    ([11.0, 13.0], [0.01, 0.02], Check("x", "better", percent=0.5, up_to=1), "contradicted"),
    # ... by 5 to 10% (0.55 to 1.1): +1 is inside
    ([11.0, 13.0], [0.01, 0.02], Check("x", "better", percent=5, up_to=10), "supported"),
    # ... +0.5 and +1.5 (mean 1.0 inside, one seed beyond): inside on average
    ([10.5, 13.5], [0.01, 0.02], Check("x", "better", points=0.5, up_to=1.2), "supported"),
    # worse by at least 1 point: -1.5 and -2.0
    ([8.5, 10.0], [0.001, 0.001], Check("x", "worse", points=1), "supported"),
    # not_better: level once, up once but not significantly (mean above zero)
    ([10.0, 13.0], [0.50, 0.30], Check("x", "not_better"), "inconclusive"),
    ([9.0, 11.9], [0.01, 0.60], Check("x", "not_better"), "supported"),
    ([11.0, 13.0], [0.01, 0.01], Check("x", "not_better"), "contradicted"),
    # not_worse by 10% (1.1): -1.0 and -0.5 pass; -1.5 and -2 fail significantly
    ([9.0, 11.5], [0.01, 0.30], Check("x", "not_worse", percent=10), "supported"),
    ([8.5, 10.0], [0.01, 0.01], Check("x", "not_worse", percent=10), "contradicted"),
    ([8.5, 12.0], [0.01, 1.00], Check("x", "not_worse", percent=10), "inconclusive"),
    # same within 0.3 points
    ([10.2, 11.8], [0.4, 0.5], Check("x", "same", points=0.3), "supported"),
    ([11.0, 13.0], [0.01, 0.01], Check("x", "same", points=0.3), "contradicted"),
    ([11.0, 13.0], [0.01, 0.40], Check("x", "same", points=0.3), "inconclusive"),
])
def test_a_check_is_judged_on_every_seed_and_its_paired_test(scores, p, check, expected):
    outcome = judge(check, results({"base": BASE, "x": scores}, {"x": p}))
    assert outcome.verdict == expected, outcome.reason
    assert "x - base per seed" in outcome.reason


def test_a_supported_gap_is_reported_as_measured_beside_the_claim_even_from_a_zero_baseline():
    outcome = judge(Check("x", "better", percent=5), results({"base": BASE, "x": [11.0, 13.0]}, {"x": [0.01, 0.02]}))
    assert "by 9.1% on average (claimed 5%)" in outcome.reason  # +1 over a mean of 11
    # a baseline that learned nothing (0 in every seed): a percent of it claims nothing more than "better"
    zero = judge(Check("x", "better", percent=5), results({"base": [0.0, 0.0], "x": [3.0, 4.0]}, {"x": [0.01, 0.01]}))
    assert zero.verdict == "supported" and zero.reason.endswith("better in every seed")


def test_a_check_between_two_cells_that_are_not_the_baseline_has_no_paired_test():
    data = results({"base": BASE, "a": [11.0, 13.0], "b": [12.0, 14.0]}, {"a": [0.01, 0.01], "b": [0.01, 0.01]})
    outcome = judge(Check("b", "better", than="a"), data)
    assert outcome.verdict == "supported" and "no paired test" in outcome.reason
    assert "+1.00 (+8.3%)" in outcome.reason  # b - a in seed 1, relative to a's mean of 12


def test_a_speed_check_compares_the_timed_speeds_without_a_significance_test():
    # the test scores would say "worse"; the check reads decode speeds: 3.0x and 3.5x the baseline's
    data = results({"base": BASE, "fast": [9.0, 11.0]}, {"fast": [0.01, 0.01]})
    for run, speed in zip(data["runs"], [10.0, 20.0, 30.0, 70.0], strict=True):
        run["decode_per_s"] = speed
    outcome = judge(Check("fast", "better", percent=200, up_to=400, metric="decode_speed"), data)
    assert outcome.verdict == "supported", outcome.reason
    assert "decode_per_s per seed: +20.00 (+133.3%), +50.00 (+333.3%)" in outcome.reason  # of the mean, 15
    assert "timed; no significance test" in outcome.reason
    assert judge(Check("fast", "better", percent=500, metric="decode_speed"), data).verdict == "contradicted"
    untimed = judge(Check("fast", "better", metric="train_speed"), data)
    assert untimed.verdict == "inconclusive" and "train speed was not timed" in untimed.reason
    assert describe(Check("fast", "better", percent=200, metric="decode_speed"), "base") == \
        "fast in decode speed better than base by 200%"


def test_a_speed_timed_beside_other_work_judges_nothing():
    data = results({"base": BASE, "fast": [9.0, 11.0]}, {"fast": [0.01, 0.01]})
    for run, speed, others in zip(data["runs"], [10.0, 20.0, 30.0, 70.0], [0.0, 0.9, 0.1, None], strict=True):
        run["decode_per_s"], run["decode_others_cpu"] = speed, others
    check = Check("fast", "better", percent=200, up_to=400, metric="decode_speed")
    outcome = judge(check, data)
    assert outcome.verdict == "inconclusive", outcome.reason
    assert "base-s2 (0.90 cores)" in outcome.reason and "fast-s" not in outcome.reason  # 0.1 and unknown pass
    data["runs"][1]["decode_others_cpu"] = 0.2  # under BUSY_OVER
    assert judge(check, data).verdict == "supported"
    data["runs"][1]["train_others_cpu"] = 2.0  # another speed's timing is not this check's business
    assert judge(check, data).verdict == "supported"


def test_a_memory_check_reads_the_kv_cache_as_larger_or_smaller():
    data = results({"base": BASE, "mqa": [9.0, 11.0]}, {"mqa": [0.01, 0.01]})
    for run, mb in zip(data["runs"], [8.0, 8.0, 2.0, 2.0], strict=True):
        run["decode_cache_mb"] = mb
    check = Check("mqa", "worse", percent=70, up_to=80, metric="decode_memory")  # a 4-head cache cut 4-fold
    outcome = judge(check, data)
    assert outcome.verdict == "supported", outcome.reason
    assert "decode_cache_mb per seed: -6.00 (-75.0%), -6.00 (-75.0%) (measured; no significance test)" in outcome.reason
    assert "smaller in every seed" in outcome.reason
    assert describe(check, "base") == "mqa in decode memory smaller than base by 70% to 80%"
    assert judge(Check("mqa", "worse", percent=80, metric="decode_memory"), data).verdict == "contradicted"
    data["runs"][0]["decode_cache_mb"] = None  # a run scored before the cache was measured
    assert "decode memory was not measured" in judge(check, data).reason


def test_a_claim_depends_when_its_parts_disagree_and_fails_with_a_failed_part():
    data = results({"base": BASE, "a": [11.0, 13.0], "b": [9.0, 11.0]}, {"a": [0.01, 0.01], "b": [0.01, 0.01]})
    up, down = (judge(Check(c, "better"), data) for c in ("a", "b"))
    assert (up.verdict, down.verdict) == ("supported", "contradicted")
    assert verdict([up, down]) == "depends"
    assert verdict([up, up]) == "supported"
    assert verdict([up, judge(Check("a", "better", percent=50), data)]) == "depends"
    # up in both seeds but neither significant against the baseline: not shown either way
    noise = judge(Check("c", "better"), results({"base": BASE, "c": [10.2, 12.3]}, {"c": [0.40, 0.30]}))
    assert noise.verdict == "inconclusive", noise.reason
    assert verdict([down, noise]) == "contradicted"  # a part fails and nothing holds: the claim fails
    assert verdict([up, noise]) == "inconclusive"  # a part holds, the rest unknown: the claim is unknown
    assert verdict([up, down, noise]) == "depends"  # a part holds and a part fails


SPEC = "# Claim: deeper is better\n" + recall_spec([1, 2]) + """
[claim]
number = 3
says = "Two layers beat one."
scale = "a 4-step toy"

[[claim.checks]]
cell = "one"
expect = "worse"
"""

BLOCKED = """[claim]
number = 1
says = "Something xformer cannot build yet."
blocked = "a missing model field"
"""


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    """Two claim specs (one measured by a real recall experiment, one blocked), the experiment
    run, and the ledger written by the CLI."""
    folder = tmp_path_factory.mktemp("claims")
    specs = folder / "specs"
    specs.mkdir()
    (specs / "depth.toml").write_text(SPEC)
    (specs / "blocked.toml").write_text(BLOCKED)
    trained = runner.invoke(app, ["experiment", str(specs / "depth.toml"), "--out", str(folder / "runs" / "depth"),
                                  "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    out = folder / "docs" / "claims.md"
    made = runner.invoke(app, ["claims", str(specs), "--runs", str(folder / "runs"), "--out", str(out), "--json"])
    assert made.exit_code == 0, made.output
    return folder, specs, out, json.loads(made.stdout.strip().splitlines()[-1])


def test_the_ledger_judges_each_claim_from_its_experiment(ledger):
    folder, specs, out, report = ledger
    blocked, depth = report["rows"]  # ordered by claim number
    assert (blocked["number"], blocked["verdict"], blocked["blocked"]) == (1, "not measurable yet",
                                                                           "a missing model field")
    measured = json.loads((folder / "runs" / "depth" / "results.json").read_text())
    from xformer.ledger import read_spec

    _, experiment = read_spec(specs / "depth.toml")
    expected = judge(experiment.checks[0], measured)
    assert depth["checks"][0]["verdict"] == expected.verdict and depth["verdict"] == verdict([expected])
    text = out.read_text()
    assert "| 3 | Two layers beat one. |" in text and f"**Verdict: {expected.verdict}.**" in text
    two, one = measured["cells"][1], measured["cells"][0]  # the ledger's row says the numbers behind it
    assert (two["cell"], one["cell"]) == ("two", "one")
    assert (f"| 3 | Two layers beat one. | {expected.verdict} | two {two['test_mean']:.2f} accuracy, "
            f"one {one['difference']:+.2f} |") in text
    assert "Not measurable yet: a missing model field" in text
    assert f"xformer experiment {specs / 'depth.toml'}" in text
    # the kept record has the results without paths of the machine that ran them
    record = json.loads((folder / "docs" / "claims" / "depth.json").read_text())
    assert record["results"]["cells"] == measured["cells"]
    assert not any(key in run for run in record["results"]["runs"] for key in ("run_dir", "predictions"))
    assert record["hardware"]["device"] == "cpu" and record["train_minutes"] >= 0


def test_the_ledger_regenerates_from_its_records_when_the_runs_are_gone(ledger, tmp_path):
    folder, specs, out, _ = ledger
    copy = tmp_path / "docs"
    shutil.copytree(out.parent, copy)
    assert ledger_problems(specs, copy / "claims.md") == []
    again = runner.invoke(app, ["claims", str(specs), "--runs", str(tmp_path / "no-runs"),
                                "--out", str(copy / "claims.md")])
    assert again.exit_code == 0, again.output
    assert (copy / "claims.md").read_text() == out.read_text()
    (copy / "claims.md").write_text(out.read_text().replace("Two layers", "Three layers"))
    assert "not what `xformer claims` generates" in ledger_problems(specs, copy / "claims.md")[0]


def test_the_ledger_refuses_a_folder_run_with_another_budget_than_its_spec(ledger, tmp_path):
    """`--set experiment.max_steps=...` runs a spec at another budget, into its own folder; the
    ledger reports specs as written, so such a folder in its place is refused, by name."""
    folder, specs, _, _ = ledger
    runs = tmp_path / "runs"
    shutil.copytree(folder / "runs" / "depth", runs / "depth")
    pinned = json.loads((runs / "depth" / "experiment.json").read_text())
    (runs / "depth" / "experiment.json").write_text(json.dumps({**pinned, "max_steps": 8}))
    result = runner.invoke(app, ["claims", str(specs), "--runs", str(runs), "--out", str(tmp_path / "claims.md")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"{runs / 'depth'}: ran with other settings than {specs / 'depth.toml'}: "
                                     "max_steps 8 (the spec: 4); the ledger reports the spec as written "
                                     "(run it into another --out)")


def test_a_verdict_names_every_setting_an_experiment_ran_with_that_is_not_the_recipes(ledger, tmp_path):
    """An experiment run with --set (a wider feed-forward, here) is judged as what it measured,
    and the ledger says so: beside the verdict in the table, and every difference from the
    spec's recipe named in its section and its record. The spec's own run says it is the recipe."""
    folder, specs, out, _ = ledger
    assert "Settings: the spec's recipe as written" in out.read_text()
    assert json.loads((folder / "docs" / "claims" / "depth.json").read_text())["differences"] == []
    spec_recipe = read_spec(specs / "depth.toml")[1].recipe("one", 1)
    wider = spec_recipe.model.d_ff * 2
    runs = tmp_path / "runs"
    trained = runner.invoke(app, ["experiment", str(specs / "depth.toml"), "--out", str(runs / "depth"),
                                  "--set", f"model.d_ff={wider}", "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    ledger_md = tmp_path / "claims.md"
    made = runner.invoke(app, ["claims", str(specs), "--runs", str(runs), "--out", str(ledger_md), "--json"])
    assert made.exit_code == 0, made.output
    row = json.loads(made.stdout.strip().splitlines()[-1])["rows"][1]
    assert row["differences"] == [{"key": "model.d_ff", "ran": wider, "recipe": spec_recipe.model.d_ff}]
    text = ledger_md.read_text()
    assert f"| 3 | Two layers beat one. | {row['verdict']} (not the recipe's settings) |" in text
    assert (f"Settings: **not the spec's recipe**: model.d_ff = {wider} (the recipe: {spec_recipe.model.d_ff})"
            in text)


@pytest.mark.parametrize(("change", "words"), [
    (('cell = "one"', 'cell = "onne"'), "claim.checks[0].cell: expected one of the cells (one, two), found 'onne'; "
                                        "did you mean 'one'?"),
    (('expect = "worse"', 'expect = "same"'), "claim.checks[0].percent: 'same' needs a tolerance"),
    (('expect = "worse"', 'expect = "worse"\npercent = 1\npoints = 1'), "expected percent or points, not both"),
    (('cell = "one"', 'cell = "two"'), "compares 'two' with itself"),
    (("number = 3", "number = 0"), "claim.number: expected the claim's positive number"),
    (('expect = "worse"', 'expect = "wrose"'), "claim.checks[0].expect: expected one of"),
    (('expect = "worse"', 'expect = "worse"\nup_to = 3'), "claim.checks[0].up_to: the upper end of a claimed gap"),
    (('expect = "worse"', 'expect = "worse"\npoints = 2\nup_to = 1'), "claim.checks[0].up_to: expected at least"),
])
def test_a_bad_claim_is_one_line_naming_the_file_and_field(tmp_path, change, words):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "bad.toml").write_text(SPEC.replace(*change))
    result = runner.invoke(app, ["claims", str(specs), "--runs", str(tmp_path / "runs"), "--out",
                                 str(tmp_path / "claims.md")])
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output, result.stderr
    assert str(specs / "bad.toml") in result.stderr and not (tmp_path / "claims.md").exists()
    # the experiment command reads the same table and refuses it before training
    ran = runner.invoke(app, ["experiment", str(specs / "bad.toml"), "--out", str(tmp_path / "out")])
    assert ran.exit_code == 2 and words in ran.stderr


def test_a_blocked_claim_must_say_what_is_missing(tmp_path):
    (tmp_path / "b.toml").write_text(BLOCKED.replace('blocked = "a missing model field"\n', ""))
    result = runner.invoke(app, ["claims", str(tmp_path), "--out", str(tmp_path / "claims.md")])
    assert result.exit_code == 2 and "claim.blocked: a claim without an [experiment] must say" in result.stderr


def test_the_ledger_regenerates_its_own_file_and_refuses_a_users(ledger, tmp_path):
    """--out names a file the ledger wrote (its header says so): regenerated; any other file:
    refused, untouched, unless --overwrite; a record folder holding a user's JSON: refused."""
    folder, specs, out, _ = ledger
    args = ["claims", str(specs), "--runs", str(folder / "runs")]
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n")
    refused = runner.invoke(app, [*args, "--out", str(notes)])
    assert refused.exit_code == 2 and refused.stderr.strip().count("\n") == 0
    assert f"{notes}: exists and is not a ledger `xformer claims` wrote" in refused.stderr
    assert notes.read_text() == "# my notes\n" and not (tmp_path / "claims").exists()
    replaced = runner.invoke(app, [*args, "--out", str(notes), "--overwrite"])
    assert replaced.exit_code == 0 and notes.read_text() == out.read_text()
    again = runner.invoke(app, [*args, "--out", str(notes)])  # now a ledger: regenerated without asking
    assert again.exit_code == 0, again.output
    other = tmp_path / "other"
    (other / "claims").mkdir(parents=True)
    (other / "claims" / "depth.json").write_text('{"mine": 1}')
    kept = runner.invoke(app, [*args, "--out", str(other / "claims.md")])
    assert kept.exit_code == 2 and "depth.json: exists and is not a claim record" in kept.stderr
    assert (other / "claims" / "depth.json").read_text() == '{"mine": 1}' and not (other / "claims.md").exists()

"""The claims ledger: each check's verdict from per-seed differences and paired tests, the
claim's verdict from its checks, and `xformer claims` writing docs/claims.md from real
experiment folders or, where a folder is gone, from the records it kept."""

import json
import shutil
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from tests.test_experiment import recall_spec
from xformer.studies.claim_spec import Check
from xformer.studies.claims import convergence, describe, half_width, judge, verdict
from xformer.studies.ledger import ledger_problems, read_spec
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
    return {"baseline": baseline, "seeds": seeds, "cells": cells, "runs": runs, "metric": "bleu"}


BASE = [10.0, 11.0, 12.0]  # mean 11: 1% is 0.11, 5% is 0.55, 15% is 1.65; t(2 df) = 4.303


@pytest.mark.parametrize(("scores", "check", "expected"), [
    # better: +1.0, +1.1, +0.9: mean +1.0, interval [+0.75, +1.25] excludes 0 and the mean >= 5% (0.55)
    ([11.0, 12.1, 12.9], Check("x", "better", percent=5), "supported"),
    # ... +1.0, -0.5, +1.5: the interval [-1.92, +3.25] holds 0
    ([11.0, 10.5, 13.5], Check("x", "better", percent=5), "inconclusive"),
    # ... the claimed 15% (1.65) is above the whole interval
    ([11.0, 12.1, 12.9], Check("x", "better", percent=15), "contradicted"),
    # ... -1.0, -1.2, -0.8: the whole interval below 0
    ([9.0, 9.8, 11.2], Check("x", "better"), "contradicted"),
    # better by 0.5 to 1% (0.055 to 0.11): the whole interval beyond the claimed gap
    ([11.0, 12.1, 12.9], Check("x", "better", percent=0.5, up_to=1), "contradicted"),
    # ... by 5 to 10% (0.55 to 1.1): the mean, +1.0, is inside
    ([11.0, 12.1, 12.9], Check("x", "better", percent=5, up_to=10), "supported"),
    # worse by at least 1 point: -1.5, -2.0, -1.8, interval [-2.39, -1.14]
    ([8.5, 9.0, 10.2], Check("x", "worse", points=1), "supported"),
    # not_better: 0, +3, -1: better on average, the interval holds 0
    ([10.0, 14.0, 11.0], Check("x", "not_better"), "inconclusive"),
    ([9.0, 11.9, 11.5], Check("x", "not_better"), "supported"),
    ([11.0, 12.1, 12.9], Check("x", "not_better"), "contradicted"),
    # not_worse by 10% (1.1): -0.5, -0.4, -0.6 pass; -2.0, -2.1, -1.9 fail; -1.5, 0, -0.5 cannot tell
    ([9.5, 10.6, 11.4], Check("x", "not_worse", percent=10), "supported"),
    ([8.0, 8.9, 10.1], Check("x", "not_worse", percent=10), "contradicted"),
    ([8.5, 11.0, 11.5], Check("x", "not_worse", percent=10), "inconclusive"),
    # same within 0.3 points
    ([10.05, 10.95, 12.0], Check("x", "same", points=0.3), "supported"),
    ([11.0, 12.1, 12.9], Check("x", "same", points=0.3), "contradicted"),
    ([10.2, 10.7, 12.4], Check("x", "same", points=0.3), "inconclusive"),
])
def test_a_check_is_judged_on_the_seed_paired_mean_and_its_t_interval(scores, check, expected):
    """Each seed's paired p-value is shown, never decided on: the same scores with other
    p-values give the same verdict."""
    for p in ([0.01, 0.02, 0.03], [0.9, 0.8, 0.7]):
        outcome = judge(check, results({"base": BASE, "x": scores}, {"x": p}))
        assert outcome.verdict == expected, outcome.reason
        assert "x - base per seed" in outcome.reason and "95% t-interval" in outcome.reason
        assert f"paired bootstrap p per seed {p[0]:.3f}" in outcome.reason


def test_the_interval_is_students_t_and_says_the_smallest_detectable_difference():
    diffs = [1.0, 1.1, 0.9]
    assert half_width(diffs) == pytest.approx(4.303 * 0.1 / 3 ** 0.5)  # t(0.975, 2 df) * sd / sqrt(n)
    assert half_width([0.5, 1.5]) == pytest.approx(12.706 * (0.5 ** 0.5) / 2 ** 0.5)
    assert half_width([1.0]) == float("inf")
    assert half_width([float(i % 2) for i in range(40)]) == pytest.approx(1.96 * 0.50637 / 40 ** 0.5, rel=1e-3)
    outcome = judge(Check("x", "better"), results({"base": BASE, "x": [11.0, 12.1, 12.9]}, {"x": [0.01] * 3}))
    assert "interval [+0.75, +1.25] over 3 seeds (the smallest difference they can detect: 0.25)" in outcome.reason


def test_a_supported_gap_is_reported_as_measured_beside_the_claim_even_from_a_zero_baseline():
    data = results({"base": BASE, "x": [11.0, 12.1, 12.9]}, {"x": [0.01] * 3})
    outcome = judge(Check("x", "better", percent=5), data)
    assert "the mean 9.1% (claimed 5%)" in outcome.reason  # +1 over a mean of 11
    # a baseline that learned nothing (0 in every seed): a percent of it claims nothing more than "better"
    zero = judge(Check("x", "better", percent=5), results({"base": [0.0] * 3, "x": [3.0, 4.0, 3.5]}, {"x": [0.01] * 3}))
    assert zero.verdict == "supported" and zero.reason.endswith("better: the interval excludes 0")


def test_a_check_between_two_cells_that_are_not_the_baseline_shows_no_paired_test():
    data = results({"base": BASE, "a": [11.0, 12.0, 13.0], "b": [12.0, 13.0, 14.0]}, {"a": [0.01] * 3, "b": [0.01] * 3})
    outcome = judge(Check("b", "better", than="a"), data)
    assert outcome.verdict == "supported" and "p per seed" not in outcome.reason
    assert "+1.00 (+8.3%)" in outcome.reason  # b - a in seed 1, relative to a's mean of 12


def test_a_check_across_lengths_waits_for_its_cells_to_learn_the_task_at_the_training_length():
    """Extrapolation read off a model that never learned the task (chance at the training
    length, so chance at every length) would "support" not_worse; with the scale's reference
    score such a cell makes the check inconclusive, and a cell that learned is judged as before."""
    data = results({"sin": [55.0, 54.0, 56.0], "learned": [99.5, 99.0, 99.8]}, {"learned": [0.01] * 3}, "sin")
    at = {"sin": [54.0, 55.0, 55.5], "learned": [60.0, 58.0, 63.0]}  # scored at 64 tokens
    for run in data["runs"]:
        run["test_at"] = {"64": at[run["cell"]][run["seed"] - 1]}
    stuck = Check("sin", "not_worse", than="sin", percent=10, length=64)
    assert judge(stuck, data).verdict == "supported"  # without a reference: the trap
    outcome = judge(stuck, data, reference=99.0)
    assert outcome.verdict == "inconclusive"
    assert outcome.reason.startswith("sin did not learn the task at its training length (test mean 55.00, 56% "
                                     "of the reference 99; rule: at least 90%)")
    learned = Check("learned", "worse", than="learned", percent=10, length=64)
    assert judge(learned, data, reference=99.0).verdict == judge(learned, data).verdict == "supported"
    # the cell it is compared with counts too: learned at 64 against sin at its own length
    against = Check("learned", "better", than="sin", length=64)
    assert "sin did not learn" in judge(against, data, reference=99.0).reason
    same_length = Check("learned", "better", than="sin")  # not across lengths: judged as before
    assert judge(same_length, data, reference=99.0).verdict == "supported"


def test_a_speed_check_compares_the_timed_speeds_by_the_same_rule():
    # the test scores would say "worse"; the check reads decode speeds: about 3x the baseline's
    data = results({"base": BASE, "fast": [9.0, 10.0, 11.0]}, {"fast": [0.01] * 3})
    for run, speed in zip(data["runs"], [10.0, 20.0, 15.0, 40.0, 52.0, 46.0], strict=True):
        run["decode_per_s"] = speed
    outcome = judge(Check("fast", "better", percent=200, up_to=400, metric="decode_speed"), data)
    assert outcome.verdict == "supported", outcome.reason
    assert "decode_per_s per seed: +30.00 (+200.0%), +32.00 (+213.3%), +31.00 (+206.7%)" in outcome.reason
    assert "p per seed" not in outcome.reason  # timed: no paired test on the test set
    assert judge(Check("fast", "better", percent=500, metric="decode_speed"), data).verdict == "contradicted"
    untimed = judge(Check("fast", "better", metric="train_speed"), data)
    assert untimed.verdict == "inconclusive" and "train speed was not timed" in untimed.reason
    assert describe(Check("fast", "better", percent=200, metric="decode_speed"), "base") == \
        "fast in decode speed better than base by 200%"


def test_a_speed_timed_beside_other_work_judges_nothing():
    data = results({"base": BASE, "fast": [9.0, 10.0, 11.0]}, {"fast": [0.01] * 3})
    for run, speed, others in zip(data["runs"], [10.0, 20.0, 15.0, 40.0, 52.0, 46.0],
                                  [0.0, 0.9, 0.0, 0.1, None, 0.0], strict=True):
        run["decode_per_s"], run["decode_others_cpu"] = speed, others
    check = Check("fast", "better", percent=200, up_to=400, metric="decode_speed")
    outcome = judge(check, data)
    assert outcome.verdict == "inconclusive", outcome.reason
    assert "base-s2 (0.90 cores)" in outcome.reason and "fast-s" not in outcome.reason  # 0.1 and unknown pass
    data["runs"][1]["decode_others_cpu"] = 0.2  # under BUSY_OVER
    assert judge(check, data).verdict == "supported"
    data["runs"][1]["train_others_cpu"] = 2.0  # another speed's timing is not this check's business
    assert judge(check, data).verdict == "supported"


def test_a_head_role_count_is_judged_against_the_same_runs_at_initialisation():
    """"Heads specialise": each seed's trained count minus its own untrained count (the chance
    level), by the same t-interval as any check; the spec may not name another cell then."""
    from xformer.studies.claim_spec import claim_from_table

    data = results({"base": BASE}, {})
    for run, trained, init in zip(data["runs"], [5, 6, 4], [0, 1, 0], strict=True):
        run["heads"], run["positional_heads"], run["positional_heads_init"] = 24, trained, init
    check = Check("base", "better", metric="positional_heads", than_init=True)
    outcome = judge(check, data)  # +5, +5, +4: the interval [+3.23, +6.10] excludes 0
    assert outcome.verdict == "supported", outcome.reason
    assert "base - base at initialisation positional_heads per seed" in outcome.reason
    assert describe(check, "base") == "base in positional heads better than base at initialisation"
    for run in data["runs"]:  # fewer after training than before: the whole interval below 0
        run["positional_heads"], run["positional_heads_init"] = run["positional_heads_init"], run["positional_heads"]
    assert judge(check, data).verdict == "contradicted"
    table = {"number": 5, "says": "Heads specialise.", "anchor": "none: a count",
             "checks": [{"cell": "base", "metric": "positional_heads", "than_init": True, "than": "other"},
                        {"cell": "base", "metric": "test", "than_init": True}]}
    _, _, problems = claim_from_table(table, ["base", "other"], "spec.toml", baseline="base")
    assert sum("than_init compares a head-role count" in p for p in problems) == 2, problems


def test_a_memory_check_reads_the_kv_cache_as_larger_or_smaller():
    data = results({"base": BASE, "mqa": [9.0, 10.0, 11.0]}, {"mqa": [0.01] * 3})
    for run, mb in zip(data["runs"], [8.0, 8.0, 8.0, 2.0, 2.0, 2.0], strict=True):
        run["decode_cache_mb"] = mb
    check = Check("mqa", "worse", percent=70, up_to=80, metric="decode_memory")  # a 4-head cache cut 4-fold
    outcome = judge(check, data)
    assert outcome.verdict == "supported", outcome.reason
    assert "decode_cache_mb per seed: -6.00 (-75.0%), -6.00 (-75.0%), -6.00 (-75.0%)" in outcome.reason
    assert "smaller: the interval excludes 0" in outcome.reason
    assert describe(check, "base") == "mqa in decode memory smaller than base by 70% to 80%"
    assert judge(Check("mqa", "worse", percent=80, metric="decode_memory"), data).verdict == "contradicted"
    data["runs"][0]["decode_cache_mb"] = None  # a run scored before the cache was measured
    assert "decode memory was not measured" in judge(check, data).reason


def test_a_claim_depends_when_its_parts_disagree_and_fails_with_a_failed_part():
    data = results({"base": BASE, "a": [11.0, 12.0, 13.0], "b": [9.0, 10.0, 11.0]}, {"a": [0.01] * 3, "b": [0.01] * 3})
    up, down = (judge(Check(c, "better"), data) for c in ("a", "b"))
    assert (up.verdict, down.verdict) == ("supported", "contradicted")
    assert verdict([up, down]) == "depends"
    assert verdict([up, up]) == "supported"


def curve_results(curves: dict[str, list[list[float]]], tests: dict[str, list[float]]) -> dict:
    """results.json with each run's validation curve ([step, score] per validation)."""
    data = results(tests, {c: [0.01] * len(v) for c, v in tests.items() if c != "base"})
    for run in data["runs"]:
        run["curve"] = curves[run["cell"]]
    return data


def test_a_baseline_still_improving_or_short_of_its_reference_has_not_converged():
    """Gain over the last doubling: the best validation score by the end against the best by
    half the steps, mean over seeds; and the test mean against the scale's reference."""
    flat = [[100, 30.0], [200, 35.0], [300, 35.2], [400, 35.3]]  # 35.0 by step 200, 35.3 by 400: +0.86%
    rising = [[100, 20.0], [200, 30.0], [300, 33.0], [400, 34.0]]  # +13.3%
    data = curve_results({"base": flat, "x": rising}, {"base": [40.0] * 3, "x": [41.0] * 3})
    state = convergence(data, "base")
    assert state["converged"] is True and state["gain"] == pytest.approx(100 * 0.3 / 35.0)
    assert "no reference score" in state["reason"]
    assert convergence(data, "x")["converged"] is False
    short = convergence(data, "base", reference=45.0)  # 40 is 89% of 45
    assert short["converged"] is False and short["share"] == pytest.approx(100 * 40 / 45)
    assert convergence(data, "base", reference=44.0)["converged"] is True  # 91%
    early = curve_results({"base": [[300, 30.0]], "x": rising}, {"base": [40.0] * 3, "x": [41.0] * 3})
    assert convergence(early, "base")["converged"] is None  # no validation by half the steps
    data["runs"][0].pop("curve")
    assert convergence(data, "base")["converged"] is None


def test_a_baseline_that_ends_at_full_accuracy_in_every_seed_has_converged_however_late_it_learned():
    """A task learned late in one seed gains over its last doubling, but at 100% validation
    accuracy more steps cannot raise it; one seed short of the ceiling, the gain rule stands."""
    late = [[1500, 56.2], [3000, 86.4], [6000, 100.0]]
    early = [[1500, 100.0], [3000, 100.0], [6000, 100.0]]
    short = [[1500, 56.2], [3000, 86.4], [6000, 99.8]]
    data = curve_results({"base": early, "x": short}, {"base": [99.8] * 3, "x": [99.6] * 3})
    data["metric"] = "accuracy"
    data["runs"][0]["curve"] = late  # seed 1 learned late: (100 * 3) / (86.4 + 200) - 1 = +4.7%
    state = convergence(data, "base", reference=99.0)
    assert state["converged"] is True and state["gain"] == pytest.approx(100 * (300 / 286.4 - 1))
    assert "every seed ended at the ceiling, 100% validation accuracy" in state["reason"]
    assert convergence(data, "x")["converged"] is False  # 99.8%: the gain rule reads it
    assert convergence(data, "base", reference=120.0)["converged"] is False  # short of its reference still counts
    data["metric"] = "bleu"  # BLEU has no ceiling a model reaches: the gain rule alone
    assert convergence(data, "base")["converged"] is False


SPEC = "# Claim: deeper is better\n" + recall_spec([1, 2, 3]) + """
[claim]
number = 3
says = "Two layers beat one."
scale = "a 4-step toy"
anchor = "none: a toy"

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
    from xformer.studies.ledger import read_spec

    _, experiment = read_spec(specs / "depth.toml")
    expected = judge(experiment.checks[0], measured)
    assert depth["checks"][0]["verdict"] == expected.verdict and depth["measured_verdict"] == verdict([expected])
    # the toy's baseline scores the same by half its 4 steps as by all of them: converged by the rule
    assert depth["convergence"]["converged"] is True and depth["verdict"] == verdict([expected])
    assert all(len(run["curve"]) == 2 for run in measured["runs"])  # validated at steps 2 and 4
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
    # its wall time, from the experiment's one sitting, is on the page beside the training time
    assert record["wall"]["sittings"] == 1 and record["wall"]["jobs"] == [1]
    assert f"{record['wall']['minutes']:g} minutes of wall time over 1 sitting(s), --jobs 1" in text
    assert "| CPU | specs measured | wall time recorded |" in text


def test_the_ledger_gives_no_verdict_from_an_undertrained_baseline(ledger, tmp_path):
    """The same record with the baseline's curves still rising: the verdict measured is kept in
    the claim's section, the one given is "inconclusive: undertrained", with the numbers."""
    from xformer.studies.ledger import build_ledger

    folder, specs, out, report = ledger
    records = tmp_path / "claims"
    shutil.copytree(out.parent / "claims", records)
    record = json.loads((records / "depth.json").read_text())
    for run in record["results"]["runs"]:
        if run["cell"] == "two":
            run["curve"] = [[2, 0.2], [4, 0.4]]
    (records / "depth.json").write_text(json.dumps(record))
    rebuilt = build_ledger(specs, tmp_path / "no-runs", tmp_path / "claims.md", records)
    row = next(r for r in rebuilt.rows if r["name"] == "depth")
    assert row["verdict"] == "inconclusive: undertrained" and row["measured_verdict"] == report["rows"][1]["verdict"]
    assert row["convergence"]["gain"] == pytest.approx(100.0)
    text = (tmp_path / "claims.md").read_text()
    assert "| 3 | Two layers beat one. | inconclusive: undertrained |" in text
    assert "Convergence: two gained 100.0% on validation over its last doubling of steps (rule: under 1%)" in text
    assert f"Measured verdict, not given: {row['measured_verdict']}." in text
    # two seeds are no design for a verdict, converged or not
    for run in record["results"]["runs"]:
        run["curve"] = [[2, 0.4], [4, 0.4]]
    record["results"]["runs"] = [r for r in record["results"]["runs"] if r["seed"] != 3]
    record["results"]["seeds"] = [1, 2]
    (records / "depth.json").write_text(json.dumps(record))
    rebuilt = build_ledger(specs, tmp_path / "no-runs", tmp_path / "claims.md", records)
    assert next(r for r in rebuilt.rows if r["name"] == "depth")["verdict"] == "inconclusive: 2 seeds (3 needed)"


def test_a_record_names_the_spec_and_recipe_it_was_measured_from(ledger, tmp_path):
    """A chain resuming on a fresh machine skips a spec whose record was measured from the spec
    and recipe as they are now, and retrains it when either's values changed (not its comments)."""
    import hashlib

    from xformer.studies.ledger import record_is_current

    folder, specs, out, _ = ledger
    record = out.parent / "claims" / "depth.json"
    kept = json.loads(record.read_text())
    spec = specs / "depth.toml"
    recipe = (spec.parent / tomllib.loads(spec.read_text())["experiment"]["recipe"])
    assert kept["spec_sha256"] == hashlib.sha256(spec.read_bytes()).hexdigest()
    assert kept["recipe_sha256"] == hashlib.sha256(recipe.read_bytes()).hexdigest()
    values = json.dumps(tomllib.loads(spec.read_text()), sort_keys=True)
    assert kept["spec_toml_sha256"] == hashlib.sha256(values.encode()).hexdigest()
    assert record_is_current(spec, record)
    copy = tmp_path / "specs"
    shutil.copytree(specs, copy)
    assert record_is_current(copy / "depth.toml", record)  # where it lies does not matter
    (copy / "depth.toml").write_text(spec.read_text().replace("seeds = ", "# Result: measured\nseeds = ", 1))
    assert record_is_current(copy / "depth.toml", record)  # a comment is not a setting
    legacy = tmp_path / "legacy.json"  # a record from before the parsed digests: its bytes decide
    legacy.write_text(json.dumps({k: v for k, v in kept.items() if "_toml_" not in k}))
    assert record_is_current(spec, legacy) and not record_is_current(copy / "depth.toml", legacy)
    (copy / "depth.toml").write_text(spec.read_text().replace("seeds = [1, 2, 3]", "seeds = [1, 2, 4]", 1))
    assert not record_is_current(copy / "depth.toml", record)
    assert not record_is_current(spec, tmp_path / "none.json")
    # the ledger does not judge a record of an earlier version of its spec, and says so
    from xformer.studies.ledger import build_ledger

    rebuilt = build_ledger(copy, tmp_path / "no-runs", tmp_path / "claims.md", out.parent / "claims")
    row = next(r for r in rebuilt.rows if r["name"] == "depth")
    assert row["verdict"] == "not measured yet" and row["earlier"] == "the spec changed since"
    assert "is of an earlier version of this spec (the spec changed since)" in (tmp_path / "claims.md").read_text()


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


def test_a_precondition_is_checked_against_the_test_lengths_and_the_device():
    from xformer.studies.claim_spec import Precondition
    from xformer.studies.claims import testable

    data = results({"base": BASE, "x": [11.0, 12.1, 12.9]}, {"x": [0.01] * 3})
    rank = Precondition(what="rank below the sources", cell="x", key="model.rank", below="median_source")
    assert testable(rank, data, "cpu", 64) == (None, "the test set's lengths were not recorded")
    data["test_lengths"] = {"median_source": 14.0, "max_source": 40}
    assert testable(rank, data, "cpu", 64) == (False, "model.rank = 64 against a median source length of 14 tokens")
    assert testable(rank, data, "cpu", 8)[0] is True
    longest = Precondition(what="w", cell="x", key="model.window", below="max_source")
    assert testable(longest, data, "cpu", 40)[0] is False and testable(longest, data, "cpu", 39)[0] is True
    long_inputs = Precondition(what="long decodes", at_least=128)
    assert testable(long_inputs, data, "cpu") == (False, "median test input 14 tokens")
    gpu = Precondition(what="a GPU kernel", device="cuda")
    assert testable(gpu, data, "cpu") == (False, "measured on cpu")
    assert testable(gpu, data, "cuda:0")[0] is True


def test_replication_is_our_interval_on_the_published_side():
    from xformer.studies.claim_spec import Claim
    from xformer.studies.claims import replication

    published_loss = Claim(anchor="a paper", anchor_cell="x", anchor_percent=-2.4)
    down = results({"base": BASE, "x": [9.0, 9.8, 11.2]}, {"x": [0.01] * 3})  # -1.0, -1.2, -0.8
    found = replication(published_loss, down)
    assert found["replicated"] == "replicated" and found["ours_percent"] == pytest.approx(-100 / 11)
    assert "published -2.4%" in found["words"]
    up = results({"base": BASE, "x": [11.0, 12.1, 12.9]}, {"x": [0.01] * 3})
    assert replication(published_loss, up)["replicated"] == "not replicated: the other way"
    noisy = results({"base": BASE, "x": [11.0, 10.5, 13.5]}, {"x": [0.01] * 3})
    assert replication(published_loss, noisy)["replicated"] == "not replicated: inside the seed noise"
    assert replication(Claim(anchor="none: no paper"), down) is None


@pytest.mark.parametrize(("change", "words"), [
    (("anchor = \"none: a toy\"\n", ""), "claim.anchor: expected the published number"),
    (("anchor = \"none: a toy\"\n", "anchor = \"p\"\nanchor_cell = \"three\"\n"), "claim.anchor_cell: expected one"),
    (("anchor = \"none: a toy\"\n", "anchor = \"p\"\nanchor_cell = \"one\"\n"), "claim.anchor_percent: expected"),
    (("[[claim.checks]]", "[[claim.preconditions]]\nwhat = \"w\"\nat_least = 5.0\ndevice = \"cuda\"\n\n"
                         "[[claim.checks]]"), "expected one of below, at_least, device"),
    (("[[claim.checks]]", "[[claim.preconditions]]\nwhat = \"w\"\nbelow = \"median_source\"\n\n[[claim.checks]]"),
     "`below` tests a recipe value"),
])
def test_a_spec_names_its_anchor_and_well_formed_preconditions(tmp_path, change, words):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "bad.toml").write_text(SPEC.replace(*change))
    result = runner.invoke(app, ["claims", str(specs), "--runs", str(tmp_path / "runs"), "--out",
                                 str(tmp_path / "claims.md")])
    assert result.exit_code == 2 and words in result.output, result.output


def test_the_ledger_says_not_testable_here_when_a_precondition_fails(ledger, tmp_path):
    """The toy's inputs are 32 tokens: a precondition asking for 1,000 fails, so the measured
    verdict is kept in the section and the claim reads "not testable here", with the reason."""
    from xformer.studies.ledger import build_ledger

    folder, specs, out, report = ledger
    mine = tmp_path / "specs"
    mine.mkdir()
    (mine / "depth.toml").write_text((specs / "depth.toml").read_text() + "\n[[claim.preconditions]]\n"
                                     "what = \"inputs of 1,000 tokens\"\nat_least = 1000.0\n")
    rebuilt = build_ledger(mine, folder / "runs", tmp_path / "claims.md", tmp_path / "records")
    row = rebuilt.rows[0]
    assert row["verdict"] == "not testable here" and row["measured_verdict"] == report["rows"][1]["verdict"]
    lengths = row["record"]["results"]["test_lengths"]
    assert lengths["median_source"] == lengths["max_source"] == 32  # recall at data.max_len 32
    assert "Not testable here: inputs of 1,000 tokens (median test input 32 tokens)" in \
        (tmp_path / "claims.md").read_text()


def test_runs_made_differently_are_refused_or_flagged():
    """A chain may cross machines: another precision or device refuses a verdict, another CPU
    does for a timing only, and is flagged otherwise, as is another code version."""
    from xformer.studies.ledger import disagreements

    data = results({"base": BASE, "x": [11.0, 12.1, 12.9]}, {"x": [0.01] * 3})
    for run in data["runs"]:
        run["machine"] = {"cpu": "AMD EPYC", "device": "cpu", "precision": "fp32", "torch": "2.13.0", "commit": "a"}
    assert disagreements(data, timed=False) == {"refuse": [], "flag": []}
    data["runs"][0]["machine"] = {**data["runs"][0]["machine"], "cpu": "Intel Xeon", "commit": "b"}
    assert disagreements(data, timed=False) == {"refuse": [], "flag": [
        "runs made with different cpu: AMD EPYC, Intel Xeon", "runs made with different commit: a, b"]}
    assert disagreements(data, timed=True)["refuse"] == ["cpu (AMD EPYC, Intel Xeon)"]
    data["runs"][1]["machine"] = {**data["runs"][1]["machine"], "precision": "bf16"}
    assert "precision (bf16, fp32)" in disagreements(data, timed=False)["refuse"]
    for run in data["runs"]:
        run.pop("machine")  # records from before machines were kept: nothing to compare
    assert disagreements(data, timed=True) == {"refuse": [], "flag": []}


def test_a_check_at_a_length_needs_the_runs_scored_there(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "bad.toml").write_text(SPEC + "length = 64\n")
    result = runner.invoke(app, ["claims", str(specs), "--runs", str(tmp_path / "runs"), "--out",
                                 str(tmp_path / "claims.md")])
    assert result.exit_code == 2 and "length 64 is not one of experiment.lengths (none)" in result.output


def test_no_difference_in_any_seed_contradicts_better_rather_than_leaving_it_open():
    """A count that stays put in every seed (no head of a role after training, none before)
    has a zero-width interval at 0: the seeds do tell, and what they tell is "not better"."""
    same = judge(Check("x", "better"), results({"base": [0.0] * 3, "x": [0.0] * 3}, {"x": [1.0] * 3}))
    assert same.verdict == "contradicted" and "the whole interval at 0 or on the other side" in same.reason
    fewer = judge(Check("x", "worse"), results({"base": [2.0] * 3, "x": [2.0] * 3}, {"x": [1.0] * 3}))
    assert fewer.verdict == "contradicted"
    apart = judge(Check("x", "better"), results({"base": [0.0] * 3, "x": [0.0, 1.0, 2.0]}, {"x": [1.0] * 3}))
    assert apart.verdict == "inconclusive"  # one seed's gain: the interval holds 0 and more

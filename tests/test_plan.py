"""xformer claims --plan: a ledger's cost counted before it runs, against what the chain trains."""

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from tests.test_experiment import recall_spec
from xformer.studies.plan import plan_ledger
from xformer_cli.main import app

runner = CliRunner()
CLAIM = """
[claim]
number = 2
says = "{says}"
anchor = "none: a toy"

[[claim.checks]]
cell = "{cell}"
expect = "worse"
"""


def write_specs(folder: Path) -> tuple[Path, Path]:
    """Two curve specs as a chain runs them: `first` (one and two layers) and `second`, whose
    `two` is first's run (a beam of its own changes only decoding) beside a new three-layer cell.
    Budgets [4, 8] with half of each run cooling down: a cell and seed trains 8 steps, and its
    4-step budget a cooldown of 2 (4 - 2)."""
    folder.mkdir()
    curve = recall_spec([1, 2]).replace("max_steps = 4", "budgets = [4, 8]").replace(
        '"model.n_heads=2"]', '"model.n_heads=2", "train.decay_fraction=0.5"]')
    first = folder / "first.toml"
    first.write_text(curve + CLAIM.format(says="Two layers beat one.", cell="one"))
    second = folder / "second.toml"
    second.write_text(curve.replace('one = ["model.n_encoder_layers=1"]\ntwo = []',
                                    'two = ["eval.beam=2"]\nthree = ["model.n_encoder_layers=3"]')
                      + CLAIM.format(says="Two layers beat three.", cell="three"))
    return first, second


def test_the_plan_counts_runs_steps_and_what_an_earlier_spec_trains(tmp_path):
    first, second = write_specs(tmp_path / "specs")
    plan = plan_ledger([first, second, first])
    rows = {i: row for i, row in enumerate(plan.specs)}
    # first: 2 cells x 2 seeds, a stable run and a cooldown each, 10 steps a cell and seed
    assert rows[0] == {"spec": "first", "cells": 2, "seeds": 2, "runs": 8, "new_runs": 8, "shared_runs": 0,
                       "new_steps": 40, "new_minutes_limit": 0, "alone": False}
    # second: its `two` is first's (decoded with another beam), `three` is new
    assert (rows[1]["runs"], rows[1]["new_runs"], rows[1]["new_steps"]) == (8, 4, 20)
    # the same spec again: everything trained already
    assert (rows[2]["new_runs"], rows[2]["new_steps"], rows[2]["shared_runs"]) == (0, 0, 8)
    assert plan.total["new_runs"] == 12 and plan.total["new_steps"] == 60 and plan.total["runs"] == 24
    shared = {(s["spec"], s["run"]): s["trained_by"] for s in plan.shared}
    assert shared[("second", "two-s2-at4")] == "first/two-s2-at4"
    assert shared[("second", "two-s1")] == "first/two-s1" and ("second", "three-s1") not in shared
    assert not plan.timed and "run_hours" not in plan.total and "run_hours" not in rows[0]


def test_the_plan_agrees_with_what_the_chain_trains(tmp_path):
    """Run the two specs as the chain does (the second with --reuse over the first): the runs
    the second trains itself, and their steps, are the plan's."""
    first, second = write_specs(tmp_path / "specs")
    runs = tmp_path / "runs"
    for spec in (first, second):
        made = runner.invoke(app, ["experiment", str(spec), "--out", str(runs / spec.stem), "--reuse", str(runs),
                                   "--device", "cpu"])
        assert made.exit_code == 0, made.output
    plan = plan_ledger([first, second])
    for row in plan.specs:
        trained = [r for r in (runs / row["spec"] / "runs").iterdir()
                   if r.is_dir() and not (r / "copied-from.json").exists()]
        steps = 0
        for run_dir in trained:
            branched = run_dir / "branched-from.json"
            start = json.loads(branched.read_text())["step"] if branched.exists() else 0
            steps += json.loads((run_dir / "train.json").read_text())["steps"] - start
        assert (len(trained), steps) == (row["new_runs"], row["new_steps"]), row["spec"]


def test_a_timed_plan_adds_each_runs_steps_and_validations_at_the_measured_pace(tmp_path):
    """With a clock that moves 0.5 s a reading, every timed step and validation takes 0.5 s: a run
    of S steps validated every 2 (and at its end) takes 0.5 * (S + S // 2 + 1) s. Two runs at
    once: wall hours are half the runs' hours. The threads are put back."""
    first, second = write_specs(tmp_path / "specs")
    readings = iter(range(10**6))
    threads = torch.get_num_threads()
    plan = plan_ledger([first, second], timed=True, jobs=2, clock=lambda: next(readings) * 0.5)
    assert torch.get_num_threads() == threads
    per_cell_seed = 0.5 * (8 + 8 // 2 + 1) + 0.5 * (2 + 2 // 2 + 1)
    first_row, second_row = plan.specs
    assert abs(first_row["run_hours"] * 3600 - 4 * per_cell_seed) < 1e-9
    assert abs(second_row["run_hours"] * 3600 - 2 * per_cell_seed) < 1e-9
    assert abs(plan.total["wall_hours"] - plan.total["run_hours"] / 2) < 1e-12
    # one timing per shape: one, two and three layers, whatever the seed, budget or beam
    assert sorted(p["pace_of"] for p in plan.paces) == ["first/one-s1", "first/two-s1", "second/three-s1"]
    assert all(p["step_seconds"] == 0.5 and p["valid_seconds"] == 0.5 for p in plan.paces)


def test_claims_plan_writes_nothing_and_refuses_a_spec_it_cannot_find(tmp_path):
    first, second = write_specs(tmp_path / "specs")
    out = tmp_path / "docs" / "claims.md"
    made = runner.invoke(app, ["claims", str(tmp_path / "specs"), "--plan", "--spec", "second", "--spec", "first",
                               "--out", str(out), "--json"])
    assert made.exit_code == 0, made.output
    plan = json.loads(made.stdout.strip().splitlines()[-1])
    assert [row["spec"] for row in plan["specs"]] == ["second", "first"]  # the order asked for
    assert plan["specs"][1]["new_runs"] == 4 and not out.exists()
    # the corpus as the chain passes it: only to specs that read one (these generated ones refuse it)
    table = runner.invoke(app, ["claims", str(tmp_path / "specs"), "--plan", "--set", 'data.dataset="PATH"'])
    assert table.exit_code == 0 and "total" in table.output and not out.exists()
    seeds = runner.invoke(app, ["claims", str(tmp_path / "specs"), "--plan", "--set", "experiment.seeds=[1]", "--json"])
    assert json.loads(seeds.stdout.strip().splitlines()[-1])["total"]["runs"] == 8  # 2 specs, 2 cells, 2 runs a cell
    missing = runner.invoke(app, ["claims", str(tmp_path / "specs"), "--plan", "--spec", "thrid"])
    assert missing.exit_code == 2
    assert "--spec" in missing.output and "thrid.toml" in missing.output and "Traceback" not in missing.output


def test_a_time_budgeted_spec_costs_its_minutes(tmp_path):
    """experiment.max_time with no step limit: each run takes its whole budget, however fast its
    steps are timed (2 cells x 2 seeds x 0.5 minutes = 2 minutes of runs, 1 of wall at --jobs 2)."""
    folder = tmp_path / "specs"
    folder.mkdir()
    spec = folder / "timed.toml"
    spec.write_text(recall_spec([1, 2]).replace("max_steps = 4", "max_time = 0.5")
                    + CLAIM.format(says="Two layers beat one.", cell="one"))
    readings = iter(range(10**6))
    plan = plan_ledger([spec], timed=True, jobs=2, clock=lambda: next(readings) * 0.01)
    row = plan.specs[0]
    assert row["new_steps"] == 0 and row["new_minutes_limit"] == 2.0
    assert abs(row["run_hours"] * 60 - 2.0) < 1e-9 and abs(row["wall_hours"] * 60 - 1.0) < 1e-9

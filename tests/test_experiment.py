"""xformer experiment: a grid of cells over seeds, each an ordinary run, compared with a baseline
cell; a rerun keeps what is done and trains what is missing."""

import filecmp
import json
import shutil
import statistics
from copy import deepcopy
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_train import RECIPE, TINY
from xformer.results import ExperimentResult
from xformer.significance import paired_bleu
from xformer.studies.experiment_report import markdown
from xformer_cli.main import app

runner = CliRunner()
SPEC = f'''[experiment]
recipe = {json.dumps(str(RECIPE))}
seeds = [1, 2]
baseline = "heads_2"
max_steps = 6
set = ["train.valid_every=3", "train.average_last=0"]

[experiment.cells]
heads_1 = ["model.n_heads=1"]
heads_2 = []
'''


def recall_spec(seeds: list[int]) -> str:
    """A tiny recall experiment: one encoder layer against two, 4 steps a run."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "longrange" / "recall_transformer.toml"
    return f"""[experiment]
recipe = {json.dumps(str(recipe))}
seeds = {seeds}
baseline = "two"
max_steps = 4
set = ["data.n_train=64", "data.n_valid=32", "data.n_test=48", "data.max_len=32", "data.curriculum_lengths=[]",
       "data.curriculum_steps=[]", "train.valid_every=2", "model.d_model=16", "model.d_ff=32", "model.n_heads=2"]

[experiment.cells]
one = ["model.n_encoder_layers=1"]
two = []
"""


def untimed(cells: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if not k.endswith("_per_s_mean")} for c in cells]


def sets(corpus) -> list[str]:
    return [arg for value in [*TINY, f"data.dataset={json.dumps(str(corpus))}"] for arg in ("--set", value)]


@pytest.fixture(scope="module")
def done(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("experiment")
    spec = folder / "heads.toml"
    spec.write_text(SPEC)
    result = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(folder / "out"),
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    return spec, folder / "out", json.loads(result.stdout.strip().splitlines()[-1])


def test_every_cell_and_seed_is_an_ordinary_run_and_the_summary_is_their_scores(done, corpus):
    spec, out, report = done
    assert [c["cell"] for c in report["cells"]] == ["heads_1", "heads_2"] and report["metric"] == "bleu"
    for cell in report["cells"]:
        tests = []
        for seed in (1, 2):
            run = out / "runs" / f"{cell['cell']}-s{seed}"
            trained, scored = (json.loads((run / name).read_text()) for name in ("train.json", "eval.json"))
            assert trained["steps"] == 6 and scored["checkpoint"] == "best"
            assert json.loads(json.dumps(trained["card"]["recipe"]))["train"]["seed"] == seed
            tests.append(scored["bleu"])
        assert cell["test_mean"] == pytest.approx(statistics.fmean(tests))
        runs = [r for r in report["runs"] if r["cell"] == cell["cell"]]
        loops = [json.loads((Path(r["run_dir"]) / "train.json").read_text())["loop_seconds"] for r in runs]
        assert cell["train_steps_per_s_mean"] == pytest.approx(statistics.fmean(  # validation excluded
            r["steps"] / loop for r, loop in zip(runs, loops, strict=True)))
        assert all(loop < r["train_seconds"] for r, loop in zip(runs, loops, strict=True))
        assert cell["decode_per_s_mean"] == pytest.approx(statistics.fmean(r["decode_per_s"] for r in runs))
        for r in runs:  # the CPU other processes took beside each timing, as the run recorded it
            trained, scored = (json.loads((Path(r["run_dir"]) / n).read_text()) for n in ("train.json", "eval.json"))
            # (left out of the files, and None here, when the timing lasted under a second)
            assert r["train_others_cpu"] == trained.get("others_cpu")
            assert r["decode_others_cpu"] == scored.get("others_cpu")
        assert cell["test_std"] == pytest.approx(statistics.stdev(tests))
    heads_1 = report["cells"][0]
    assert [p["seed"] for p in heads_1["paired"]] == [1, 2] and "paired" not in report["cells"][1]
    # the paired test is sacreBLEU's on the two runs' own hypotheses
    refs = [json.loads(line)["en"] for line in (corpus / "test.jsonl").read_text().splitlines()]
    hyps = [(out / "runs" / f"{c}-s1" / "eval.json") for c in ("heads_1", "heads_2")]
    lines = [open(json.loads(h.read_text())["hypotheses"]).read().splitlines() for h in hyps]
    assert heads_1["paired"][0]["p_value"] == paired_bleu(lines[0], lines[1], refs).p_value
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).is_file()
    assert "| heads_1 | model.n_heads=1 |" in (out / "results.md").read_text()


def test_a_rerun_trains_only_what_is_missing_and_refuses_another_experiment(done, corpus):
    spec, out, report = done
    kept = {p: p.stat().st_mtime_ns for p in out.glob("runs/heads_2-s*/checkpoints/last.safetensors")}
    import shutil

    shutil.rmtree(out / "runs" / "heads_1-s2")
    # a score of other tensors than `best` holds now (as when eval ran while the run still trained)
    stale = out / "runs" / "heads_2-s1" / "eval.json"
    score = json.loads(stale.read_text())
    assert score["card"]["checkpoint"]["final"] and score["card"]["checkpoint"]["name"] == "best"
    score["card"]["checkpoint"]["sha256"] = "0" * 64
    stale.write_text(json.dumps(score))
    fresh = (out / "runs" / "heads_2-s2" / "eval.json").stat().st_mtime_ns
    again = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(out), "--device", "cpu",
                                "--json"])
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # finished runs were not trained again
    assert json.loads(stale.read_text())["card"]["checkpoint"]["sha256"] != "0" * 64  # scored again
    assert (out / "runs" / "heads_2-s2" / "eval.json").stat().st_mtime_ns == fresh  # a current score is kept
    # the retrained run is the same seed of the same recipe: the same numbers (but for its timings)
    assert untimed(json.loads(again.stdout.strip().splitlines()[-1])["cells"]) == untimed(report["cells"])
    spec.write_text(SPEC.replace("seeds = [1, 2]", "seeds = [1, 3]"))
    try:
        other = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(out), "--device", "cpu"])
    finally:
        spec.write_text(SPEC)
    assert other.exit_code == 2 and "other cells, seeds, budget or recipe" in other.stderr


def test_a_run_finished_in_another_experiment_is_copied_not_trained_again(done, corpus, tmp_path):
    spec, out, report = done
    other = tmp_path / "other.toml"  # heads_2 again (as "two") beside a cell no one has run, seeds 2 and 3
    other.write_text(SPEC.replace("seeds = [1, 2]", "seeds = [2, 3]")
                     .replace('baseline = "heads_2"', 'baseline = "two"')
                     .replace('heads_1 = ["model.n_heads=1"]\nheads_2 = []', 'two = []\nwide = ["model.d_ff=48"]'))
    result = runner.invoke(app, ["experiment", str(other), *sets(corpus), "--out", str(tmp_path / "out"),
                                 "--device", "cpu", "--reuse", str(out.parent), "--json"])
    assert result.exit_code == 0, result.output
    copied = tmp_path / "out" / "runs" / "two-s2"
    source = out / "runs" / "heads_2-s2"
    said = " ".join(result.stderr.split())  # rich wraps lines
    assert "two seed 2: the same run is finished in" in said and "copied, not trained again" in said
    assert said.count("copied") == 1
    assert (copied / "train.json").read_text() == (source / "train.json").read_text()
    for trained in ("two-s3", "wide-s2", "wide-s3"):  # another seed, another recipe: trained here
        assert json.loads((tmp_path / "out" / "runs" / trained / "train.json").read_text())["steps"] == 6
        assert not filecmp.cmp(tmp_path / "out" / "runs" / trained / "train.json", source / "train.json", shallow=False)
    two = next(c for c in json.loads(result.stdout.strip().splitlines()[-1])["runs"] if c["cell"] == "two"
               and c["seed"] == 2)
    assert two["test"] == next(r["test"] for r in report["runs"] if r["cell"] == "heads_2" and r["seed"] == 2)
    assert Path(two["hypotheses"]).parent == copied / "eval"  # scored and paired from the copy's own files
    missing = runner.invoke(app, ["experiment", str(other), *sets(corpus), "--out", str(tmp_path / "again"),
                                  "--reuse", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "--reuse expected a folder of finished runs" in missing.stderr


def test_inspect_heads_counts_each_runs_head_roles_once_beside_its_initialisation(done, corpus, tmp_path):
    """experiment.inspect_heads: every run's row holds its heads' role counts and the chance
    level (the same model untrained), as xformer.heads.roles counts them, kept in RUN/heads and
    not counted again on a rerun."""
    from xformer.heads.roles import role_counts

    spec, out, _ = done
    roles = tmp_path / "roles.toml"
    roles.write_text(SPEC.replace("heads_1 = [\"model.n_heads=1\"]\n", "")
                     .replace("max_steps = 6", "max_steps = 6\ninspect_heads = 10"))
    args = ["experiment", str(roles), *sets(corpus), "--out", str(tmp_path / "out"), "--device", "cpu",
            "--reuse", str(out.parent), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])["runs"]
    kept = tmp_path / "out" / "runs" / "heads_2-s1" / "heads" / "roles.json"
    assert kept.is_file() and all((tmp_path / "out" / "runs" / f"heads_2-s{s}" / "heads" / "roles.json").is_file()
                                  for s in (1, 2))
    for row in rows:
        counted = role_counts(tmp_path / "out" / "runs" / f"heads_2-s{row['seed']}", 10)
        assert {k: row[k] for k in counted} == counted and row["heads"] == 2 * 3
    before = kept.stat().st_mtime_ns
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert kept.stat().st_mtime_ns == before


def test_a_cell_that_only_decodes_otherwise_scores_a_copy_again(done, corpus, tmp_path):
    spec, out, report = done
    other = tmp_path / "int8.toml"  # heads_2 decoded in int8: the same trained runs, scored again
    other.write_text(SPEC.replace('heads_1 = ["model.n_heads=1"]', 'int8 = ["eval.quantize=int8"]'))
    result = runner.invoke(app, ["experiment", str(other), *sets(corpus), "--out", str(tmp_path / "out"),
                                 "--device", "cpu", "--reuse", str(out), "--json"])
    assert result.exit_code == 0, result.output
    for seed in (1, 2):
        copy, source = tmp_path / "out" / "runs" / f"int8-s{seed}", out / "runs" / f"heads_2-s{seed}"
        assert (copy / "train.json").read_text() == (source / "train.json").read_text()  # not trained again
        assert json.loads((copy / "copied-from.json").read_text()) == {"source": str(source), "rescored": True}
        assert 'quantize = "int8"' in (copy / "recipe.toml").read_text()
        assert "quantize" not in (source / "recipe.toml").read_text()  # left out when off
        scored = json.loads((copy / "eval.json").read_text())
        assert scored["quantize"] == "int8" and Path(scored["hypotheses"]).parent == copy / "eval"
        assert ".int8." in scored["hypotheses"] and scored["sentences_per_s"] > 0
        exact = json.loads((tmp_path / "out" / "runs" / f"heads_2-s{seed}" / "copied-from.json").read_text())
        assert exact["rescored"] is False  # the very same run keeps its scores
    # speeds are this experiment's timings: the int8 copies were decoded here, nothing was trained here
    cells = {c["cell"]: c for c in json.loads(result.stdout.strip().splitlines()[-1])["cells"]}
    assert cells["int8"]["decode_per_s_mean"] > 0 and cells["int8"]["train_steps_per_s_mean"] is None
    assert cells["heads_2"]["decode_per_s_mean"] is None and cells["heads_2"]["train_steps_per_s_mean"] is None
    title, _, header, _, int8, heads_2 = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert "n/a where not taken here (heads_2-s1, heads_2-s2, int8-s1, int8-s2: copies by --reuse)" in title
    assert header.endswith("| train steps/s | decode sentences/s | KV cache MB |")
    train, decode, cache = (column.strip() for column in int8.strip("|").split("|")[-3:])
    # no baseline speed to divide by (" busy" follows where this machine was busy meanwhile)
    assert train == "n/a" and decode.split()[0] == f"{cells['int8']['decode_per_s_mean']:.3g}" and "x)" not in decode
    ratio = cells["int8"]["decode_cache_mb_mean"] / cells["heads_2"]["decode_cache_mb_mean"]
    assert cache == f"{cells['int8']['decode_cache_mb_mean']:.3g} ({ratio:.2f}x)"  # copies' caches are measured


def test_a_speed_timed_beside_other_work_is_marked_busy(done):
    report = deepcopy(done[2])
    for run in report["runs"]:  # a quiet machine, whatever ran beside these tests
        run["train_others_cpu"], run["decode_others_cpu"] = 0.0, 0.0
    quiet = markdown(ExperimentResult(**report))
    assert " busy" not in quiet and "other processes" not in quiet
    report["runs"][0]["decode_others_cpu"] = 1.2  # heads_1-s1 decoded beside something else
    title, _, _, _, heads_1, heads_2 = markdown(ExperimentResult(**report)).splitlines()
    assert "timed while other processes took more than 0.25 CPU cores (speeds marked busy): " \
           "heads_1-s1 decoding (1.20 cores)" in title
    train, decode, cache = (column.strip() for column in heads_1.strip("|").split("|")[-3:])
    assert decode.endswith(" busy") and not train.endswith("busy") and not cache.endswith("busy")
    assert heads_2.strip("|").split("|")[-2].strip().endswith("(1.00x)")  # the baseline's own ratio stands


@pytest.mark.parametrize(("change", "words"), [
    (('baseline = "heads_2"', 'baseline = "heads_3"'), "experiment.baseline: expected one of the cells"),
    (("max_steps = 6", "max_steps = 0"), "experiment.max_time: expected experiment.max_steps or"),
    (('heads_1 = ["model.n_heads=1"]', 'heads_1 = ["model.n_heads=0"]'), "experiment.cells.heads_1: "),
    (("[experiment]", "[experimnt]"), "experimnt: unknown table; did you mean 'experiment'?"),
])
def test_a_bad_spec_is_one_line_before_anything_runs(corpus, tmp_path, change, words):
    spec = tmp_path / "bad.toml"
    spec.write_text(SPEC.replace(*change))
    result = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_cell_scored_on_another_test_set_is_refused_before_anything_trains(tmp_path):
    spec = tmp_path / "lengths.toml"
    spec.write_text(recall_spec([1]).replace('one = ["model.n_encoder_layers=1"]', 'one = ["data.max_len=24"]'))
    result = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "experiment.cells.one is scored on another test set than the baseline 'two'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_that_diverges_is_an_outcome_scored_as_empty_output_and_kept(tmp_path):
    """A cell whose loss goes non-finite (lr 1e30) stops training, as `train` does, but the
    experiment goes on: the run counts as an empty output (accuracy 0, paired with the
    baseline's run), results.md says it diverged, and a rerun keeps it rather than training
    it again."""
    spec = tmp_path / "wild.toml"
    spec.write_text(recall_spec([1]) + 'wild = ["train.lr=1e30", "train.max_nonfinite_steps=0"]\n')
    out = tmp_path / "out"
    result = runner.invoke(app, ["experiment", str(spec), "--out", str(out), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    wild = next(r for r in report["runs"] if r["cell"] == "wild")
    assert wild["test"] == 0.0 and wild["diverged_at"] <= 4 and wild["valid"] is None
    assert wild["train_seconds"] > 0 and wild["train_steps_per_s"] > 0  # the steps it took, timed
    assert Path(wild["predictions"]).read_text() == "\n" * 48  # data.n_test: every example unanswered
    two = next(r for r in report["runs"] if r["cell"] == "two")
    (paired,) = next(c for c in report["cells"] if c["cell"] == "wild")["paired"]
    assert paired["difference"] == pytest.approx(-two["test"])
    assert f"diverged (the loss stayed non-finite), scored as an empty output: wild-s1 at step " \
           f"{wild['diverged_at']}" in (out / "results.md").read_text()
    last = out / "runs" / "wild-s1" / "checkpoints" / "last.safetensors"
    before = last.stat().st_mtime_ns
    again = runner.invoke(app, ["experiment", str(spec), "--out", str(out), "--device", "cpu", "--json"])
    assert again.exit_code == 0, again.output
    assert last.stat().st_mtime_ns == before  # kept, not trained again
    from xformer.studies.experiment import load_experiment
    from xformer.studies.ledger import record_from_run

    record = record_from_run(out, spec, load_experiment(spec))  # what `xformer claims` keeps of it
    assert record["train_minutes"] >= 0 and record["results"]["runs"][2]["diverged_at"] == wild["diverged_at"]


def test_set_experiment_values_change_the_spec_and_the_rest_every_recipe(tmp_path):
    """--set experiment.max_steps=... runs a spec at another budget (a GPU's, say) without
    editing it; recipe values still go to every cell; the cells stay the spec's."""
    from xformer.studies.experiment import load_experiment

    spec = tmp_path / "depth.toml"
    spec.write_text(recall_spec([1, 2]))
    loaded = load_experiment(spec, ["experiment.max_steps=40", "experiment.seeds=[3]", "model.dropout=0.2"])
    assert (loaded.config.max_steps, loaded.config.seeds) == (40, [3])
    recipe = loaded.recipe("one", 3)
    assert (recipe.train.max_steps, recipe.train.seed, recipe.model.dropout) == (40, 3, 0.2)
    result = runner.invoke(app, ["experiment", str(spec), "--set", 'experiment.cells={a=[]}', "--out",
                                 str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "--set experiment.cells={a=[]}: experiment.cells cannot be set from the command line" in result.stderr
    result = runner.invoke(app, ["experiment", str(spec), "--set", "experiment.seeds=[1,1]", "--out",
                                 str(tmp_path / "out")])
    assert result.exit_code == 2 and "experiment.seeds: expected distinct seeds, found [1, 1]" in result.stderr


def test_a_recipe_where_an_experiment_belongs_is_named(tmp_path):
    result = runner.invoke(app, ["experiment", str(RECIPE), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no [experiment] table" in result.stderr and "xformer train" in result.stderr


def test_a_classification_experiment_pairs_its_runs_by_mcnemar(tmp_path):
    """A generated task (recall): accuracy per cell, and McNemar's test of each seed's run
    against the baseline's on the same test examples."""
    spec = tmp_path / "depth.toml"
    spec.write_text(recall_spec([1]))
    result = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["metric"] == "accuracy"
    (paired,) = report["cells"][0]["paired"]
    runs = {r["cell"]: r for r in report["runs"]}
    assert paired["difference"] == pytest.approx(runs["one"]["test"] - runs["two"]["test"])
    assert 0 < paired["p_value"] <= 1
    for run in runs.values():  # the test split's forward passes are timed like translation's decoding
        scored = json.loads((Path(run["run_dir"]) / "eval.json").read_text())
        assert run["decode_per_s"] == scored["examples_per_s"] > 0
        assert run["decode_others_cpu"] == scored.get("others_cpu")
        assert scored["examples_per_s"] == pytest.approx(scored["n_examples"] / scored["eval_seconds"])
    assert "| test examples/s |" in (tmp_path / "out" / "results.md").read_text()


def test_an_experiment_never_writes_into_a_users_folder_or_a_training_run(done, corpus, tmp_path):
    spec, _, _ = done
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.md").write_text("my results\n")
    refused = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(mine), "--device", "cpu"])
    assert refused.exit_code == 2 and f"{mine}: not empty and not a folder xformer experiment wrote" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["results.md"] and (mine / "results.md").read_text() == "my results\n"
    run_dir = tmp_path / "run"
    trained = runner.invoke(app, ["train", str(RECIPE), *sets(corpus), "--max-steps", "2", "--out", str(run_dir),
                                  "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    before = sorted(p.name for p in run_dir.iterdir())
    refused = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(run_dir), "--device", "cpu"])
    assert refused.exit_code == 2 and f"{run_dir}: is a training run's folder (xformer train)" in refused.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_reuse_refuses_a_run_whose_checkpoint_is_damaged_before_copying_it(done, corpus, tmp_path):
    spec, out, _ = done
    source = tmp_path / "finished"
    shutil.copytree(out, source)
    best = source / "runs" / "heads_2-s1" / "checkpoints" / "best.safetensors"
    data = bytearray(best.read_bytes())
    data[-8:] = b"\xff" * 8  # a flipped tail: the tensors no longer match their sha256
    best.write_bytes(bytes(data))
    result = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(tmp_path / "new"),
                                 "--device", "cpu", "--reuse", str(source)])
    assert result.exit_code == 2 and "--reuse: " in result.stderr and str(best) in result.stderr
    assert "damaged" in result.stderr and not (tmp_path / "new" / "runs" / "heads_2-s1").exists()


def test_every_problem_of_a_spec_is_reported_at_once(corpus, tmp_path):
    """The spec's own problems and every cell's, together: not the first cell's only."""
    spec = tmp_path / "bad.toml"
    spec.write_text(SPEC.replace("seeds = [1, 2]", "seeds = [1, 1]")
                    .replace('heads_1 = ["model.n_heads=1"]', 'heads_1 = ["model.n_heads=0", "train.lrr=1"]')
                    .replace("heads_2 = []", 'heads_2 = ["model.ffn=\\"gelu2\\""]'))
    result = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    lines = result.stderr.strip().splitlines()
    for words in ("experiment.seeds: expected distinct seeds", "experiment.cells.heads_1: --set model.n_heads",
                  "experiment.cells.heads_1: --set train.lrr: unknown key",
                  "experiment.cells.heads_2: --set model.ffn"):
        assert sum(words in line for line in lines) == 1, (words, lines)


def test_a_curve_trains_one_stable_run_per_seed_and_branches_each_smaller_budget(tmp_path):
    """experiment.budgets = [4, 8] with 3 seeds: each cell and seed trains once to 8 steps in the
    wsd schedule, and the 4-step budget is a cooldown branched from it at step 3 (where a
    4-step run starts cooling), ending with the tensors of a 4-step run trained alone. Every
    budget is scored; results.json keeps a curve per budget and the validation curve the
    convergence rule reads."""
    import torch

    from xformer.studies.experiment import load_experiment
    from xformer.train import run
    from xformer.training.checkpoint import read_checkpoint

    spec = tmp_path / "curve.toml"
    spec.write_text(recall_spec([1, 2, 3]).replace("max_steps = 4", "budgets = [4, 8]"))
    made = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu", "--json"])
    assert made.exit_code == 0, made.output
    report = json.loads(made.stdout.strip().splitlines()[-1])
    runs = tmp_path / "out" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted(f"{c}-s{s}{b}" for c in ("one", "two") for s in (1, 2, 3)
                                                           for b in ("", "-at4"))
    for cell in ("one", "two"):
        for seed in (1, 2, 3):
            stable = json.loads((runs / f"{cell}-s{seed}" / "train.json").read_text())
            branch = json.loads((runs / f"{cell}-s{seed}-at4" / "train.json").read_text())
            assert stable["steps"] == 8 and branch["steps"] == 4
            assert json.loads((runs / f"{cell}-s{seed}-at4" / "branched-from.json").read_text())["step"] == 3
    assert [c["budget"] for c in report["curves"]] == [4, 8]
    assert report["curves"][1]["cells"] == report["cells"]
    four = {(r["cell"], r["seed"]): r for r in report["curves"][0]["runs"]}
    for row in report["runs"]:
        shorter = four[(row["cell"], row["seed"])]
        assert row["budget"] == 8 and row["curve"] == [[4, shorter["valid"]], [8, row["valid"]]]
    # the branch is the run a 4-step wsd budget trains alone
    experiment = load_experiment(spec)
    run(experiment.recipe("two", 2, 4), tmp_path / "alone", device="cpu")
    a, _ = read_checkpoint(tmp_path / "alone" / "checkpoints" / "last.safetensors")
    b, _ = read_checkpoint(runs / "two-s2-at4" / "checkpoints" / "last.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith(("model.", "optim.")))
    again = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert again.exit_code == 0 and "12 runs, 12 done already" in again.output
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0
    # the ledger judges it at 8 steps, says the verdict at 4 too, and draws the curves
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "curve.toml").write_text(spec.read_text() + CURVE_CLAIM)
    shutil.copytree(tmp_path / "out", tmp_path / "runs" / "curve")
    ledger = runner.invoke(app, ["claims", str(specs), "--runs", str(tmp_path / "runs"), "--out",
                                 str(tmp_path / "docs" / "claims.md"), "--json"])
    assert ledger.exit_code == 0, ledger.output
    row = json.loads(ledger.stdout.strip().splitlines()[-1])["rows"][0]
    assert [b["budget"] for b in row["budgets"]] == [4, 8] and set(row["budgets"][0]["order"]) == {"one", "two"}
    text = (tmp_path / "docs" / "claims.md").read_text()
    assert "At every budget (judged at the largest): 4 steps: " in text
    assert "![learning curves of curve](claims/curve.png)" in text
    assert (tmp_path / "docs" / "claims" / "curve.png").stat().st_size > 0


def test_reuse_copies_a_curves_cooldowns_with_the_run_they_branch_from(tmp_path):
    """A second experiment of the same cell with --reuse copies the stable run and its cooldowns
    (the branch recorded as a change in the copy's recipe is no difference), trains nothing, and
    reports the scores of the runs it copied."""
    spec = tmp_path / "curve.toml"
    spec.write_text(recall_spec([1, 2]).replace("max_steps = 4", "budgets = [4, 8]"))
    first = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "first"), "--device", "cpu", "--json"])
    assert first.exit_code == 0, first.output
    again = tmp_path / "again.toml"
    again.write_text(spec.read_text().replace('one = ["model.n_encoder_layers=1"]\n', ""))
    second = runner.invoke(app, ["experiment", str(again), "--out", str(tmp_path / "second"), "--device", "cpu",
                                 "--reuse", str(tmp_path / "first"), "--json"])
    assert second.exit_code == 0, second.output
    runs = tmp_path / "second" / "runs"
    for name in ("two-s1", "two-s1-at4", "two-s2", "two-s2-at4"):
        source = json.loads((runs / name / "copied-from.json").read_text())["source"]
        assert Path(source) == tmp_path / "first" / "runs" / name
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second))
    mine = {(r["cell"], r["seed"], r.get("budget")): (r["test"], r["valid"]) for c in b["curves"] for r in c["runs"]}
    theirs = {(r["cell"], r["seed"], r.get("budget")): (r["test"], r["valid"]) for c in a["curves"] for r in c["runs"]
              if r["cell"] == "two"}
    assert mine == theirs and len(mine) == 4


CURVE_CLAIM = """
[claim]
number = 2
says = "Two layers beat one."
anchor = "none: a toy"

[[claim.checks]]
cell = "one"
expect = "worse"
"""


def test_jobs_2_makes_the_runs_jobs_1_makes(tmp_path, monkeypatch):
    """--jobs 2 trains two runs at once, each in its own process with half the threads; with
    one thread a run either way, every run's tensors and scores equal those of --jobs 1, and the
    results are the same cell for cell. A curve's cooldowns go with their stable run."""
    import torch

    from xformer.training.checkpoint import read_checkpoint

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # --jobs 2: one thread each
    spec = tmp_path / "curve.toml"
    spec.write_text(recall_spec([1, 2]).replace("max_steps = 4", "budgets = [4, 8]"))
    parallel = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "two"), "--device", "cpu",
                                   "--jobs", "2", "--json"])
    assert parallel.exit_code == 0, parallel.output
    monkeypatch.undo()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "one"), "--device", "cpu",
                                     "--json"])
    finally:
        torch.set_num_threads(threads)
    assert serial.exit_code == 0, serial.output
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (parallel, serial))
    assert untimed(a["cells"]) == untimed(b["cells"])
    assert [(r["cell"], r["seed"], r["test"], r["valid"]) for r in a["runs"]] == \
        [(r["cell"], r["seed"], r["test"], r["valid"]) for r in b["runs"]]
    for run in (tmp_path / "one" / "runs").iterdir():
        mine, _ = read_checkpoint(run / "checkpoints" / "last.safetensors")
        theirs, _ = read_checkpoint(tmp_path / "two" / "runs" / run.name / "checkpoints" / "last.safetensors")
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if k.startswith(("model.", "optim."))), run.name
    assert not list((tmp_path / "two" / "runs").glob("*.job.log"))  # a job's log goes once it succeeded


def test_runs_are_scored_at_longer_lengths_and_learned_positions_cannot_go_past_their_table(tmp_path):
    """experiment.lengths: each run's best checkpoint scored on its task generated at 40 and 64
    tokens (trained at 32). Sinusoidal positions are a formula and score at both; learned
    positions with a 48-position table score at 40 (on positions never trained) and "cannot
    extrapolate" to 64, which is a result (scored 0, the reason kept), not an error. A check
    compares a cell with itself at another length."""
    from xformer.studies.claim_spec import Check
    from xformer.studies.claims import judge

    spec = tmp_path / "lengths.toml"
    cells = 'one = ["model.positional=learned", "model.max_positions=48"]\ntwo = ["model.positional=sinusoidal"]'
    spec.write_text(recall_spec([1, 2, 3]).replace('one = ["model.n_encoder_layers=1"]\ntwo = []', cells)
                    .replace("max_steps = 4", "max_steps = 4\nlengths = [40, 64]"))
    made = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu", "--json"])
    assert made.exit_code == 0, made.output
    report = json.loads(made.stdout.strip().splitlines()[-1])
    for row in report["runs"]:
        assert set(row["test_at"]) == {"40", "64"}
        scored = json.loads((tmp_path / "out" / "runs" / f"{row['cell']}-s{row['seed']}" / "eval" /
                             "test.len40.best.json").read_text())
        assert row["test_at"]["40"] == scored["accuracy"] and scored["split"] == "test.len40"
        if row["cell"] == "one":
            assert row["test_at"]["64"] == 0.0 and "model.max_positions = 48" in row["cannot"]["64"]
        else:
            assert "cannot" not in row
    run = tmp_path / "out" / "runs" / "two-s1"
    assert json.loads((run / "eval.json").read_text())["split"] == "test"  # the run's own score stays its own
    outcome = judge(Check("one", "worse", than="one", length=64), report)
    assert "one at 64 - one per seed" in outcome.reason and "cannot extrapolate (scored 0): one at 64" in outcome.reason
    shown = runner.invoke(app, ["eval", str(tmp_path / "out" / "runs" / "one-s1"), "--length", "64", "--device", "cpu"])
    assert shown.exit_code == 0 and "cannot extrapolate to 64 tokens" in shown.output
    refused = runner.invoke(app, ["eval", str(tmp_path / "out" / "runs" / "one-s1"), "--length", "0"])
    assert refused.exit_code == 2


def test_archived_runs_restored_on_another_machine_are_scored_from_their_records_not_trained(done, corpus, tmp_path):
    """A finished experiment's runs archived without their checkpoints (xformer.studies.archive)
    and put back into a new folder: the experiment trains and decodes nothing there, and its
    scores, curves and paired tests are the first's. Only the baseline's first run keeps its
    tokenizer (the test inputs' lengths); archiving again adds nothing, and a restore never
    replaces a run folder that is there."""
    from xformer.studies.archive import ARCHIVED
    from xformer.studies.archive_spec import restore_spec, save_spec

    spec, out, report = done
    dest = tmp_path / "records"
    made = save_spec(spec, out, dest)
    assert sorted(made) == ["heads_1-s1", "heads_1-s2", "heads_2-s1", "heads_2-s2"]
    assert not list(dest.rglob("*.safetensors")) and save_spec(spec, out, dest) == []
    assert [p.parent.name for p in dest.glob("*/tokenizer")] == ["heads_2-s1"]
    best = json.loads((dest / "heads_1-s2" / ARCHIVED).read_text())["best"]
    assert best["final"] and best["sha256"] and best["name"] == "best"
    changed = spec.with_name("heads-edited.toml")  # another version of the spec: its archive is not restored
    changed.write_text(spec.read_text().replace("max_steps = 6", "max_steps = 7"))
    assert restore_spec(changed, dest, tmp_path / "other") is None and not (tmp_path / "other").exists()
    commented = spec.with_name("heads-commented.toml")  # a comment is not a setting: the same version
    commented.write_text("# Result: measured\n" + spec.read_text())
    assert sorted(restore_spec(commented, dest, tmp_path / "commented")) == sorted(made)
    again = tmp_path / "again"
    assert sorted(restore_spec(spec, dest, again)) == sorted(made) and restore_spec(spec, dest, again) == []
    result = runner.invoke(app, ["experiment", str(spec), *sets(corpus), "--out", str(again), "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert not list(again.rglob("*.safetensors")) and not list(again.rglob("checkpoints"))
    mine = json.loads(result.stdout.strip().splitlines()[-1])
    keys = ("cell", "seed", "test", "valid", "curve", "best_step")
    assert [{k: r[k] for k in keys} for r in mine["runs"]] == [{k: r[k] for k in keys} for r in report["runs"]]
    assert untimed(mine["cells"]) == untimed(report["cells"])


def test_a_cell_is_archived_only_when_its_run_and_every_cooldown_are_finished(tmp_path):
    """A cooldown branches from its run's checkpoints, so a cell whose cooldown is missing is
    not archived: restored elsewhere, that cell trains again (run and cooldown), the archived
    cell does not, and the scores of the archived cell are the first experiment's."""
    from xformer.studies.archive_spec import restore_spec, save_spec

    spec = tmp_path / "curve.toml"
    spec.write_text(recall_spec([1]).replace("max_steps = 4", "budgets = [4, 8]"))
    first = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "first"), "--device", "cpu", "--json"])
    assert first.exit_code == 0, first.output
    shutil.rmtree(tmp_path / "first" / "runs" / "one-s1-at4")
    assert sorted(save_spec(spec, tmp_path / "first", tmp_path / "records")) == ["two-s1", "two-s1-at4"]
    restore_spec(spec, tmp_path / "records", tmp_path / "second")
    second = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "second"), "--device", "cpu",
                                 "--json"])
    assert second.exit_code == 0, second.output
    runs = tmp_path / "second" / "runs"
    assert (runs / "one-s1" / "checkpoints").is_dir() and (runs / "one-s1-at4" / "checkpoints").is_dir()
    assert not (runs / "two-s1" / "checkpoints").exists() and not (runs / "two-s1-at4" / "checkpoints").exists()
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second))
    scores = [{(r["cell"], r.get("budget")): r["test"] for c in x["curves"] for r in c["runs"] if r["cell"] == "two"}
              for x in (a, b)]
    assert scores[0] == scores[1] and len(scores[0]) == 2


def test_a_teacher_without_weights_is_trained_from_its_own_spec_before_its_students(corpus, tmp_path, monkeypatch):
    """A student's cells name their teacher by folder (RUNS/<spec>/runs/<cell>-s<seed>). Where
    the teacher has no checkpoints (a fresh machine holds only archived records), it is trained
    from that spec's cell and seed, the archived copy moved aside; once trained, nothing more.
    A teacher that is not such a run cannot be made and says so."""
    from xformer.errors import RunError
    from xformer.studies.archive import ARCHIVED
    from xformer.studies.archive_spec import train_teachers

    monkeypatch.chdir(tmp_path)  # teachers are named from the chain's working folder
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "teach.toml").write_text(SPEC)
    student = specs / "student.toml"
    student.write_text(SPEC.replace('baseline = "heads_2"', 'baseline = "refs"').replace(
        'heads_1 = ["model.n_heads=1"]\nheads_2 = []',
        'refs = []\nword = ["distill.teacher=runs/teach/runs/heads_2-s2", "distill.kind=word"]'))
    archived = tmp_path / "runs" / "teach" / "runs" / "heads_2-s2"
    archived.mkdir(parents=True)
    (archived / ARCHIVED).write_text("{}")
    overrides = [*TINY, f"data.dataset={json.dumps(str(corpus))}"]
    assert train_teachers(student, "cpu", overrides) == ["runs/teach/runs/heads_2-s2"]
    assert (archived / "checkpoints" / "best.safetensors").is_file()
    assert (archived.with_name("heads_2-s2.archived") / ARCHIVED).is_file()
    ran = json.loads((archived / "train.json").read_text())["card"]["recipe"]
    assert (ran["train"]["seed"], ran["train"]["max_steps"], ran["model"]["n_heads"]) == (2, 6, 2)
    assert train_teachers(student, "cpu", overrides) == []
    student.write_text(student.read_text().replace("runs/teach/runs/heads_2-s2", "elsewhere/teacher"))
    with pytest.raises(RunError, match="elsewhere/teacher has no checkpoints"):
        train_teachers(student, "cpu", overrides)

"""A user's files are never lost to `train`: which folders count as runs, what --overwrite
removes, and that the recipe being read is never written to."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from tests.test_train import RECIPE, TINY
from xformer.config.loading import load_recipe
from xformer.training.checkpoint import read_checkpoint
from xformer_cli.main import app

runner = CliRunner()
COMMENTED = "# my notes on this experiment\n" + RECIPE.read_text(encoding="utf-8")


def train(corpus, recipe, *args):
    sets = [arg for value in TINY + [f"data.dataset={json.dumps(str(corpus))}"] for arg in ("--set", value)]
    return runner.invoke(app, ["train", str(recipe), *sets, "--max-steps", "2", "--precision", "fp32", *args])


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder: a commented recipe, notes and data, as the current directory."""
    (tmp_path / "recipe.toml").write_text(COMMENTED, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("precious", encoding="utf-8")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.jsonl").write_text("{}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_current_directory_is_refused_as_a_run(corpus, project):
    before = snapshot(project)
    one_line_error(train(corpus, "recipe.toml", "--out", ".", "--overwrite"), "current directory")
    one_line_error(train(corpus, project / "recipe.toml", "--out", "..", "--overwrite"), "holds it")
    assert snapshot(project) == before


def test_a_folder_holding_the_recipe_is_refused_with_or_without_overwrite(corpus, project):
    before = snapshot(project)
    (project / "myexp").mkdir()
    shutil.copy(project / "recipe.toml", project / "myexp" / "recipe.toml")
    (project / "myexp" / "notes.txt").write_text("mine", encoding="utf-8")
    for extra in ([], ["--overwrite"]):
        one_line_error(train(corpus, "myexp/recipe.toml", "--out", "myexp", *extra), "holds the recipe")
    assert (project / "myexp" / "recipe.toml").read_text(encoding="utf-8") == COMMENTED
    assert (project / "myexp" / "notes.txt").read_text(encoding="utf-8") == "mine"
    assert snapshot(project) == {**before, **snapshot(project)}  # nothing of the user's changed


def test_a_folder_that_is_not_a_run_is_never_written_into(corpus, project):
    (project / "other").mkdir()
    (project / "other" / "notes.txt").write_text("mine", encoding="utf-8")
    for extra in ([], ["--overwrite"]):
        one_line_error(train(corpus, "recipe.toml", "--out", "other", *extra), "not an xformer run directory")
    assert [p.name for p in (project / "other").iterdir()] == ["notes.txt"]
    (project / "afile").write_text("x", encoding="utf-8")
    one_line_error(train(corpus, "recipe.toml", "--out", "afile"), "is a file, not a directory")


def test_overwrite_removes_run_artefacts_only_and_resume_never_writes_the_recipe(corpus, project):
    assert train(corpus, "recipe.toml", "--out", "runs/a").exit_code == 0
    run = project / "runs" / "a"
    assert (run / "xformer-run.json").is_file()
    (run / "my-analysis.md").write_text("keep me", encoding="utf-8")
    again = train(corpus, "recipe.toml", "--out", "runs/a")
    one_line_error(again, "exists and is not empty", "--overwrite")
    replaced = train(corpus, "recipe.toml", "--out", "runs/a", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert "--overwrite removed" in replaced.stderr
    assert (run / "my-analysis.md").read_text(encoding="utf-8") == "keep me"
    assert (run / "checkpoints" / "last.safetensors").is_file()
    # the run's own recipe resumes it (what the interrupt hint prints), recording the new limit
    # with the step it took effect at; a resume that changes nothing leaves it as it was
    resumed = runner.invoke(app, ["train", "runs/a/recipe.toml", "--out", "runs/a", "--resume", "--max-steps", "3"])
    assert resumed.exit_code == 0, resumed.output
    recorded = load_recipe(run / "recipe.toml")
    assert recorded.train.max_steps == 3
    assert [(c.step, c.set, c.was) for c in recorded.changes] == [(2, {"train.max_steps": 3}, {"train.max_steps": 2})]
    _, meta = read_checkpoint(run / "checkpoints" / "last.safetensors")
    assert meta["progress"]["step"] == 3
    saved = (run / "recipe.toml").read_bytes()
    done = runner.invoke(app, ["train", "runs/a/recipe.toml", "--out", "runs/a", "--resume"])
    assert done.exit_code == 2 and "already stopped" in done.stderr
    assert (run / "recipe.toml").read_bytes() == saved
    # ... but --overwrite from it would delete the file being read
    one_line_error(runner.invoke(app, ["train", "runs/a/recipe.toml", "--out", "runs/a", "--overwrite"]),
                   "holds the recipe")
    assert (project / "recipe.toml").read_text(encoding="utf-8") == COMMENTED


def test_the_interrupt_hint_is_a_command_that_resumes(corpus, project, monkeypatch):
    """The README's own command carries --set data.dataset=...; the hint names the run's
    recipe, which holds every override, so it works as printed."""
    import os
    import shlex
    import signal

    import xformer_cli.train as cli_train

    class InterruptAtStep3(cli_train.TrainDisplay):
        def __call__(self, kind, payload):
            super().__call__(kind, payload)
            if kind in ("tick", "step") and payload["step"] == 3:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cli_train, "TrainDisplay", InterruptAtStep3)
    stopped = train(corpus, "recipe.toml", "--out", "runs/b", "--max-steps", "6")
    assert stopped.exit_code == 130, stopped.output
    hint = stopped.stderr.strip().splitlines()[-1]
    assert hint.startswith("interrupted at step 4; continue with: xformer train ")
    command = shlex.split(hint.split("continue with: ", 1)[1])
    monkeypatch.setattr(cli_train, "TrainDisplay", cli_train.TrainDisplay.__mro__[1])
    resumed = runner.invoke(app, command[1:])
    assert resumed.exit_code == 0, resumed.output
    _, meta = read_checkpoint(project / "runs" / "b" / "checkpoints" / "last.safetensors")
    assert meta["progress"]["step"] == 6


def test_json_written_for_a_non_finite_number_is_null_with_what_it_was():
    from xformer.files import finite_json

    text = finite_json({"loss": float("nan"), "ppl": float("inf"), "bleu": 1.5, "history": [{"x": -float("inf")}]})
    parsed = json.loads(text, parse_constant=lambda word: pytest.fail(f"bare {word}"))
    assert parsed == {"loss": None, "ppl": None, "bleu": 1.5, "nonfinite": {"loss": "nan", "ppl": "inf"},
                      "history": [{"x": None, "nonfinite": {"x": "-inf"}}]}

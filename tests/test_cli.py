import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
runner = CliRunner()


def test_every_command_in_help_answers_its_own_help_with_a_usage_naming_its_arguments():
    top = runner.invoke(app, ["--help"], terminal_width=100)
    assert top.exit_code == 0, top.output
    listing = top.stdout.split("\nCommands:\n", 1)[1].splitlines()
    described = dict(line.split(None, 1) for line in listing if line.strip())  # name -> summary
    registered = {name: command for name, command in typer.main.get_command(app).commands.items()
                  if not command.hidden}
    assert set(described) == set(registered)  # every command listed, nothing listed that is not one
    commands = [([name], command) for name, command in registered.items()]
    for name, command in registered.items():  # a group's commands too (xformer bench attention)
        commands += [([name, sub], c) for sub, c in getattr(command, "commands", {}).items()]
    for words, command in commands:
        arguments = [p.name.upper() if p.required else f"[{p.name.upper()}]"
                     for p in command.params if p.param_type_name == "argument"]
        if hasattr(command, "commands"):
            arguments = ["COMMAND", "[ARGS]..."]
        result = runner.invoke(app, [*words, "--help"], terminal_width=100)
        assert result.exit_code == 0, (words, result.output)
        assert result.stdout.splitlines()[0] == " ".join(["Usage: xformer", *words, "[OPTIONS]", *arguments])
    assert all(summary.strip() for summary in described.values()), "a command has no summary in --help"


def test_check_prints_config_and_parameters():
    result = runner.invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "model.d_model" in result.stdout and "non_embedding" in result.stdout


def test_check_shows_what_a_resumed_run_changed(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.read_text() + '\n[[changes]]\nstep = 40\nset = {"train.lr" = 1e-4}\n'
                      'was = {"train.lr" = 5e-4}\n')
    result = runner.invoke(app, ["check", str(recipe)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "from step 40" in result.stdout and "train.lr 0.0005 -> 0.0001" in result.stdout


def test_check_json_is_one_object():
    result = runner.invoke(app, ["check", str(RECIPE), "--json", "--set", "model.n_kv_heads=2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"config", "derived", "parameters"}
    assert set(report["parameters"]) == {"total", "embedding", "non_embedding"}
    assert report["config"]["model"]["n_kv_heads"] == 2
    p = report["parameters"]
    assert p["total"] == p["embedding"] + p["non_embedding"] > 0


def test_bad_recipe_exits_2_with_one_line_per_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nd_modle = 3\nn_heads = "four"\n[train]\nmax_steps = 5\n')
    result = runner.invoke(app, ["check", str(bad), "--set", "train.lr=fast"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"{bad}: model.d_modle: unknown key; did you mean 'd_model'?",
        f'{bad}: model.n_heads: expected an integer, found "four" (string)',
        '--set train.lr: expected a number, found "fast" (string)',
    ]
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_missing_recipe_exits_2(tmp_path):
    result = runner.invoke(app, ["check", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"{tmp_path / 'nope.toml'}: no such recipe file"


def test_debug_shows_the_exception(tmp_path):
    result = runner.invoke(app, ["--debug", "check", str(tmp_path / "nope.toml")])
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "RecipeError"


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("xformer ")


def test_help_keeps_bracketed_words_and_names_arguments_plainly():
    """Help strings are plain text, not rich markup: '[default: ...]' and '[sweep]' survive."""
    train = runner.invoke(app, ["train", "--help"], terminal_width=100)
    assert train.exit_code == 0
    assert "Usage: xformer train [OPTIONS] RECIPE" in train.stdout
    assert "[default: runs/<recipe name>]" in " ".join(train.stdout.split())
    sweep = runner.invoke(app, ["longrange", "--help"], terminal_width=100)
    assert "[sweep]" in sweep.stdout and "{sweep}" not in sweep.stdout
    evaluate = runner.invoke(app, ["eval", "--help"], terminal_width=100)
    assert "Usage: xformer eval [OPTIONS] RUN" in evaluate.stdout and "[default: eval.beam]" in evaluate.stdout


def one_line(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert "Traceback" not in result.output


def test_files_that_are_not_recipes_are_named_as_such(tmp_path):
    sweep = ROOT / "recipes" / "longrange" / "recall_cpu_sweep.toml"
    one_line(runner.invoke(app, ["check", str(sweep)]), "a [sweep] file, not a recipe", "xformer longrange")
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing yet\n")
    for path in (empty, Path("/dev/null")):
        one_line(runner.invoke(app, ["check", str(path)]), "expected a recipe with [model], [data] and [train]")


def test_bad_paths_and_flag_values_are_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line(runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(afile)]), str(afile))
    one_line(runner.invoke(app, ["average", str(tmp_path / "nope")]), "no such run directory")
    one_line(runner.invoke(app, ["train", str(RECIPE), "--max-time", "-1"]), "--max-time:")
    assert "--set" not in runner.invoke(app, ["train", str(RECIPE), "--max-time", "-1"]).stderr


def test_an_error_is_the_first_line_written_with_no_empty_line_above_it(tmp_path):
    """A bar that never started (train failing while loading its data), a transient one
    outside a terminal (eval) and one over a grid leave nothing above the error."""
    missing = json.dumps(str(tmp_path / "none"))
    for args in (["eval", str(tmp_path)], ["inspect-heads", str(tmp_path)],
                 ["train", str(RECIPE), "--set", f"data.dataset={missing}", "--out", str(tmp_path / "r")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "\n\n" not in "\n" + result.stderr, (args, result.stderr)


def test_a_write_that_fails_names_the_file_written_not_its_temporary():
    """atomic_write writes through a temporary file beside the target; an error in it names the
    target, the one file the user knows."""
    from xformer.files import atomic_write

    target = Path("/proc/xformer-cannot-write-here.json")
    with pytest.raises(OSError) as info:
        atomic_write(target, lambda tmp: Path(tmp).write_text("x"))
    assert info.value.filename == str(target) and ".tmp" not in str(info.value)


def test_the_progress_bar_keeps_its_times_at_80_columns():
    import io
    import re
    import time

    from rich.console import Console

    from xformer_cli.display import TrainDisplay

    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    display = TrainDisplay(console)
    display("start", {"parameters": 1000, "steps_per_epoch": 10, "step": 0, "run_dir": "runs/x"})
    for step in (1, 2):
        display("step", {"fraction": 0.1 * step, "step": step, "epoch": 1, "loss": 4.5678, "lr": 1.5e-3,
                         "tokens_per_s": 12345.0})
        time.sleep(0.05)
    display.__exit__(None, None, None)
    bar = console.file.getvalue().splitlines()[-1]
    assert re.search(r"\d:\d\d:\d\d ETA \d:\d\d:\d\d", bar), bar


def test_the_grid_bar_counts_each_run_once_and_starts_past_silent_ones():
    """experiment reports every run (finished ones too), a sweep only those it trains: the bar
    starts past the ones that will not report, and each report moves it one run."""
    import io

    from rich.console import Console

    from xformer_cli.display import TOTAL, GridBar

    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    with GridBar("sweep", console) as bar:
        bar.plan(4, 1, "runs/x", silent=1)
        task = bar.progress.tasks[0]
        assert task.completed == 1 * TOTAL and task.total == 4 * TOTAL
        bar.start("lstm length 64 seed 1", resumed=True)
        assert task.fields["run"] == "lstm length 64 seed 1 (resumed)"
        bar.advance(0.5)
        assert task.completed == 1.5 * TOTAL
        bar.end("lstm length 64 seed 1: done")
        assert task.completed == 2 * TOTAL
    with GridBar("experiment", console) as bar:
        bar.plan(2, 2, "runs/y")  # both finished, both will report their scores again
        for _ in range(2):
            bar.end("scored")
        assert bar.progress.tasks[0].completed == bar.progress.tasks[0].total
    out = console.file.getvalue()
    assert "4 runs, 1 done already; results in runs/x" in out and "lstm length 64 seed 1: done" in out


def test_the_heads_table_keeps_its_headers_at_80_columns():
    import io

    from rich.console import Console

    from xformer.results import HeadsReport
    from xformer_cli.heads import heads_table

    head = {"space": "decoder cross", "layer": 2, "head": 3, "ablation": 0.1234, "gradient": 0.5, "confidence": 0.9,
            "entropy": 1.2, "special": 0.3, "roles": ["positional -1", "special", "rare-word"]}
    report = HeadsReport(run="r", kind="translation", split="validation", data=None, n_examples=500,
                         importance_metric="loss", ablate="zero", base_metric=1.0, heads=[head], kv_groups={},
                         rank_correlation={}, similarity={}, criteria={}, syntactic="")
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    console.print(heads_table(report))
    text = console.file.getvalue()
    for header in ("attention", "head", "ablation", "grad.", "conf.", "entropy", "special", "roles"):
        assert header in text, text
    assert "…" not in text


CHOICES = [  # (command, option, the core's words, a word the core does not have)
    ("train", "--precision", "auto|fp32|bf16|fp16", "fp64"),
    ("inspect-heads", "--importance", "loss|bleu|accuracy", "perplexity"),
    ("inspect-heads", "--ablate", "zero|mean|rescale|renorm", "noise"),
    ("inspect-heads", "--prune-order", "one-shot|gradient|greedy", "random"),
    ("tokenize", "--side", "source|target", "both"),
]


@pytest.mark.parametrize(("command", "option", "words", "bad"), CHOICES)
def test_choice_options_list_the_core_words_and_refuse_others(command, option, words, bad, tmp_path):
    """Choice options are Enums built from the core's own words: --help lists them and click
    refuses another word with exit 2 before any work is done."""
    shown = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert f"{option} <{words}>" in shown.stdout, shown.stdout
    argument = str(tmp_path / "not-read")
    refused = runner.invoke(app, [command, argument, option, bad])
    assert refused.exit_code == 2
    assert f"'{bad}' is not one of " + ", ".join(f"'{w}'" for w in words.split("|")) in refused.output


def test_the_enums_are_the_core_choices():
    import typing

    from xformer.config import schema as config
    from xformer.heads.analyse import ABLATIONS, IMPORTANCE_METRICS, PRUNE_ORDERS
    from xformer_cli import common

    assert [p.value for p in common.Precision] == list(typing.get_args(config.Precision))
    assert [p.value for p in common.Importance] == list(IMPORTANCE_METRICS)
    assert [p.value for p in common.Ablation] == list(ABLATIONS)
    assert [p.value for p in common.PruneOrder] == list(PRUNE_ORDERS)


def test_core_argument_names_become_the_flags_typed():
    from xformer_cli.common import as_flag

    assert as_flag("prune_step: expected a fraction") == "--prune-step: expected a fraction"
    assert as_flag("runs/x: no checkpoints") == "runs/x: no checkpoints"  # a path is not an argument
    names = ("split", "last", "save_pruned")
    assert as_flag("split nope: a generated task has ...", names) == "--split nope: a generated task has ..."
    assert as_flag("last = 0: expected at least 1", names) == "--last 0: expected at least 1"
    assert as_flag("save_pruned: out exists", names) == "--save-pruned: out exists"
    assert as_flag("splits are ...", names) == "splits are ..."

import json
from pathlib import Path

from typer.testing import CliRunner

from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "check" in result.stdout


def test_check_prints_config_and_parameters():
    result = runner.invoke(app, ["check", str(RECIPE)])
    assert result.exit_code == 0, result.output
    assert "model.d_model" in result.stdout and "non_embedding" in result.stdout


def test_check_json_is_one_object():
    result = runner.invoke(app, ["check", str(RECIPE), "--json", "--set", "model.n_kv_heads=2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"config", "parameters"}
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

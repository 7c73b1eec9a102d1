"""Every recipe and sweep in recipes/ loads, validates, and builds (shrunk to a tiny size)."""

from pathlib import Path

import pytest
import torch

from xformer.config.loading import load_recipe
from xformer.model.attention import MultiHeadAttention
from xformer.model.build import count_parameters
from xformer.studies.longrange import MODELS, load_sweep, row_recipe
from xformer.tasks import build_for_recipe

FILES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.toml"))
SWEEPS = [p for p in FILES if p.read_text().count("[sweep]")]
EXPERIMENTS = [p for p in FILES if p.read_text().count("[experiment]")]
BLOCKED = [p for p in FILES if p.read_text().count("[claim]") and p not in EXPERIMENTS]  # claims not measurable yet
RECIPES = [p for p in FILES if p not in SWEEPS and p not in EXPERIMENTS and p not in BLOCKED]
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32", "model.n_encoder_layers=1"]


def name(path: Path) -> str:
    return str(path.relative_to(path.parents[1]))


def test_there_are_recipes_and_sweeps():
    assert RECIPES and SWEEPS and EXPERIMENTS


@pytest.mark.parametrize("path", EXPERIMENTS, ids=name)
def test_experiment_loads_and_every_cell_builds(path):
    """Every cell's recipe validates (load_experiment checks them) and builds on the meta
    device at its own size; the spec opens with the claim it measures (a study of a recipe's
    choices, outside recipes/claims/, with what it decides) and its command."""
    from xformer.studies.experiment import load_experiment

    experiment = load_experiment(path)
    opening = "# Claim:" if "claims" in path.parts else ("# Claim:", "# Study:")
    assert path.read_text().startswith(opening) and "xformer experiment " in path.read_text()
    for cell in experiment.cells:
        with torch.device("meta"):
            model = build_for_recipe(experiment.recipe(cell, experiment.config.seeds[0]), init=False)
        assert count_parameters(model)["total"] > 0


@pytest.mark.parametrize("path", sorted(BLOCKED + [p for p in EXPERIMENTS if "claims" in p.parts]), ids=name)
def test_every_claim_spec_states_its_claim(path):
    """Every spec in recipes/claims/ reads as the ledger reads it: a claim with checks against
    its experiment's cells, or blocked with what xformer lacks."""
    from xformer.studies.ledger import read_spec

    claim, experiment = read_spec(path)
    assert claim.number > 0 and claim.says
    assert bool(claim.blocked) == (experiment is None)
    assert experiment is None or experiment.checks
    assert path.read_text().startswith("# Claim:")


@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_recipe_builds_and_runs_at_tiny_size(path):
    recipe = load_recipe(path)
    assert path.read_text().startswith("#"), "a recipe opens with a comment: what, the command, the result"
    extra = {"seq2seq": ["model.n_decoder_layers=1"], "lstm": ["model.lstm_hidden=8"]}.get(recipe.model.arch, [])
    if recipe.data.task in ("translation", "classification"):
        extra.append("data.vocab_size=50")
    model = build_for_recipe(load_recipe(path, TINY + extra)).eval()
    tokens = torch.randint(1, 16, (2, 5))  # ids every vocabulary has (ListOps has 16)
    out = model(tokens, tokens) if recipe.model.arch == "seq2seq" else model(tokens)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("path", RECIPES, ids=name)
def test_recipe_builds_at_its_own_size_on_the_meta_device(path):
    """The tiny build above overrides the head counts; the recipe's own shape must build too
    (pruned heads, n_kv_heads, RoPE's head dimension), without allocating its weights."""
    recipe = load_recipe(path)
    with torch.device("meta"):
        model = build_for_recipe(recipe, init=False)
    counts = count_parameters(model)
    assert counts["total"] == counts["embedding"] + counts["non_embedding"] > 0
    if recipe.model.arch != "lstm":
        heads = {m.n_heads for m in model.modules() if isinstance(m, MultiHeadAttention)}
        assert heads and max(heads) == recipe.model.n_heads


@pytest.mark.parametrize("path", SWEEPS, ids=name)
def test_sweep_loads_and_its_lstm_matches_the_transformer(path):
    assert path.read_text().startswith("#")
    sweep = load_sweep(path)
    length = sweep.config.lengths[-1]
    recipes = {m: row_recipe(sweep, m, length, sweep.config.seeds[0]) for m in MODELS}
    assert recipes["transformer"].data.max_len == length <= recipes["transformer"].model.max_positions - 1
    if sweep.config.match_parameters:
        from xformer.studies.longrange import parameters

        t, lstm = parameters(recipes["transformer"]), parameters(recipes["lstm"])
        assert abs(lstm - t) / t < 0.10

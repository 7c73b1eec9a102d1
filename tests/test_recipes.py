"""Every recipe in recipes/ loads, validates, and builds (shrunk to a tiny size)."""

from pathlib import Path

import pytest
import torch

from xformer.config import load_recipe
from xformer.model.build import build_for_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.toml"))
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32",
        "model.n_encoder_layers=1", "data.vocab_size=50"]


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_builds_and_runs_at_tiny_size(path):
    recipe = load_recipe(path)
    assert recipe.model.d_model % recipe.model.n_heads == 0
    text = path.read_text()
    assert text.startswith("#"), "a recipe opens with a comment: what it reproduces, the command, the result"
    tiny = load_recipe(path, TINY + (["model.n_decoder_layers=1"] if recipe.model.arch == "seq2seq" else []))
    model = build_for_recipe(tiny).eval()
    tokens = torch.randint(1, 50, (2, 5))
    out = model(tokens, tokens) if recipe.model.arch == "seq2seq" else model(tokens)
    assert torch.isfinite(out).all()

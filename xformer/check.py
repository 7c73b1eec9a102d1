"""`xformer check`: validate a recipe and size the model it describes, without training."""

from __future__ import annotations

from pathlib import Path

import torch

from xformer.config.loading import load_recipe
from xformer.model.build import count_parameters
from xformer.results import CheckResult
from xformer.tasks import build_for_recipe


def check_recipe(path: str | Path, overrides: list[str] | None = None) -> CheckResult:
    """Load and validate a recipe (raising RecipeError with every problem), build its model
    on the meta device (no memory, no time) and return the resolved tables, the derived values
    and the parameter counts (total, embedding, non_embedding)."""
    recipe = load_recipe(path, overrides)
    with torch.device("meta"):
        model = build_for_recipe(recipe, init=False)
    derived = {"model.head_dim": recipe.model.head_dim, "model.kv_heads": recipe.model.kv_heads}
    return CheckResult(config=recipe.to_dict(), derived=derived, parameters=count_parameters(model))

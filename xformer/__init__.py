"""xformer: train, evaluate and take apart Transformer models.

The core library; the `xformer` command in `xformer_cli` is a thin shell over it. This
package never imports typer or rich, so it can be used from any program or notebook.
"""

from xformer.config.loading import load_recipe
from xformer.config.schema import Recipe
from xformer.errors import RecipeError, XformerError
from xformer.model import build_model, count_parameters
from xformer.tasks import TASKS, build_for_recipe, make_task

__version__ = "0.1.0"

__all__ = [
    "TASKS", "Recipe", "RecipeError", "XformerError", "build_for_recipe", "build_model",
    "count_parameters", "load_recipe", "make_task",
]

"""The tasks: one class per value of `data.task`, in a plain dict.

A task owns its [data] table (its `Data` class), its examples, its model's vocabulary and
outputs, its loss, validation, evaluation, predictions and its view for head inspection
(xformer/tasks/base.py lists the protocol). A new task is a new module here and one line in
TASKS; the recipe loader, train, eval, translate and inspect-heads pick it up from the dict.
"""

from __future__ import annotations

import torch

from xformer.config.loading import TASKS
from xformer.config.schema import Recipe
from xformer.model.build import count_parameters
from xformer.tasks.base import Task
from xformer.tasks.classification import ClassificationTask
from xformer.tasks.generated import ListOpsTask, RecallTask
from xformer.tasks.translation import TranslationTask

# the loader's own dict (config/loading.py), so a task added here is a task recipes can name
TASKS.update({
    "translation": TranslationTask,
    "classification": ClassificationTask,
    "listops": ListOpsTask,
    "recall": RecallTask,
})


def make_task(recipe: Recipe) -> Task:
    """The task object of a loaded recipe (recipe.data.task is a key of TASKS)."""
    return TASKS[recipe.data.task](recipe)


def build_for_recipe(recipe: Recipe, *, init: bool = True):
    """The model a recipe describes, sized from its [data] table without reading data:
    translation vocabularies of data.vocab_size each; a generated task's own vocabulary and
    classes; for a text corpus data.vocab_size (258 for bytes) and 2 classes (the real count
    comes from the data). Build it under `torch.device("meta")` to count parameters without
    allocating them."""
    return make_task(recipe).build_model(init=init)


def parameter_count(recipe: Recipe) -> int:
    """Parameters of the recipe's model, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        return count_parameters(build_for_recipe(recipe, init=False))["total"]


__all__ = ["TASKS", "Task", "build_for_recipe", "make_task", "parameter_count"]

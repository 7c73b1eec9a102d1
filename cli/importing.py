"""xformer import hf SOURCE: a MarianMTModel (a folder or a Hub id) as an xformer run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xformer.config.loading import load_recipe
from xformer.importing import import_hf
from xformer_cli.common import Command, SetOption, flags_named, stdout, user_errors

import_app = typer.Typer(help="Turn a model someone else trained into an xformer run, to evaluate and take apart.",
                         no_args_is_help=True, rich_markup_mode=None)


@import_app.command("hf", cls=Command)
@user_errors
def hf(
    source: Annotated[str, typer.Argument(help="A folder MarianMTModel.from_pretrained reads (what `xformer export "
                                               "--format hf` writes), or a Hub id such as "
                                               "Helsinki-NLP/opus-mt-de-en (downloaded).")],
    out: Annotated[Path, typer.Option("--out", help="New or empty run directory to write.")],
    recipe: Annotated[Path | None, typer.Option(
        "--recipe", help="Take [data], [train] and [eval] from this recipe [default: xformer's defaults, with "
                         "the tokenizer's languages].")] = None,
    overrides: SetOption = None,
) -> None:
    """Write the model's weights (mapped exactly), its sentencepiece tokenizer and a recipe whose
    [model] is the checkpoint's as an xformer run: eval, translate, inspect-heads and export
    then work on it. RUN/imported-from.json records the source, its licence and attribution."""
    base = load_recipe(recipe) if recipe is not None else None
    with flags_named("out", "recipe"):
        path = import_hf(source, out, base=base, overrides=overrides or [])
    stdout.print(f"{path}: imported from {source}; xformer eval {path} scores it, xformer inspect-heads {path} "
                 "opens its heads")

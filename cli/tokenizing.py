"""xformer tokenize RECIPE: train the run's sentencepiece tokenizer, or apply it (--apply)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xformer.config.loading import load_recipe
from xformer.tokenizing import apply_tokenizer, tokenize_recipe
from xformer_cli.common import JsonOption, SetOption, Side, console, read_sentences, stdout, user_errors
from xformer_cli.display import score_table


@user_errors
def tokenize(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML whose [data] table names the corpus and tokenizer.")],
    out: Annotated[Path | None, typer.Option("--out", help="Run directory [default: runs/<recipe name>].")] = None,
    overrides: SetOption = [],  # noqa: B006 - typer reads the default, never mutates it
    apply: Annotated[str | None, typer.Option("--apply", help="Tokenize this file ('-' for stdin) with the run's "
                                                              "model.")] = None,
    side: Annotated[Side, typer.Option("--side", help="With --apply: the source or target language's "
                                                      "model.")] = Side("source"),
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the run's existing tokenizer.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Train sentencepiece on the recipe's training split into RUN/tokenizer (xformer train reuses it)."""
    cfg = load_recipe(recipe, overrides)
    run_dir = out or Path("runs") / recipe.stem
    if apply is not None:
        side = getattr(side, "value", side)
        for line in apply_tokenizer(cfg, run_dir, read_sentences(Path(apply)), side):
            typer.echo(line)
        return
    with console.status("training sentencepiece"):
        result = tokenize_recipe(cfg, run_dir, overwrite=overwrite)
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    rows = {k: v for k, v in result.to_dict().items() if k != "directory"}
    stdout.print(score_table(f"tokenizer: {result.directory}", rows))

"""xformer tokenize RECIPE: train the run's sentencepiece tokenizer, or apply it (--apply)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from xformer.errors import DataError
from xformer.recipe_io import load_recipe
from xformer.tokenize import apply_tokenizer, tokenize_recipe
from xformer_cli.common import SET_HELP, user_errors
from xformer_cli.display import score_table


@user_errors
def tokenize(
    recipe: Path = typer.Argument(..., help="Recipe TOML whose [data] table names the corpus and tokenizer."),
    out: Path | None = typer.Option(None, "--out", help="Run directory [default: runs/<recipe name>]."),
    overrides: list[str] = typer.Option([], "--set", help=SET_HELP),
    apply: str | None = typer.Option(None, "--apply", help="Tokenize this file ('-' for stdin) with the run's model."),
    side: str = typer.Option("source", "--side", help="With --apply: source or target language model."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run's existing tokenizer."),
) -> None:
    """Train sentencepiece on the recipe's training split into RUN/tokenizer (xformer train reuses it)."""
    cfg = load_recipe(recipe, overrides)
    run_dir = out or Path("runs") / recipe.stem
    if apply is not None:
        if side not in ("source", "target"):
            raise DataError(f"--side {side}: expected source or target")
        if apply != "-" and not Path(apply).is_file():
            raise DataError(f"{apply}: no such file")
        text = sys.stdin.read() if apply == "-" else Path(apply).read_text(encoding="utf-8")
        for line in apply_tokenizer(cfg, run_dir, text.splitlines(), side):
            typer.echo(line)
        return
    with Console(stderr=True).status("training sentencepiece"):
        stats = tokenize_recipe(cfg, run_dir, overwrite=overwrite)
    Console().print(score_table(f"tokenizer: {stats.pop('directory')}", stats))

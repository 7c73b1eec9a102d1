"""xformer check RECIPE: validate a recipe and count the parameters of its model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.check import check_recipe
from xformer_cli.common import JsonOption, SetOption, stdout, user_errors


@user_errors
def check(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file, e.g. recipes/translation/multi30k_de_en.toml.")],
    overrides: SetOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Validate a recipe, build its model on the meta device, print the config and parameter counts."""
    result = check_recipe(recipe, overrides)
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    config = Table(title=f"{recipe}", show_header=True, header_style="bold")
    config.add_column("key")
    config.add_column("value")
    for section, values in result.config.items():
        if section == "changes":  # what a resumed run changed: the values above are the latest
            for change in values:
                shown = ", ".join(f"{k} {change['was'][k]} -> {v}" for k, v in change["set"].items())
                config.add_row(f"from step {change['step']}", shown)
            continue
        for key, value in values.items():
            config.add_row(f"{section}.{key}", str(value))
    for key, value in result.derived.items():
        config.add_row(f"[dim]{key} (derived)[/dim]", f"[dim]{value}[/dim]")
    stdout.print(config)
    params = Table(title="parameters", header_style="bold")
    params.add_column("kind")
    params.add_column("count", justify="right")
    for kind, count in result.parameters.items():
        params.add_row(kind, f"{count:,}")
    stdout.print(params)

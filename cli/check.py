"""xformer check RECIPE: validate a recipe and count the parameters of its model."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from xformer.check import check_recipe
from xformer_cli.common import SET_HELP, user_errors


@user_errors
def check(
    recipe: Path = typer.Argument(..., help="Recipe TOML file, e.g. recipes/translation/multi30k_de_en.toml."),
    overrides: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {config, parameters} instead of tables."),
) -> None:
    """Validate a recipe, build its model on the meta device, print the config and parameter counts."""
    report = check_recipe(recipe, overrides)
    if as_json:
        typer.echo(json.dumps({"config": report["config"], "parameters": report["parameters"]}))
        return
    console = Console()
    config = Table(title=f"{recipe}", show_header=True, header_style="bold")
    config.add_column("key")
    config.add_column("value")
    for section, values in report["config"].items():
        for key, value in values.items():
            config.add_row(f"{section}.{key}", str(value))
    for key, value in report["derived"].items():
        config.add_row(f"[dim]{key} (derived)[/dim]", f"[dim]{value}[/dim]")
    console.print(config)
    params = Table(title="parameters", header_style="bold")
    params.add_column("kind")
    params.add_column("count", justify="right")
    for kind, count in report["parameters"].items():
        params.add_row(kind, f"{count:,}")
    console.print(params)

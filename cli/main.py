"""The `xformer` command line: one typer app, one module per command."""

from __future__ import annotations

import typer

import xformer
from xformer_cli.average import average
from xformer_cli.check import check
from xformer_cli.common import STATE
from xformer_cli.evaluate import evaluate, translate
from xformer_cli.heads import inspect_heads_command
from xformer_cli.longrange import longrange
from xformer_cli.tokenize import tokenize
from xformer_cli.train import train

app = typer.Typer(
    name="xformer",
    help="Train, evaluate and take apart Transformer models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"xformer {xformer.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks instead of one-line errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Train, evaluate and take apart Transformer models."""
    STATE["debug"] = debug
    import datasets

    datasets.disable_progress_bars()  # our own progress display reports the long steps


app.command("check")(check)
app.command("tokenize")(tokenize)
app.command("train")(train)
app.command("eval")(evaluate)
app.command("translate")(translate)
app.command("longrange")(longrange)
app.command("inspect-heads")(inspect_heads_command)
app.command("average")(average)

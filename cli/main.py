"""The `xformer` command line: one typer app, one module per command."""

from __future__ import annotations

from typing import Annotated

import typer

import xformer
from xformer.allocator import tune_allocator
from xformer.errors import XformerError
from xformer_cli.average import average
from xformer_cli.bench import bench_app
from xformer_cli.check import check
from xformer_cli.claims import claims
from xformer_cli.common import Command
from xformer_cli.distill import distill
from xformer_cli.evaluate import evaluate, translate
from xformer_cli.experiment import experiment
from xformer_cli.export import export
from xformer_cli.heads import inspect_heads_command
from xformer_cli.importing import import_app
from xformer_cli.longrange import longrange
from xformer_cli.tokenizing import tokenize
from xformer_cli.train import train

# rich_markup_mode=None: help strings are plain text, so "[default: runs/<name>]" and "[data]"
# print as written instead of being taken for rich markup tags and dropped.
app = typer.Typer(
    name="xformer",
    help="Train, evaluate and take apart Transformer models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"xformer {xformer.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version.")] = False,
) -> None:
    """Train, evaluate and take apart Transformer models."""
    ctx.obj = {"debug": debug}  # read by common.user_errors through the context
    try:
        tune_allocator()  # before the first large tensor; reaches the processes this one starts
    except XformerError as error:
        typer.echo("\n".join(error.problems), err=True)
        raise typer.Exit(error.exit_code) from None
    import datasets

    datasets.disable_progress_bars()  # our own progress display reports the long steps


app.command("check", cls=Command)(check)
app.command("tokenize", cls=Command)(tokenize)
app.command("train", cls=Command)(train)
app.command("distill", cls=Command)(distill)
app.command("eval", cls=Command)(evaluate)
app.command("translate", cls=Command)(translate)
app.command("longrange", cls=Command)(longrange)
app.command("experiment", cls=Command)(experiment)
app.command("claims", cls=Command)(claims)
app.command("inspect-heads", cls=Command)(inspect_heads_command)
app.command("average", cls=Command)(average)
app.command("export", cls=Command)(export)
app.add_typer(import_app, name="import")
app.add_typer(bench_app, name="bench")

"""What every command shares: the consoles, choice Enums, option types, and turning errors into
one-line messages."""

from __future__ import annotations

import contextlib
import errno
import functools
import sys
import typing
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand

try:  # typer >= 0.17 carries its own copy of click, whose context stack the commands run in
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer on the public click
    from click import get_current_context
from rich.console import Console

from xformer.config import schema as config
from xformer.errors import DataError, XformerError
from xformer.generation.quantize import QUANTIZE
from xformer.heads.analyse import ABLATIONS, IMPORTANCE_METRICS, PRUNE_ORDERS
from xformer.model.patterns import PATTERNS

console = Console(stderr=True)  # progress, messages and warnings
stdout = Console()  # results: tables and lines a user may pipe

_PATH_ERRORS = {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.ENOENT, errno.EROFS}


class Command(TyperCommand):
    """Usage lines as `xformer eval [OPTIONS] RUN` (typer writes a required argument {run})."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = (param.metavar or param.name).upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces


def choices(name: str, values: Iterable[str]) -> type[Enum]:
    """A str Enum of the core's own choice words, so click validates them and --help lists them."""
    return Enum(name, {v.replace("-", "_"): v for v in values}, type=str)


Precision = choices("Precision", typing.get_args(config.Precision))
Importance = choices("Importance", IMPORTANCE_METRICS)
Ablation = choices("Ablation", ABLATIONS)
PruneOrder = choices("PruneOrder", PRUNE_ORDERS)
Side = choices("Side", ("source", "target"))
Pattern = choices("Pattern", PATTERNS)
Backend = choices("Backend", typing.get_args(config.AttentionBackend))
Quantize = choices("Quantize", QUANTIZE)

# Options several commands take, spelled once.
SetOption = Annotated[list[str], typer.Option(
    "--set", help="Override a recipe value, TOML-typed: --set train.lr=3e-4 (repeatable).")]
DeviceOption = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu, cuda or cuda:N.")]
ReportOption = Annotated[list[str], typer.Option(
    "--report-to", help="Also send each log line and validation to a tracker: tensorboard (RUN/tensorboard), wandb "
                        "or mlflow (repeatable; default: $XFORMER_REPORT_TO, comma-separated; needs the trackers "
                        "extra).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object instead of tables.")]
RunArgument = Annotated[Path, typer.Argument(help="Run directory written by xformer train.")]
CheckpointOption = Annotated[str | None, typer.Option(
    "--checkpoint", help="best, last, averaged or a name from `xformer average` [default: the recipe's "
                         "eval.checkpoint].")]


def as_flag(problem: str, names: Iterable[str] | None = None) -> str:
    """'prune_step: expected ...' (a core argument) -> '--prune-step: expected ...' (the flag
    typed). With `names`, only those arguments, also as 'name X: ...' or 'name = X ...'."""
    if names is None:
        name, sep, rest = problem.partition(":")
        return f"--{name.replace('_', '-')}{sep}{rest}" if sep and name.isidentifier() else problem
    for name in names:
        for sep in (":", " = ", " "):
            if problem.startswith(name + sep):
                rest = problem[len(name) + len(sep):]
                return f"--{name.replace('_', '-')}{' ' if sep == ' = ' else sep}{rest}"
    return problem


@contextlib.contextmanager
def flags_named(*names: str):
    """Core errors raised inside name these arguments by the command's flags."""
    try:
        yield
    except XformerError as exc:
        exc.problems = [as_flag(line, names) for line in exc.problems]
        raise


def debugging() -> bool:
    """--debug, as the root command's context holds it (main.main sets ctx.obj)."""
    ctx = get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return bool(obj and obj.get("debug"))


def user_errors(command: Callable) -> Callable:
    """Run a command; an XformerError prints its lines to stderr and exits 2, any other
    exception prints one line and exits 1. --debug shows the traceback instead."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except XformerError as exc:
            if debugging():
                raise
            for line in exc.problems:
                typer.echo(line, err=True)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except OSError as exc:
            if debugging():
                raise
            if exc.errno not in _PATH_ERRORS or not exc.filename:
                typer.echo(f"error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
                raise typer.Exit(1) from None
            # a path given on the command line that cannot be used: bad input, said in one line
            typer.echo(f"{exc.filename}: {exc.strerror.lower()}", err=True)
            raise typer.Exit(2) from None
        except Exception as exc:
            if debugging():
                raise
            typer.echo(f"error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
            raise typer.Exit(1) from None

    return wrapper


def read_sentences(source: Path | None) -> list[str]:
    """The lines of `source` (None or "-": stdin) for translate and tokenize --apply. A missing
    file, a folder or bytes that are not UTF-8 are a DataError naming the file and line."""
    if source is not None and str(source) != "-":
        if not source.exists():
            raise DataError(f"{source}: no such input file")
        if source.is_dir():
            raise DataError(f"{source}: a folder, expected a file of sentences, one per line")
        data = source.read_bytes()  # a pipe or device (/dev/stdin, <(...)) reads like a file
    else:
        source, data = "stdin", sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{source}:{line}: not UTF-8 ({exc.reason} at byte {exc.start}); expected UTF-8 text, "
                        "one sentence a line") from None
    return text.splitlines()


"""What every command shares: the --debug switch and turning errors into one-line messages."""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable

import typer

from xformer.errors import XformerError

STATE = {"debug": False}
_PATH_ERRORS = {errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.ENOENT, errno.EROFS}

SET_HELP = "Override a recipe value, TOML-typed: --set train.lr=3e-4 (repeatable)."


def user_errors(command: Callable) -> Callable:
    """Run a command; an XformerError prints its lines to stderr and exits 2, any other
    exception prints one line and exits 1. --debug shows the traceback instead."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except XformerError as exc:
            if STATE["debug"]:
                raise
            for line in exc.problems:
                typer.echo(line, err=True)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except OSError as exc:
            if STATE["debug"] or exc.errno not in _PATH_ERRORS or not exc.filename:
                if STATE["debug"]:
                    raise
                typer.echo(f"error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
                raise typer.Exit(1) from None
            # a path given on the command line that cannot be used: bad input, said in one line
            typer.echo(f"{exc.filename}: {exc.strerror.lower()}", err=True)
            raise typer.Exit(2) from None
        except Exception as exc:
            if STATE["debug"]:
                raise
            typer.echo(f"error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
            raise typer.Exit(1) from None

    return wrapper


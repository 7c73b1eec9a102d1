"""The `xformer` command's entry point. Loading torch takes seconds; a Ctrl-C in them ends the
command as one during its work does (exit 130, no traceback), rather than with Python's."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from xformer_cli.main import app
    except KeyboardInterrupt:
        sys.exit(130)
    app(prog_name="xformer")

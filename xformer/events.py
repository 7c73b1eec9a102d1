"""Progress reporting from the core to whoever draws it (the CLI's rich displays, a notebook).

A long-running core function takes `on_event: Event | None` and calls it as
`on_event(kind, payload)`; each function's docstring lists its kinds. The core never prints.
"""

from __future__ import annotations

from collections.abc import Callable

Event = Callable[[str, dict], None]


def ignore(kind: str, payload: dict) -> None:
    """The Event used when the caller passes none."""

"""The command line's rich consoles: as wide as the terminal, or ``PIPED_WIDTH`` where the output
goes to a file or a pipe (a CI log, ``| less``), where rich would lay tables out 80 columns wide
and split their numbers over two lines. A width asked for (``COLUMNS``, typer's
``TERMINAL_WIDTH``) always wins."""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

PIPED_WIDTH = 120


def width_for(file: Any) -> int | None:
    """``PIPED_WIDTH`` for a ``file`` that is no terminal, else None (rich's own choice). The
    file, not rich's ``is_terminal``: typer forces a terminal (colours) under CI variables such
    as ``GITHUB_ACTIONS`` or ``FORCE_COLOR``, where the output still goes to a pipe."""
    asked = any(os.environ.get(v, "").isdigit() for v in ("COLUMNS", "TERMINAL_WIDTH"))
    if asked or getattr(file, "isatty", lambda: False)():
        return None
    return PIPED_WIDTH


def output_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) at ``width_for`` its stream."""
    return Console(stderr=stderr, width=width_for(sys.stderr if stderr else sys.stdout))

"""The command line's rich consoles: as wide as the terminal, or ``PIPED_WIDTH`` where there is
no terminal to ask (a CI log, a file), where rich would lay tables out 80 columns wide and split
their numbers over two lines. A width asked for (``COLUMNS``, typer's ``TERMINAL_WIDTH``) wins;
piped from a terminal (``| tee``, ``| less``), rich takes that terminal's width. A closed pipe
(``| head -1``) is raised as the BrokenPipeError it is, for the command to end on."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from rich.console import Console

PIPED_WIDTH = 120


def _terminal_near() -> bool:
    """Whether stdin, stdout or stderr is a terminal whose size rich can read."""
    for fd in (0, 1, 2):
        try:
            os.get_terminal_size(fd)
            return True
        except OSError:
            continue
    return False


def width_for(file: Any) -> int | None:
    """The width to lay ``file``'s output out at, or None for rich's own choice (``COLUMNS``, or
    the terminal's). The file, not rich's ``is_terminal``: typer forces a terminal (colours)
    under CI variables such as ``GITHUB_ACTIONS`` or ``FORCE_COLOR``, where output still goes to
    a pipe."""
    if os.environ.get("COLUMNS", "").isdigit():
        return None
    if (asked := os.environ.get("TERMINAL_WIDTH", "")).isdigit():
        return int(asked)
    if getattr(file, "isatty", lambda: False)() or _terminal_near():
        return None
    return PIPED_WIDTH


def raise_broken_pipe() -> None:
    """A console's ``on_broken_pipe``: rich's own exits with status 1 and no word, before the
    command line (``tuner.cli.errors``) can tell a closed stdout from a failure."""
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


class OutputConsole(Console):
    """A rich console whose closed pipe is raised (``raise_broken_pipe``)."""

    def on_broken_pipe(self) -> None:
        raise_broken_pipe()


def output_console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) at ``width_for`` its stream."""
    return OutputConsole(stderr=stderr, width=width_for(sys.stderr if stderr else sys.stdout))


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: "1 winner", "2 winners"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"

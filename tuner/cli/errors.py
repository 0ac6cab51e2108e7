"""Errors of the ``tuner`` commands as one line on stderr, ``error: <what>``, never a traceback.

A fleet service that refused or could not be reached fails the command with exit status 1 and
the service's URL: commands wrap their talk with it in ``fleet_service``. A mistake in the input
(``ValueError``, which ``ConfigError`` is) or a cache that cannot be used (``StoreError``, or
SQLite finding a damaged page while reading) exits 2, reported by ``report_usage_errors`` around
the whole command line (``tuner.cli.main.main``), as are click's own errors of options and
arguments; called as a library (``app([...])``), the exception itself reaches the caller.
A closed stdout (``tuner show | head -1``) ends the command quietly, as ``OutputClosed``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pydantic
import typer

from tuner.cache import StoreError
from tuner.cache.sqlite import is_corrupt
from tuner.core.atomic import writable_dir, write_atomic
from tuner.fleet.client import FleetError
from tuner.measure.records import clipped, quoted
from tuner.offline.problem_list import ConfigError

USAGE, FAILED = 2, 1  # exit statuses: a mistake in the input; the work could not be done
MESSAGE_WIDTH = 1000  # an error's characters at most: a quoted value may be a file's worth
CUT_OFF = 128 + 13  # a closed stdout: what a shell reports for a command SIGPIPE (13) ended
# click's exceptions, from wherever this typer takes click (its own copy, or the click package)
CLICK = importlib.import_module(typer.BadParameter.__module__)


def typed_in(ctx: typer.Context, name: str) -> bool:
    """Whether parameter ``name`` was given on the command line (not by its environment
    variable or default); by the source's name, as this typer's click may be its own copy."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"


def write_output(path: Path, data: str) -> None:
    """A command's output file, replaced in one rename (never left half-written), or a
    ConfigError that names it; ``-`` is stdout. What is no regular file (``/dev/null``, a FIFO)
    is written to, and a link's target replaced: a rename would put a file in their place."""
    if str(path) == "-":
        sys.stdout.write(data if data.endswith("\n") else data + "\n")
        return
    if path.is_dir():  # said here: "." has no name to write beside, ".." fails as "busy"
        raise ConfigError(f"{path}: cannot write: a folder, not a file")
    try:
        if path.exists() and not path.is_file():
            with path.open("w") as f:
                f.write(data)
        else:
            write_atomic(path.resolve(), data)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write: {e.strerror}") from None


def output_dir(path: Path) -> Path:
    """``--out``'s ``path`` made a writable directory before the work that fills it, or a
    ValueError that names it (a run must not end, hours in, unable to write its report)."""
    return writable_dir(path, "the output directory")


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


@contextlib.contextmanager
def fleet_service(server: str) -> Iterator[None]:
    """A ``FleetError`` inside ends the command: ``error: fleet service <url>: <cause>``."""
    try:
        yield
    except FleetError as e:
        cause = str(e).removeprefix(f"{server.rstrip('/')} ").removeprefix(f"{server} ")
        fail(f"fleet service {server}: {cause}")
        raise typer.Exit(FAILED) from None


class OutputClosed(Exception):
    """stdout's reader went away (``tuner show | head -1``): raised in place of the write's
    BrokenPipeError, which click ends a command with as a silent exit status 1."""


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader is gone: a broken pipe elsewhere (a socket) is a
    real error and stays one."""
    if not hasattr(select, "poll"):  # (Windows) no way to ask: stdout is the pipe a command has
        return True
    poll = select.poll()
    poll.register(sys.__stdout__.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


@contextlib.contextmanager
def stdout_cut_off() -> Iterator[None]:
    """A BrokenPipeError of writing to a closed stdout, inside, becomes ``OutputClosed``; any
    other is said as an error (click would end the command on it with status 1 and no word)."""
    try:
        yield
    except BrokenPipeError as e:
        if not stdout_closed():
            raise CLICK.ClickException(f"closed by the other end (not stdout): {e}") from e
        raise OutputClosed() from None


def _end_cut_off() -> None:
    """End quietly on a closed stdout, with ``CUT_OFF``, the status a shell gives ``cat`` or
    ``grep`` killed by SIGPIPE at the same point: a script (``set -o pipefail``) sees that the
    output was cut, as for them, where 0 would say it was all written. What is still buffered
    goes to /dev/null, so Python's own flush at exit has nothing to complain of."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.__stdout__.fileno())
    sys.exit(CUT_OFF)


@contextlib.contextmanager
def report_usage_errors() -> Iterator[None]:
    try:
        yield
    except OutputClosed:
        _end_cut_off()
    except CLICK.UsageError as e:  # a bad option or argument, in the form of every other mistake
        if type(e).__name__ != "NoArgsIsHelpError":  # (that one's help is printed already)
            fail(_usage_line(e))
        sys.exit(USAGE)
    except CLICK.ClickException as e:  # a file argument that cannot be opened, ...
        fail(e.format_message())
        sys.exit(e.exit_code)
    except typer.Abort as e:  # typer's word for an EOFError in the command: said, with it
        fail(f"aborted: {e.__cause__}" if e.__cause__ else "aborted")
        sys.exit(FAILED)
    except (StoreError, ValueError) as e:  # cut short where it quotes a file's worth of input
        fail(clipped(str(e), MESSAGE_WIDTH))
        sys.exit(USAGE)
    except sqlite3.DatabaseError as e:  # a page damaged inside a file that opened fine
        if not is_corrupt(e):
            raise
        fail(f"a tuner database this command reads is corrupt ({e}): restore it from a backup, "
             "or move it aside to start a new one")  # fmt: skip
        sys.exit(USAGE)


def _usage_line(e: CLICK.UsageError) -> str:
    """click's message and the help that answers it; an option of ``tuner`` itself given after
    a subcommand (``tuner tune gemm ... -v``) is told where it goes, which click's "No such
    option" does not say, and pointed to the help that lists it."""
    ctx = e.ctx
    if ctx is None:
        return e.format_message()
    root = ctx.find_root()
    name = getattr(e, "option_name", None)
    if isinstance(e, CLICK.NoSuchOption) and root is not ctx and _root_option(root, name):
        rest = ctx.command_path.removeprefix(root.command_path).strip()
        said = (f"No such option after the subcommand: {name}; put it before: "
                f"'{root.command_path} {name} {rest} ...'")  # fmt: skip
        return f"{said} (see '{root.command_path} --help')"
    said = e.format_message().replace(": Value error, ", ": ")  # pydantic's words
    param = getattr(e, "param", None)
    if param is not None and param.envvar and typed_in(ctx, param.name):  # not the variable's
        said = said.replace(f" (env var: '{param.envvar}')", "", 1)  # fault: not named
    return f"{said}{_given(e)} (see '{ctx.command_path} --help')"


def _given(e: CLICK.UsageError) -> str:
    """ ", got VALUE" where typer's type check (pydantic's) refused a value and did not quote
    it ("Input should be a valid number"): which of several values was wrong, in a script."""
    cause = e.__cause__
    errors = cause.errors() if isinstance(cause, pydantic.ValidationError) else []
    if not errors or "input" not in errors[0]:
        return ""
    given = quoted(errors[0]["input"])
    said = e.format_message()
    return "" if " got " in said or given in said else f", got {given}"


def _root_option(root: CLICK.Context, name: str | None) -> bool:
    return any(name in param.opts for param in root.command.params)

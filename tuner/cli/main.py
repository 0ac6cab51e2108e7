"""The ``tuner`` command line: the app assembled from one module per command group.

    tuner info | tune gemm|sdpa|key | show | export | import     (tuner.cli.tune)
    tuner tune-all | report | tunableop show|export              (tuner.cli.tune_all)
    tuner serve | token ... | sync | push | artifacts             (tuner.cli.fleet)
    tuner bench gemm|sdpa                                         (tuner.cli.bench)
    tuner warmup                                                  (tuner.cli.warmup)

Startup here: logging, and the config file's defaults for unset ``TUNER_*`` variables; and help
read through a pipe (``tuner tune-all --help | less``) as wide as ``tuner.core.console`` says.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
import typer.core
import typer.rich_utils
from rich.console import Console

from tuner.cli import bench, fleet, tune, tune_all, warmup
from tuner.cli.errors import CLICK, report_usage_errors, stdout_cut_off
from tuner.core.console import raise_broken_pipe, width_for
from tuner.core.settings import load_config_file
from tuner.version import __version__


def wide_when_piped(make_console: Callable[..., Console]) -> Callable[..., Console]:
    """Typer's help (and error) console at ``width_for`` its file: read through a pipe, rich
    would lay it out 80 wide and cut option texts with "…"; a closed pipe raised, as on the
    tuner's own consoles."""

    @functools.wraps(make_console)
    def console(*args: object, **kwargs: object) -> Console:
        made = make_console(*args, **kwargs)
        if (width := width_for(made.file)) is not None:
            made.width = width
        made.on_broken_pipe = raise_broken_pipe  # type: ignore[method-assign]
        return made

    return console


# typer's own (private) console maker: help stays typer's 80-column default should a later typer
# rename it, rather than the CLI failing to start
if hasattr(typer.rich_utils, "_get_rich_console"):
    typer.rich_utils._get_rich_console = wide_when_piped(typer.rich_utils._get_rich_console)


def no_type_on_flags(display: Callable[..., str | None]) -> Callable[..., str | None]:
    """Help lists a flag (``--json``) without typer's ``<bool>``, which reads as a value to
    give (``--json true`` is refused)."""

    @functools.wraps(display)
    def shown(self: typer.core.TyperOption, ctx: object) -> str | None:
        return None if getattr(self, "is_flag", False) else display(self, ctx)

    return shown


if hasattr(typer.core.TyperOption, "display_type_rich"):  # typer's own, as above
    typer.core.TyperOption.display_type_rich = no_type_on_flags(
        typer.core.TyperOption.display_type_rich
    )


class Commands(typer.core.TyperGroup):
    """The ``tuner`` group: a write to a closed stdout, in a command or in help, is
    ``OutputClosed`` before click sees it (click would end with status 1 and no word)."""

    def make_context(self, *args: Any, **kwargs: Any) -> CLICK.Context:
        with stdout_cut_off():  # the group's own --help and --version are written here
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: CLICK.Context) -> Any:
        with stdout_cut_off():
            return super().invoke(ctx)


HELP = ["-h", "--help"]
app = typer.Typer(
    cls=Commands,
    help="Autotuned GEMM and attention kernels with a shared results cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP},  # subcommands inherit it
)
app.add_typer(tune.app)
app.add_typer(tune_all.app)
app.add_typer(fleet.app)
app.add_typer(bench.app, name="bench")
app.add_typer(warmup.app)


def _version(asked: bool) -> None:
    if asked:
        typer.echo(f"tuner {__version__}")
        raise typer.Exit()


@app.callback()
def startup(
    ctx: typer.Context,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log the tuner's debug detail.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if verbose:  # the tuner's loggers only: a library's debug (matplotlib's font scan) buries them
        logging.getLogger("tuner").setLevel(logging.DEBUG)
    # a config file that cannot apply stops every command but the one that shows the settings
    # (and help: --help, whose words click has not handed on yet, read from the command line,
    # or a group such as 'tuner tune' given nothing after it)
    words, sub = sys.argv[1:], ctx.invoked_subcommand
    group = sub is not None and isinstance(ctx.command.get_command(ctx, sub), typer.core.TyperGroup)
    asks_help = any(word in HELP for word in words) or (group and words[-1:] == [sub])
    load_config_file(strict=sub != "info" and not asks_help)


def main() -> None:
    """The console command ``tuner``; a closed stdout ends it quietly with status 141
    (``tuner.cli.errors.CUT_OFF`` says why that status)."""
    with report_usage_errors(), stdout_cut_off():
        code = app(standalone_mode=False)  # click's errors reach report_usage_errors
        sys.stdout.flush()  # what is still buffered meets a closed stdout here, not at exit
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

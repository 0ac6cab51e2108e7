"""The ``tuner`` command line: the app assembled from one module per command group.

    tuner info | tune gemm|sdpa|key | show | export | import     (tuner.cli.tune)
    tuner tune-all | report | tunableop show|export              (tuner.cli.tune_all)
    tuner serve | token ... | sync | push                         (tuner.cli.fleet)
    tuner bench gemm|sdpa                                         (tuner.cli.bench)
    tuner warmup                                                  (tuner.cli.warmup)

Startup here: logging, and the config file's defaults for unset ``TUNER_*`` variables.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from tuner.cli import bench, fleet, tune, tune_all, warmup
from tuner.cli.errors import report_usage_errors
from tuner.core.settings import load_config_file
from tuner.version import __version__

app = typer.Typer(
    help="Autotuned GEMM and attention kernels with a shared results cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
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
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log debug detail.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    load_config_file()


def main() -> None:
    """The console command ``tuner``."""
    with report_usage_errors():
        app()


if __name__ == "__main__":
    main()

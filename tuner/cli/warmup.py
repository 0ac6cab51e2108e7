"""``tuner warmup``: load every stored winner of this device class before a model starts
(``tuner.serving.warmup``), and say what could not be loaded and why."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cli.errors import FAILED
from tuner.cli.options import CacheOpt, cache_path, open_store
from tuner.core.console import counted, output_console
from tuner.measure.records import candidate_label

console = output_console()
app = typer.Typer()


@app.command()
def warmup(
    cache: CacheOpt = None,
    fetch: Annotated[
        bool,
        typer.Option(help="First fetch this host's compiled kernels from $TUNER_SERVER, if set."),
    ] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    device: Annotated[
        str | None,
        typer.Option(
            help="The GPU whose winners are loaded (cuda:1, or its index), or cpu; by default "
            "this process's GPU (CUDA_VISIBLE_DEVICES' first), else the CPU."
        ),
    ] = None,
) -> None:
    """Load the kernel of every stored winner for this device (this GPU, else the CPU), fetched
    or built; exit 1 on a failure."""
    from tuner.serving.dispatcher import Dispatcher
    from tuner.serving.warmup import gpu_named
    from tuner.serving.warmup import warmup as warm_up

    gpu = gpu_named(int(device) if device and device.isdecimal() else device, "--device ")
    # a mistyped path, or a file that is not a usable cache: refused here, not served around
    open_store(cache, existing=True).close()
    dispatcher = Dispatcher(cache_path(cache))
    if dispatcher.mode == "off":
        console.print(
            "mode off (TUNER_MODE or the config file's mode): this process serves baselines only "
            "and never reads the cache, so there is nothing to load; the lookup mode serves the "
            "stored winners"
        )
        return
    report = warm_up(progress, dispatcher=dispatcher, fetch=fetch, device=gpu or "cpu")
    fetched = f", {report.fetched} kernels fetched" if report.fetched else ""
    console.print(
        f"{report.device_class}: {counted(report.winners, 'winner')}: {report.loaded} loaded now, "
        f"{report.ready} ready already, {len(report.failures)} failed{fetched}"
    )
    if report.fetch_error:
        console.print(f"[yellow]fleet service: {report.fetch_error}[/yellow]")
    if report.failures:
        table = Table(title="not loaded (the baseline serves these)")
        for column in ("key", "candidate", "why"):
            table.add_column(column, overflow="fold")
        for f in report.failures:
            table.add_row(f.key, escape(candidate_label(f.candidate)), escape(f.error))
        console.print(table)
        raise typer.Exit(FAILED)

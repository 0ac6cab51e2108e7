"""``tuner.warmup()``: load every stored winner of a device class before the work starts.

Without it the dispatcher builds a winner whose kernel is not loaded in the background, on first
use, and serves the baseline meanwhile. Warmup does that work up front, before a model starts
or a CUDA graph is captured (nothing may be built during a capture): it brings this host's
compiled kernels from the fleet service when one is configured (``$TUNER_SERVER``), waits for
the dispatcher's builds in flight, then builds each winner's runner (installing stored kernels,
compiling the rest) into the dispatcher and calls it once; a winner that is the baseline is
called once too, so that the library's own first-call setup is not left to the first request.
The report says what could not be loaded and why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tuner.candidates import registry
from tuner.core.device import fingerprint
from tuner.core.keys import parse_key
from tuner.serving.background import run_once
from tuner.serving.dispatcher import Dispatcher, get_dispatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupFailure:
    key: str
    candidate: str
    error: str


@dataclass
class WarmupReport:
    device_class: str
    winners: int = 0  # stored for this device class
    loaded: int = 0  # built now
    ready: int = 0  # loaded before, or served by the baseline: nothing to build
    failures: list[WarmupFailure] = field(default_factory=list)
    fetched: int = 0  # kernels brought from the fleet service
    fetch_error: str | None = None  # the fleet service could not be used (local kernels only)

    @property
    def ok(self) -> bool:
        return not self.failures


def warmup(
    progress: bool = True,
    *,
    dispatcher: Dispatcher | None = None,
    fetch: bool = True,
    device: Any = None,
) -> WarmupReport:
    """Load every stored winner of a device class into ``dispatcher`` (the process's by
    default), with a progress bar unless ``progress`` is False. ``fetch``: first bring this
    host's kernels from the fleet service, when one is configured. ``device``: the GPU whose
    winners are loaded there (``"cuda:1"``, a ``torch.device`` or its index); by default the
    current GPU, else the CPU. A model spread over several GPUs warms up each of them."""
    disp = dispatcher or get_dispatcher()
    if disp.mode == "off":
        log.warning("warmup: mode off serves baselines only: no winner is loaded")
    gpu = gpu_named(device)
    fp = fingerprint(gpu or "cpu")
    report = WarmupReport(fp.device_class)
    if fetch and disp.mode != "off":  # off: the cache is never opened
        _fetch(disp, fp, report)
    disp.loader.wait()  # builds the dispatcher started: done, or failed and retried below
    winners = disp.winners(fp.device_class)
    report.winners = len(winners)
    with _bar(progress, len(winners), fp.device_class) as advance:
        for w in winners:
            try:
                key = parse_key(w.key)
                base = registry.baseline(key.op, key)
                if base.chose_itself(w.source, w.params):
                    if gpu is not None:  # the library's first call (handles, heuristics)
                        with torch.cuda.device(gpu):
                            run_once(base.build(key, w.params), key)
                    report.ready += 1
                elif disp.load(key, w, gpu or torch.device("cpu")):
                    report.loaded += 1
                else:
                    report.ready += 1
            except Exception as e:  # each winner's own failure, reported; the rest still load
                report.failures.append(
                    WarmupFailure(w.key, w.candidate, f"{type(e).__name__}: {e}")
                )
            advance()
    return report


def gpu_named(device: Any, field: str = "device=") -> torch.device | None:
    """The GPU ``device`` names, with its index (None for the CPU); by default the current GPU
    where there is one. A GPU that is not there is a ValueError naming ``field`` and the value."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        named = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f'{field}{device!r} is not a device: give a GPU index, "cuda:1", a '
            'torch.device or "cpu"'
        ) from None
    if named.type == "cpu":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.cuda.current_device() if count and named.index is None else named.index
    if named.type != "cuda" or index is None or not 0 <= index < count:
        there = f"GPUs cuda:0 to cuda:{count - 1}" if count else "no GPU"
        raise ValueError(f'{field}{device!r}: this host has {there} ("cpu" for the CPU)')
    return torch.device("cuda", index)


def _fetch(disp: Dispatcher, fp: Any, report: WarmupReport) -> None:
    """Bring the kernels of this host's archs from the fleet service, if one is configured."""
    from tuner.cache import Store
    from tuner.fleet.artifact_sync import fetch_host_artifacts
    from tuner.fleet.client import FleetClient, FleetError

    try:
        client = FleetClient.from_env()
    except (FleetError, ValueError) as e:
        report.fetch_error = f"fleet service not usable: {e}"
        return
    if client is None:
        return
    try:
        with client, Store(disp.store_path) as store:
            fetched = fetch_host_artifacts(client, store, fp)
    except Exception as e:  # the service down: warm up from what this host has
        report.fetch_error = f"{type(e).__name__}: {e}"
        log.warning("warmup: kernels not fetched from %s: %s", client.server, e)
        return
    if fetched is None:
        return
    report.fetched = fetched.fetched
    if fetched.rejected:
        report.fetch_error = f"{len(fetched.rejected)} downloads rejected: {fetched.rejected[0]}"


@contextmanager
def _bar(shown: bool, total: int, device_class: str) -> Iterator[Any]:
    """A rich progress bar over ``total`` winners; its ``advance`` (a no-op when not shown)."""
    if not shown:
        yield lambda: None
        return
    from tuner.core.console import output_console
    from tuner.core.progress import progress_bar

    with progress_bar(output_console(stderr=True)) as bar:
        task = bar.add_task(f"loading winners for {device_class}", total=total)
        yield lambda: bar.advance(task)

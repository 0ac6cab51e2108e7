"""Options that several ``tuner`` commands share, each declared once.

The tuning options of ``tuner tune``, ``tuner tune-all`` and ``tuner bench`` become one
``TuneOptions`` (``tune_options``), which the library takes whole.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Literal

import typer

from tuner.cache import Store, StoreError, cache_file, default_path
from tuner.cache.sqlite import unmade
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.console import output_console
from tuner.core.device import Fingerprint, fingerprint
from tuner.core.keys import Key
from tuner.measure.records import LAUNCHES
from tuner.offline.problem_list import ConfigError
from tuner.tuning.options import TuneOptions


def _cache_chosen(ctx: typer.Context, value: Path | None) -> Path | None:
    """``--cache`` (``~`` expanded, as the library expands ``$TUNER_CACHE``) stands for
    ``$TUNER_CACHE`` while the command runs (in this process and the ones it starts), so what
    takes its place from the cache's (the compiled-kernel store) follows it; put back after, for
    a caller that runs the app in its own process."""
    if value is not None:
        value = cache_file(value)
        before = os.environ.get("TUNER_CACHE")
        os.environ["TUNER_CACHE"] = str(value)

        def put_back() -> None:
            if before is None:
                os.environ.pop("TUNER_CACHE", None)
            else:
                os.environ["TUNER_CACHE"] = before

        ctx.call_on_close(put_back)
    return value


CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache",
        envvar="TUNER_CACHE",
        help="SQLite cache file (compiled kernels go to artifacts/ beside it, or $TUNER_ARTIFACTS).",
        show_default="$XDG_CACHE_HOME/tuner/tuner.db, else ~/.cache/tuner/tuner.db",
        callback=_cache_chosen,
    ),
]
BudgetOpt = Annotated[float, typer.Option(min=0.001, help="Timing budget per candidate, seconds.")]
SourcesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--source",
        help="Only these candidate sources (repeatable), each serving the command's op (tune-all: "
        "any of its problems' ops); the baseline always runs.",
    ),
]
LaunchOpt = Annotated[
    Literal[LAUNCHES],  # type: ignore[valid-type]  # the choices, as the records name them
    typer.Option(
        "--launch",
        help="What a winner must be fastest at: eager (each call launched from the host, launch "
        "time counts) or graph (calls replayed in a CUDA graph: GPU time only).",
    ),
]
ConfirmRoundsOpt = Annotated[
    int,
    typer.Option(
        min=0,
        help="Rounds that re-time a challenger alternately with the baseline before it wins "
        "(0: the first timing decides).",
    ),
]
ConfirmTriesOpt = Annotated[
    int,
    typer.Option(min=0, help="Challengers confirmed in turn, fastest first, until one wins."),
]
SustainedOpt = Annotated[
    float,
    typer.Option(
        "--sustained",
        min=0,
        help="Seconds of each round's stretch of calls back to back in a duel of GPU-bound calls "
        "(100 us or more) or heavy ones (kernels outlasting their launches, one multiplying at 75% "
        "of the GPU's bf16 matmul peak or more): compute-bound kernels compared at the GPU's power "
        "limit (0: short rounds, as for other calls).",
    ),
]
OpOpt = Annotated[
    str | None,
    typer.Option("--op", metavar="[gemm|sdpa]", help="Only GEMM or only SDPA problems."),
]
DeviceClassOpt = Annotated[
    str | None,
    typer.Option(
        "--device-class",
        help="Another device class whose results this cache holds (see tuner show --all-devices); "
        "default: this machine's.",
    ),
]
IsolateOpt = Annotated[
    bool,
    typer.Option(help="Candidates in a replaceable worker process: a crashing one fails alone."),
]

TUNE_DEFAULTS = TuneOptions()
OPS = ("gemm", "sdpa")  # what --op takes; a run without it may tune either


def check_sources_serve(source: list[str] | None, ops: Collection[str]) -> None:
    """ValueError for a ``--source`` that serves none of ``ops`` (the ops of the problems the
    command tunes): it would add no challenger, and the run would time the baseline alone
    without a word. A source that could not be loaded has no known op and is let through."""
    for name in source or ():
        src = registry.all_sources().get(name)
        if isinstance(src, Source) and src.op not in ops:
            wanted = " or ".join(sorted(ops))
            serving = ", ".join(sorted(s.name for s in registry.sources() if s.op in ops))
            raise ValueError(f"--source {name} serves {src.op}, not {wanted}; the sources that "
                             f"serve {wanted}: {serving}")  # fmt: skip


def check_sources_run_here(source: list[str] | None, ops: Collection[str]) -> None:
    """ValueError where, for one of ``ops``, ``--source`` names a challenger source and none of
    the sources it names for that op can time a challenger on this machine (GPU libraries
    without a GPU; torch's GEMM, the baseline, beside them): the run would time the baseline
    alone and store it as tuned, so a later run would skip the problem. Naming only the
    baseline asks for just that; where some named source can run, the run's table says why the
    others did not."""
    from tuner.tuning.engine import current_device

    device = current_device()
    for op in sorted(ops):
        named = {src.name: src for src in _named(source, op)}  # a name given twice counts once
        if all(src.baseline_params is not None for src in named.values()) or any(
            src.times_challengers(device) for src in named.values()
        ):
            continue
        said = "; ".join(f"{name}: {src.unavailable(device) or 'the baseline only'}"
                         for name, src in named.items())  # fmt: skip
        running = ", ".join(s.name for s in registry.sources(op) if s.times_challengers(device))
        raise ValueError(f"--source cannot run here: {said}; the {op} sources with challengers "
                         f"that run here: {running or 'none'}")  # fmt: skip


def _named(source: list[str] | None, op: str) -> list[Source]:
    """The sources of ``op`` among ``--source``'s names (another op's are refused by
    ``check_sources_serve``; one that could not be loaded has no known op and is let through)."""
    loaded = registry.all_sources()
    return [src for name in source or ()
            if isinstance(src := loaded.get(name), Source) and src.op == op]  # fmt: skip


def _takers(op: str, keys: Sequence[Key]) -> str:
    """The sources of ``op`` that take any of ``keys``, for the message that refuses others."""
    return ", ".join(s.name for s in registry.sources(op)
                     if any(s.unsupported(key) is None for key in keys))  # fmt: skip


def check_sources_take(source: list[str] | None, key: Key) -> None:
    """ValueError where every ``--source`` of ``key``'s op has nothing for ``key`` (plain-GEMM
    sources named for a low-bit key, say): the run would time the baseline alone. Where only
    some of them cannot take it, the run's table says why beside the others' times."""
    named = _named(source, key.op)
    reasons = {src.name: why for src in named if (why := src.unsupported(key))}
    if named and len(reasons) == len(named):
        said = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        raise ValueError(f"--source has nothing for {key.label}: {said}; the sources that take "
                         f"it: {_takers(key.op, [key])}")  # fmt: skip


def check_sources_take_some(source: list[str] | None, keys: Sequence[Key]) -> None:
    """ValueError for a ``--source`` that has nothing for any of ``keys`` (a suite's rows, of one
    op): it would add no challenger anywhere, and the suite would time the baseline alone at
    1.00x without a word. One that takes some of the rows runs: the others list it unsupported."""
    if not keys:
        return
    op, first = keys[0].op, keys[0].label
    rows = first if len(keys) == 1 else f"any of the run's {len(keys)} problems ({first}, ...)"
    for src in _named(source, op):
        reasons = [why for key in keys if (why := src.unsupported(key))]
        if len(reasons) == len(keys):
            them = "it" if len(keys) == 1 else "some of them"
            raise ValueError(f"--source has nothing for {rows}: {src.name}: {reasons[0]}; the "
                             f"sources that take {them}: {_takers(op, keys)}")  # fmt: skip


def tune_options(
    *,
    budget: float,
    ops: Collection[str],
    source: list[str] | None = None,
    launch: str = TUNE_DEFAULTS.launch,
    confirm_rounds: int = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: int = TUNE_DEFAULTS.confirm_tries,
    sustained: float = TUNE_DEFAULTS.sustained_s,
    isolate: bool = False,
) -> TuneOptions:
    """The ``TuneOptions`` of a command's flags for problems of ``ops``; a clear error for an
    unknown source, one serving none of them or none that can run here, and a note where
    ``--launch graph`` cannot mean what it says (no CUDA graphs without a GPU)."""
    registry.check_names(source)
    check_sources_serve(source, ops)
    check_sources_run_here(source, ops)
    if launch == "graph":
        import torch

        if not torch.cuda.is_available():
            output_console(stderr=True).print(
                "[yellow]note[/yellow]: no CUDA GPU here: --launch graph times each call "
                "eagerly (CUDA graphs need a GPU); winners are stored for graph launch, as asked"
            )
    return TuneOptions(
        budget_s=budget, sources=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained_s=sustained, isolate=isolate,
    )  # fmt: skip


def check_op(op: str | None) -> None:
    if op not in (None, *OPS):
        raise ConfigError(f"--op must be 'gemm' or 'sdpa', got {op!r}")


def cache_path(cache: Path | None) -> Path:
    """The cache file named by ``--cache`` / ``$TUNER_CACHE``, else the default one."""
    return cache or default_path()


def unknown_device_class(store: Store, device_class: str, what: str) -> ConfigError:
    """The error for a ``--device-class`` this cache holds ``what`` of none of."""
    known = ", ".join(store.device_classes()) or "none"
    return ConfigError(
        f"--device-class {device_class!r}: {what} in this cache (device classes seen: {known})"
    )


def device_fingerprint(store: Store, device_class: str | None) -> Fingerprint:
    """This machine's fingerprint, or the one the cache holds of ``--device-class``: the
    versions its results were measured under (so stale ones are told apart as on that host)."""
    if device_class is None:
        return fingerprint()
    found = store.fingerprint(device_class)
    if found is None and store.winners(device_class, limit=1):
        raise ConfigError(
            f"--device-class {device_class!r}: this cache holds its winners but no fingerprint "
            "of the device (its versions, its name): an export without one brought them, or "
            "an older tuner's sync; 'tuner sync' or a tune on such a device saves it"
        )
    if found is None:
        raise unknown_device_class(store, device_class, "no fingerprint of it")
    return found


def open_store(cache: Path | None, *, existing: bool = False) -> Store:
    """The cache, checked page by page before the command does any work (a damaged file is
    refused, not tuned into). ``existing``: the command only reads it, so a path with no cache
    yet is refused (a mistyped one would find nothing and say all is well), and so is an empty
    file (SQLite would make it a new cache: a command that only reads would write it)."""
    path = cache_path(cache)
    if existing and not path.exists():
        raise ConfigError(f"{path}: no such cache: tune first, or give --cache / $TUNER_CACHE")
    if existing and unmade(path):
        raise ConfigError(
            f"{path}: an empty file, not a cache: tune first, or give another --cache"
        )
    store = Store(path)
    try:
        store.verify()
    except StoreError:
        store.close()
        raise
    return store


def _absent(path: Path) -> bool:
    """Nothing at ``path``, not even a dangling link; a path that cannot be looked at (no
    permission, a name too long) counts as there, so it is never taken for one to remove."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _empty_file(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == 0
    except OSError:
        return False


class NewPaths:
    """The cache a command may make, and the folders it may make for it and for ``folders``
    (``--out``'s), noted before any is made, so that where the command's step under
    ``kept_if_used`` fails (a bad token, no service reached, an ``--out`` that cannot be made),
    what it made is unmade again: a mistake leaves no cache behind that a later command would
    take for one, nor an empty folder. A link is followed: its target is what is made, and the
    link stays. An empty file given stays one, a cache that was there keeps what it holds, and
    so does one another command stored anything in meanwhile."""

    def __init__(self, cache: Path, *folders: Path) -> None:
        self.cache = Path(os.path.realpath(cache))
        self.existed = not _absent(self.cache)
        self.unmade = not self.existed or _empty_file(self.cache)
        real = [Path(os.path.realpath(f)) for f in (self.cache.parent, *folders)]
        self.folders = {p for f in real for p in (f, *f.parents) if _absent(p)}

    @contextlib.contextmanager
    def kept_if_used(self, store: Store) -> Iterator[None]:
        """Where the body fails, what it made is unmade (``unmake``) and its error raised."""
        try:
            yield
        except BaseException:
            self.unmake(store)
            raise

    def unmake(self, store: Store) -> None:
        """``store`` (of the cache) closed, the cache unmade if it was unmade before and holds
        nothing, and the folders made since removed where empty: for a command that stops
        before it did anything, by an error or as it chose."""
        unused = False
        with contextlib.suppress(OSError, sqlite3.Error):  # the command's error is the one to tell
            unused = self.unmade and store.holds_nothing()
        store.close()
        with contextlib.suppress(OSError):
            if unused and self.existed:
                os.truncate(self.cache, 0)
            elif unused:
                self.cache.unlink()
        for folder in sorted(self.folders, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # a folder something was put in stays
                folder.rmdir()


@contextlib.contextmanager
def store_kept_if_used(cache: Path | None) -> Iterator[Store]:
    """``open_store`` for a command that may make the cache (a first ``tuner sync``), unmade
    again where the command fails before it stored anything in it (``NewPaths``)."""
    new = NewPaths(cache_path(cache))
    store = open_store(cache)
    with new.kept_if_used(store):
        yield store
    store.close()

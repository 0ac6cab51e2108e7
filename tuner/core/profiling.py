"""Opt-in profile of a process's Python time: ``TUNER_PROFILE=<folder>``.

A tuning run's fixed costs (imports, device start, first loads of each library) are spread over
several processes; with the variable set, each long-lived one (the tune-all command and every
supervised worker: tune-all's, the isolated candidate runner) writes a cProfile file
``<name>-<pid>.prof`` there when it ends, for ``pstats`` or snakeviz to read.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
from collections.abc import Iterator
from pathlib import Path

from tuner.core.atomic import writable_dir

ENV = "TUNER_PROFILE"


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile the block into ``$TUNER_PROFILE/<name>-<pid>.prof``; nothing when unset. The
    folder is made and checked first (a ValueError naming it): found unwritable only when the
    profile is written, the whole run would be lost to it."""
    if not (env := os.environ.get(ENV)):
        yield
        return
    folder = writable_dir(Path(env), f"the {ENV} folder")
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(folder / f"{name}-{os.getpid()}.prof")

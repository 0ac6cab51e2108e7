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

ENV = "TUNER_PROFILE"


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """Profile the block into ``$TUNER_PROFILE/<name>-<pid>.prof``; nothing when unset."""
    folder = os.environ.get(ENV)
    if not folder:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        Path(folder).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(folder) / f"{name}-{os.getpid()}.prof")

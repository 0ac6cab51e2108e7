"""``tune(key, options)``: tune one problem where ``options.isolate`` says.

In this process (``tuner.tuning.engine``), or in a replaceable worker process that a crashing
candidate cannot take down with it (``tuner.tuning.isolation``). The choice lives here, above
both, so that the engine knows nothing of the worker that runs it.
"""

from __future__ import annotations

from collections.abc import Callable

from tuner.core.keys import Key
from tuner.tuning import engine, isolation
from tuner.tuning.engine import TuneOptions, TuneOutcome


def tune(
    key: Key,
    *,
    options: TuneOptions | None = None,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> TuneOutcome:
    """Tune ``key`` and return its winner and measurements; nothing is stored here."""
    options = options or TuneOptions()
    if options.isolate:
        return isolation.tune_isolated(key, options, device=device, progress=progress)
    return engine.tune(key, options=options, device=device, progress=progress)

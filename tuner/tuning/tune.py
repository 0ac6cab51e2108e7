"""``tune(key, options)``: tune one problem where ``options.isolate`` says.

In this process (``tuner.tuning.engine``), or in a replaceable worker process that a crashing
candidate cannot take down with it (``tuner.tuning.isolation``). The choice lives here, above
both, so that the engine knows nothing of the worker that runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tuner.core.keys import Key
from tuner.measure.records import Measurement
from tuner.tuning import engine, isolation
from tuner.tuning.engine import TuneOptions, TuneOutcome


def tune(
    key: Key,
    *,
    options: TuneOptions | None = None,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    compiled: Callable[[], None] | None = None,
    earlier: Mapping[str, float] | None = None,
    first_pass: TuneOutcome | None = None,
) -> TuneOutcome:
    """Tune ``key`` and return its winner and measurements; nothing is stored here.

    ``on_result`` sees each measurement as it is made; ``compiled`` waits for a run-wide compile
    pool to have compiled ``key`` (``engine.tune``; an isolated worker waits before it starts and
    then finds the kernels in the on-disk caches); ``earlier``: candidates' times from an
    earlier run, which order the challengers (``engine.tune``); ``first_pass``: the problem's
    first pass, for its second (``engine.tune``)."""
    options = options or TuneOptions()
    if options.isolate:
        if compiled is not None:
            compiled()
        return isolation.tune_isolated(
            key, options, device=device, progress=progress, on_result=on_result, earlier=earlier,
            first_pass=first_pass,
        )  # fmt: skip
    return engine.tune(
        key, options=options, device=device, progress=progress, on_result=on_result,
        compiled=compiled, earlier=earlier, first_pass=first_pass,
    )  # fmt: skip

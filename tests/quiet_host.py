"""Timing tests on a shared host (CI's two cores; a GPU host's CPU, busy with compiles). Where a duel read the baseline far off its
trial, or its rounds scattered wider than the noise, the engine keeps the baseline by design, and
that run says nothing of the rule a test checks: ``first_judged`` takes such a run again."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tuner.tuning.engine import TuneOutcome
from tuner.tuning.verdict import DISTURBED_SPREAD

T = TypeVar("T")
ATTEMPTS = 3


def undisturbed(note: str) -> bool:
    """A duel's note that tells of no disturbance: not read twice off its trials, and its
    rounds not scattered apart."""
    return "disturbed" not in note and "apart" not in note


def quiet(outcome: TuneOutcome) -> bool:
    """Whether the engine found this host quiet through the run: no timing spread wider than
    the disturbed spread, no duel taken again or widened by its rounds' scatter."""
    return not any(
        m.spread > DISTURBED_SPREAD or not undisturbed(m.error) for m in outcome.measurements
    )


def first_judged(run: Callable[[], T], judged: Callable[[T], bool], attempts: int = ATTEMPTS) -> T:
    """``run()`` until ``judged`` says the host left its result alone, at most ``attempts``
    times: the first such result, else the last (which the test judges all the same, and fails
    on where the host stayed busy throughout). ``run`` times its baseline afresh: a trial taken
    once, in a quicker moment than the rest, would read every later duel disturbed."""
    for _ in range(attempts - 1):
        result = run()
        if judged(result):
            return result
    return run()

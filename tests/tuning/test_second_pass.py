"""A problem tuned in two passes (``engine.tune(first_pass=...)``): the first times every
candidate but those of sources that share kernels (CUTLASS's, compiled once for a whole run),
the second times those alone, once built, and duels them against what the first settled."""

from __future__ import annotations

import pytest
import torch
from planted import Busy, SharedMemoized, SharedTwin
from quiet_host import first_judged, quiet
from test_trials import Twins

from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.tuning.engine import (
    TuneOptions,
    TuneOutcome,
    first_pass_options,
    second_pass_duels,
    tune,
)
from tuner.tuning.trials import SUSTAINED_TRIES

# large enough that torch's CPU matmul takes far longer than Busy's 100 us of host work
KEY = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")


@pytest.fixture
def sources(one_thread):
    """The planted sources, registered for the test, beside torch on one thread (its 512^3
    GEMM's threads waiting for cores another process holds read it far off its trial)."""
    made = [Busy(), SharedMemoized(), SharedTwin()]
    for source in made:
        registry.register(source)
    yield
    for source in made:
        registry.unregister(source.name)


def two_passes(*names: str) -> tuple[TuneOutcome, TuneOutcome]:
    """Both passes of ``KEY`` over the sources ``names``, taken again where the host disturbed
    either (``first_judged``): torch's 512^3 GEMM on a shared host can read far off its trial,
    and the second pass duels against the first's baseline."""

    def run() -> tuple[TuneOutcome, TuneOutcome]:
        options = TuneOptions(budget_s=0.02, sources=list(names))
        first = tune(KEY, options=first_pass_options(KEY.op, options))
        return first, tune(KEY, options=options, first_pass=first)

    return first_judged(run, lambda passes: all(map(quiet, passes)))


def confirmations(outcome: TuneOutcome) -> int:
    return sum(m.error.count("confirmation:") for m in outcome.measurements)


def test_the_first_pass_leaves_out_the_sources_that_share_kernels(sources):
    options = first_pass_options(KEY.op, TuneOptions(sources=["busy", "shared_memoized"]))
    assert options.sources == ["busy"]
    everything = first_pass_options(KEY.op, TuneOptions())
    assert "torch" in everything.sources and "cutlass" not in everything.sources
    assert "shared_twin" not in everything.sources


@pytest.mark.cpu_host
def test_a_shared_kernel_that_beats_the_settled_baseline_wins_the_second_pass(sources):
    first, second = two_passes("shared_memoized")
    assert first.winner.source == "torch"  # the baseline alone in the first pass
    assert second.winner.source == "shared_memoized" and second.winner.speedup > 1.5
    assert second.winner.run_id == first.winner.run_id  # one problem, one run
    baselines = [m for m in second.measurements if m.is_baseline]
    assert [m.uid for m in baselines] == [m.uid for m in first.measurements if m.is_baseline]


@pytest.mark.cpu_host
def test_a_shared_kernel_faster_than_the_kept_challenger_duels_it_and_serves(sources):
    first, second = two_passes("busy", "shared_memoized")
    assert first.winner.source == "busy"
    kept = next(m for m in second.measurements if m.source == "busy")
    assert kept.uid == next(m.uid for m in first.measurements if m.source == "busy")
    assert kept.error.count("confirmation:") == 1  # its first pass's duel, not run again
    assert "then shared_memoized, whose trial tied or beat it, won their duel" in kept.error
    assert second.winner.source == "shared_memoized"
    # its time is relative to the first pass's baseline, through the kept one's
    assert second.winner.baseline_us == first.winner.baseline_us
    assert second.winner.speedup > first.winner.speedup


@pytest.mark.cpu_host
def test_without_a_new_contender_the_first_pass_verdict_stands_with_no_duel(sources):
    first, second = two_passes("busy", "shared_twin")
    assert second.winner.source == first.winner.source == "busy"
    assert (second.winner.median_us, second.winner.baseline_us) == (
        first.winner.median_us,
        first.winner.baseline_us,
    )
    assert confirmations(second) == confirmations(first) == 1
    assert any(m.source == "shared_twin" for m in second.measurements)
    assert len(second.measurements) == len(first.measurements) + 1


def test_a_second_pass_duels_only_what_one_pass_would_have(sources):
    """One pass duels the first ``confirm_tries`` of its order; a second pass, the new ones
    among those."""
    from test_trials import timed

    base = timed("torch", 100.0, baseline=True)
    fast_shared, busy, slow_shared = (
        timed("shared_memoized", 50.0), timed("busy", 60.0), timed("shared_twin", 70.0)
    )  # fmt: skip
    measured = [base, slow_shared, busy, fast_shared]
    options = TuneOptions(confirm_tries=2)
    assert second_pass_duels(measured, options, "cpu") == [fast_shared]
    assert second_pass_duels(measured, TuneOptions(confirm_tries=3), "cpu") == [
        fast_shared,
        slow_shared,
    ]


@pytest.mark.cpu_host
def test_without_duels_a_second_pass_serves_what_one_pass_would(sources):
    """``confirm_rounds`` 0 (no duel, the fastest trial serves): a second pass neither duels
    (it would have no rounds to read) nor keeps a slower first-pass verdict."""
    options = TuneOptions(budget_s=0.02, sources=["busy", "shared_memoized"], confirm_rounds=0)
    first = tune(KEY, options=first_pass_options(KEY.op, options))
    second = tune(KEY, options=options, first_pass=first)
    assert first.winner.source == "busy"
    assert second.winner.source == "shared_memoized" and confirmations(second) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_first_pass_that_lost_at_the_power_limit_leaves_a_faster_shared_kernel_its_duel():
    """A 4096^3 bf16 GEMM: the first pass's twins of the baseline lose two sustained duels (the
    budget of one pass); one pass would have duelled the shared source's far faster candidate
    before them, and so does the second pass, which serves it. The noise of 30% makes every
    twin a tie however far the clock fell between its trial and the baseline's, and a host
    slack of 100% keeps a twin's host time, a Python call above torch's, from keeping it out of
    the duel (the launch rule is not what this tests; as in
    ``test_twins_of_a_heavy_baseline_duel_at_the_power_limit_at_most_twice``)."""
    made = [Twins(), SharedMemoized()]
    for source in made:
        registry.register(source)
    key = GemmKey(m=4096, n=4096, k=4096)
    options = TuneOptions(sources=["twins", "shared_memoized"], min_noise=0.3, host_slack=1.0,
                          prune=False, cut_factor=1e9, late_cut=1e9)  # fmt: skip
    try:
        first = tune(key, options=first_pass_options(key.op, options))
        second = tune(key, options=options, first_pass=first)
    finally:
        for source in made:
            registry.unregister(source.name)
    assert first.winner.source == "torch"
    trials = {m.candidate: (m.median_us, m.error) for m in first.measurements}
    assert sum(first.stretched.values()) == SUSTAINED_TRIES, (first.stretched, trials)
    notes = {m.candidate: m.error for m in second.measurements if m.source == "shared_memoized"}
    assert second.winner.source == "shared_memoized", notes

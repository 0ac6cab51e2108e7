"""The tuning engine on the CPU path: torch baseline, interpreted Triton, and planted bad candidates."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import pytest
import torch
from planted import PlantedGemm

from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.keys import GemmKey, SdpaKey
from tuner.measure import timing
from tuner.measure.records import LAUNCHES, Measurement, candidate_name
from tuner.tuning.engine import (
    DISTURBED_SPREAD,
    PHASES,
    Rounds,
    TuneOptions,
    TuneOutcome,
    at_power_limit,
    choose,
    contenders,
    cut_off,
    duels,
    eager_win,
    earlier_times,
    far_off_trials,
    gap_unexplained,
    gpu_only_win,
    graph_reading_off,
    heavy_rate,
    host_hides_gpu,
    may_hold_power_limit,
    power_limited,
    round_scatter,
    runner_up,
    steadier,
    sustained_duel,
    tied_in_trial,
    tied_rival,
    ties,
    tune,
)

KEY = GemmKey(m=48, n=40, k=72, dtype="f32", out_dtype="f32")


@pytest.fixture
def planted():
    registry.register(PlantedGemm())
    yield
    registry.unregister("planted")


def tuned_with(source: Source, launch: str = "eager", **options) -> TuneOutcome:
    """``KEY`` tuned with ``source`` registered for the run, against the baseline alone."""
    registry.register(source)
    try:
        return tune(KEY, options=TuneOptions(sources=[source.name], launch=launch, **options))
    finally:
        registry.unregister(source.name)


def tuned_uncut(
    key: GemmKey, sources: list[Source], min_noise: float = 0.02, **hooks
) -> TuneOutcome:
    """``key`` tuned with ``sources`` registered for the run and cut-offs that cannot cut: the
    rule under test is the duels', not this host's speed."""
    for source in sources:
        registry.register(source)
    try:
        options = TuneOptions(budget_s=0.02, sources=[s.name for s in sources], cut_factor=1e9,
                              late_cut=1e9, min_noise=min_noise, prune=False)  # fmt: skip
        return tune(key, options=options, **hooks)
    finally:
        for source in sources:
            registry.unregister(source.name)


def by_params(outcome):
    return {m.params.get("bug", m.source): m for m in outcome.measurements}


def test_wrong_nan_and_broken_candidates_are_recorded_never_chosen(planted):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.02, sources=["planted"]))
    got = by_params(outcome)
    assert got["drops_last_k"].status == "rejected" and got["drops_last_k"].max_rel_err > 0.01
    assert got["nan"].status == "rejected" and "relative error nan" in got["nan"].error
    assert got["build_error"].status == "failed" and "static_assert" in got["build_error"].error
    assert got["raises"].status == "failed" and "illegal memory access" in got["raises"].error
    assert got["slow"].status == "cut"  # 20 ms against a ~10 us baseline: cut after the probe
    assert got["torch"].status == "ok" and got["torch"].is_baseline
    assert outcome.winner.source == "torch"


def test_interpreted_triton_candidate_is_checked_and_timed():
    outcome = tune(
        GemmKey(m=40, n=24, k=56, dtype="f16", out_dtype="f16"),
        options=TuneOptions(budget_s=0.02, cut_factor=1e9, late_cut=1e9),
    )
    triton = [m for m in outcome.measurements if m.source == "triton_gemm"]
    assert triton and all(m.status == "ok" for m in triton)
    assert triton[0].max_rel_err < 5e-3 and triton[0].median_us > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter: CPU hosts only")
def test_bf16_triton_is_unsupported_in_the_interpreter_with_a_reason():
    outcome = tune(GemmKey(m=16, n=16, k=16), options=TuneOptions(budget_s=0.01))
    triton = next(m for m in outcome.measurements if m.source == "triton_gemm")
    assert triton.status == "unsupported" and "interpreter" in triton.error


def test_sdpa_baseline_tunes_on_cpu():
    key = SdpaKey(
        batch=1,
        q_heads=4,
        kv_heads=2,
        q_len=7,
        kv_len=13,
        head_dim=16,
        causal="bottom_right",
        dtype="f32",
    )
    outcome = tune(key, options=TuneOptions(budget_s=0.01))
    assert outcome.baseline.max_rel_err < 1e-4
    assert outcome.winner.baseline_us > 0


def m(source: str, median: float, p10: float, p90: float, baseline: bool = False) -> Measurement:
    return Measurement(
        device_class="d",
        key="k",
        source=source,
        params={},
        status="ok",
        is_baseline=baseline,
        median_us=median,
        p10_us=p10,
        p90_us=p90,
        host_us=0.0,
    )


def test_baseline_keeps_the_win_within_noise():
    base = m("torch", 100.0, 95.0, 105.0, baseline=True)  # +-5% spread
    assert choose([base, m("x", 97.0, 96.0, 98.0)], TuneOptions()).source == "torch"
    assert choose([base, m("x", 90.0, 89.0, 91.0)], TuneOptions()).source == "x"
    assert choose([base, m("x", 101.0, 100.0, 102.0)], TuneOptions()).source == "torch"


def test_challengers_rank_only_against_a_timed_baseline():
    failed = dataclasses.replace(m("torch", 100.0, 95.0, 105.0, baseline=True), status="failed")
    with pytest.raises(ValueError, match="no timed baseline"):
        choose([failed, m("x", 90.0, 89.0, 91.0)], TuneOptions())


def test_contenders_are_the_challengers_beyond_noise_fastest_first():
    """tune() confirms them in turn (``confirm_tries``): eager times of small problems are
    host-bound, so the fastest there may be slow on the GPU while the next one is not."""
    base = m("torch", 100.0, 95.0, 105.0, baseline=True)
    near, fast, faster = (
        m("near", 97.0, 96.0, 98.0),
        m("a", 90.0, 89.0, 91.0),
        m("b", 80.0, 79.0, 81.0),
    )
    slow_launch = m("c", 70.0, 69.0, 71.0)
    slow_launch.host_us = 140.0  # 140 us of launch work for 30 us of GPU time saved
    found = contenders([base, near, fast, faster, slow_launch], TuneOptions())
    assert [c.source for c in found] == ["b", "a"]
    assert contenders([base, near], TuneOptions()) == []


def test_ties_are_the_challengers_within_noise_fastest_first():
    """On the GPU tune() also takes them to the confirmation, whose CUDA-graph timing sees the
    GPU time that host-bound eager timings hide; they are never chosen without it. One reading a
    hair slower than the baseline (up to ``min_noise``) is a tie too: a GPU-bound call's eager
    time moves by that much from one reading to the next."""
    base = m("torch", 100.0, 80.0, 120.0, baseline=True)  # a jittery host: +-20%
    near, nearer, beyond, hair, slower = (
        m("near", 97.0, 96.0, 98.0),
        m("nearer", 92.0, 91.0, 93.0),
        m("beyond", 70.0, 69.0, 71.0),
        m("hair", 101.0, 100.0, 102.0),
        m("slower", 103.0, 102.0, 104.0),
    )
    slow_launch = m("c", 95.0, 94.0, 96.0)
    slow_launch.host_us = 140.0
    found = ties([base, near, nearer, beyond, hair, slower, slow_launch], TuneOptions())
    assert [c.source for c in found] == ["nearer", "near", "hair"]
    assert [c.source for c in contenders([base, near, nearer, beyond], TuneOptions())] == ["beyond"]
    assert choose([base, near, nearer], TuneOptions()).source == "torch"


def test_duels_add_the_ties_only_where_a_graph_can_decide_them():
    base = m("torch", 100.0, 80.0, 120.0, baseline=True)
    tie, beyond = m("tie", 95.0, 94.0, 96.0), m("beyond", 70.0, 69.0, 71.0)
    ms = [base, tie, beyond]
    assert [c.source for c in duels(ms, TuneOptions(), "cuda")] == ["beyond", "tie"]
    assert [c.source for c in duels(ms, TuneOptions(), "cpu")] == ["beyond"]
    unconfirmed = TuneOptions(confirm_rounds=0)  # no duel: the trial's verdict stands
    assert [c.source for c in duels(ms, unconfirmed, "cuda")] == ["beyond"]


def test_eager_launch_cost_counts_against_a_challenger():
    base = m("torch", 10.0, 9.9, 10.1, baseline=True)
    fast_gpu_slow_launch = m("x", 5.0, 4.9, 5.1)
    fast_gpu_slow_launch.host_us = 30.0
    assert choose([base, fast_gpu_slow_launch], TuneOptions(launch="eager")).source == "torch"
    assert choose([base, fast_gpu_slow_launch], TuneOptions(launch="graph")).source == "x"


def test_eager_winner_must_repay_extra_launch_cost():
    """Host-bound callers (decode steps) pay a winner's extra host time on every call: it must
    save at least that much GPU time."""
    base = m("torch", 20.0, 19.9, 20.1, baseline=True)
    base.host_us = 11.0
    faster_gpu = m("x", 15.0, 14.9, 15.1)  # saves 5 us
    faster_gpu.host_us = 18.0  # 7 us more, 5.9 beyond the slack of max(1 us, 10%)
    assert choose([base, faster_gpu], TuneOptions()).source == "torch"
    faster_gpu.host_us = 12.0  # within the slack
    assert choose([base, faster_gpu], TuneOptions()).source == "x"
    faster_gpu.host_us = 16.0  # 3.9 us beyond the slack, repaid by 5 us of GPU time
    assert choose([base, faster_gpu], TuneOptions()).source == "x"
    faster_gpu.host_us = 18.0
    assert choose([base, faster_gpu], TuneOptions(host_slack=0.5)).source == "x"
    assert choose([base, faster_gpu], TuneOptions(launch="graph")).source == "x"
    big = m("torch", 1160.0, 1150.0, 1170.0, baseline=True)
    big.host_us = 14.5
    padded = m("x", 270.0, 268.0, 272.0)  # 4097^3: two launches and a pad buffer
    padded.host_us = 30.7
    assert choose([big, padded], TuneOptions()).source == "x"


@pytest.fixture
def memoized():
    from planted import Memoized

    Memoized.slow = False
    registry.register(Memoized())
    yield Memoized
    registry.unregister("memoized")


def test_a_truly_faster_challenger_wins_and_is_confirmed(memoized):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.02, sources=["memoized"]))
    assert outcome.winner.source == "memoized" and outcome.winner.speedup > 1.5
    assert "kept" in by_params(outcome)["memoized"].error


def test_a_lucky_measurement_does_not_survive_the_confirmation(memoized):
    def slow_down_after_its_trial(m):
        if m.source == "memoized":
            memoized.slow = True  # it measured fast; from now on it is slow

    outcome = tune(
        KEY,
        options=TuneOptions(budget_s=0.02, sources=["memoized"]),
        on_result=slow_down_after_its_trial,
    )
    assert outcome.winner.source == "torch"
    error = by_params(outcome)["memoized"].error
    # taken again, then judged as read; on a loaded host the baseline's rounds may be far off
    # its trial too, and a duel disturbed twice keeps the baseline just the same
    assert "lost" in error
    assert "far over its trial" in error or "disturbed twice: far off a trial's time" in error


def test_a_challenger_read_far_over_its_trial_still_wins_where_it_stays_faster(
    monkeypatch, one_thread
):
    """A challenger that measured 100 us a call in its trial reads 400 us in its duel (its
    host path slowed by what ran between its calls, as a Triton launcher's does beside torch's
    calls), twice: its duel is disturbed, but only on its own side, which cannot make its win.
    Against torch's ~ms 512^3 GEMM it stays far faster, so it wins as read."""
    from planted import Busy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    class SlowerInItsDuel(Busy):
        name, busy_s = "slower_in_its_duel", 100e-6

    def slow_down_after_its_trial(m):
        if m.source == SlowerInItsDuel.name:
            SlowerInItsDuel.busy_s = 400e-6

    key = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
    outcome = tuned_uncut(key, [SlowerInItsDuel()], on_result=slow_down_after_its_trial)
    error = by_params(outcome)[SlowerInItsDuel.name].error
    assert outcome.winner.source == SlowerInItsDuel.name, error
    assert "far over its trial" in error and "kept" in error


def quiet(outcome: TuneOutcome) -> bool:
    """Whether the engine found this host quiet through the run: no timing spread wider than
    the disturbed spread, no duel taken again or widened by its rounds' scatter. On a busy host
    the engine keeps the baseline by design, and a run says nothing about a duel's rule."""
    return not any(
        m.spread > DISTURBED_SPREAD or "disturbed" in m.error or "apart" in m.error
        for m in outcome.measurements
    )


@pytest.mark.cpu_host
def test_a_winner_confirmed_slower_than_a_runner_ups_trial_meets_the_runner_up(
    monkeypatch, one_thread
):
    """Both beat torch's 512^3 GEMM on the CPU by far; the first ranked first on its trial, then
    its confirmation reads it slower than the second's trial: the second duels too and wins.
    Each duel weighs its runner against its own reading of torch, which drifts on a shared CPU
    host while a busy wait does not: the second's trial also reads it slower than it is, so that
    its win is wider than that drift. Taken again (up to three runs) where the engine reports
    the host noisy."""
    from planted import Busy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    def run() -> TuneOutcome:
        class First(Busy):
            name, busy_s = "first", 100e-6

        class Second(Busy):
            name, busy_s = "second", 115e-6

        def change_after_its_trial(m):
            if m.source == "first":
                First.busy_s = 140e-6  # slower, though not beyond a disturbed spread
            if m.source == "second":
                Second.busy_s = 80e-6

        key = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
        return tuned_uncut(key, [First(), Second()], on_result=change_after_its_trial)

    outcome = run()
    for _ in range(2):
        if quiet(outcome):
            break
        outcome = run()
    first = by_params(outcome)["first"]
    assert outcome.winner.source == "second", [
        (m.candidate, m.median_us, m.error) for m in outcome.measurements
    ]
    assert "kept" in first.error and "then second confirmed faster" in first.error


def test_a_disturbed_timing_is_taken_again(one_thread):
    from planted import Disturbed

    # a budget of hundreds of its calls: the disturbed ones are a fifth of the first timing;
    # cut-offs that cannot cut: it is torch's twin, and its retake must stand on any host
    outcome = tuned_with(Disturbed(), budget_s=0.02, cut_factor=1e9, late_cut=1e9)
    timed = by_params(outcome)["disturbed"]
    assert timed.status == "ok", timed.error
    assert timed.p90_us < Disturbed.wait_s * 1e6 / 2  # the retake's, not the disturbed one's


def test_only_a_disturbed_timing_or_cut_is_retaken_and_only_a_better_retake_replaces_it():
    steady = timing.Timing(10.0, 9.5, 10.5, 100, 10.0)
    disturbed = timing.Timing(12.0, 9.5, 900.0, 100, 12.0)
    cut = timing.Timing(50.0, 49.0, 900.0, 3, 50.0, cut=True)

    def never() -> timing.Timing:
        raise AssertionError("retaken")

    assert steadier(steady, never) is steady
    assert steadier(cut, never, cut_at=40.0) is cut  # even its fastest call was too slow
    mixed = timing.Timing(50.0, 30.0, 900.0, 30, 50.0, cut=True)  # a tenth of its calls < 40 us
    assert steadier(mixed, lambda: steady, cut_at=40.0) is steady
    assert steadier(mixed, lambda: cut, cut_at=40.0) is mixed
    assert steadier(disturbed, lambda: steady) is steady
    assert steadier(disturbed, lambda: cut) is disturbed
    assert steadier(disturbed, lambda: timing.Timing(15.0, 9.0, 1500.0, 100, 15.0)) is disturbed


def test_a_gpu_win_decides_an_eager_tie_only_where_the_host_hides_the_kernels():
    assert host_hides_gpu(host_us=(20.0, 22.0), gpu_us=(15.0, 12.0))  # a launch-bound call
    assert host_hides_gpu(host_us=(20.0, 14.0), gpu_us=(19.0, 16.0))  # one side's launch
    assert not host_hides_gpu(host_us=(51.0, 52.8), gpu_us=(84.5, 82.5))  # kernels longer


def test_a_gpu_only_win_needs_a_launch_no_longer_than_the_baselines():
    # eager times are launch times here: the challenger's longer launch loses a quiet host's tie
    assert gpu_only_win(host_us=(33.5, 33.5), gpu_us=(11.6, 11.1), margin=0.02)
    assert not gpu_only_win(host_us=(33.5, 34.0), gpu_us=(11.6, 11.1), margin=0.02)
    assert not gpu_only_win(host_us=(33.5, 33.0), gpu_us=(11.6, 11.5), margin=0.02)  # GPU tie
    assert not gpu_only_win(host_us=(51.0, 50.0), gpu_us=(84.5, 70.0), margin=0.02)  # not hidden


def test_a_duel_far_off_a_trial_says_which_side_was_disturbed():
    # (baseline, challenger): a trial tie, then the baseline's rounds beside a disturbance
    assert far_off_trials(trial_us=(29.4, 28.9), duel_us=(102.9, 53.9)) == (True, True)
    assert far_off_trials(trial_us=(29.4, 28.9), duel_us=(30.0, 45.0)) == (False, True)
    assert far_off_trials(trial_us=(29.4, 28.9), duel_us=(36.0, 31.0)) == (False, False)


def test_an_eager_win_within_the_rounds_scatter_is_a_tie():
    """A power-limited prefill duel: the challenger's rounds fell 57.98-63.76 us apart, torch's
    57.6-58.2. Half that range over the median (4.8%) is how far one reading of it can fall from
    the next, so a 4.2% win (57.63 against 60.13 us) is a tie and keeps the baseline, while
    the same win between steady rounds stands; a GPU win where the host's launch hides the
    kernels stands whatever the host-bound rounds' scatter."""
    winner, torch_op = [63.76, 57.98, 62.11, 59.07], [57.82, 57.6, 58.24, 57.63]
    assert round_scatter(winner) == pytest.approx((63.76 - 57.98) / 2 / 60.59)
    assert round_scatter(torch_op) < 0.006
    assert round_scatter([10.0]) == 0.0 and round_scatter([]) == 0.0
    assert round_scatter([0.0, 0.0, 0.0]) == 0.0  # a clamped fenced time: nothing divides by 0
    scattered = Rounds(60.13, 57.63, 33.0, 35.0, round_scatter(winner))
    steady = scattered._replace(scatter=round_scatter(torch_op))
    assert not eager_win(scattered, margin=0.02, gpu_win=False)
    assert eager_win(steady, margin=0.02, gpu_win=False)
    assert not eager_win(steady, margin=0.05, gpu_win=False)  # the noise margin still counts
    host_bound = Rounds(29.70, 29.60, 29.70, 29.60, 0.3)  # a tie eagerly, rounds 30% apart
    assert eager_win(host_bound, margin=0.02, gpu_win=True)
    assert not eager_win(host_bound._replace(chal_us=29.9), margin=0.02, gpu_win=True)


def test_a_tie_in_its_trial_must_win_a_sustained_duel_twice():
    """FP8 rowwise prefill, Qwen o M = 2048 (us): a cuBLASLt algorithm tied torch's op in its
    trial, read 2.4% ahead in its sustained duel (margin 2.2%), then 2.4% behind when the suite
    timed both again. A tie's win at the power limit needs a second take that shows it too."""
    assert tied_in_trial((47.87, 47.90), margin=0.02)  # a hair slower in the trial
    assert tied_in_trial((215.3, 211.01), margin=0.02)  # Qwen down: 2.0% faster, within noise
    assert not tied_in_trial((215.3, 200.0), margin=0.02)  # a contender: one take decides
    first = Rounds(base_us=51.78, chal_us=50.53, base_host=19.75, chal_host=21.61, scatter=0.022)
    second = Rounds(base_us=50.85, chal_us=52.08, base_host=20.4, chal_host=21.0, scatter=0.04)
    assert eager_win(first, margin=0.02, gpu_win=False)
    assert not eager_win(second, margin=0.022, gpu_win=False)  # the second take: not ahead


def test_an_eager_gap_between_kernel_bound_calls_must_show_in_their_graph_times():
    # (baseline, challenger), an FP8 prefill row: torch's rounds read 99.3 us beside a
    # disturbance, while both kernels ran 80-81 us in a graph, longer than either launch
    hosts, gpus = (71.7, 37.5), (81.0, 80.4)
    assert gap_unexplained((99.3, 81.9), hosts, gpus, margin=0.046)
    assert not gap_unexplained((84.7, 81.9), hosts, gpus, margin=0.046)  # within the noise
    # a real win shows in the graph too (an FP8 CUTLASS kernel against torch's op)
    assert not gap_unexplained((59.7, 56.6), (44.0, 29.2), (60.4, 53.6), margin=0.021)
    # launch-bound calls: eager times are launch times, which the graph does not see
    assert not gap_unexplained((40.0, 25.0), (38.0, 24.0), (12.0, 11.9), margin=0.02)
    # a long baseline (torch's INT4 op on a prefill row) reads 2.3% apart eagerly and in a
    # graph: the win is 96% either way
    assert not gap_unexplained((16162.0, 643.9), (48.9, 21.8), (15791.2, 641.9), margin=0.02)
    # a win the graph shows too, if narrower: not a disturbance that made the win
    assert not gap_unexplained((90.0, 84.9), (30.0, 31.0), (80.0, 77.3), margin=0.02)
    # no eager win to explain: a loss, whatever its readings
    assert not gap_unexplained((137.6, 141.3), (33.3, 33.3), (137.7, 147.6), margin=0.02)
    # a graph time of 0 (a fenced time clamped at 0): any launch hides it, nothing divides by it
    assert not gap_unexplained((10.0, 9.0), (5.0, 5.0), (0.0, 0.0), margin=0.02)


def test_a_graph_duel_reading_far_off_the_trials_in_the_challengers_favour_is_not_believed():
    """Graph replays of one kernel vary by a few percent: a duel reading a challenger 37% under
    its own trial (12.14 -> 7.66 us, under the bare read of its bytes) is not its kernel's time,
    nor is a baseline's far over its own; a few percent either way, or under a microsecond, is.
    Off the other way, the readings only make the challenger's win harder: a baseline whose
    trial read 16.46 us and whose two duel graphs read 12.5 (the trial was the disturbed
    reading) is judged at 12.5, as is a challenger far over its trial."""
    assert graph_reading_off((12.18, 12.14), (12.07, 7.66))
    assert graph_reading_off((12.18, 12.14), (18.0, 12.1))
    assert not graph_reading_off((12.18, 12.14), (12.07, 11.6))
    assert not graph_reading_off((2.0, 1.5), (2.1, 2.3))  # within a microsecond
    assert not graph_reading_off((16.46, 8.9), (12.51, 8.65))  # the suite's Qwen qkv M = 1, s33
    assert not graph_reading_off((12.18, 8.0), (12.2, 11.0))
    # both off against the challenger: judged; both off in its favour: not believed
    assert not graph_reading_off((16.0, 8.0), (12.0, 11.0))
    assert graph_reading_off((12.0, 11.0), (16.0, 8.0))
    # the share is of the trial: 18% under a 10 us trial is within it, 21% is not
    assert not graph_reading_off((12.0, 10.0), (12.0, 8.2))
    assert graph_reading_off((12.0, 10.0), (12.0, 7.9))


def test_a_duel_of_gpu_bound_calls_is_timed_over_sustained_stretches():
    """Compute-bound kernels draw the GPU to its power limit in use: their duel is timed there,
    not at the full clock of a short timing; a duel with a short call, off the GPU, or with the
    stretches turned off is timed as before."""
    heavy, also_heavy, light = 180.0, 171.0, 40.0  # trial times, us a call
    options = TuneOptions()
    assert sustained_duel("cuda", (heavy, also_heavy), options)
    assert not sustained_duel("cuda", (heavy, light), options)
    assert not sustained_duel("cpu", (heavy, also_heavy), options)
    assert not sustained_duel("cuda", (heavy, also_heavy), TuneOptions(sustained_s=0))


def test_heavy_gpu_bound_calls_hold_the_power_limit_however_short():
    """A call under ``timing.STEADY_US`` that multiplies near the tensor cores' peak (an FP8
    GEMM of 30 GFLOP in 31 us on the GPU) holds the GPU at its power limit when run back to back,
    as a model's prefill runs it, and its duel is timed there. A call whose launch outlasts its
    kernel does not, however fast its kernel multiplies: back to back, its GPU idles between
    calls (an FP8 GEMM of 12.9 GFLOP: 13.8 us on the GPU, 19.5 us eagerly)."""
    heavy_from = 5e8  # FLOPs per us (0.5 PFLOP/s)
    down, qkv = 30.1e9, 12.9e9
    assert at_power_limit(down, (35.4, 33.0), (31.7, 30.8), heavy_from)
    assert at_power_limit(down, (35.4, 62.1), (31.7, 59.2), heavy_from)  # one of them heavy
    assert not at_power_limit(qkv, (22.0, 19.5), (13.7, 13.8), heavy_from)  # host-bound
    assert not at_power_limit(down, (90.0, 95.0), (88.0, 93.0), heavy_from)  # light
    # an eager rate this low cannot belong to a heavy GPU-bound call: no graph times needed
    assert may_hold_power_limit(down, (35.4, 33.0), heavy_from)
    assert not may_hold_power_limit(down, (90.0, 95.0), heavy_from)
    options = TuneOptions()
    assert sustained_duel("cuda", (35.4, 33.0), options, heavy=True)
    assert not sustained_duel("cuda", (35.4, 33.0), options)
    assert not sustained_duel("cpu", (35.4, 33.0), options, heavy=True)
    assert not sustained_duel("cuda", (35.4, 33.0), TuneOptions(sustained_s=0), heavy=True)
    assert heavy_rate("cpu") == math.inf


def test_graph_times_are_read_only_where_the_eager_times_allow_a_heavy_call():
    """``power_limited`` spares the graph timings of light calls, and a call that cannot be
    captured in a graph (no GPU time: None) is judged not heavy."""
    heavy_from, down = 5e8, 30.1e9
    read: list[str] = []

    def gpu_times(*us: float):
        return lambda: read.append("read") or us

    assert power_limited(down, (35.4, 33.0), gpu_times(31.7, 30.8), heavy_from)
    assert read == ["read"]
    assert not power_limited(down, (90.0, 95.0), gpu_times(88.0, 93.0), heavy_from)
    assert read == ["read"]  # light by their eager times: no graph timing
    assert not power_limited(down, (35.4, 33.0), lambda: None, heavy_from)


def test_the_runner_up_duels_where_the_winners_confirmation_reads_it_slower():
    options = TuneOptions()
    triton, cuda = m("triton", 30.2, 30.1, 30.3), m("cuda", 42.2, 42.0, 42.4)
    # the kept challenger read 29.8 in its trial, 40.8 in its confirmation: triton's 30.2 beats it
    assert runner_up([triton, cuda], confirmed_us=40.8, options=options) is triton
    assert runner_up([cuda, triton], confirmed_us=40.8, options=options) is triton
    assert runner_up([triton], confirmed_us=30.5, options=options) is None  # within noise
    assert runner_up([], confirmed_us=40.8, options=options) is None


def test_a_later_duellist_whose_eager_trial_ties_the_kept_one_duels_it():
    # session 27's Qwen o trials, host-bound beside compiles: 2.4% apart, within pingpong's noise
    kept = m("cutlass_ws", 25.09, 25.0, 25.2)
    pingpong, slower = m("cutlass_pingpong", 25.70, 25.0, 26.4), m("triton", 27.0, 26.9, 27.1)
    assert tied_rival([pingpong, slower], kept, TuneOptions()) is pingpong
    assert tied_rival([slower], kept, TuneOptions()) is None  # beyond either one's noise
    steady = m("cutlass_pingpong", 25.70, 25.65, 25.75)
    assert tied_rival([steady], kept, TuneOptions()) is None  # 2.4% apart, both steady
    assert tied_rival([pingpong], kept, TuneOptions(launch="graph")) is None  # graph times ranked


def test_the_numerics_check_covers_a_later_call_not_only_the_first():
    from planted import RightOnce

    outcome = tuned_with(RightOnce(), budget_s=0.01)
    assert by_params(outcome)["right_once"].status == "rejected"


HAS_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_confirmation_times_both_in_a_cuda_graph(memoized):
    for launch in ("eager", "graph"):
        # cut-offs that cannot cut: the rule under test is the duel's, not this host's speed
        options = TuneOptions(
            budget_s=0.02, cut_factor=1e9, late_cut=1e9, sources=["memoized"], launch=launch
        )
        outcome = tune(KEY, options=options)
        errors = {m.candidate: m.error for m in outcome.measurements}
        assert outcome.winner.source == "memoized", (launch, errors)
        assert "in a CUDA graph" in by_params(outcome)["memoized"].error


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_a_tie_goes_to_the_duel_and_a_twin_of_the_baseline_does_not_win():
    from planted import Twin

    outcome = tuned_with(Twin(), budget_s=0.02)
    twin = by_params(outcome)["twin"]
    assert outcome.winner.source == "torch", twin.error
    if twin in duels(outcome.measurements, TuneOptions(), "cuda"):
        assert "in a CUDA graph" in twin.error and "lost" in twin.error  # it met the baseline


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_graph_launch_ranks_candidates_by_gpu_time():
    """A challenger slow eagerly (host work) but fastest on the GPU: an eager caller keeps the
    baseline, a caller that replays graphs gets the challenger."""
    from planted import HostHeavy, Memoized

    Memoized.slow = False
    winners = {launch: tuned_with(HostHeavy(), launch, budget_s=0.02) for launch in LAUNCHES}
    assert winners["eager"].winner.source == "torch"
    graph = winners["graph"]
    assert graph.winner.source == "hostheavy", {m.candidate: m.error for m in graph.measurements}
    assert by_params(graph)["hostheavy"].median_us < by_params(graph)["torch"].median_us


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_a_challenger_that_cannot_be_captured_loses():
    from planted import Uncapturable

    Uncapturable.slow = False
    # cut-offs that cannot cut: the challenger must reach the duel on any host
    outcome = tuned_with(Uncapturable(), budget_s=0.02, cut_factor=1e9, late_cut=1e9)
    assert outcome.winner.source == "torch"
    assert "cannot be captured in a CUDA graph" in by_params(outcome)["uncapturable"].error
    assert torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_of_two_challengers_tied_by_their_launches_the_faster_on_the_gpu_serves(monkeypatch):
    """Both beat torch's ~0.3 ms f32 GEMM by far behind ~80 us of host work and one spin-kernel
    launch a call; one spins the GPU ~25 us a call, the other a few cycles. The idle one's trial
    ran beside a disturbance (10 us more host work a call), so the busy one ranks first and keeps
    its win over torch; the idle one tied it (within 25% noise), duels it, ties it eagerly and
    wins on the GPU. The trial sits 10 us from either edge of the tie: a host's jitter moves
    neither the ranking nor the tie."""
    from planted import GpuBusy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    class Quick(GpuBusy):
        name, busy_s, gpu_cycles = "quick_gpu", 90e-6, 1  # its trial, beside a disturbance

    class Slow(GpuBusy):
        name, busy_s = "slow_gpu", 80e-6

    def quieter_after_its_trial(m):
        if m.source == "quick_gpu":
            Quick.busy_s = 78e-6

    key = GemmKey(m=1024, n=1024, k=8192, dtype="f32", out_dtype="f32")
    outcome = tuned_uncut(key, [Quick(), Slow()], min_noise=0.25, on_result=quieter_after_its_trial)
    got = by_params(outcome)
    errors = {name: (m.median_us, m.host_us, m.error) for name, m in got.items()}
    assert outcome.winner.source == "quick_gpu", errors
    assert outcome.winner.median_us < outcome.winner.baseline_us / 2
    assert "kept" in got["slow_gpu"].error, errors  # ranked first, it met torch first
    assert "quick_gpu, whose trial tied it, won their duel" in got["slow_gpu"].error, errors
    assert "vs slow_gpu" in got["quick_gpu"].error, errors


class Compiling(Source):
    """Logs its precompile and build calls; one name can fail its precompile."""

    op = "gemm"
    events: ClassVar[list[tuple[str, str, object]]] = []

    def __init__(self, name: str, *, broken: bool = False) -> None:
        self.name, self.broken = name, broken

    def candidates(self, key, device):
        return [{"tile": 1}, {"tile": 2}]

    def precompile(self, key, shortlist):
        Compiling.events.append(("precompile", self.name, shortlist))
        if self.broken:
            raise RuntimeError("compiler crashed")

    def build(self, key, params):
        Compiling.events.append(("build", self.name, params))
        return lambda a, b, out=None: torch.matmul(a, b, out=out)


def test_every_source_precompiles_its_shortlist_before_any_timing():
    Compiling.events = []
    sources = [Compiling("compiling_a"), Compiling("compiling_b", broken=True)]
    for src in sources:
        registry.register(src)
    try:
        outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=[s.name for s in sources]))
    finally:
        for src in sources:
            registry.unregister(src.name)
    kinds = [kind for kind, _, _ in Compiling.events]
    assert kinds[:2] == ["precompile", "precompile"] and "precompile" not in kinds[2:]
    shortlist = [{"tile": 1}, {"tile": 2}]
    assert {(name, str(p)) for _, name, p in Compiling.events[:2]} == {
        ("compiling_a", str(shortlist)), ("compiling_b", str(shortlist))
    }  # fmt: skip
    # a failed precompile leaves each candidate to its own build, which works here
    statuses = {m.candidate: m.status for m in outcome.measurements if m.source == "compiling_b"}
    assert len(statuses) == 2 and set(statuses.values()) <= {"ok", "cut"}


def test_a_resumed_run_precompiles_only_what_is_left():
    Compiling.events = []
    src = Compiling("compiling_a")
    registry.register(src)
    try:
        first = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["compiling_a"]))
        done = [m for m in first.measurements if m.params == {"tile": 1}]
        Compiling.events = []
        tune(KEY, options=TuneOptions(budget_s=0.005, sources=["compiling_a"]), prior=done)
    finally:
        registry.unregister("compiling_a")
    assert Compiling.events[0] == ("precompile", "compiling_a", [{"tile": 2}])


@pytest.mark.parametrize("launch", ["eager", "graph"])
def test_the_winner_and_measurements_record_the_launch_mode(launch):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=[], launch=launch))
    assert outcome.winner.launch == launch
    assert {m.launch for m in outcome.measurements} == {launch}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"launch": "warp"}, "launch must be one of ['eager', 'graph'], got 'warp'"),
        ({"cut_factor": 0.5}, "cut_factor must be >= 1, got 0.5"),
        ({"budget_s": -1.0}, "budget_s must be >= 0, got -1.0"),
        ({"confirm_rounds": -1}, "confirm_rounds must be >= 0, got -1"),
    ],
)
def test_bad_options_name_the_field_the_value_and_what_is_allowed(fields, message):
    with pytest.raises(ValueError) as e:
        TuneOptions(**fields)
    assert str(e.value) == message


def test_the_engine_runs_in_process_only():
    with pytest.raises(ValueError, match=r"through tuner\.tuning\.tune"):
        tune(KEY, options=TuneOptions(isolate=True))


def test_the_cut_is_tighter_where_the_best_is_a_steady_gpu_bound_call():
    options = TuneOptions(cut_factor=1.5, steady_cut=1.1)
    assert cut_off(None, "cuda", options) is None  # nothing timed yet: nothing to cut against
    assert cut_off(1000.0, "cuda", options) == pytest.approx(1100.0)
    assert cut_off(10.0, "cuda", options) == pytest.approx(15.0)  # launch-bound: noisy probes
    assert cut_off(1000.0, "cpu", options) == pytest.approx(1500.0)
    with pytest.raises(ValueError, match="steady_cut must be >= 1"):
        TuneOptions(steady_cut=0.9)
    with pytest.raises(ValueError, match="late_cut must be >= 1"):
        TuneOptions(late_cut=0.9)


def test_challengers_timed_in_an_earlier_run_go_first_fastest_first(planted):
    """A warm re-tune times what was fastest last time first, so the cut-off is tight at once."""
    first = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]))
    earlier = earlier_times(first.measurements, "eager")
    timed = {m.candidate for m in first.measurements if m.status == "ok" or m.median_us}
    assert set(earlier) == timed and all(t > 0 for t in earlier.values())
    assert any(m.status == "cut" for m in first.measurements if m.candidate in earlier)
    assert earlier_times(first.measurements, "graph") == {}  # other launch modes say nothing

    names = [m.candidate for m in first.measurements if not m.is_baseline and m.params]
    hinted = {names[-1]: 1.0, names[-2]: 2.0}  # the plan's last two, in reverse
    order = []
    tune(
        KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]), earlier=hinted,
        on_start=lambda source, params: order.append(candidate_name(source.name, params)),
    )  # fmt: skip
    challengers = [n for n in order if n in names]
    assert challengers[:2] == [names[-1], names[-2]]
    assert challengers[2:] == [n for n in names if n not in hinted]


def test_a_problems_tuning_time_is_split_into_its_phases(planted):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]))
    assert list(outcome.phases) == list(PHASES)
    assert all(t >= 0 for t in outcome.phases.values())
    assert sum(outcome.phases.values()) == pytest.approx(outcome.seconds)
    assert outcome.phases["compile"] >= outcome.compile_s


def test_a_runners_first_call_on_each_input_set_is_set_up_not_timing(monkeypatch):
    """A runner's first call on an operand may convert it (a weight layout made once per
    tensor): the warm-up covers every input set, however short the warm-up itself, so no
    timed call includes a conversion (else the probe's calls would, and it would be cut)."""
    from planted import ConvertsOnFirstSight, Memoized

    from tuner.measure import samples

    monkeypatch.setattr(timing, "WARMUP", 1)
    monkeypatch.setattr(Memoized, "slow", False)
    assert len(samples.input_sets(KEY, "cpu", 0)) >= 4  # the probe's 3 calls: all first sights
    # cut-offs far above this host's noise and far below a conversion (tens of ms): a probe
    # that converted is still cut, one slowed by a busy box is not
    outcome = tuned_with(ConvertsOnFirstSight(), budget_s=0.005, cut_factor=100, late_cut=100)
    timed = by_params(outcome)["converts_on_first_sight"]
    assert timed.status == "ok", timed.error
    assert timed.median_us < ConvertsOnFirstSight.first_sight_s * 1e6 / 10

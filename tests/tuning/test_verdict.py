"""The rules that judge measurements (``tuner.tuning.verdict``), on measurements and timings made
up to the case: which challengers contend or tie, what a launch cost or a disturbed reading
weighs, and what a duel's readings say."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tuner.measure import timing
from tuner.measure.records import Measurement
from tuner.tuning.options import TuneOptions
from tuner.tuning.verdict import (
    Rounds,
    at_power_limit,
    bands_apart,
    contenders,
    duels,
    eager_win,
    far_off_trials,
    gap_unexplained,
    gpu_only_win,
    graph_reading_off,
    heavy_rate,
    host_hides_gpu,
    left_out,
    may_hold_power_limit,
    pair_noise,
    power_limited,
    retake_scattered,
    round_scatter,
    runner_up,
    steadier,
    sustained_duel,
    tied_in_trial,
    tied_rival,
    ties,
)


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
    assert contenders([base, m("x", 97.0, 96.0, 98.0)], TuneOptions()) == []
    assert [c.source for c in contenders([base, m("x", 90.0, 89.0, 91.0)], TuneOptions())] == ["x"]
    assert contenders([base, m("x", 101.0, 100.0, 102.0)], TuneOptions()) == []


def test_a_baselines_long_tail_ties_no_challenger_whose_band_lies_under_it():
    """A CPU call of a few us has a long tail in every take, a half spread near 100%: as a margin
    it would tie any challenger, however fast. Where the challenger's p90 is under the
    baseline's p10 by the floor, the gap is no noise, and the floor is the margin."""
    base = m("torch", 4.2, 4.0, 12.0, baseline=True)  # half spread 95%
    fast = m("fast", 0.25, 0.23, 0.28)
    assert bands_apart(base, fast, 0.02, "eager")
    assert pair_noise(base, fast, 0.02, "eager") == 0.02
    assert [c.source for c in contenders([base, fast], TuneOptions())] == ["fast"]
    reaching = m("reaching", 2.0, 1.0, 3.95)  # its p90 within the floor of torch's p10
    assert pair_noise(base, reaching, 0.02, "eager") == pytest.approx(8.0 / 4.2 / 2)
    assert contenders([base, reaching], TuneOptions()) == []
    slow_launch = m("slow_launch", 0.25, 0.23, 0.28)
    slow_launch.host_us = 3.95  # eagerly its launch reaches torch's quickest readings
    assert not bands_apart(base, slow_launch, 0.02, "eager")
    assert bands_apart(base, slow_launch, 0.02, "graph")


def test_a_challenger_faster_in_its_trial_that_no_duel_judges_is_told_why():
    base = m("torch", 100.0, 95.0, 105.0, baseline=True)
    base.host_us = 10.0
    tie, beyond = m("tie", 98.0, 97.0, 99.0), m("beyond", 80.0, 79.0, 81.0)
    slower = m("slower", 101.0, 100.0, 102.0)
    slow_launch = m("slow_launch", 70.0, 69.0, 71.0)
    slow_launch.host_us = 140.0  # 130 us more launch work for 30 us saved
    host_bound = m("host_bound", 10.0, 9.0, 11.0)
    host_bound.host_us = 100.0  # repaid (90 us saved), but eagerly a call takes its launch
    ms = [base, tie, beyond, slower, slow_launch, host_bound]
    order = duels(ms, TuneOptions(), "cpu")
    assert [c.source for c in order] == ["beyond"]
    assert {c.source: why for c, why in left_out(ms, order, {"beyond"}, beyond, TuneOptions())} == {
        "tie": "trial 98.00 vs baseline 100.00 us, within the noise (margin 5.0%): a tie, "
        "not duelled",
        "slow_launch": "a launch of 140.00 vs 10.00 us a call: 130.00 us more than the 30.00 us "
        "it saves, not duelled",
        "host_bound": "a launch of 100.00 vs 10.00 us a call: eagerly no faster than the "
        "baseline's 100.00 us, not duelled",
    }


def test_on_the_gpu_a_tie_in_line_for_a_duel_says_which_duels_it_missed():
    base = m("torch", 100.0, 95.0, 105.0, baseline=True)
    beyond, tie = m("beyond", 80.0, 79.0, 81.0), m("tie", 98.0, 97.0, 99.0)
    ms = [base, tie, beyond]
    order = duels(ms, TuneOptions(), "cuda")
    assert [c.source for c in order] == ["beyond", "tie"]
    duelled = {"beyond"}  # it met torch, and won
    notes = {c.source: why for c, why in left_out(ms, order, duelled, beyond, TuneOptions())}
    assert notes == {
        "tie": "trial 98.00 vs baseline 100.00 us: the duels ended before its turn (a win or "
        "sustained losses first)"
    }
    one_try = TuneOptions(confirm_tries=1)
    assert [why for _, why in left_out(ms, order, duelled, base, one_try)] == [
        "trial 98.00 vs baseline 100.00 us: 2 in line for a duel, past confirm_tries, not duelled"
    ]
    unconfirmed = TuneOptions(confirm_rounds=0)  # the fastest contender serves, as it is
    second = m("second", 85.0, 84.0, 86.0)
    ms.append(second)
    order = duels(ms, unconfirmed, "cuda")
    assert [c.source for c in order] == ["beyond", "second"]
    assert {c.source: why for c, why in left_out(ms, order, set(), beyond, unconfirmed)} == {
        "tie": "trial 98.00 vs baseline 100.00 us, within the noise (margin 5.0%): a tie, "
        "not duelled",
        "second": "trial 85.00 vs baseline 100.00 us: no duels (confirm_rounds 0), not duelled",
    }


def test_a_missing_host_time_reads_as_unknown_not_zero():
    base = m("torch", 100.0, 95.0, 105.0, baseline=True)
    base.host_us = None
    fast = m("fast", 10.0, 9.0, 11.0)
    fast.host_us = 120.0  # eagerly its launch is the call
    assert [why for _, why in left_out([base, fast], [], set(), base, TuneOptions())] == [
        "a launch of 120.00 vs ? us a call: eagerly no faster than the baseline's 100.00 us, "
        "not duelled"
    ]


def test_challengers_rank_only_against_a_timed_baseline():
    failed = dataclasses.replace(m("torch", 100.0, 95.0, 105.0, baseline=True), status="failed")
    with pytest.raises(ValueError, match="no timed baseline"):
        contenders([failed, m("x", 90.0, 89.0, 91.0)], TuneOptions())


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
    assert contenders([base, near, nearer], TuneOptions()) == []


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
    assert contenders([base, fast_gpu_slow_launch], TuneOptions(launch="eager")) == []
    assert contenders([base, fast_gpu_slow_launch], TuneOptions(launch="graph")) == [
        fast_gpu_slow_launch
    ]


def test_eager_winner_must_repay_extra_launch_cost():
    """Host-bound callers (decode steps) pay a winner's extra host time on every call: it must
    save at least that much GPU time."""
    base = m("torch", 20.0, 19.9, 20.1, baseline=True)
    base.host_us = 11.0
    faster_gpu = m("x", 15.0, 14.9, 15.1)  # saves 5 us
    faster_gpu.host_us = 18.0  # 7 us more, 5.9 beyond the slack of max(1 us, 10%)
    assert contenders([base, faster_gpu], TuneOptions()) == []
    faster_gpu.host_us = 12.0  # within the slack
    assert contenders([base, faster_gpu], TuneOptions()) == [faster_gpu]
    faster_gpu.host_us = 16.0  # 3.9 us beyond the slack, repaid by 5 us of GPU time
    assert contenders([base, faster_gpu], TuneOptions()) == [faster_gpu]
    faster_gpu.host_us = 18.0
    assert contenders([base, faster_gpu], TuneOptions(host_slack=0.5)) == [faster_gpu]
    assert contenders([base, faster_gpu], TuneOptions(launch="graph")) == [faster_gpu]
    big = m("torch", 1160.0, 1150.0, 1170.0, baseline=True)
    big.host_us = 14.5
    padded = m("x", 270.0, 268.0, 272.0)  # 4097^3: two launches and a pad buffer
    padded.host_us = 30.7
    assert contenders([big, padded], TuneOptions()) == [padded]


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


def test_a_gpu_only_win_needs_a_launch_no_longer_than_the_baselines_within_a_host_tie():
    # eager times are launch times here: the challenger's longer launch loses a quiet host's tie
    assert gpu_only_win(host_us=(33.5, 33.5), gpu_us=(11.6, 11.1), margin=0.02)
    assert not gpu_only_win(host_us=(33.5, 34.0), gpu_us=(11.6, 11.1), margin=0.02)
    # two launches of one kernel family, a few ns apart: the same launch, so the GPU decides
    assert gpu_only_win(host_us=(19.728, 19.734), gpu_us=(22.17, 18.97), margin=0.02)
    # HOST_TIE is half a percent: 0.4% longer is a tie, 0.6% a longer launch
    assert gpu_only_win(host_us=(100.0, 100.4), gpu_us=(110.0, 90.0), margin=0.02)
    assert not gpu_only_win(host_us=(100.0, 100.6), gpu_us=(110.0, 90.0), margin=0.02)
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


def test_scattered_rounds_are_taken_again_unless_a_sustained_challenger_read_behind():
    """Rounds at the power limit 2-4% apart are common, and each take of a sustained duel costs
    seconds: one whose challenger read no faster has nothing for a second take to confirm."""
    behind = Rounds(base_us=1000.0, chal_us=1010.0, base_host=30.0, chal_host=31.0, scatter=0.03)
    ahead = behind._replace(chal_us=990.0)
    assert not retake_scattered(behind, margin=0.02, sustained=True)
    assert retake_scattered(ahead, margin=0.02, sustained=True)  # a win the scatter may hide
    assert not retake_scattered(ahead, margin=0.04, sustained=True)  # steady enough to judge
    # a short duel: a retake costs little, and a tie may be won on the GPU
    assert retake_scattered(behind, margin=0.02, sustained=False)


def test_a_tie_in_its_trial_must_win_an_eager_duel_twice():
    """A challenger tied in its trial that reads ahead in one sustained take and behind in the
    next has not won: a tie must win a second take, as must a host-bound twin (the same call)
    that reads ahead beyond its scatter over one take while its GPU time is level."""
    assert tied_in_trial((47.87, 47.90), margin=0.02)  # a hair slower in the trial
    assert tied_in_trial((215.3, 211.01), margin=0.02)  # a 2% win within the noise
    assert not tied_in_trial((215.3, 200.0), margin=0.02)  # a contender: one take decides
    first = Rounds(base_us=51.78, chal_us=50.53, base_host=19.75, chal_host=21.61, scatter=0.022)
    second = Rounds(base_us=50.85, chal_us=52.08, base_host=20.4, chal_host=21.0, scatter=0.04)
    assert eager_win(first, margin=0.02, gpu_win=False)
    assert not eager_win(second, margin=0.022, gpu_win=False)  # the second take: not ahead
    twin = Rounds(base_us=23.46, chal_us=18.88, base_host=20.14, chal_host=15.57, scatter=0.173)
    assert eager_win(twin, margin=0.02, gpu_win=False)  # one take: "faster" beyond its scatter


def test_an_eager_gap_between_kernel_bound_calls_must_show_in_their_graph_times():
    # (baseline, challenger): the baseline's eager rounds read high beside a disturbance, while
    # both kernels' graph times are level and longer than either launch
    hosts, gpus = (71.7, 37.5), (81.0, 80.4)
    assert gap_unexplained((99.3, 81.9), hosts, gpus, margin=0.046)
    assert not gap_unexplained((84.7, 81.9), hosts, gpus, margin=0.046)  # within the noise
    # a real win shows in the graph too
    assert not gap_unexplained((59.7, 56.6), (44.0, 29.2), (60.4, 53.6), margin=0.021)
    # launch-bound calls: eager times are launch times, which the graph does not see
    assert not gap_unexplained((40.0, 25.0), (38.0, 24.0), (12.0, 11.9), margin=0.02)
    # a long baseline reads a little apart eagerly and in a graph: the win is wide either way
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
    # a disturbed baseline trial: judged at its duel reading
    assert not graph_reading_off((16.46, 8.9), (12.51, 8.65))
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
    stretches turned off is not."""
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
    # the kept challenger's confirmation reads 40.8, far over its trial: triton's 30.2 beats it
    assert runner_up([triton, cuda], confirmed_us=40.8, options=options) is triton
    assert runner_up([cuda, triton], confirmed_us=40.8, options=options) is triton
    assert runner_up([triton], confirmed_us=30.5, options=options) is None  # within noise
    assert runner_up([], confirmed_us=40.8, options=options) is None


def test_a_later_duellist_whose_eager_trial_ties_the_kept_one_duels_it():
    # host-bound trials a little apart, within pingpong's noise
    kept = m("cutlass_ws", 25.09, 25.0, 25.2)
    pingpong, slower = m("cutlass_pingpong", 25.70, 25.0, 26.4), m("triton", 27.0, 26.9, 27.1)
    assert tied_rival([pingpong, slower], kept, TuneOptions()) is pingpong
    assert tied_rival([slower], kept, TuneOptions()) is None  # beyond either one's noise
    steady = m("cutlass_pingpong", 25.70, 25.65, 25.75)
    assert tied_rival([steady], kept, TuneOptions()) is None  # 2.4% apart, both steady
    assert tied_rival([pingpong], kept, TuneOptions(launch="graph")) is None  # graph times ranked

"""The rules that judge measurements: which time counts, how wide the noise is, who meets the
baseline in a duel, and whether a duel's readings make a win. They take timings and options and
return a verdict, timing nothing themselves (``tuner.tuning.trials`` takes the timings;
``heavy_rate`` reads ``pruning``'s measured peak), so that each rule can be read and tested alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple

from tuner.measure import timing
from tuner.measure.records import Measurement
from tuner.tuning import pruning
from tuner.tuning.options import TuneOptions


def effective_us(m: Measurement, launch: str) -> float:
    """What the caller waits for: GPU time, or the host launch time if that is larger (eager)."""
    assert m.median_us is not None
    if launch == "eager" and m.host_us is not None:
        return max(m.median_us, m.host_us)
    return m.median_us


def noise(m: Measurement, floor: float) -> float:
    """Half the relative p10..p90 spread, at least ``floor``."""
    return max(floor, m.spread / 2)


def bands_apart(base: Measurement, chal: Measurement, floor: float, launch: str) -> bool:
    """Whether the challenger's p90 (eagerly, its host time if that is longer) is under the
    baseline's p10 by more than ``floor``: none of the challenger's usual readings reaches the
    baseline's quickest ones."""
    if chal.p90_us is None or base.p10_us is None:
        return False
    top = chal.p90_us
    if launch == "eager" and chal.host_us is not None:
        top = max(top, chal.host_us)
    return top < base.p10_us * (1 - floor)


def wider_noise(base: Measurement, chal: Measurement, floor: float) -> float:
    """The wider of two runners' ``noise``s."""
    return max(noise(base, floor), noise(chal, floor))


def pair_noise(base: Measurement, chal: Measurement, floor: float, launch: str) -> float:
    """The share by which a challenger must beat ``base`` to be faster beyond noise: their
    ``wider_noise``, but only ``floor`` where their p10..p90 bands lie apart (``bands_apart``).
    A half spread stands for how far readings of one runner may fall apart; a baseline whose
    every take has a long tail (a CPU call of a few us) would otherwise tie any challenger,
    however much faster, though no usual reading of either reaches the other's."""
    if bands_apart(base, chal, floor, launch):
        return floor
    return wider_noise(base, chal, floor)


DISTURBED_SPREAD = 0.5  # a timing's (p90 - p10) / median beyond this: something ran beside it


def steadier(
    t: timing.Timing, retake: Callable[[], timing.Timing], cut_at: float | None = None
) -> timing.Timing:
    """``t``, or where it may have been disturbed (a compile, a collector, a neighbour's kernel
    beside a part of its calls), a retake if that one is steadier. A disturbed timing's spread
    becomes its noise margin, so a disturbed challenger could not win and a disturbed baseline
    could not be beaten, whatever their true times. A cut (``cut_at``: the cut-off that stopped
    it) may have been disturbed where a tenth of its calls were under the cut-off: the retake
    stands if it is not cut."""
    if t.cut:
        if cut_at is None or t.p10_us >= cut_at:
            return t
        again = retake()
        return t if again.cut else again
    if t.spread <= DISTURBED_SPREAD:
        return t
    again = retake()
    return again if not again.cut and again.spread < t.spread else t


def host_hides_gpu(host_us: tuple[float, float], gpu_us: tuple[float, float]) -> bool:
    """Whether eager times of two runners are their host's launch time, not their kernels': a
    host call at least as long as the shorter kernel. Only there may a GPU win within the eager
    noise decide a duel; where the kernels are longer, eager times measure the kernels in the
    order a caller runs them, and a graph replay's win alone does not carry over to that."""
    return max(host_us) >= min(gpu_us)


def gap_unexplained(
    eager_us: tuple[float, float],
    host_us: tuple[float, float],
    gpu_us: tuple[float, float],
    margin: float,
) -> bool:
    """Whether an eager duel's win (baseline first, challenger second in each pair) between two
    calls whose kernels outlast their launches (not ``host_hides_gpu``) is one their graph times
    do not show: an eager win beyond ``margin``, the graph's below it, and the eager one wider
    than the graph's by more than ``margin``. Eager times of such calls are their kernels'
    times, so that win is a disturbance of the eager readings, not the kernels. Wins are shares
    of the baseline's time, not microseconds: an eager and a graph time of one long call differ
    by a few percent of it."""
    (base, chal), (base_gpu, chal_gpu) = eager_us, gpu_us
    if host_hides_gpu(host_us, gpu_us) or base <= 0 or base_gpu <= 0:
        return False  # (a kernel of no GPU time is hidden by any launch)
    eager_gain, gpu_gain = 1 - chal / base, 1 - chal_gpu / base_gpu
    return eager_gain > margin > gpu_gain and eager_gain > gpu_gain + margin


# Two launches whose host times per call differ by at most this share are the same launch:
# runners of one kernel family read a few ns apart, in either order, duel after duel.
HOST_TIE = 0.005


def gpu_only_win(host_us: tuple[float, float], gpu_us: tuple[float, float], margin: float) -> bool:
    """Whether the challenger (second of each pair; the baseline first) wins an eager tie on its
    GPU time alone: where the host hides the kernels (``host_hides_gpu``), faster in the graph
    beyond ``margin``, and no longer to launch (beyond ``HOST_TIE``). Eager times there are
    launch times, so a longer launch inside a tie is a loss that a quieter host shows."""
    (base_host, chal_host), (base_gpu, chal_gpu) = host_us, gpu_us
    return (
        host_hides_gpu(host_us, gpu_us)
        and chal_host <= base_host * (1 + HOST_TIE)
        and chal_gpu < base_gpu * (1 - margin)
    )


def far_off_trials(
    trial_us: tuple[float, float], duel_us: tuple[float, float]
) -> tuple[bool, bool]:  # fmt: skip
    """Which of an eager duel's times (baseline, challenger) ran beside a disturbance: slower
    than the same runner's trial by more than a disturbed spread. A verdict on a disturbed
    baseline would say more about the disturbance than about the kernels; a disturbed
    challenger only makes its own win harder."""
    base, chal = (d > t * (1 + DISTURBED_SPREAD) for t, d in zip(trial_us, duel_us, strict=True))
    return base, chal


def round_scatter(rounds: Sequence[float]) -> float:
    """Half the range of one runner's duel rounds over their median: how far its own readings
    fell apart in the duel. An eager win narrower than either runner's scatter is a tie, which
    keeps the baseline: a heavy kernel's stretches at the power limit can read several percent
    apart, and a win within that is the clock's, not the kernel's."""
    mid = statistics.median(rounds) if rounds else 0.0
    return (max(rounds) - min(rounds)) / 2 / mid if mid > 0 else 0.0


class Rounds(NamedTuple):
    """A duel's eager rounds: each runner's median time and host time a call, and the wider of
    their ``round_scatter``s."""

    base_us: float
    chal_us: float
    base_host: float
    chal_host: float
    scatter: float


def eager_win(readings: Rounds, margin: float, gpu_win: bool) -> bool:
    """An eager duel's verdict on its rounds: the challenger faster by more than the noise
    ``margin`` and than the rounds' own scatter, or, where the host's launch hides the kernels,
    faster on the GPU beyond the graph's noise (``gpu_win``, which the scatter of host-bound
    rounds does not touch) with no eager loss."""
    beyond = max(margin, readings.scatter)
    chal, base = readings.chal_us, readings.base_us
    return chal < base * (1 - beyond) or (gpu_win and chal <= base)


def retake_scattered(readings: Rounds, margin: float, sustained: bool) -> bool:
    """Whether an eager duel's rounds, scattered wider than the noise ``margin``, are taken
    again: cleaner rounds may show a win that the scatter hid. Not in a sustained duel whose
    challenger read no faster than the baseline: between GPU-bound calls only an eager win
    counts (no ``gpu_only_win``), this take showed none for a retake to confirm, and a retake
    at the power limit costs seconds."""
    if readings.scatter <= margin:
        return False
    return not sustained or readings.chal_us < readings.base_us


# A graph reading off the same runner's trial graph time by this share of the trial and by at
# least this many us is not a reading of its kernel: replays of one kernel are steady.
GRAPH_OFF = 0.2
GRAPH_OFF_US = 1.0


def graph_reading_off(trial_us: tuple[float, float], gpu_us: tuple[float, float]) -> bool:
    """Whether a graph duel's GPU times (baseline, challenger) contradict the same runners'
    trial graph times the way that favours the challenger: a kernel's replays vary by a few
    percent, so a challenger's reading far under its trial or a baseline's far over its own (a
    disturbed fence, a cache state no model's step has) would crown a challenger that is not
    faster. A reading off the other way only makes the challenger's win harder, and where the
    trial was the disturbed reading (a baseline's trial far over its duel readings) the duel's
    fresh readings are the ones to judge on."""
    (base_trial, chal_trial), (base_gpu, chal_gpu) = trial_us, gpu_us
    base_over = base_gpu - base_trial > max(base_trial * GRAPH_OFF, GRAPH_OFF_US)
    chal_under = chal_trial - chal_gpu > max(chal_trial * GRAPH_OFF, GRAPH_OFF_US)
    return base_over or chal_under


# A call multiplying at this share of the device's measured bf16 matmul peak or more is heavy:
# run back to back, as a model's layers run at prefill, such calls hold the GPU at its power
# limit, however short each one is.
HEAVY_SHARE = 0.75
# A call whose GPU time is this share of its eager time or more is GPU-bound: back to back, its
# kernels follow each other with no idle GPU between them. A host-bound call's GPU waits for
# the next launch, and stretches of such calls would time launches, not kernels at the limit.
GPU_BOUND_SHARE = 0.85


def heavy_rate(device: str) -> float:
    """FLOPs per us from which a call on ``device`` is heavy (``HEAVY_SHARE`` of its measured
    bf16 matmul peak); infinite off the GPU."""
    if device != "cuda":
        return math.inf
    return HEAVY_SHARE * pruning.measured_roof(device, "bf16", "f32").peak * 1e-6


def may_hold_power_limit(flops: float, eager_us: Iterable[float], heavy_from: float) -> bool:
    """Whether calls of ``flops`` with these eager times could pass ``at_power_limit``: a
    GPU-bound call's GPU time is at least ``GPU_BOUND_SHARE`` of its eager time, so one that is
    heavy multiplies at ``GPU_BOUND_SHARE * heavy_from`` or more by its eager time. Cheap: it
    spares the graph times that ``at_power_limit`` needs where no call could be heavy."""
    return any(us > 0 and flops / us >= GPU_BOUND_SHARE * heavy_from for us in eager_us)


def at_power_limit(
    flops: float, eager_us: Sequence[float], gpu_us: Sequence[float], heavy_from: float
) -> bool:
    """Whether calls of ``flops`` with these eager and GPU (graph) times, run back to back, hold
    the GPU at its power limit: every one GPU-bound (``GPU_BOUND_SHARE``) and one of them heavy
    (``heavy_from`` FLOPs per us of GPU time or more: ``heavy_rate``). An eager time alone cannot
    say this: a host-bound call's eager time is its launch's, and its rate by that time can read
    heavy while its GPU idles between calls."""
    bound = all(g >= GPU_BOUND_SHARE * e for e, g in zip(eager_us, gpu_us, strict=True))
    return bound and any(g > 0 and flops / g >= heavy_from for g in gpu_us)


def power_limited(
    flops: float,
    eager_us: Sequence[float],
    read_gpu: Callable[[], Sequence[float] | None],
    heavy_from: float,
) -> bool:
    """``at_power_limit`` for calls with these eager times, read at full clock (a short timing:
    a time taken at the power limit is slower, and would make a GPU-bound call read host-bound).
    Their graph times are read (``read_gpu``: None where a call cannot be captured, which then
    counts as not heavy) only where ``may_hold_power_limit`` allows a heavy call."""
    if not may_hold_power_limit(flops, eager_us, heavy_from):
        return False
    gpu_us = read_gpu()
    return gpu_us is not None and at_power_limit(flops, eager_us, gpu_us, heavy_from)


def sustained_duel(
    device: str, trial_us: Iterable[float], options: TuneOptions, heavy: bool = False
) -> bool:
    """Whether runners with these trial times (us a call) are compared over sustained stretches
    (``timing.sustained_time``): on the GPU, where every one is GPU-bound and long
    (``timing.STEADY_US`` or more) or the calls are heavy (``heavy``: ``at_power_limit``). Such
    calls draw the GPU to its power limit in use, and a kernel faster at the full clock of a
    short timing need not be faster there."""
    return (
        device == "cuda"
        and options.sustained_s > 0
        and (heavy or all(us >= timing.STEADY_US for us in trial_us))
    )


def runner_up(
    rest: list[Measurement], confirmed_us: float, options: TuneOptions
) -> Measurement | None:
    """The next duellist whose trial time beats the kept challenger's confirmed time beyond
    noise, if any: the winner's trial time was then too kind to it (its confirmation reads it
    slower), and the ranking that put it first does not hold."""
    for m in rest:
        margin = noise(m, options.min_noise)
        if effective_us(m, options.launch) < confirmed_us * (1 - margin):
            return m
    return None


def tied_rival(
    rest: list[Measurement], kept: Measurement, options: TuneOptions
) -> Measurement | None:
    """Eager: the first later duellist whose trial time ties the kept challenger's (under it
    plus either one's noise), if any. Where launches hide the kernels, two challengers'
    eager trials read their hosts and tie whatever their kernels cost, and one disturbed reading
    (a compile beside it) ranks them; only their own duel's graph times say which is faster on
    the GPU."""
    return under_kept(rest, kept, options) if options.launch == "eager" else None


def under_kept(
    rest: list[Measurement], kept: Measurement, options: TuneOptions
) -> Measurement | None:
    """The first of ``rest`` whose trial time is under the kept challenger's plus either one's
    noise: ahead of it or tied with it, so that only their own duel says which is faster."""
    kept_us = effective_us(kept, options.launch)
    for m in rest:
        margin = max(noise(kept, options.min_noise), noise(m, options.min_noise))
        if effective_us(m, options.launch) < kept_us * (1 + margin):
            return m
    return None


def launch_cost_repaid(
    us: float,
    host_us: float | None,
    base_us: float,
    base_host_us: float | None,
    options: TuneOptions,
) -> bool:
    """Eager callers are often bound by the host, not the GPU: a decode step launches dozens of
    small kernels and the GPU waits for each. There a kernel that is faster on the GPU but slower
    to launch makes the whole step slower. So in eager mode a winner may cost more host time per
    call than the baseline (beyond noise) only if it saves at least that much GPU time: a large
    GEMM several times faster repays a longer launch; a small one a little faster does not."""
    if options.launch != "eager" or host_us is None or base_host_us is None:
        return True
    slack = max(options.host_slack_us, options.host_slack * base_host_us)
    extra = host_us - base_host_us - slack
    return extra <= 0 or base_us - us >= extra


def tie_ceiling(base_us: float, options: TuneOptions) -> float:
    """The slowest trial time (``effective_us``) a tie may read: one eager reading of a
    GPU-bound call moves by a few percent, and only its duel, alternating rounds and a CUDA
    graph, says which of the two is faster."""
    return base_us * (1 + options.min_noise)


def host_decides(median_us: float, host_us: float, base: Measurement, options: TuneOptions) -> bool:
    """Whether a challenger that would contend or tie on its own time (eager: ``median_us``
    below ``tie_ceiling`` of the baseline's ``effective_us``) is kept from the duel by its host
    time alone: its launch cost is not repaid, or its host time lifts it past the ceiling. There
    one disturbed host reading would drop it with no duel to correct it, so that reading is
    taken again.

    The baseline's reading is not: a disturbed (high) one only lets more challengers into the
    duel, which reads both host times again over alternating rounds and applies the launch rule
    to those readings. A host time above the call's own time is no sign of a disturbance
    either: it is what every launch-bound call reads."""
    if options.launch != "eager" or base.host_us is None:
        return False
    ceiling = tie_ceiling(effective_us(base, options.launch), options)
    if median_us >= ceiling:
        return False
    repaid = launch_cost_repaid(median_us, host_us, base.median_us, base.host_us, options)
    return not repaid or max(median_us, host_us) >= ceiling


def tied_in_trial(trial_us: tuple[float, float], margin: float) -> bool:
    """Whether a challenger's trial time was no faster than the baseline's beyond ``margin``
    (times: baseline, challenger): it meets the baseline as a tie, if at all (``ties``). One
    eager take of two tied calls can read either one ahead by more than the margin (at the
    power limit; or host-bound, where a disturbance of the host lasts through one runner's
    rounds), so such a challenger's win stands only where a second take shows it too."""
    base, chal = trial_us
    return chal >= base * (1 - margin)


def _challengers(
    measurements: list[Measurement], options: TuneOptions
) -> tuple[list[Measurement], list[Measurement]]:
    """The challengers that repay any extra launch cost, split into those faster than the
    baseline in the trial (``effective_us``) beyond both sides' noise, and the ties: faster
    within that noise, or slower but under ``tie_ceiling``; each fastest first."""
    ok = [m for m in measurements if m.status == "ok"]
    base = _required_baseline(ok)
    base_us = effective_us(base, options.launch)
    beyond: list[Measurement] = []
    within: list[Measurement] = []
    for m in ok:
        if m is base or not launch_cost_repaid(
            m.median_us, m.host_us, base.median_us, base.host_us, options
        ):
            continue
        us = effective_us(m, options.launch)
        margin = pair_noise(base, m, options.min_noise, options.launch)
        if not tied_in_trial((base_us, us), margin):
            beyond.append(m)
        elif us < tie_ceiling(base_us, options):
            within.append(m)

    def fastest_first(ms: list[Measurement]) -> list[Measurement]:
        return sorted(ms, key=lambda m: effective_us(m, options.launch))

    return fastest_first(beyond), fastest_first(within)


def contenders(measurements: list[Measurement], options: TuneOptions) -> list[Measurement]:
    """Challengers faster than the baseline by more than both sides' noise (and, eager, that
    repay any extra launch cost), fastest first."""
    return _challengers(measurements, options)[0]


def ties(measurements: list[Measurement], options: TuneOptions) -> list[Measurement]:
    """Challengers faster than the baseline in the trial but within the noise, or slower by at
    most ``min_noise`` (and that repay any extra launch cost), fastest first. On the GPU the
    confirmation's CUDA-graph timing can tell them apart: eager times of small kernels are
    host-bound, and their noise hides a real difference on the GPU."""
    return _challengers(measurements, options)[1]


def duels(measurements: list[Measurement], options: TuneOptions, device: str) -> list[Measurement]:
    """Who meets the baseline in the confirmation, in order (``tune`` takes the first
    ``confirm_tries``): the contenders, then on the GPU the ties, whose duel the graph decides."""
    beyond, within = _challengers(measurements, options)
    return beyond + within if device == "cuda" and options.confirm_rounds > 0 else beyond


def _us(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def left_out(
    measurements: list[Measurement],
    order: list[Measurement],
    duelled: Collection[str],
    chosen: Measurement,
    options: TuneOptions,
) -> list[tuple[Measurement, str]]:
    """The challengers faster than the baseline in their trial (median) that no duel judged
    (``duelled``: the candidates that met one), each with why: a launch its GPU time does not
    repay, a launch that eagerly makes it no faster, a tie within the pair's noise where no
    graph decides ties, or a place in ``order`` (``duels``) the duels did not reach. A loss in
    the trial otherwise leaves no word of itself."""
    base = _required_baseline(m for m in measurements if m.status == "ok")
    base_us = effective_us(base, options.launch)
    place = {id(m): i for i, m in enumerate(order)}
    found: list[tuple[Measurement, str]] = []
    for m in measurements:
        if (
            m.status != "ok"
            or m is base
            or m is chosen
            or m.candidate in duelled
            or m.median_us >= base.median_us
        ):
            continue
        us = effective_us(m, options.launch)
        trial = f"trial {us:.2f} vs baseline {base_us:.2f} us"
        launch = f"a launch of {_us(m.host_us)} vs {_us(base.host_us)} us a call"
        if not launch_cost_repaid(m.median_us, m.host_us, base.median_us, base.host_us, options):
            extra = (m.host_us or 0) - (base.host_us or 0)
            saved = base.median_us - m.median_us
            why = f"{launch}: {extra:.2f} us more than the {saved:.2f} us it saves, not duelled"
        elif us >= base_us:
            why = f"{launch}: eagerly no faster than the baseline's {base_us:.2f} us, not duelled"
        elif id(m) not in place:
            margin = pair_noise(base, m, options.min_noise, options.launch)
            why = f"{trial}, within the noise (margin {margin:.1%}): a tie, not duelled"
        elif options.confirm_rounds <= 0:
            why = f"{trial}: no duels (confirm_rounds 0), not duelled"
        elif place[id(m)] >= max(1, options.confirm_tries):
            why = f"{trial}: {place[id(m)] + 1} in line for a duel, past confirm_tries, not duelled"
        else:
            why = f"{trial}: the duels ended before its turn (a win or sustained losses first)"
        found.append((m, why))
    return found


def timed_baseline(measurements: Iterable[Measurement]) -> Measurement | None:
    """The baseline's timed measurement, once there is one."""
    return next((m for m in measurements if m.is_baseline and m.status == "ok"), None)


def _required_baseline(measurements: Iterable[Measurement]) -> Measurement:
    """The baseline's timed measurement, which ranking challengers needs."""
    if (base := timed_baseline(measurements)) is None:
        raise ValueError("no timed baseline among the measurements: challengers rank against it")
    return base

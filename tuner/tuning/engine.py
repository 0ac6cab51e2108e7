"""tune(key): candidates -> build -> check numerics -> time -> winner.

Every candidate ends as one Measurement: ``ok`` (timed), ``rejected`` (wrong numbers or NaN),
``failed`` (did not build or crashed), ``cut`` (far slower than the best so far after a probe, or
pruned before compiling: it cannot beat the baseline, ``tuner.tuning.pruning``) or
``unsupported`` (its source has nothing for this key). The baseline (torch's default) keeps the
win unless a challenger beats it by more than the measured noise, so a tuned result is never
slower than doing nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tuner.candidates import registry
from tuner.candidates.base import Params, Runner, Source
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key
from tuner.measure import samples, timing
from tuner.measure.records import Measurement, Winner, candidate_name
from tuner.tuning import pruning
from tuner.tuning.options import TuneOptions

log = logging.getLogger(__name__)


@dataclass
class TuneOutcome:
    key: Key
    winner: Winner
    measurements: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    compile_s: float = 0.0  # of ``seconds``: compiling (or waiting for the run's compile pool)
    phases: dict[str, float] = field(default_factory=dict)  # of ``seconds``, by PHASES

    @property
    def pruned(self) -> dict[str, int]:
        """Candidates left out before compiling, by rule (``tuner.tuning.pruning``)."""
        return pruning.count(self.measurements)

    @property
    def baseline(self) -> Measurement:
        return next(m for m in self.measurements if m.is_baseline and m.status == "ok")


def current_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def effective_us(m: Measurement, launch: str) -> float:
    """What the caller waits for: GPU time, or the host launch time if that is larger (eager)."""
    assert m.median_us is not None
    if launch == "eager" and m.host_us is not None:
        return max(m.median_us, m.host_us)
    return m.median_us


def noise(m: Measurement, floor: float) -> float:
    """Half the relative p10..p90 spread, at least ``floor``."""
    return max(floor, m.spread / 2)


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


def gpu_only_win(host_us: tuple[float, float], gpu_us: tuple[float, float], margin: float) -> bool:
    """Whether the challenger (second of each pair; the baseline first) wins an eager tie on its
    GPU time alone: where the host hides the kernels (``host_hides_gpu``), faster in the graph
    beyond ``margin``, and no longer to launch. Eager times there are launch times, so a longer
    launch inside a tie is a loss that a quieter host shows."""
    (base_host, chal_host), (base_gpu, chal_gpu) = host_us, gpu_us
    return (
        host_hides_gpu(host_us, gpu_us)
        and chal_host <= base_host
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


GraphPair = tuple[timing.Timing | None, timing.Timing | None] | None  # baseline's, challenger's

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
    if options.launch != "eager":
        return None
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
    (times: baseline, challenger): it meets the baseline as a tie, if at all (``ties``). At the
    power limit one sustained take of two tied kernels can read either one ahead by about the
    margin, so such a challenger's win there stands only where a second take shows it too."""
    base, chal = trial_us
    return chal >= base * (1 - margin)


def _challengers(
    measurements: list[Measurement], options: TuneOptions
) -> tuple[list[Measurement], list[Measurement]]:
    """The challengers that repay any extra launch cost, split into those faster than the
    baseline in the trial (``effective_us``) beyond both sides' noise, and the ties: faster
    within that noise, or slower but under ``tie_ceiling``; each fastest first."""
    ok = [m for m in measurements if m.status == "ok"]
    base = _timed_baseline(ok)
    base_us = effective_us(base, options.launch)
    beyond: list[Measurement] = []
    within: list[Measurement] = []
    for m in ok:
        if m is base or not launch_cost_repaid(
            m.median_us, m.host_us, base.median_us, base.host_us, options
        ):
            continue
        us = effective_us(m, options.launch)
        margin = max(noise(base, options.min_noise), noise(m, options.min_noise))
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


def choose(measurements: list[Measurement], options: TuneOptions) -> Measurement:
    """The fastest contender, else the baseline."""
    found = contenders(measurements, options)
    return found[0] if found else _timed_baseline(measurements)


def _confirmed(
    trial: _Trial, base: Measurement, order: list[Measurement], options: TuneOptions
) -> tuple[Measurement, float, float]:
    """The first of ``order`` (up to ``confirm_tries``) that keeps its win over the baseline in
    the confirmation, else the baseline; where the kept one's confirmed time is beaten by a later
    duellist's trial time (``runner_up``), that one duels too and the faster of the two, each
    relative to its own duel's baseline, wins. Else, on the GPU, a later duellist whose trial
    tied the kept one's (``tied_rival``) duels the kept one, as a challenger duels the baseline,
    and serves if it wins. Returns (chosen, baseline's time, chosen's time)."""
    base_us = trial_base_us = effective_us(base, options.launch)
    for i, challenger in enumerate(order[: max(1, options.confirm_tries)]):
        if options.confirm_rounds <= 0:
            return challenger, base_us, effective_us(challenger, options.launch)
        chosen, base_us, chosen_us = trial.confirm(base, challenger, options)
        if chosen is base:
            continue
        # a sustained duel reads both runners slower than their trials: compared in its terms
        scale = (
            trial_base_us / base_us if trial.stretched[base.candidate, chosen.candidate] else 1.0
        )
        rival = runner_up(order[i + 1 :], chosen_us * scale, options)
        if rival is not None:
            other, other_base_us, other_us = trial.confirm(base, rival, options)
            # each against its own duel's baseline: the two duels ran at different moments
            if other is not base and other_us / other_base_us < chosen_us / base_us:
                challenger.error += f"; then {rival.candidate} confirmed faster ({other_us:.2f} us)"
                return other, other_base_us, other_us
            if other is not base:
                rival.error += f"; {challenger.candidate} confirmed faster: it serves"
            return chosen, base_us, chosen_us
        tied = tied_rival(order[i + 1 :], chosen, options) if trial.device == "cuda" else None
        if tied is not None:
            other, kept_us, other_us = trial.confirm(chosen, tied, options, chosen.candidate)
            if other is tied:  # its time relative to the baseline, through the kept one's
                challenger.error += f"; then {tied.candidate}, whose trial tied it, won their duel"
                return tied, base_us, chosen_us * other_us / kept_us
        return chosen, base_us, chosen_us
    return base, base_us, base_us


class _Trial:
    """Runs one candidate through build -> numerics -> timing, recording what happened."""

    def __init__(
        self,
        key: Key,
        device: str,
        input_sets: list[tuple[torch.Tensor, ...]],
        ref: torch.Tensor,
        tol: float,
        record: Callable[..., Measurement],
    ) -> None:
        self.key, self.device, self.sets, self.ref, self.tol, self.record = (
            key,
            device,
            input_sets,
            ref,
            tol,
            record,
        )
        self.runners: dict[str, Runner] = {}  # candidates that passed the numerics check
        self.stretched: dict[tuple[str, str], bool] = {}  # (baseline, challenger): sustained

    @classmethod
    def for_key(
        cls, key: Key, device: str, seed: int, record: Callable[..., Measurement]
    ) -> _Trial:
        """A trial on ``key``'s rotation of input sets (``seed``) and its reference."""
        gen = torch.Generator(device=device).manual_seed(seed)
        n_sets = timing.rotation_sets(samples.bytes_per_set(key), device)
        sets = [samples.make_inputs(key, device, gen) for _ in range(n_sets)]
        return cls(
            key, device, sets, samples.reference(key, sets[0]), samples.tolerance(key), record
        )

    def run(
        self,
        source: Source,
        params: Params,
        cutoff_us: float | None,
        options: TuneOptions,
        late_cutoff_us: float | None = None,
        base: Measurement | None = None,
    ) -> Measurement:
        """The candidate's measurement; ``base``, the baseline's, for a challenger (its host
        reading is taken again where the launch-cost verdict hinges on it: ``host_decides``)."""
        try:
            runner = source.build(self.key, params)
        except Exception as e:
            return self.record(source, params, "failed", error=f"build: {_short(e)}")
        try:
            err = self.check(runner)
        except Exception as e:
            return self.record(source, params, "failed", error=f"run: {_short(e)}")
        if not err <= self.tol:  # NaN compares False: never passes
            return self.record(
                source,
                params,
                "rejected",
                max_rel_err=err,
                error=f"relative error {err:.3g} > tolerance {self.tol:.3g}",
            )
        self.runners[candidate_name(source.name, params)] = runner
        sets = self.sets
        graph = options.launch == "graph" and self.device == "cuda"
        measure = functools.partial(
            timing.measure_sets,
            runner,
            sets,
            device=self.device,
            # in graph mode only its host time is used, from a shorter run
            budget_s=min(options.budget_s, 0.01) if graph else options.budget_s,
            cutoff_us=None if graph else cutoff_us,  # a cutoff from GPU times: not eager's
            late_cutoff_us=None if graph else late_cutoff_us,
        )
        try:
            t = measure()
            if not graph:  # graph mode ranks by the graph's time: the eager one is host time only
                t = steadier(t, measure, _cut_at(t, cutoff_us, late_cutoff_us))
        except Exception as e:
            return self.record(
                source, params, "failed", max_rel_err=err, error=f"timing: {_short(e)}"
            )
        if graph:
            # ranked by GPU time: an eager time of a small kernel is its host's launch time, so
            # the candidate fastest on the GPU might never reach the duel
            try:
                calls = timing.graph_calls(t.median_us, len(sets))
                g = timing.graph_time(timing.on_sets(runner, sets), calls)
            except Exception as e:
                torch.cuda.synchronize()
                error = f"cannot be captured in a CUDA graph: {_short(e)}"
                return self.record(source, params, "failed", max_rel_err=err, error=error)
            t = timing.Timing(g.median_us, g.p10_us, g.p90_us, g.reps, t.host_us)
        note = _cut_reason(t, cutoff_us, late_cutoff_us) if t.cut else ""
        if base is not None and not t.cut and host_decides(t.median_us, t.host_us, base, options):
            again = timing.host_reading(timing.on_sets(runner, sets), self.device)
            note = (
                f"host time read again: {t.host_us:.2f} then {again:.2f} us a call, the lower kept"
            )
            t = dataclasses.replace(t, host_us=min(t.host_us, again))
        return self.record(
            source, params, "cut" if t.cut else "ok", max_rel_err=err,
            median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, reps=t.reps, host_us=t.host_us,
            error=note,
        )  # fmt: skip

    def confirm(
        self,
        base: Measurement,
        challenger: Measurement,
        options: TuneOptions,
        base_name: str = "baseline",
    ) -> tuple[Measurement, float, float]:
        """Re-time baseline and challenger alternately on the same inputs, in
        ``timing.round_order``. The challenger keeps the win only if it still beats the baseline
        by the margin: one lucky measurement (clock drift, a quiet moment) must not make a winner
        that is slower in use. Eagerly the margin is at least the rounds' own scatter
        (``round_scatter``; rounds scattered wider than the noise are taken again once): a win
        narrower than how far either runner's rounds fell apart is a tie, and a tie keeps the
        baseline, unless the GPU times show the win where the host's launch hides the kernels
        (``eager_win``).

        On the GPU both are also timed in a CUDA graph (GPU time alone, ``timing.graph_time``):
        with ``launch="graph"`` that is the time compared; eagerly the challenger must in addition
        be no slower on the GPU than the baseline beyond the margin. An eager win that is only a
        cheaper launch (a kernel quicker to launch than cuBLAS but slower on the GPU) would make
        every graph-replayed step slower. Eagerly a challenger
        faster on the GPU beyond the graph's noise also wins when it is no slower eagerly, where
        the host's launch hides the kernels and its own launch is no longer (``gpu_only_win``). A
        challenger that cannot be captured loses: it could not serve a caller that runs its step
        as a graph. Eagerly, rounds far over either runner's trial time (``far_off_trials``), or
        whose win between two kernel-bound calls is wider than their graph times allow
        (``gap_unexplained``), are taken again once; disturbed twice, the baseline stays, at its
        trial time, except where only the challenger's rounds are far over its trial: they are
        judged as read, since a slower reading of the challenger cannot make its win. So, with
        ``launch="graph"``, are graph readings far off the runners' trial graph times the way that
        favours the challenger (``graph_reading_off``). A sustained win of a challenger that tied
        the baseline in its trial (``tied_in_trial``) stands only where a second take of the
        rounds shows it too.

        ``base_name``: what the verdict calls ``base`` (a kept challenger that a tied one duels).
        Returns the chosen measurement and the baseline's and chosen one's times (us).
        """
        runners = {
            m.candidate: self.runners.get(m.candidate)
            or registry.get(m.source).build(self.key, m.params)
            for m in (base, challenger)
        }
        trial_us = (effective_us(base, options.launch), effective_us(challenger, options.launch))
        margin = max(noise(base, options.min_noise), noise(challenger, options.min_noise))
        tied = tied_in_trial(trial_us, margin)
        sustained = self.sustained(runners, base, challenger, options)
        readings = self.rounds(runners, base, challenger, options, sustained)

        def graph_times() -> tuple[GraphPair, tuple[float, float] | None]:
            """Both runners' graph timings, and their medians where both were captured."""
            gpu = self.gpu_times(runners, base, challenger)
            return gpu, (gpu[0].median_us, gpu[1].median_us) if gpu and gpu[0] and gpu[1] else None

        # the graph after the rounds, so that both graphs run on a GPU the rounds warmed alike
        # (timed straight after the trials, the baseline's would be timed first, on whatever
        # state the trials left), and before the rounds are judged: they are judged against it
        gpu, gpu_us = graph_times()
        graph = options.launch == "graph"
        if graph and gpu_us and graph_reading_off(trial_us, gpu_us):  # taken again once
            gpu, gpu_us = graph_times()

        def off(readings: Rounds, either_side: bool) -> str:
            """Why eager rounds do not say what the kernels cost, or "" where they do; a
            challenger far over its trial counts only where ``either_side`` (the first rounds,
            taken again: a disturbance should not cost it the duel)."""
            eager_us = (readings.base_us, readings.chal_us)
            host_us = (readings.base_host, readings.chal_host)
            base_off, chal_off = far_off_trials(trial_us, eager_us)
            if base_off or (either_side and chal_off):
                return "far off a trial's time"
            if gpu_us and gap_unexplained(eager_us, host_us, gpu_us, margin):
                return "a win the GPU times do not show"
            return ""

        eager = options.launch == "eager"
        why = off(readings, either_side=True) if eager else ""
        # taken again once, as are rounds scattered wider than the noise; a duel disturbed
        # twice keeps the baseline
        if why or (eager and readings.scatter > margin):
            readings = self.rounds(runners, base, challenger, options, sustained)
            why = off(readings, either_side=False)
        if graph and gpu_us and graph_reading_off(trial_us, gpu_us):
            why = "graph times far off the trials' graph times"
        disturbed = bool(why)
        base_us, chal_us, base_host, chal_host, scatter = readings
        gpu_ok, gpu_win = True, False
        note = f"; disturbed twice: {why}" if disturbed else ""
        if eager and not disturbed and far_off_trials(trial_us, (base_us, chal_us))[1]:
            note += "; the challenger far over its trial (judged as read: that cannot make a win)"
        if sustained:
            note += f"; rounds of {options.sustained_s:g} s stretches (GPU-bound or heavy calls)"
        if gpu is not None:
            base_gpu, chal_gpu = gpu
            if chal_gpu is None:
                gpu_ok = False
                note += "; cannot be captured in a CUDA graph"
            elif base_gpu is not None:
                # graph replays are steady: their own spread, not the eager one, is the noise,
                # in us relative to the baseline's time (a challenger of ~0 us on the GPU would
                # otherwise make its jitter of a few ns an unbounded relative spread)
                jitter_us = (chal_gpu.p90_us - chal_gpu.p10_us) / 2
                chal_jitter = jitter_us / base_gpu.median_us if base_gpu.median_us else 0.0
                gpu_margin = max(options.min_noise, base_gpu.spread / 2, chal_jitter)
                note += (
                    f"; GPU {chal_gpu.median_us:.2f} vs {base_gpu.median_us:.2f} us in a CUDA "
                    f"graph (margin {gpu_margin:.1%})"
                )
                if options.launch == "graph":
                    base_us, chal_us = base_gpu.median_us, chal_gpu.median_us
                    margin = gpu_margin
                else:
                    gpu_ok = chal_gpu.median_us <= base_gpu.median_us * (1 + gpu_margin)
                    gpu_win = gpu_only_win((base_host, chal_host), gpu_us, gpu_margin)
        if eager:
            won = eager_win(readings, margin, gpu_win)
            if scatter > margin:
                margin = scatter
                note += f"; rounds {scatter:.1%} apart"
        else:
            won = chal_us < base_us * (1 - margin)
        launch_ok = launch_cost_repaid(chal_us, chal_host, base_us, base_host, options)
        kept = won and launch_ok and gpu_ok and not disturbed
        if kept and eager and sustained and tied:
            again = self.rounds(runners, base, challenger, options, sustained)
            kept = eager_win(again, margin, gpu_win)
            note += (
                f"; a tie in its trial, so taken again: {again.chal_us:.2f} vs "
                f"{again.base_us:.2f} us, {'ahead again' if kept else 'not ahead'}"
            )
        verdict = (
            f"confirmation: {chal_us:.2f} us vs {base_name} {base_us:.2f} us, host "
            f"{chal_host:.2f} vs {base_host:.2f} us per call{note}, "
            f"{'kept' if kept else 'lost'} (margin {margin:.1%})"
        )
        # after the trial's own note (a host time read again), which says why it is here
        challenger.error = f"{challenger.error}; {verdict}" if challenger.error else verdict
        if disturbed:  # neither reading says what the baseline costs; its trial does
            base_us = trial_us[0]
        return (challenger, base_us, chal_us) if kept else (base, base_us, base_us)

    def rounds(
        self,
        runners: dict[str, Runner],
        base: Measurement,
        challenger: Measurement,
        options: TuneOptions,
        sustained: bool,
    ) -> Rounds:
        """The duel's rounds, each runner in ``timing.round_order``: the median over the rounds
        of each one's time (eager: its host time where that is longer) and host time per call,
        and how far apart each one's rounds fell; ``sustained``: over stretches of calls back to
        back."""
        times: dict[str, list[float]] = {base.candidate: [], challenger.candidate: []}
        hosts: dict[str, list[float]] = {base.candidate: [], challenger.candidate: []}
        eager = options.launch == "eager"

        def timed(m: Measurement) -> timing.Timing:
            return timing.eager_time(
                runners[m.candidate], self.sets, device=self.device,
                sustained_s=options.sustained_s if sustained else 0.0, budget_s=options.budget_s,
                max_reps=CONFIRM_REPS,
            )  # fmt: skip

        if sustained:  # the GPU brought to its power limit before the first timed stretch
            timed(base)
        for round_ in range(options.confirm_rounds):
            for m in timing.round_order((base, challenger), round_):
                t = timed(m)
                times[m.candidate].append(max(t.median_us, t.host_us) if eager else t.median_us)
                hosts[m.candidate].append(t.host_us)
        return Rounds(
            statistics.median(times[base.candidate]),
            statistics.median(times[challenger.candidate]),
            statistics.median(hosts[base.candidate]),
            statistics.median(hosts[challenger.candidate]),
            max(round_scatter(times[base.candidate]), round_scatter(times[challenger.candidate])),
        )

    def sustained(
        self,
        runners: dict[str, Runner],
        base: Measurement,
        challenger: Measurement,
        options: TuneOptions,
    ) -> bool:
        """Whether their duel times stretches of calls back to back (``sustained_duel``), decided
        once a pair: where the trial times allow heavy calls (``may_hold_power_limit``), their
        graph times say whether they are (``at_power_limit``)."""
        pair = (base.candidate, challenger.candidate)
        if pair not in self.stretched:
            heavy = False
            if self.device == "cuda" and options.sustained_s > 0:

                def read_gpu() -> tuple[float, float] | None:
                    gpu = self.gpu_times(runners, base, challenger)
                    if gpu and gpu[0] and gpu[1]:
                        return gpu[0].median_us, gpu[1].median_us
                    return None

                eager_us = tuple(effective_us(m, options.launch) for m in (base, challenger))
                heavy = power_limited(self.key.flops, eager_us, read_gpu, heavy_rate(self.device))
            trial_us = (base.median_us, challenger.median_us)
            self.stretched[pair] = sustained_duel(self.device, trial_us, options, heavy)
        return self.stretched[pair]

    def gpu_times(
        self, runners: dict[str, Runner], base: Measurement, challenger: Measurement
    ) -> GraphPair:
        """Graph-replay GPU time per call of baseline and challenger (None: capture failed);
        None altogether off the GPU."""
        if self.device != "cuda":
            return None
        out: list[timing.Timing | None] = []
        sets = self.sets
        # both timed alike: as many calls per graph as the quicker one needs
        call_us = min(m.median_us or math.inf for m in (base, challenger))
        calls = timing.graph_calls(call_us, len(sets))
        for m in (base, challenger):
            runner = runners[m.candidate]
            try:
                out.append(timing.graph_time(timing.on_sets(runner, sets), calls))
            except Exception as e:  # e.g. a library launching on a stream of its own
                log.info("%s: no CUDA-graph time: %s", m.candidate, _short(e)[:300])
                torch.cuda.synchronize()
                out.append(None)
        return out[0], out[1]

    def check(self, runner: Runner) -> float:
        """Worst relative error of two calls on the first input set, each into a NaN-poisoned
        output buffer: the second call is the one checked for runners whose first call compiles
        and later calls take a faster launch path, which is the path that gets timed and served.
        """
        inputs = self.sets[0]
        errors = []
        for _ in range(2):
            out = samples.output_like(self.key, inputs)
            res = runner(*inputs, out=out)
            if res is not out:
                out.copy_(res)
            if self.device == "cuda":
                torch.cuda.synchronize()
            errors.append(samples.relative_error(out, self.ref))
        return float("nan") if any(e != e for e in errors) else max(errors)


def _baseline(measurements: Iterable[Measurement]) -> Measurement | None:
    """The baseline's timed measurement, once there is one."""
    return next((m for m in measurements if m.is_baseline and m.status == "ok"), None)


def _timed_baseline(measurements: Iterable[Measurement]) -> Measurement:
    """The baseline's timed measurement, which ranking challengers needs."""
    if (base := _baseline(measurements)) is None:
        raise ValueError("no timed baseline among the measurements: challengers rank against it")
    return base


def _late(t: timing.Timing, late_cutoff_us: float | None) -> bool:
    """Stopped by the late cut-off (after ``LATE_REPS`` calls), not by the probe's."""
    return t.reps >= timing.LATE_REPS and late_cutoff_us is not None


def _cut_at(
    t: timing.Timing, cutoff_us: float | None, late_cutoff_us: float | None
) -> float | None:
    """The cut-off that stopped ``t`` (None where it was not cut)."""
    if not t.cut:
        return None
    return late_cutoff_us if _late(t, late_cutoff_us) else cutoff_us


def _cut_reason(t: timing.Timing, cutoff_us: float | None, late_cutoff_us: float | None) -> str:
    if not _late(t, late_cutoff_us):
        return f"probe {t.median_us:.1f} us > cutoff {cutoff_us:.1f} us"
    return f"{t.reps} calls {t.median_us:.1f} us > late cutoff {late_cutoff_us:.1f} us"


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 2000 else text[:2000] + "..."


def _wanted(source: Source, key: Key, options: TuneOptions) -> bool:
    """A source asked for, or the baseline that takes ``key`` (never left out)."""
    if options.sources is None or source.name in options.sources:
        return True
    return source.baseline_params is not None and source.unsupported(key) is None


def cut_off(best_us: float | None, device: str, options: TuneOptions) -> float | None:
    """The probe time past which a challenger is cut: a multiple of the best so far, tighter
    where that best is a steady GPU-bound call, whose probes vary by a few percent at most."""
    if best_us is None:
        return None
    steady = device == "cuda" and best_us >= timing.STEADY_US
    return best_us * (options.steady_cut if steady else options.cut_factor)


def candidate_shortlists(
    key: Key,
    device: str,
    options: TuneOptions,
    record: Callable[..., Measurement] | None = None,
    done: dict[str, Measurement] | None = None,
    measurements: list[Measurement] | None = None,
) -> list[tuple[Source, list[Params]]]:
    """Each wanted source that has candidates for ``key`` here, with its shortlist.

    With ``record`` (``tune``), a source that is unsupported or cannot list candidates is
    recorded once, by name, and such a row in ``done`` is taken into ``measurements`` as it is;
    without it (the compile pool) such sources are left out silently."""
    done = done or {}
    found: list[tuple[Source, list[Params]]] = []
    for source in registry.sources(key.op):
        if not _wanted(source, key, options):
            continue
        earlier = done.get(candidate_name(source.name, {}))
        if earlier is not None and (
            earlier.status == "unsupported" or earlier.error.startswith("candidates: ")
        ):
            if measurements is not None:
                measurements.append(earlier)
            continue
        reason = source.unavailable(device) or source.unsupported(key)
        if reason:
            if record:
                record(source, {}, "unsupported", error=reason)
            continue
        try:
            shortlist = source.candidates(key, device)[: options.max_candidates]
        except Exception as e:
            if record:
                record(source, {}, "failed", error=f"candidates: {_short(e)}")
            else:
                log.info("%s: no candidates for %s: %s", source.name, key, _short(e)[:300])
            continue
        found.append((source, shortlist))
    return found


def _prune(
    key: Key,
    device: str,
    plan: list[tuple[Source, list[Params]]],
    base: Measurement | None,
    options: TuneOptions,
    record: Callable[..., Measurement],
    done: dict[str, Measurement],
    measurements: list[Measurement],
) -> list[tuple[Source, list[Params]]]:
    """The plan less what ``pruning`` says cannot win, each of those recorded as ``cut`` with
    its reason (so a resumed worker does not compile it either)."""
    if not options.prune or not pruning.prunable(key):
        return plan
    baseline_us = (
        None if base is None or base.status != "ok" else effective_us(base, options.launch)
    )
    assert isinstance(key, GemmKey)
    on_gpu = baseline_us is not None and device == "cuda"  # host timings bound nothing
    roof = pruning.measured_roof(device, key.dtype, key.compute) if on_gpu else None
    out = []
    for source, shortlist in plan:
        kept, pruned = pruning.prune_challengers(
            key, source, shortlist, roof=roof, baseline_us=baseline_us, margin=options.min_noise
        )
        for p in pruned:
            earlier = done.get(candidate_name(source.name, p.params))
            if earlier is not None:
                measurements.append(earlier)
            else:
                record(source, p.params, "cut", error=pruning.describe(p))
        out.append((source, [p for p in shortlist if source.is_baseline(p) or p in kept]))
    return out


def _precompile(
    key: Key, plan: list[tuple[Source, list[Params]]], done: dict[str, Measurement]
) -> None:
    """Compile what is left to time, each source in parallel as it can, before any timing."""
    for source, shortlist in plan:
        todo = [p for p in shortlist if candidate_name(source.name, p) not in done]
        if todo:
            try:
                source.precompile(key, todo)
            except Exception as e:  # each candidate's build says what failed, on its own row
                log.warning("%s: precompile failed on %s: %s", source.name, key, _short(e)[:300])


def earlier_times(measurements: Iterable[Measurement], launch: str) -> dict[str, float]:
    """Each candidate's best time in ``measurements`` (stored by earlier runs) for ``launch``,
    as ``tune`` takes them for ``earlier``; a challenger cut after its probe has the probe's."""
    out: dict[str, float] = {}
    for m in measurements:
        if m.status in ("ok", "cut") and m.launch == launch and m.median_us is not None:
            us = effective_us(m, launch)
            out[m.candidate] = min(us, out.get(m.candidate, math.inf))
    return out


def fastest_first(
    plan: list[tuple[Source, list[Params]]], earlier: Mapping[str, float]
) -> list[tuple[Source, Params]]:
    """The plan's challengers, those with an earlier time fastest first, then the others in
    the plan's order."""
    challengers = [(s, p) for s, shortlist in plan for p in shortlist if not s.is_baseline(p)]
    return sorted(
        challengers, key=lambda sp: earlier.get(candidate_name(sp[0].name, sp[1]), math.inf)
    )


CONFIRM_REPS = 100  # calls per duel round at most: alternating rounds, not long ones, catch drift

PHASES = ("setup", "baseline", "compile", "challengers", "confirm")
"""Where a problem's tuning time goes: inputs, reference and shortlists; timing the baseline
(and pruning); compiling or waiting for the compile pool (with ``Source.prepare``); timing the
challengers; the duels that confirm a winner."""


def _prepare(key: Key, plan: list[tuple[Source, list[Params]]]) -> None:
    """Each source's per-process set-up (``Source.prepare``) before the wait for the compile
    pool, so that it overlaps the compiling; a failure is the first build's to raise."""
    for source, shortlist in plan:
        if not shortlist:
            continue
        try:
            source.prepare(key, shortlist)
        except Exception as e:
            log.debug("%s: prepare failed on %s: %r", source.name, key, e)


def tune(
    key: Key,
    *,
    options: TuneOptions | None = None,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
    prior: list[Measurement] | None = None,
    on_start: Callable[[Source, Params], None] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    compiled: Callable[[], None] | None = None,
    earlier: Mapping[str, float] | None = None,
) -> TuneOutcome:
    """Tune one problem on the current device and return its winner and all measurements.

    Nothing is stored here: the caller (CLI, dispatcher, worker) saves the outcome. This always
    runs in this process: ``tuner.tuning.tune.tune`` is the entry point that honours
    ``options.isolate``. The isolation worker uses the hooks: ``prior`` measurements (of an
    earlier, crashed worker) are taken as they are instead of running those candidates again;
    ``on_start`` is called before each candidate runs, ``on_result`` with each new measurement.

    The baseline is timed first, so that ``pruning`` can drop what cannot beat it before
    anything is compiled. ``compiled``, when given, replaces this process's precompile: it
    returns once a run-wide compile pool (``tuner.tuning.compile_pool``) has compiled this
    problem.

    ``earlier``: times (us, as ``effective_us``) that candidates took on this key in an earlier
    run. Those challengers are timed fastest first, so that the cut-off is tight from the first
    one and the rest are cut after their probe; nothing is left out for them.
    """
    options = options or TuneOptions()
    if options.isolate:
        raise ValueError(
            "engine.tune runs in this process; tune with isolate=True through tuner.tuning.tune"
        )
    device = device or current_device()
    fp = fingerprint(device)
    run_id = uuid.uuid4().hex
    started = time.perf_counter()
    measurements: list[Measurement] = []

    def record(source: Source, params: Params, status: str, **fields) -> Measurement:
        m = Measurement(
            device_class=fp.device_class, key=str(key), source=source.name, params=params,
            status=status, is_baseline=source.is_baseline(params), versions=fp.version_tag,
            run_id=run_id, launch=options.launch, **fields,
        )  # fmt: skip
        measurements.append(m)
        if progress:
            progress(f"{m.candidate}: {status}")
        if on_result:
            on_result(m)
        return m

    done = {m.candidate: m for m in prior or ()}

    trial = _Trial.for_key(key, device, options.seed, record)

    plan = candidate_shortlists(key, device, options, record, done, measurements)
    best_us: float | None = None

    def run(source: Source, params: Params) -> Measurement:
        nonlocal best_us
        # the baseline is never cut: every decision is relative to it
        challenger = not source.is_baseline(params)
        cutoff = cut_off(best_us, device, options) if challenger else None
        late = best_us * options.late_cut if challenger and best_us is not None else None
        m = done.get(candidate_name(source.name, params))
        if m is not None:
            measurements.append(m)
        else:
            if on_start:
                on_start(source, params)
            baseline = _baseline(measurements) if challenger else None
            m = trial.run(source, params, cutoff, options, late, baseline)
        if m.status == "ok":
            us = effective_us(m, options.launch)
            best_us = us if best_us is None else min(best_us, us)
        elif m.is_baseline:
            log.error("baseline %s failed on %s: %s", m.candidate, key, m.error)
        return m

    marks = [started, time.perf_counter()]
    base = next((run(s, p) for s, shortlist in plan for p in shortlist if s.is_baseline(p)), None)
    plan = _prune(key, device, plan, base, options, record, done, measurements)
    marks.append(time.perf_counter())
    _prepare(key, plan)
    t0 = time.perf_counter()
    if compiled is not None:
        compiled()
    else:
        _precompile(key, plan, done)
    compile_s = time.perf_counter() - t0
    marks.append(time.perf_counter())
    for source, params in fastest_first(plan, earlier or {}):
        run(source, params)
    marks.append(time.perf_counter())

    base = _baseline(measurements)
    if base is None:
        errors = "; ".join(f"{m.candidate}: {m.error}" for m in measurements if m.is_baseline)
        raise RuntimeError(f"the baseline failed on {key}: {errors}")
    chosen, base_us, chosen_us = _confirmed(
        trial, base, duels(measurements, options, device), options
    )
    winner = Winner(
        device_class=fp.device_class, key=str(key), source=chosen.source, params=chosen.params,
        median_us=chosen_us, baseline_us=base_us, versions=fp.version_tag, run_id=run_id,
        launch=options.launch,
    )  # fmt: skip
    marks.append(time.perf_counter())
    phases = {name: b - a for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
    return TuneOutcome(key, winner, measurements, marks[-1] - started, compile_s, phases)

"""Running candidates: one candidate's trial (build, numerics check, timing) and the duels that
confirm a win against the baseline (alternating rounds, and CUDA graphs on the GPU). The timing
work behind ``tuner.tuning.verdict``'s rules, apart from the tune loop (``tuner.tuning.engine``)
that decides what runs and in what order."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from tuner.candidates import registry
from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import Key
from tuner.measure import samples, timing
from tuner.measure.records import Measurement, Winner, candidate_name
from tuner.tuning.options import TuneOptions
from tuner.tuning.verdict import (
    Rounds,
    duels,
    eager_win,
    effective_us,
    far_off_trials,
    gap_unexplained,
    gpu_only_win,
    graph_reading_off,
    heavy_rate,
    host_decides,
    launch_cost_repaid,
    pair_noise,
    power_limited,
    retake_scattered,
    round_scatter,
    runner_up,
    steadier,
    sustained_duel,
    tied_in_trial,
    tied_rival,
    under_kept,
    wider_noise,
)

log = logging.getLogger(__name__)


CONFIRM_REPS = 100  # calls per duel round at most (a sustained round runs its stretch instead):
# alternating rounds, not long ones, catch drift
# challengers that lose a sustained duel (stretches of calls back to back: long or heavy calls,
# at the power limit) before the baseline stays: there two kernels of one library within a few %
# of each other read alike, and each such duel takes seconds
SUSTAINED_TRIES = 2

GraphPair = tuple[timing.Timing | None, timing.Timing | None] | None  # baseline's, challenger's


def confirmed(
    trial: Trial,
    base: Measurement,
    order: list[Measurement],
    options: TuneOptions,
    lost: Mapping[str, bool] | None = None,
) -> tuple[Measurement, float, float]:
    """The first of ``order`` (up to ``confirm_tries``) that keeps its win over the baseline in
    the confirmation, else the baseline (also once ``SUSTAINED_TRIES`` have lost sustained
    duels); where the kept one's confirmed time is beaten by a later duellist's trial time
    (``runner_up``), that one duels too and the faster of the two, each relative to its own
    duel's baseline, wins. Else, on the GPU and eagerly, a later duellist whose trial
    tied the kept one's (``tied_rival``) duels the kept one, as a challenger duels the baseline,
    and serves if it wins. ``lost``: challengers that already lost their duel against this
    baseline (a first pass's: ``reconfirmed``), each with whether it was sustained: not duelled
    again, nor taken as a rival, but counted where they come in ``order``, as one pass over
    every candidate would have. Returns (chosen, baseline's time, chosen's time)."""
    lost = lost or {}
    base_us = trial_base_us = effective_us(base, options.launch)
    lost_sustained = 0
    for i, challenger in enumerate(order[: max(1, options.confirm_tries)]):
        if options.confirm_rounds <= 0:
            return challenger, base_us, effective_us(challenger, options.launch)
        if lost_sustained >= SUSTAINED_TRIES:
            log.info(
                "%s: %d sustained duels lost; %d more challengers not confirmed",
                trial.key, lost_sustained, len(order[i : options.confirm_tries]),
            )  # fmt: skip
            break
        if challenger.candidate in lost:
            lost_sustained += lost[challenger.candidate]
            continue
        chosen, base_us, chosen_us = trial.confirm(base, challenger, options)
        if chosen is base:
            lost_sustained += trial.stretched[base.candidate, challenger.candidate]
            continue
        rest = [m for m in order[i + 1 :] if m.candidate not in lost]
        # a sustained duel reads both runners slower than their trials: compared in its terms
        scale = (
            trial_base_us / base_us if trial.stretched[base.candidate, chosen.candidate] else 1.0
        )
        rival = runner_up(rest, chosen_us * scale, options)
        if rival is not None:
            other, other_base_us, other_us = trial.confirm(base, rival, options)
            # each against its own duel's baseline: the two duels ran at different moments
            if other is not base and other_us / other_base_us < chosen_us / base_us:
                challenger.error += f"; then {rival.candidate} confirmed faster ({other_us:.2f} us)"
                return other, other_base_us, other_us
            if other is not base:
                rival.error += f"; {challenger.candidate} confirmed faster: it serves"
            return chosen, base_us, chosen_us
        tied = tied_rival(rest, chosen, options) if trial.device == "cuda" else None
        if tied is not None:
            return _rival_duel(trial, (chosen, base_us, chosen_us), tied, options, "tied it")
        return chosen, base_us, chosen_us
    return base, base_us, base_us


def reconfirmed(
    trial: Trial,
    base: Measurement,
    settled: Winner,
    measurements: list[Measurement],
    new: list[Measurement],
    options: TuneOptions,
) -> tuple[Measurement, float, float]:
    """The verdict of a problem's second pass: ``settled`` (its first pass's verdict, on every
    candidate but those of sources that share kernels, which compiled meanwhile) stands unless
    one of ``new`` (the second pass's duellists: ``engine.second_pass_duels``) wins its duel.
    ``trial.stretched`` holds the first pass's duels (``engine.tune`` hands them on); they are
    not run again.

    Where the first pass kept the baseline, one pass's duels over ``measurements`` are replayed
    (``confirmed``): the first pass's, all lost, count where they come in the order (its
    sustained ones against ``SUSTAINED_TRIES``), the new ones duel the baseline. Where it kept a
    challenger, the first new one whose trial ties or beats that one's (``under_kept``), else
    one whose trial beats its confirmed time (``runner_up``, as one pass would have duelled
    next), duels it, as a tied rival does. Without duels (``confirm_rounds`` 0), one pass's
    verdict. Returns as ``confirmed``."""
    kept = next((m for m in measurements if m.candidate == settled.candidate), None)
    if options.confirm_rounds <= 0 or kept is None:  # one pass's verdict, whatever it takes
        return confirmed(trial, base, duels(measurements, options, trial.device), options)
    if kept.is_baseline:
        if not new:
            return base, settled.baseline_us, settled.median_us
        lost = {c: s for (b, c), s in trial.stretched.items() if b == base.candidate}
        order = duels(measurements, options, trial.device)
        chosen, base_us, chosen_us = confirmed(trial, base, order, options, lost)
        if chosen is base:  # the first pass's verdict stands
            return base, settled.baseline_us, settled.median_us
        return chosen, base_us, chosen_us
    verdict = (kept, settled.baseline_us, settled.median_us)
    # the kept one's confirmed time in its trial's terms, as ``confirmed`` compares it
    sustained = trial.stretched.get((base.candidate, kept.candidate), False)
    scale = effective_us(base, options.launch) / settled.baseline_us if sustained else 1.0
    rival = under_kept(new, kept, options)
    why = "tied or beat it"
    if rival is None:
        rival, why = runner_up(new, settled.median_us * scale, options), "beat its confirmed time"
    if rival is None:
        return verdict
    return _rival_duel(trial, verdict, rival, options, why)


def _rival_duel(
    trial: Trial,
    verdict: tuple[Measurement, float, float],
    rival: Measurement,
    options: TuneOptions,
    why: str,
) -> tuple[Measurement, float, float]:
    """``rival`` duels the kept challenger of ``verdict`` (chosen, baseline's time, its time),
    as a challenger duels the baseline; it serves if it wins, its time relative to the baseline
    through the kept one's. ``why``: what its trial did, for the kept one's note."""
    chosen, base_us, chosen_us = verdict
    other, kept_us, other_us = trial.confirm(chosen, rival, options, chosen.candidate)
    if other is not rival:
        return verdict
    chosen.error += f"; then {rival.candidate}, whose trial {why}, won their duel"
    return rival, base_us, chosen_us * other_us / kept_us


class Trial:
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
    def for_key(cls, key: Key, device: str, seed: int, record: Callable[..., Measurement]) -> Trial:
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
            return self.record(source, params, "failed", error=f"build: {short_error(e)}")
        try:
            err = self.check(runner)
        except Exception as e:
            return self.record(source, params, "failed", error=f"run: {short_error(e)}")
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
                source, params, "failed", max_rel_err=err, error=f"timing: {short_error(e)}"
            )
        if graph:
            # ranked by GPU time: an eager time of a small kernel is its host's launch time, so
            # the candidate fastest on the GPU might never reach the duel
            try:
                calls = timing.graph_calls(t.median_us, len(sets))
                g = timing.graph_time(timing.on_sets(runner, sets), calls)
            except Exception as e:
                torch.cuda.synchronize()
                error = f"cannot be captured in a CUDA graph: {short_error(e)}"
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
            median_us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, reps=t.reps,
            host_us=None if t.cut else t.host_us,  # a cut candidate's host time is never read
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
        by the margin (``pair_noise``): one lucky measurement (clock drift, a quiet moment) must
        not make a winner that is slower in use. Eagerly the margin is at least the rounds' own
        scatter (``round_scatter``; rounds scattered wider than the noise may be taken again
        once: ``retake_scattered``): a win narrower than how far either runner's rounds fell
        apart is a tie, and a tie keeps the baseline, unless the GPU times show the win where the
        host's launch hides the kernels (``eager_win``).

        On the GPU both are also timed in a CUDA graph (GPU time alone), side by side
        (``timing.graph_duel``; one at a time only where one of them cannot be captured):
        with ``launch="graph"`` that is the time compared; eagerly the challenger must in addition
        be no slower on the GPU than the baseline beyond the margin. An eager win that is only a
        cheaper launch (a kernel quicker to launch than cuBLAS but slower on the GPU) would make
        every graph-replayed step slower. Eagerly a challenger faster on the GPU beyond the
        graph's noise also wins when it is no slower eagerly, where the host's launch hides the
        kernels and its own launch is no longer (within ``HOST_TIE``: ``gpu_only_win``). A
        challenger that cannot be captured loses: it could not serve a caller that runs its step
        as a graph. Eagerly, rounds far over either runner's trial time (``far_off_trials``), or
        whose win between two kernel-bound calls is wider than their graph times allow
        (``gap_unexplained``), are taken again once; disturbed twice, the baseline stays, at its
        trial time, except where only the challenger's rounds are far over its trial: they are
        judged as read, since a slower reading of the challenger cannot make its win. So, with
        ``launch="graph"``, are graph readings far off the runners' trial graph times the way that
        favours the challenger (``graph_reading_off``). An eager win of a challenger that tied
        the baseline in its trial (``tied_in_trial`` by their ``wider_noise``, also where their
        bands lie apart) stands only where a second take of the rounds shows it too.

        ``base_name``: what the verdict calls ``base`` (a kept challenger that a tied one duels).
        Returns the chosen measurement and the baseline's and chosen one's times (us). A duel
        that raises (a runner rebuilt, a kernel's error) is lost by the challenger, its error
        noted and logged: one broken duel must not lose the problem's other measurements. Where
        the CUDA context broke, nothing more can run in it: the problem fails, as before.
        """
        try:
            return self._duel(base, challenger, options, base_name)
        except Exception as e:
            log.warning("%s: the duel of %s raised; it loses", self.key, challenger.candidate,
                        exc_info=True)  # fmt: skip
            if self.device == "cuda":  # a broken context raises here: the problem fails whole
                torch.cuda.synchronize()
            why = f"duel: {short_error(e)}"
            challenger.error = f"{challenger.error}; {why}" if challenger.error else why
            self.stretched.setdefault((base.candidate, challenger.candidate), False)
            base_us = effective_us(base, options.launch)
            return base, base_us, base_us

    def _duel(
        self, base: Measurement, challenger: Measurement, options: TuneOptions, base_name: str
    ) -> tuple[Measurement, float, float]:
        """``confirm``'s duel, which may raise."""
        started = time.perf_counter()
        runners = {
            m.candidate: self.runners.get(m.candidate)
            or registry.get(m.source).build(self.key, m.params)
            for m in (base, challenger)
        }
        trial_us = (effective_us(base, options.launch), effective_us(challenger, options.launch))
        margin = pair_noise(base, challenger, options.min_noise, options.launch)
        # a second take by the wider noise, also where the bands lie apart: a baseline's trial
        # slowed throughout (a compile beside all of it) lifts its p10 as well
        tied = tied_in_trial(trial_us, wider_noise(base, challenger, options.min_noise))
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
        # taken again once, as are rounds scattered wider than the noise (``retake_scattered``);
        # a duel disturbed twice keeps the baseline
        if why or (eager and retake_scattered(readings, margin, sustained)):
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
        # a loss names every test it failed: its figures alone leave the reader to redo them
        failed = [
            test
            for test, passed in (
                ("disturbed", not disturbed),
                ("no faster beyond the margin", won),
                ("its launch not repaid", launch_ok),
                ("slower on the GPU" if gpu and gpu[1] else "not capturable", gpu_ok),
            )
            if not passed
        ]
        if kept and eager and tied:
            again = self.rounds(runners, base, challenger, options, sustained)
            ahead = eager_win(again, margin, gpu_win)
            # a second take whose baseline ran beside a disturbance confirms nothing
            again_off = far_off_trials(trial_us, (again.base_us, again.chal_us))[0]
            kept = ahead and not again_off
            second = "ahead again" if ahead else "not ahead"
            note += (
                f"; a tie in its trial, so taken again: {again.chal_us:.2f} vs "
                f"{again.base_us:.2f} us, {second}"
                + ("; the baseline far off its trial" if again_off else "")
            )
            if not ahead:
                failed.append("not ahead in the second take")
            if again_off:
                failed.append("second take disturbed")
        verdict = (
            f"confirmation: {chal_us:.2f} us vs {base_name} {base_us:.2f} us, host "
            f"{chal_host:.2f} vs {base_host:.2f} us per call{note}, "
            f"{'kept' if kept else 'lost: ' + ', '.join(failed)} (margin {margin:.1%}; "
            f"the duel took {time.perf_counter() - started:.1f} s)"
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
        """Graph-replay GPU time per call of baseline and challenger (None: capture failed),
        taken side by side (``timing.graph_duel``); None altogether off the GPU."""
        if self.device != "cuda":
            return None
        out: list[timing.Timing | None] = []
        sets = self.sets
        # both timed alike: as many calls per graph as the quicker one needs
        call_us = min(m.median_us or math.inf for m in (base, challenger))
        calls = timing.graph_calls(call_us, len(sets))
        fns = [timing.on_sets(runners[m.candidate], sets) for m in (base, challenger)]
        try:
            base_gpu, chal_gpu = timing.graph_duel(fns, calls)
            return base_gpu, chal_gpu
        except Exception as e:  # which runner cannot be captured is found below, one at a time
            log.info("graph duel of %s and %s: %s; timed one at a time", base.candidate,
                     challenger.candidate, short_error(e)[:300])  # fmt: skip
            torch.cuda.synchronize()
        for m in (base, challenger):
            runner = runners[m.candidate]
            try:
                out.append(timing.graph_time(timing.on_sets(runner, sets), calls))
            except Exception as e:  # e.g. a library launching on a stream of its own
                log.info("%s: no CUDA-graph time: %s", m.candidate, short_error(e)[:300])
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


def short_error(e: BaseException) -> str:
    """An exception's type and message for a measurement's error, cut at 2000 characters."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 2000 else text[:2000] + "..."

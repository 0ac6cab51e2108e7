"""tune(key): candidates -> build -> check numerics -> time -> winner.

Every candidate ends as one Measurement: ``ok`` (timed), ``rejected`` (wrong numbers or NaN),
``failed`` (did not build or crashed), ``cut`` (far slower than the best so far after a probe, or
pruned before compiling: it cannot beat the baseline, ``tuner.tuning.pruning``) or
``unsupported`` (its source has nothing for this key). The baseline (torch's default) keeps the
win unless a challenger beats it by more than the measured noise, so a tuned result is never
slower than doing nothing.

This module is the tune loop: what to time and in what order. The rules that judge the timings
live in ``tuner.tuning.verdict``, the trials and duels that take them in ``tuner.tuning.trials``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from tuner.candidates import registry
from tuner.candidates.base import Params, Source
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key
from tuner.measure import timing
from tuner.measure.records import Measurement, Winner, candidate_name
from tuner.tuning import pruning
from tuner.tuning.options import TuneOptions
from tuner.tuning.trials import Trial, confirmed, reconfirmed, short_error
from tuner.tuning.verdict import duels, effective_us, left_out, timed_baseline

log = logging.getLogger(__name__)


@dataclass
class TuneOutcome:
    key: Key
    winner: Winner
    measurements: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    compile_s: float = 0.0  # of ``seconds``: compiling (or waiting for the run's compile pool)
    phases: dict[str, float] = field(default_factory=dict)  # of ``seconds``, by PHASES
    # each duel run: (baseline or kept challenger, challenger) -> whether sustained
    # (``Trial.stretched``): a second pass goes on from its first pass's (``trials.reconfirmed``)
    stretched: dict[tuple[str, str], bool] = field(default_factory=dict)

    @property
    def pruned(self) -> dict[str, int]:
        """Candidates left out before compiling, by rule (``tuner.tuning.pruning``)."""
        return pruning.count(self.measurements)

    @property
    def baseline(self) -> Measurement:
        return next(m for m in self.measurements if m.is_baseline and m.status == "ok")


def current_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def second_pass_duels(
    measurements: list[Measurement], options: TuneOptions, device: str
) -> list[Measurement]:
    """A second pass's duellists: those of sources that share kernels among the first
    ``confirm_tries`` that one pass over every candidate would have duelled (``duels``): a
    second pass duels none that one pass would have left out."""
    order = duels(measurements, options, device)[: max(1, options.confirm_tries)]
    return [m for m in order if registry.get(m.source).shares_kernels]


def first_pass_options(op: str, options: TuneOptions) -> TuneOptions:
    """``options`` for a problem's first pass while the run's compile pool still builds the
    kernels of sources that share them (``Source.shares_kernels``): every source asked for but
    those (the baseline is never left out: ``_wanted``)."""
    names = [
        s.name
        for s in registry.sources(op)
        if not s.shares_kernels and (options.sources is None or s.name in options.sources)
    ]
    return dataclasses.replace(options, sources=names)


def _baseline_timed(key: Key, measurements: list[Measurement]) -> Measurement:
    """The baseline's measurement; a RuntimeError naming its failure where it has no time:
    nothing could be judged against it, so no challenger is worth its compile."""
    base = timed_baseline(measurements)
    if base is None:
        errors = "; ".join(f"{m.candidate}: {m.error}" for m in measurements if m.is_baseline)
        raise RuntimeError(f"the baseline failed on {key}: {errors}")
    return base


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
    without it (the compile pool) such sources are left out, logged at info level only."""
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
                record(source, {}, "failed", error=f"candidates: {short_error(e)}")
            else:
                log.info("%s: no candidates for %s: %s", source.name, key, short_error(e)[:300])
            continue
        found.append((source, shortlist))
    return found


def _prune(
    key: Key,
    device: str,
    plan: list[tuple[Source, list[Params]]],
    base: Measurement,
    options: TuneOptions,
    record: Callable[..., Measurement],
    done: dict[str, Measurement],
    measurements: list[Measurement],
) -> list[tuple[Source, list[Params]]]:
    """The plan less what ``pruning`` says cannot win, each of those recorded as ``cut`` with
    its reason (so a resumed worker does not compile it either)."""
    if not options.prune or not pruning.prunable(key):
        return plan
    baseline_us = effective_us(base, options.launch)
    assert isinstance(key, GemmKey)
    on_gpu = device == "cuda"  # host timings bound nothing
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
                log.warning(
                    "%s: precompile failed on %s: %s", source.name, key, short_error(e)[:300]
                )


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
    first_pass: TuneOutcome | None = None,
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

    ``first_pass``: this problem's first pass (every candidate but those of sources that share
    kernels, timed while the compile pool built them: ``first_pass_options``). This second pass
    takes its measurements as they are, times the rest, and duels only those of the rest that
    one pass would have duelled (``second_pass_duels``), against what the first pass kept
    (``reconfirmed``: the first pass's duels are not run again, and count as in one pass, its
    sustained losses against the budget); both passes' measurements and the winner carry the
    first pass's run id.
    """
    options = options or TuneOptions()
    if options.isolate:
        raise ValueError(
            "engine.tune runs in this process; tune with isolate=True through tuner.tuning.tune"
        )
    device = device or current_device()
    fp = fingerprint(device)
    run_id = first_pass.winner.run_id if first_pass is not None else uuid.uuid4().hex
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

    taken = [*(first_pass.measurements if first_pass else []), *(prior or [])]
    done = {m.candidate: m for m in taken}

    trial = Trial.for_key(key, device, options.seed, record)

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
            baseline = timed_baseline(measurements) if challenger else None
            m = trial.run(source, params, cutoff, options, late, baseline)
        if m.status == "ok":
            us = effective_us(m, options.launch)
            best_us = us if best_us is None else min(best_us, us)
        elif m.is_baseline:
            log.error("baseline %s failed on %s: %s", m.candidate, key, m.error)
        return m

    marks = [started, time.perf_counter()]
    for source, params in ((s, p) for s, shortlist in plan for p in shortlist):
        if source.is_baseline(params):
            run(source, params)
            break
    base = _baseline_timed(key, measurements)  # before any challenger is compiled or timed
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

    order = duels(measurements, options, device)  # as one pass over every candidate has it
    if first_pass is None:
        chosen, base_us, chosen_us = confirmed(trial, base, order, options)
    else:
        trial.stretched.update(first_pass.stretched)  # its duels: not run again
        new = second_pass_duels(measurements, options, device)
        verdict = first_pass.winner
        chosen, base_us, chosen_us = reconfirmed(trial, base, verdict, measurements, new, options)
    duelled = {challenger for _, challenger in trial.stretched}  # this pass's and the first's
    for m, why in left_out(measurements, order, duelled, chosen, options):
        if why not in m.error:  # a first pass's measurement carries its note already
            m.error = f"{m.error}; {why}" if m.error else why
    winner = Winner(
        device_class=fp.device_class, key=str(key), source=chosen.source, params=chosen.params,
        median_us=chosen_us, baseline_us=base_us, versions=fp.version_tag, run_id=run_id,
        launch=options.launch,
    )  # fmt: skip
    marks.append(time.perf_counter())
    phases = {name: b - a for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
    seconds = marks[-1] - started
    return TuneOutcome(key, winner, measurements, seconds, compile_s, phases, trial.stretched)

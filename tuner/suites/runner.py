"""Benchmark suites: tune each problem, then time the baseline and the winner side by side.

The ratio of a suite row comes from one run: the baseline (what users get without us) and the
winner are rebuilt and timed alternately on the same rotating inputs, after tuning, so clock
and thermal drift hit both. A winner that *is* the baseline has ratio 1.0 by construction: the
user gets exactly that kernel. Results go to JSON (with device, versions and the measured
device-to-device copy bandwidth) and a PNG of speedup per problem.

Used by ``tuner bench gemm`` and ``tuner bench sdpa``; their commands live in ``tuner.cli.bench``,
whose app ``tuner.cli.main`` registers as ``bench``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.base import Params, Runner
from tuner.core.atomic import write_atomic
from tuner.core.console import counted, output_console
from tuner.core.device import fingerprint
from tuner.core.keys import Key
from tuner.core.progress import progress_bar
from tuner.measure import samples, timing
from tuner.measure.records import LABEL_WIDTH, Winner, candidate_label
from tuner.measure.timing import copy_bandwidth_gbs
from tuner.offline.plots import geomean, speedup_plot
from tuner.suites import catalog
from tuner.tuning.engine import TuneOptions, TuneOutcome, current_device
from tuner.tuning.tune import tune

console = output_console()
Metrics = Callable[[Key, float], dict[str, float]]  # (key, time in us) -> extra columns


@dataclass
class Row:
    label: str
    key: str
    baseline_us: float
    winner_us: float
    source: str
    candidate: str
    tune_s: float
    phases: dict[str, float] = field(default_factory=dict)  # of tune_s, by engine.PHASES
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.winner_us

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup}


Timed = tuple[Callable[..., Any], Sequence[tuple[Any, ...]]]  # a runner and its input sets
Rounds = dict[str, list[timing.Timing]]  # each runner's timings, a round each


def in_turn_rounds(
    runners: dict[str, Timed],
    device: str,
    *,
    graph: bool,
    rounds: int = 4,
    budget_s: float = 0.075,
    warmup_rounds: int = 0,
    sustained_s: float = 0.0,
    on_error: Callable[[str, Exception], None] | None = None,
) -> Rounds:
    """Each runner's timings over ``rounds`` rounds that time the runners in turn, each on its
    own input sets, so that all are measured under the same load: GPU times inside CUDA graphs
    (``graph``), else eager times, in ``timing.round_order``. ``warmup_rounds`` rounds like them
    come first, untimed: a runner just built may run slow for a while (first uses of its library
    in the process), and a round of every runner outlasts that before any is timed.
    ``sustained_s``: eager times over stretches of that many seconds of calls back to back
    (``timing.sustained_time``), for GPU-bound calls compared at the GPU's power limit as the
    engine's duels compare them. ``on_error(name, e)``: a runner that raises is dropped and
    reported there; without it the error propagates."""
    times: Rounds = {name: [] for name in runners}
    for round_ in range(-warmup_rounds, rounds):
        for name in timing.round_order(list(times), round_):
            runner, sets = runners[name]
            try:
                if graph:
                    t = timing.graph_time_over(runner, sets)
                else:
                    t = timing.eager_time(
                        runner, sets, device=device, sustained_s=sustained_s, budget_s=budget_s
                    )
            except Exception as e:
                if on_error is None:
                    raise
                on_error(name, e)
                del times[name]
                continue
            if round_ >= 0:
                times[name].append(t)
    return times


def rounds_spread(rounds: Rounds) -> float:
    """The widest spread of any runner's round times, (max - min) / median: rounds that took one
    runner in turn under the same load read alike unless something ran beside some of them."""
    spreads = [
        (max(us) - min(us)) / statistics.median(us)
        for us in ([t.median_us for t in ts] for ts in rounds.values())
        if us and statistics.median(us) > 0
    ]
    return max(spreads, default=0.0)


def steadier_rounds(take: Callable[[], Rounds], limit: float) -> tuple[Rounds, Rounds | None]:
    """``take()``'s rounds, or where a runner's rounds spread past ``limit`` (``rounds_spread``:
    a disturbance beside some rounds, whose median it may move), a second take's if they spread
    less; and the first take where a second was made (None otherwise), to be reported beside."""
    first = take()
    if rounds_spread(first) <= limit:
        return first, None
    again = take()
    return (again if rounds_spread(again) < rounds_spread(first) else first), first


def in_turn(runners: dict[str, Timed], device: str, **options: Any) -> dict[str, float]:
    """Median times (us) of each runner over the rounds of ``in_turn_rounds`` (same options)."""
    rounds = in_turn_rounds(runners, device, **options)
    return {name: statistics.median(t.median_us for t in ts) for name, ts in rounds.items()}


def quick_on_cpu(quick: bool, device: str | None = None) -> bool:
    """Whether a ``--quick`` run on ``device`` (default: this host's) takes its suite's few
    small CPU rows (``catalog``'s ``*_QUICK_CPU_*``) in place of its GPU rows, which take
    minutes each on a CPU."""
    return quick and (device or current_device()) != "cuda"


def rate(value: float) -> str:
    """A rate (TFLOP/s, GB/s) for the console with at least 3 significant digits: whole numbers
    from 100 up, as GPU rates read, and decimals below, where a CPU's rates lie and a whole
    number would read 0 or 1."""
    if value == 0 or not math.isfinite(value) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def quick_cpu_note(labels: Iterable[str], rows: str) -> str | None:
    """A line saying the rows are ``--quick``'s small CPU ones (``rows`` names their shapes),
    where any ``labels`` is one of theirs (``catalog.is_quick_cpu``), or None: their ratios are
    of CPU code on toy shapes, not of the suite's own."""
    if not any(catalog.is_quick_cpu(label) for label in labels):
        return None
    return (f"{rows}, not the suite's own shapes: --quick on a machine without a GPU times "
            "these in their place")  # fmt: skip


NOT_JUDGED = (
    "targets not judged: they are GPU targets, judged only on a GPU; this run timed CPU code"
)


def warning_sentence(note: str) -> str:
    """``note`` as a console sentence of its own: capitalised, a full stop, in yellow."""
    return f"[yellow]{note[:1].upper()}{note[1:]}.[/yellow]"


def targets_judged(device: str) -> bool:
    """Whether a run on ``device`` is judged by a suite's targets: only on a GPU, where they
    apply (``NOT_JUDGED`` says why not elsewhere)."""
    return device == "cuda"


def verdict_notes(
    device: str, shapes_note: str | None, not_judged: str = NOT_JUDGED
) -> dict[str, Any]:
    """The fields every suite's result carries beside its targets: whether they were judged
    (``targets_judged``), why not (``targets_note``: ``not_judged``, or None) and what its rows'
    shapes are where they are not the suite's own (``shapes_note``, ``quick_cpu_note``'s)."""
    judged = targets_judged(device)
    return {"targets_judged": judged, "targets_note": None if judged else not_judged,
            "shapes_note": shapes_note}  # fmt: skip


def print_notes(result: Mapping[str, Any]) -> None:
    """A result's ``verdict_notes`` on the console, a sentence each where they say anything."""
    if note := result["shapes_note"]:
        console.print(f"[yellow]{note}.[/yellow]")
    if not result["targets_judged"]:
        console.print(warning_sentence(result["targets_note"]))


def print_figures(title: str, figures: Mapping[str, Any]) -> None:
    """A result's summary figures (or target counts) as a two-column table: read at a glance,
    where its JSON line was not (the JSON file holds them all the same)."""
    t = Table(title=title, show_header=False, title_justify="left")
    for name, value in figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else "-" if value is None else value
        t.add_row(name.replace("_", " "), escape(str(shown)))
    console.print(t)


def built(key: Key, source: str, params: Params) -> tuple[Runner, Runner | None]:
    """torch's runner for ``key`` (its baseline) and the winner's; None where the winner is
    that baseline itself."""
    base = registry.baseline(key.op, key)
    win = None if base.chose_itself(source, params) else registry.get(source).build(key, params)
    return base.build(key, base.baseline_params), win


def tuned_times(key: Key, winner: Winner, device: str) -> tuple[float, float]:
    """The baseline's and the winner's times as the tuning confirmed them (``Winner``), for
    rows timed again side by side later: no second timing of the same pair."""
    return winner.baseline_us, winner.median_us


def side_by_side(
    key: Key, winner: Winner, device: str, *, rounds: int = 4, budget_s: float = 0.075
) -> tuple[float, float]:
    """Median times (us) of the baseline and the winner, measured in turn on the same inputs,
    in the launch mode the winner was chosen for (GPU times inside CUDA graphs for ``graph``)."""
    base, win = built(key, winner.source, winner.params)
    sets = samples.input_sets(key, device, seed=1)
    runners: dict[str, Timed] = {"baseline": (base, sets)}
    if win is not None:
        runners["winner"] = (win, sets)
    graph = winner.launch == "graph" and device == "cuda"
    t = in_turn(runners, device, graph=graph, rounds=rounds, budget_s=budget_s)
    return t["baseline"], t.get("winner", t["baseline"])


def pct_of_copy(nbytes: int, us: float, copy_gbs: float) -> float:
    """The share of the device-to-device copy bandwidth at which ``nbytes`` moved in ``us``."""
    return 100 * nbytes / us / 1e3 / copy_gbs


def run_suite(
    name: str,
    problems_: Sequence[tuple[str, Key]],
    *,
    out_dir: str | Path,
    title: str,
    options: TuneOptions | None = None,
    metrics: Metrics | None = None,
    store: Store | None = None,
    tuner: Callable[[Key, TuneOptions], TuneOutcome] | None = None,
    plot: bool = True,
    times: Callable[[Key, Winner, str], tuple[float, float]] = side_by_side,
    write: bool = True,
) -> dict[str, Any]:
    """Tune and measure every (label, key); write ``<name>.json`` and ``<name>.png`` into out_dir
    (``save_result``); on Ctrl-C, the rows done as ``<name>.interrupted.json``/``.png``, then
    the interrupt goes on.

    ``tuner`` replaces ``engine.tune`` (e.g. a crash-isolating worker); ``store`` keeps every
    measurement and winner (the tuned cache that comes back with the results); ``plot=False``
    leaves the PNG to a suite that draws its own; ``times(key, winner, device)`` gives a row's
    baseline and winner times (``tuned_times`` for a suite that times its rows again once all
    are tuned); ``write=False`` leaves the writing to a suite with steps after the rows (and
    ``marked_if_interrupted`` around them).
    """
    options = options or TuneOptions()
    run_tuner = tuner or (lambda key, opts: tune(key, options=opts))
    device = current_device()
    fp = fingerprint(device)
    if store is not None:
        store.save_device(fp)
    copy_gbs = copy_bandwidth_gbs(device)
    console.print(f"{fp.name}: device-to-device copy {rate(copy_gbs)} GB/s")

    def measured(label: str, key: Key, bar: Progress) -> Row | None:
        """One problem tuned and timed, said on the console; None when its tuning raised (one
        broken problem must not lose the suite)."""
        started = time.perf_counter()
        try:
            outcome = run_tuner(key, options)
        except Exception as e:
            bar.console.print(f"[red]{escape(label)}: tuning failed: {escape(str(e))}[/red]")
            return None
        tune_s = time.perf_counter() - started
        if store is not None:
            store.save_run(outcome.measurements, outcome.winner)
        base_us, win_us = times(key, outcome.winner, device)
        row = Row(
            label,
            str(key),
            base_us,
            win_us,
            outcome.winner.source,
            outcome.winner.candidate,
            tune_s,
            {name: round(seconds, 3) for name, seconds in outcome.phases.items()},
        )
        if metrics:
            row.extra = {f"baseline_{k}": v for k, v in metrics(key, base_us).items()} | metrics(
                key, win_us
            )
        winner = escape(candidate_label(row.candidate))
        bar.console.print(
            f"{label:<40} {base_us:9.1f} us -> {win_us:9.1f} us  {row.speedup:5.2f}x  "
            f"{winner}{' (graph)' if outcome.winner.launch == 'graph' else ''}"
        )
        return row

    rows: list[Row] = []
    interrupted: KeyboardInterrupt | None = None
    try:  # Ctrl-C, up to the table printed: what is done is written, then it goes on
        with progress_bar(console) as bar:
            task = bar.add_task(name, total=len(problems_))
            for i, (label, key) in enumerate(problems_, 1):
                bar.update(task, description=label[:50])
                if not console.is_terminal:  # no bar to show where a slow run is: a line
                    console.print(f"[{i}/{len(problems_)}] measuring {label}")
                if (row := measured(label, key, bar)) is not None:
                    rows.append(row)
                bar.advance(task)
    except KeyboardInterrupt as e:
        interrupted = e
    result = {
        "suite": name,
        "title": title,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": fp.to_dict(),
        "copy_gbs": copy_gbs,
        "options": asdict(options),
        "rows": [r.to_dict() for r in rows],
        "summary": summarize(rows),
    }
    draw = speedup_drawing(title) if plot else None
    try:
        print_table(rows)
    except KeyboardInterrupt as e:
        interrupted = e
    if interrupted is not None:
        missing = f"{len(problems_) - len(rows)} of its {len(problems_)} rows"
        stopped(out_dir, name, result, missing, draw)
        raise interrupted
    if write:
        save_result(out_dir, name, result, draw)
    return result


Draw = Callable[[dict[str, Any], Path], None]  # (a suite's result, the PNG to draw it into)


def speedup_drawing(title: str) -> Draw:
    """The runner's plot of a result: each row's speedup, grouped by the winner's source,
    titled ``title`` on the result's device."""

    def draw(result: dict[str, Any], png: Path) -> None:
        rows = result["rows"]
        speedup_plot([r["label"] for r in rows], [r["speedup"] for r in rows], png,
                     title=f"{title} on {result['device']['name']}",
                     groups=[r["source"] for r in rows])  # fmt: skip

    return draw


INTERRUPTED_SUFFIX = ".interrupted"  # a partial result's files: <name>.interrupted.json/.png


def result_path(out_dir: str | Path, name: str, *, interrupted: bool, ext: str = "json") -> Path:
    """Where a suite's result goes: ``<name>.<ext>``, or for a run cut short
    ``<name>.interrupted.<ext>``, so that a partial run never replaces a complete one."""
    return Path(out_dir) / f"{name}{INTERRUPTED_SUFFIX if interrupted else ''}.{ext}"


def save_result(
    out_dir: str | Path, name: str, result: dict[str, Any], draw: Draw | None = None
) -> Path:
    """The one writer of every suite's result: its JSON, and its PNG through ``draw`` where it
    has rows, under the complete name or, when ``result`` is marked interrupted, the partial one
    (``result_path``). A complete result supersedes this suite's earlier partial files, which
    are removed. Returns the JSON's path."""
    cut = bool(result.get("interrupted"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = result_path(out, name, interrupted=cut, ext="png")
    if draw is not None and result["rows"]:  # first: a JSON never stands beside an older PNG
        drawn(draw, result, png)
    else:  # nothing to draw: an earlier run's PNG would stand beside this JSON
        png.unlink(missing_ok=True)
    path = result_path(out, name, interrupted=cut)
    write_atomic(path, json.dumps(result, indent=1))
    if not cut:
        for ext in ("json", "png"):
            result_path(out, name, interrupted=True, ext=ext).unlink(missing_ok=True)
    return path


def drawn(draw: Draw, result: dict[str, Any], png: Path) -> None:
    """``result`` drawn into ``png`` in one rename: a plot cut short (Ctrl-C while it draws)
    leaves the PNG there before it as it was."""
    drawing = png.with_name(f".{png.stem}.drawing{png.suffix}")
    try:
        draw(result, drawing)
        os.replace(drawing, png)
    finally:
        drawing.unlink(missing_ok=True)


def stopped(
    out_dir: str | Path, name: str, result: dict[str, Any], missing: str, draw: Draw | None
) -> None:
    """Ctrl-C: ``result`` saved marked interrupted, under its partial name (``save_result``),
    and the console says where, what it lacks (``missing``) and that a complete result of an
    earlier run is left as it was."""
    result["interrupted"] = True
    path = save_result(out_dir, name, result, draw)
    kept = result_path(out_dir, name, interrupted=False)
    earlier = f"; the complete {kept.name} of an earlier run is kept" if kept.exists() else ""
    console.print(f"[yellow]interrupted[/yellow]: {counted(len(result['rows']), 'row')} written to {path} "
                  f"(without {missing}){earlier}")  # fmt: skip


@contextlib.contextmanager
def marked_if_interrupted(
    out_dir: str | Path, name: str, result: dict[str, Any], missing: str, draw: Draw | None = None
) -> Iterator[None]:
    """A suite's run around ``run_suite`` (``write=False``, its result put into ``result``) and
    the steps after it: on Ctrl-C inside, ``result`` as it stands is saved as interrupted
    (``stopped``: under its partial name, saying it lacks ``missing``), then the interrupt goes
    on. Not where ``run_suite`` saved it already (cut short in its rows) or never returned."""
    try:
        yield
    except KeyboardInterrupt:
        if result and not result.get("interrupted"):
            stopped(out_dir, name, result, missing, draw)
        raise


def summarize(rows: Sequence[Row]) -> dict[str, float]:
    if not rows:
        return {"n": 0}
    speedups = [r.speedup for r in rows]
    return {
        "n": len(rows),
        "geomean": geomean(speedups),
        "min": min(speedups),
        "max": max(speedups),
        "slower_than_0.98": sum(s < 0.98 for s in speedups),
        "median_tune_s": statistics.median(r.tune_s for r in rows),
        "total_tune_s": sum(r.tune_s for r in rows),
    }


def print_table(rows: Sequence[Row]) -> None:
    t = Table(title="baseline vs tuned (same run)")
    for col in ("problem", "baseline us", "tuned us", "speedup", "winner", "tune s"):
        t.add_column(col)
    for r in rows:
        color = "green" if r.speedup >= 1.02 else "red" if r.speedup < 0.98 else "white"
        t.add_row(
            r.label,
            f"{r.baseline_us:.1f}",
            f"{r.winner_us:.1f}",
            f"[{color}]{r.speedup:.2f}x[/{color}]",
            escape(candidate_label(r.candidate, LABEL_WIDTH)),
            f"{r.tune_s:.1f}",
        )
    console.print(t)
    s = summarize(rows)
    if rows:
        console.print(
            f"geomean {s['geomean']:.3f}x  min {s['min']:.3f}x  max {s['max']:.3f}x  median tuning {s['median_tune_s']:.2f} s"
        )

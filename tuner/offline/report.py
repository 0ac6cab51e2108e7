"""What tune-all achieved: per problem the baseline, the winner, the ratio and the source.

Built from the store (winners of this device class) and the tune-all journal (tuning time per
problem, failures), so the report at the end of a run and ``tuner report`` later agree.
``write`` puts ``report.json`` and ``speedup.png`` (speedup per problem) in a directory.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tuner.core.atomic import write_atomic
from tuner.core.console import counted
from tuner.core.device import Fingerprint
from tuner.core.keys import GemmKey, Key, parse_key
from tuner.measure.records import LABEL_WIDTH, Winner, candidate_label
from tuner.offline.journal import FAILURES, UNFINISHED, clipped_error
from tuner.offline.plots import geomean, speedup_plot
from tuner.offline.problem_set import ProblemSet
from tuner.offline.tune_all import RunSummary
from tuner.tuning.engine import PHASES


def shape_label(shape: str, label: str = "") -> str:
    """A problem's name in tables and plots: its shape always, then where it came from."""
    return f"{shape} ({label})" if label and label != shape else shape


@dataclass
class Row:
    label: str  # where the problem came from (model, list, misses), else its shape
    key: str
    # tuned | stale (winner from other versions) | failed | timeout | partial | pending |
    # unsupported (this device cannot run it: ``unsupported``)
    status: str
    baseline_us: float | None = None
    winner_us: float | None = None  # a cut-off problem's is what it kept (baseline, first pass)
    source: str = ""
    candidate: str = ""
    tune_s: float | None = None
    error: str = ""
    shape: str = ""  # the key's short form (``GemmKey.label``)
    wait_s: float | None = None  # of tune_s: waiting for this problem's kernels to compile
    compile_s: float | None = None  # the compile pool's time on it (beside the GPU's work)
    compiled: int | None = None  # candidates compiled (or found compiled)
    pruned: dict[str, int] = field(default_factory=dict)  # left out uncompiled, by rule
    phases: dict[str, float] = field(default_factory=dict)  # of tune_s (engine.PHASES)
    first_pass_s: float | None = None  # of tune_s: its first pass's, timed while CUTLASS compiled

    @property
    def title(self) -> str:
        return shape_label(self.shape or short_label(self.key), self.label)

    @property
    def timing_s(self) -> float | None:
        return None if self.tune_s is None else self.tune_s - (self.wait_s or 0.0)

    @property
    def speedup(self) -> float | None:
        if self.baseline_us is None or not self.winner_us:
            return None
        return self.baseline_us / self.winner_us


@dataclass
class Report:
    device_class: str
    versions: str
    rows: list[Row]
    wall_s: float | None = None  # of the tune-all run, when the report ends one
    workers: int | None = None
    stopped: str = ""
    idle_s: float = 0.0  # of the run: workers idle while every pending problem was compiling
    shared_compile_s: float | None = None  # of the run: the compile pool's shared job
    start_s: float | None = None  # of the run: until the first worker was ready
    ran: set[str] | None = None  # of the run: the keys it tuned (others' times are earlier runs')
    created_at: float = field(default_factory=time.time)

    def timed(self) -> list[Row]:
        """The rows whose speedup is this run's, which the summary and the plot count: not a
        stale winner (other versions) nor a timed-out problem's kept baseline."""
        return [r for r in self.rows if r.status == "tuned" and r.speedup is not None]

    def summary(self) -> dict[str, Any]:
        timed = self.timed()
        speedups = [r.speedup for r in timed if r.speedup is not None]
        tune_times = [r.tune_s for r in self.rows if r.tune_s is not None]
        worst = min(timed, key=lambda r: r.speedup or 0.0, default=None)
        best = max(timed, key=lambda r: r.speedup or 0.0, default=None)
        counts = {s: sum(r.status == s for r in self.rows) for s in _STATUS_ORDER}
        return {
            "problems": len(self.rows),
            **counts,
            "geomean_speedup": geomean(speedups) if speedups else None,
            "worst": {"label": worst.title, "speedup": worst.speedup} if worst else None,
            "best": {"label": best.title, "speedup": best.speedup} if best else None,
            "compiled": sum(r.compiled or 0 for r in self.rows),
            "pruned": _summed(r.pruned for r in self.rows),  # by rule (tuner.tuning.pruning)
            "compile_wait_s_total": sum(r.wait_s or 0.0 for r in self.rows) + self.idle_s,
            "two_passes": sum(r.first_pass_s is not None for r in self.rows),
            "compile_pool_s_total": sum(r.compile_s or 0.0 for r in self.rows),
            "shared_compile_s": self.shared_compile_s,
            "tuning_s_total": sum(tune_times),
            "tuning_s_by_phase": _in_phase_order(_summed(r.phases for r in self.rows)),
            "tuning_s_median": sorted(tune_times)[len(tune_times) // 2] if tune_times else None,
            "wall_s": self.wall_s,
            "start_s": self.start_s,
            "workers": self.workers,
            "stopped": self.stopped,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_class": self.device_class,
            "versions": self.versions,
            "created_at": self.created_at,
            "summary": self.summary(),
            "rows": [
                {**asdict(r), "speedup": r.speedup, "title": r.title, "timing_s": r.timing_s}
                for r in self.rows
            ],
        }


_STATUS_ORDER = ("tuned", "stale", "failed", "timeout", "partial", "pending", "unsupported")


def short_label(key: str | Key) -> str:
    """The key's short table form (``GemmKey.label`` / ``SdpaKey.label``)."""
    return (parse_key(key) if isinstance(key, str) else key).label


def _order(key: str) -> tuple:
    """Problems grouped by op, dtype and shape family, growing M (or lengths) within a family."""
    k = parse_key(key)
    if isinstance(k, GemmKey):
        return (k.op, k.dtype, k.compute, k.layout, k.n, k.k, k.batch, k.m, k.align)
    return (k.op, k.dtype, k.causal, k.q_heads, k.kv_heads, k.head_dim, k.head_dim_v, k.scale,
            k.q_len, k.kv_len, k.batch)  # fmt: skip


def _journal_index(journal: list[dict[str, Any]], device_class: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rec in journal:
        if rec.get("device_class") in (device_class, ""):
            out.setdefault(rec["key"], []).append(rec)
    return out


def _summed(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per name, the sum of its values over ``counts`` (pruned candidates by rule, seconds by
    tuning phase)."""
    totals: dict[str, Any] = {}
    for each in counts:
        for name, value in each.items():
            totals[name] = totals.get(name, 0) + value
    return totals


def _in_phase_order(by_phase: dict[str, float]) -> dict[str, float]:
    """Seconds by tuning phase in the order a problem goes through them (``engine.PHASES``)."""
    ordered = {p: by_phase[p] for p in PHASES if p in by_phase}
    return ordered | by_phase


def _costs(rec: dict[str, Any]) -> dict[str, Any]:
    """A journal record's compile/timing split (absent in records of older runs)."""
    return {
        "tune_s": rec["seconds"], "wait_s": rec.get("wait_s"), "compile_s": rec.get("compile_s"),
        "compiled": rec.get("compiled"), "pruned": rec.get("pruned") or {},
        "phases": rec.get("phases") or {}, "first_pass_s": rec.get("first_pass_s"),
    }  # fmt: skip


def _row(label: str, key: str, winner: Winner | None, records: list[dict], fp: Fingerprint) -> Row:
    shape = short_label(key)
    last = records[-1] if records else None
    if winner is not None and last is not None and last["status"] in UNFINISHED:
        # the last attempt did not finish (it timed out, a forced re-tune failed, the run stopped
        # between its passes): say so, beside the winner it kept
        return Row(
            label, key, last["status"], winner.baseline_us, winner.median_us, winner.source,
            winner.candidate, error=last["error"], shape=shape, **_costs(last),
        )  # fmt: skip
    if winner is not None:
        tuned = [r for r in records if r["status"] == "tuned"]
        match = [r for r in tuned if r.get("run_id") == winner.run_id] or tuned[-1:]
        costs = _costs(match[-1]) if match else {}
        return Row(
            label, key, "tuned" if winner.measured_under(fp) else "stale",
            winner.baseline_us, winner.median_us, winner.source, winner.candidate,
            shape=shape, **costs,
        )  # fmt: skip
    if last is not None and last["status"] in UNFINISHED:
        return Row(label, key, last["status"], error=last["error"], shape=shape, **_costs(last))
    if why := unsupported(parse_key(key), fp):
        return Row(label, key, "unsupported", error=why, shape=shape)
    return Row(label, key, "pending", shape=shape)


def unsupported(key: Key, fp: Fingerprint) -> str | None:
    """Why ``fp``'s device cannot run ``key`` (an int4 weight that torch's packing cannot hold
    there), or None: a run leaves such a problem out at its start and its report says why."""
    if not isinstance(key, GemmKey) or key.wdtype != "int4":
        return None
    from tuner.quant.int4_torch import cannot_pack

    return cannot_pack(key.n, fp.kind)


def build(
    store: Any,
    fp: Fingerprint,
    *,
    problems: ProblemSet | None = None,
    journal: list[dict[str, Any]] | None = None,
    run: RunSummary | None = None,
) -> Report:
    """The report of ``problems`` (default: every winner and failure of this device class)."""
    winners = {w.key: w for w in store.winners(fp.device_class)}
    records = _journal_index(journal or [], fp.device_class)
    if problems is not None:
        items = [(problems.label(k) or k.label, str(k)) for k in problems]
    else:
        failed = {k for k, recs in records.items() if recs[-1]["status"] in UNFINISHED}
        items = [(short_label(k), k) for k in sorted(set(winners) | failed, key=_order)]
    rows = [_row(label, key, winners.get(key), records.get(key, []), fp) for label, key in items]
    return Report(
        fp.device_class, fp.version_tag, rows,
        wall_s=run.wall_s if run else None, workers=run.workers if run else None,
        stopped=run.stopped if run else "", idle_s=run.idle_s if run else 0.0,
        shared_compile_s=run.shared_compile_s if run else None,
        start_s=run.start_s if run else None,
        # a problem another process tuned meanwhile ("skipped") was not tuned by this run
        ran={str(r.key) for r in run.results if r.status != "skipped"} if run else None,
    )  # fmt: skip


def write(report: Report, out_dir: Path, *, title: str = "tune-all") -> tuple[Path, Path | None]:
    """``report.json`` and (when anything was tuned) ``speedup.png`` in ``out_dir``; an
    earlier run's plot goes where this one draws none."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    write_atomic(json_path, json.dumps(report.to_dict(), indent=1))
    plotted = report.timed()
    if not plotted:
        (out_dir / "speedup.png").unlink(missing_ok=True)
        return json_path, None
    left = Counter(r.status for r in report.rows if r not in plotted)
    left_out = ", ".join(f"{n} {status}" for status, n in left.items())
    png = speedup_plot(
        [r.title for r in plotted],
        [r.speedup or 1.0 for r in plotted],
        out_dir / "speedup.png",
        title=f"{title} on {report.device_class}: speedup of the winner over the baseline"
        + (f" (not drawn: {left_out})" if left_out else ""),
        groups=[r.source for r in plotted],
    )
    return json_path, png


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


_TABLE_ORDER = {"failed": 0, "timeout": 1, "partial": 2, "unsupported": 3, "pending": 4, "stale": 5,
                "tuned": 6}  # fmt: skip


def render(
    report: Report, console: Console, *, limit: int | None = None, written: bool = True
) -> None:
    """A table of the problems (failures first, ``limit`` rows) and the summary lines;
    ``written``: the rows past the limit are in a report.json being written."""
    shown, hidden = _table_rows(report.rows, limit)
    console.print(_table(report, shown))
    if hidden:
        where = "in report.json" if written else "(tuner report --rows N, or --out DIR for all)"
        won = "; the baseline won on each" if all(map(_kept_baseline, hidden)) else ""
        console.print(f"... {counted(len(hidden), 'more row')} {where}{won}")
    for line in _summary_lines(report):
        console.print(line)


def _kept_baseline(row: Row) -> bool:
    """A tuned row whose winner is its baseline: the least telling row of a table."""
    return row.status == "tuned" and row.winner_us is not None and row.winner_us == row.baseline_us


def _table_rows(rows: list[Row], limit: int | None) -> tuple[list[Row], list[Row]]:
    """The rows a table of ``limit`` rows shows, failures first and otherwise in the problems'
    order, and those it leaves out: rows that kept their baseline go first, so a long run's
    table still shows its wins."""
    ordered = sorted(rows, key=lambda r: _TABLE_ORDER[r.status])
    if limit is None or len(ordered) <= limit:
        return ordered, []
    kept = {id(r) for r in sorted(ordered, key=_kept_baseline)[:limit]}
    return [r for r in ordered if id(r) in kept], [r for r in ordered if id(r) not in kept]


def _table(report: Report, rows: list[Row]) -> Table:
    t = Table(title=f"{counted(len(report.rows), 'problem')} on {report.device_class}")
    # the figures' columns keep their width (two-line headers keep it small): a narrow
    # terminal folds the problem and the winner, the columns worth their width
    for col in ("problem", "status", "baseline\nus", "winner\nus", "speedup", "winner", "tune\ns",
                "compile\nwait s", "pruned"):  # fmt: skip
        t.add_column(col, overflow="fold", no_wrap=col not in ("problem", "winner"))
    for r in rows:
        sp = r.speedup
        color = "green" if sp and sp > 1.0 else ("red" if r.status in FAILURES else "")
        speed = "-" if sp is None else f"[{color}]{sp:.2f}x[/{color}]" if color else f"{sp:.2f}x"
        t.add_row(
            escape(r.title), r.status, _fmt(r.baseline_us, ".2f"), _fmt(r.winner_us, ".2f"), speed,
            escape(_winner_cell(r)), _fmt(r.tune_s, ".1f"), _fmt(r.wait_s, ".1f"),
            str(sum(r.pruned.values())) if r.pruned else "-",
        )  # fmt: skip
    return t


def _winner_cell(row: Row) -> str:
    """The winner's label; for a problem whose last attempt failed or timed out, why (the
    winner it kept is in report.json). A ``partial`` row shows the verdict it kept: its status
    says why it is not final."""
    if (row.error and row.status in FAILURES) or not row.candidate:
        return clipped_error(row.error, LABEL_WIDTH)
    return candidate_label(row.candidate, LABEL_WIDTH)


def _summary_lines(report: Report) -> list[str]:
    """The lines under the table: counts, speedups, tuning time (by phase), compiling."""
    s = report.summary()
    counts = ", ".join(f"{s[k]} {k}" for k in _STATUS_ORDER if s[k])
    lines = [f"problems: {s['problems']} ({counts or 'none'})"]
    if s["geomean_speedup"] is not None:
        lines.append(_speedup_line(report.timed(), s["geomean_speedup"]))
    lines.append(_tuning_line(report, s))
    if s["tuning_s_by_phase"]:
        split = ", ".join(f"{phase} {t:.1f} s" for phase, t in s["tuning_s_by_phase"].items())
        lines.append(f"tuning time by phase: {split}")
    if s["tuning_s_median"] is not None or s["compiled"]:
        lines += _compile_lines(s)
    return lines


def _speedup_line(timed: list[Row], geomean_: float) -> str:
    """Geomean, worst and best; a speedup several problems share is counted, not pinned on
    one of them."""
    speedups = [r.speedup or 0.0 for r in timed]
    worst, best = min(speedups), max(speedups)
    if worst == best:
        return f"speedup: {worst:.3f}x {_where(timed, worst)}"
    return (f"speedup: geomean {geomean_:.3f}x, worst {worst:.3f}x {_where(timed, worst)}, "
            f"best {best:.3f}x {_where(timed, best)}")  # fmt: skip


def _where(rows: list[Row], speedup: float) -> str:
    at = [r for r in rows if r.speedup == speedup]
    return f"on {escape(at[0].title)}" if len(at) == 1 else f"on {len(at)} problems"


def _tuning_line(report: Report, s: dict[str, Any]) -> str:
    """Tuning time over the problems (saying how many earlier runs tuned), then the run's wall
    time."""
    if s["tuning_s_median"] is None:  # tuning and compile times: tune-all's journal
        line = "tuning time: not recorded (the problems were not tuned by tune-all)"
    else:
        timed = [r for r in report.rows if r.tune_s is not None]
        earlier = [r for r in timed if report.ran is not None and r.key not in report.ran]
        before = f" ({len(earlier)} of them tuned by earlier runs)" if earlier else ""
        line = (f"tuning time: {s['tuning_s_total']:.1f} s over {counted(len(timed), 'problem')}"
                f"{before}, median {s['tuning_s_median']:.2f} s per problem")  # fmt: skip
    if s["wall_s"] is not None:
        line += f"; wall time {s['wall_s']:.1f} s on {counted(s['workers'], 'worker')}"
        if s["start_s"] is not None:
            started = "the worker" if s["workers"] == 1 else "them"
            line += f", {s['start_s']:.1f} s of it starting {started}"
    return line + (f"; stopped early: {s['stopped']}" if s["stopped"] else "")


def _compile_lines(s: dict[str, Any]) -> list[str]:
    pruned = ", ".join(f"{n} by {rule}" for rule, n in sorted(s["pruned"].items())) or "none"
    shared = s["shared_compile_s"]
    shared = f", {shared:.1f} s for kernels shared by all shapes" if shared is not None else ""
    if s["two_passes"]:
        shared += (f"; {counted(s['two_passes'], 'problem')} timed the other families while "
                   "those compiled")  # fmt: skip
    return [
        f"compiling: {counted(s['compiled'], 'candidate')} compiled ahead "
        f"({s['compile_pool_s_total']:.1f} s of per-problem compile jobs{shared}), "
        f"{s['compile_wait_s_total']:.1f} s waited for",
        f"pruned uncompiled: {pruned}",
    ]

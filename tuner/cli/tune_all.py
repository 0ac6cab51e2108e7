"""``tuner tune-all``, ``tuner report``, ``tuner tunableop show|export``: many problems at once.

tune-all gathers every source (model configs, problem lists, TunableOp files, recorded misses,
fleet-queue keys) into one de-duplicated list, skips what already has a winner for this device
class and these versions, and tunes the rest on every local GPU (``tuner.offline.tune_all``).
Fleet-queue keys are completed on the service with the measurements of their winning runs; keys
the run did not finish go back to the queue at that completion, for a run that finishes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from tuner.cache import ReadOnlyError, Store, WriteFailedError
from tuner.cache.artifacts import ArtifactStore
from tuner.cache.sqlite import unmade
from tuner.cli.errors import FAILED, fail, fleet_service, output_dir, write_output
from tuner.cli.options import (
    OPS,
    TUNE_DEFAULTS,
    BudgetOpt,
    CacheOpt,
    ConfirmRoundsOpt,
    ConfirmTriesOpt,
    DeviceClassOpt,
    IsolateOpt,
    LaunchOpt,
    NewPaths,
    OpOpt,
    SourcesOpt,
    SustainedOpt,
    cache_path,
    check_op,
    check_sources_serve,
    device_fingerprint,
    open_store,
    tune_options,
)
from tuner.core.console import counted, output_console
from tuner.core.device import Fingerprint, fingerprint
from tuner.core.keys import Key, key_op, parse_key
from tuner.core.profiling import profiled
from tuner.core.progress import progress_bar
from tuner.fleet.artifact_sync import fetch_host_artifacts, host_archs, push_artifacts
from tuner.fleet.client import BATCH, CompletedEarlier, FleetClient, FleetError
from tuner.measure.records import Measurement, Winner, candidate_label, clipped
from tuner.offline import plots, tunableop
from tuner.offline.journal import (
    PARTIAL,
    clipped_error,
    current_launches,
    journal_records,
    kept_after_unfinished,
    order,
    pending,
)
from tuner.offline.model_config import load_model
from tuner.offline.problem_list import ConfigError
from tuner.offline.problem_set import ProblemSet
from tuner.offline.run_settings import RunSettings

if TYPE_CHECKING:  # tuner.offline.tune_all and .report import torch: imported where they run
    from tuner.offline.report import Report
    from tuner.offline.tune_all import Event, Result, RunSummary

app = typer.Typer()
tunableop_app = typer.Typer(help="PyTorch TunableOp CSV files: show, export.", no_args_is_help=True)
app.add_typer(tunableop_app, name="tunableop")
console = output_console()

ModelsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--model", help="Model config YAML (configs/models/*.yaml): its problems in each of "
        "its dtypes (f16, bf16, f32, tf32, and low-bit formats such as int4-g128 or fp8-rowwise); "
        "repeatable.", exists=True,
        dir_okay=False,
    ),
]  # fmt: skip
ConfigsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config", "-c", help="YAML file with a 'problems:' list; repeatable.", exists=True,
        dir_okay=False,
    ),
]  # fmt: skip
TunableOpOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--tunableop", help="PyTorch TunableOp results or untuned-shapes CSV; repeatable.",
        exists=True, dir_okay=False,
    ),
]  # fmt: skip
MissesOpt = Annotated[
    bool, typer.Option("--misses", help="The keys recorded as missed here (TUNER_MODE=record).")
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Directory for report.json and speedup.png.", file_okay=False),
]


@app.command("tune-all")
def tune_all_command(
    model: ModelsOpt = None,
    config: ConfigsOpt = None,
    tunableop_file: TunableOpOpt = None,
    misses: MissesOpt = False,
    queue: Annotated[
        int,
        typer.Option(
            "--queue",
            min=0,
            help="Claim this many keys from the fleet's queue (the service of $TUNER_SERVER, "
            "with a $TUNER_TOKEN of scope submit).",
        ),
    ] = 0,
    op: OpOpt = None,
    cache: CacheOpt = None,
    budget: BudgetOpt = TUNE_DEFAULTS.budget_s,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    isolate: IsolateOpt = False,
    problem_timeout: Annotated[
        float, typer.Option(help="Seconds a problem may take before its worker is killed.")
    ] = 900.0,
    time_limit: Annotated[
        float | None,
        typer.Option(
            help="Seconds for the whole run (default: no limit); no problem starts after (one "
            "between its two passes keeps its first pass's verdict, recorded 'partial': the next "
            "run finishes it)."
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Worker processes (default: one per local GPU).")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Retune problems that already have a current winner.")
    ] = False,
    retries: Annotated[
        int,
        typer.Option(
            min=0, help="Runs that may try a failed or timed-out problem again (after the rest)."
        ),
    ] = RunSettings.retries,
    prune: Annotated[
        bool,
        typer.Option(
            help="Leave out, uncompiled, candidates whose tile or roofline floor cannot beat the "
            "baseline (--no-prune: compile and time everything)."
        ),
    ] = True,
    compile_ahead: Annotated[
        bool,
        typer.Option(
            help="Compile every problem's candidates ahead, on all CPU cores, in one pool."
        ),
    ] = RunSettings.compile_ahead,
    out: OutOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be tuned.")
    ] = False,
) -> None:
    """Tune models, problem lists, TunableOp files, recorded misses and fleet-queue keys.

    All local GPUs work at once; problems tuned already are skipped (a killed run resumes);
    a report ends the run. Exit status 0 when every problem is tuned, else 1 (one that timed
    out keeps its baseline but counts as not tuned); 130 after Ctrl-C (143 after SIGTERM)."""
    options = tune_options(
        budget=budget, ops=OPS, source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained, isolate=isolate,
    )  # fmt: skip
    settings = RunSettings(
        dataclasses.replace(options, prune=prune), problem_timeout_s=problem_timeout,
        time_limit_s=time_limit, workers=workers, force=force, retries=retries,
        compile_ahead=compile_ahead,
    )  # fmt: skip
    sources = Sources.of(model, config, tunableop_file, misses, op, queue)
    with profiled("tune-all"):
        status = tune_all(sources, cache_path(cache), settings, out=out, dry_run=dry_run)
    raise typer.Exit(status)


@app.command("report")
def report_command(
    model: ModelsOpt = None,
    config: ConfigsOpt = None,
    tunableop_file: TunableOpOpt = None,
    misses: MissesOpt = False,
    op: OpOpt = None,
    cache: CacheOpt = None,
    out: OutOpt = None,
    rows: Annotated[
        int, typer.Option(min=0, help="Table rows to print (all of them in --out's report.json).")
    ] = 60,
    device_class: DeviceClassOpt = None,
) -> None:
    """Baseline, winner, speedup and tuning time per problem, a summary and a speedup plot.

    Covers every winner and failure of this device class (or --device-class's), or the problems
    of the sources given."""
    from tuner.offline import report

    sources = Sources.of(model, config, tunableop_file, misses, op)
    path = cache_path(cache)
    store = open_store(cache, existing=True)
    if out is not None:  # made for a cache that is there, and before the table is printed
        output_dir(out)
    fp = device_fingerprint(store, device_class)
    quiet = Console(quiet=True)
    problems = (
        None
        if sources.empty()
        else add_recorded(read_files(sources, quiet), sources, store, fp, quiet, None)
    )
    rep = report.build(store, fp, problems=problems, journal=journal_records(path))
    if problems is None and sources.op:
        rep.rows = [r for r in rep.rows if key_op(r.key) == sources.op]
    report.render(rep, console, limit=rows, written=out is not None)
    _write_report(rep, out, "tuner report")


@tunableop_app.command("show")
def tunableop_show(
    files: Annotated[list[Path], typer.Argument(help="TunableOp CSV files.", exists=True)],
) -> None:
    """The problem keys that TunableOp files name (tune them with tune-all --tunableop)."""
    imported = tunableop.import_files(files)
    for f in imported.files:
        validators = ", ".join(f"{k}={v}" for k, v in f.validators.items()) or "none"
        console.print(
            f"{f.path}: {f.kind} file, {counted(len(f.entries), 'GEMM line')}, "
            f"validators: {validators}"
        )
    for key, (path, entry) in imported.found.items():
        console.print(f"{path.name}:{entry.line} {entry.op},{entry.params} -> {key}")
    for path, entry, reason in imported.skipped:
        console.print(f"[yellow]skipped[/yellow] {path.name}:{entry.line} {entry.op}: {reason}")


@tunableop_app.command("export")
def tunableop_export(
    output: Annotated[
        Path, typer.Argument(help="CSV to write, e.g. tunableop_results0.csv ('-' for stdout).")
    ],
    cache: CacheOpt = None,
    pt_version: Annotated[
        str | None, typer.Option(help="PT_VERSION validator (default: this torch's).")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace OUTPUT if it exists (its lines are lost).")
    ] = False,
    device_class: DeviceClassOpt = None,
) -> None:
    """Write this device's (or --device-class's) winners that TunableOp can run (cuBLAS
    default, cuBLASLt algos)."""
    if str(output) != "-" and output.is_file() and not force:  # (/dev/null has no lines to lose)
        raise ConfigError(
            f"{output} exists: pass --force to replace it (a TunableOp results file would lose "
            "its own lines), or name another file"
        )
    import torch

    from tuner.offline import report

    store = open_store(cache, existing=True)
    fp = device_fingerprint(store, device_class)
    winners = [w for w in store.winners(fp.device_class, op="gemm") if w.measured_under(fp)]
    if pt_version is not None and not tunableop.PT_VERSION.fullmatch(pt_version):
        raise ConfigError(
            f"--pt-version {pt_version!r}: expected a release such as 2.6.0 (digits and dots, "
            "as TunableOp's PT_VERSION validator holds it)"
        )
    version = pt_version or tunableop.torch_version_tag(torch.__version__)
    exp = tunableop.export(winners, version)
    write_output(output, "\n".join(exp.lines) + "\n")
    status = output_console(stderr=True)  # stdout may be the CSV itself
    status.print(f"wrote {output}: {counted(exp.written, 'GEMM')} (Validator PT_VERSION={version})")
    for key, reason in exp.skipped:
        status.print(f"  [yellow]not expressible[/yellow] {report.short_label(key)}: {reason}")


# --- the bodies ----------------------------------------------------------------------------------


@dataclass
class Sources:
    """Where tune-all takes its problems from (any mix)."""

    models: list[Path] = field(default_factory=list)
    configs: list[Path] = field(default_factory=list)
    tunableop: list[Path] = field(default_factory=list)
    misses: bool = False
    queue: int = 0  # keys to claim from the fleet's tuning queue (0: none)
    op: str | None = None  # only "gemm" or "sdpa" problems

    @classmethod
    def of(
        cls,
        models: list[Path] | None,
        configs: list[Path] | None,
        tunableop_files: list[Path] | None,
        misses: bool,
        op: str | None,
        queue: int = 0,
    ) -> Sources:
        check_op(op)
        return cls(models or [], configs or [], tunableop_files or [], misses, queue, op)

    def empty(self) -> bool:
        return not (self.models or self.configs or self.tunableop or self.misses or self.queue)


@dataclass
class FleetLease:
    client: FleetClient
    lease_id: str | None
    keys: list[Key]


def read_files(sources: Sources, console: Console) -> ProblemSet:
    """The problems of the sources' local files (model configs, problem lists, TunableOp files),
    with a line per file on the console. Read before any cache is opened or fleet key leased, so
    that a broken file fails the run with nothing written and no keys held."""
    problems = ProblemSet()
    for path in sources.models:
        model = load_model(path, sources.op)
        n = problems.add_model(model, sources.op)
        console.print(f"model {model.name} ({path}): {counted(n, 'problem')}")
    for path in sources.configs:
        console.print(f"problem list {path}: {counted(problems.add_problem_list(path), 'problem')}")
    if sources.tunableop:
        imported = tunableop.import_files(sources.tunableop)
        n = problems.add_tunableop(imported)
        kinds = ", ".join(
            f"{f.path.name} ({f.kind}, {len(f.entries)} lines)" for f in imported.files
        )
        console.print(f"TunableOp {kinds}: {n} GEMMs")
        for path, entry, reason in imported.skipped:
            console.print(
                f"  [yellow]skipped[/yellow] {path.name}:{entry.line} {entry.op}: {reason}"
            )
    return problems


def add_recorded(
    problems: ProblemSet,
    sources: Sources,
    store: Store,
    fp: Fingerprint,
    console: Console,
    lease: FleetLease | None,
) -> ProblemSet:
    """``problems`` with the cache's recorded misses (``sources.misses``) and a fleet lease's
    keys added, then narrowed to ``sources.op``."""
    if sources.misses:
        rows = store.misses(fp.device_class)
        for bad in problems.add_misses(rows):
            console.print(f"  [yellow]skipped[/yellow] recorded miss {bad}")
        console.print(f"recorded misses on {fp.device_class}: {len(rows)} keys")
    if lease is not None:
        for key in lease.keys:
            problems.add(key, "fleet queue")
        console.print(f"fleet queue: {len(lease.keys)} keys leased")
    kept = problems.only(sources.op)
    if len(kept) < len(problems):
        console.print(f"--op {sources.op}: {len(kept)} of {len(problems)} problems kept")
    return kept


def queue_client() -> FleetClient:
    """The fleet service ``--queue`` claims from (``$TUNER_SERVER``), made before the cache is
    opened: a server unset, or no URL, is a mistake in the command line, refused (exit 2) with
    no cache made or touched."""
    client = FleetClient.from_env()
    if client is None:
        raise ConfigError("--queue needs the fleet service: set TUNER_SERVER (and TUNER_TOKEN)")
    return client


def claim_queue(
    client: FleetClient, n: int, fp: Fingerprint, settings: RunSettings, workers: int
) -> FleetLease:
    """Lease ``n`` keys of this device class from the fleet service of ``client``."""
    rounds = math.ceil(n / max(1, workers))
    lease_s = rounds * settings.problem_timeout_s + 300
    if settings.time_limit_s is not None:
        lease_s = min(lease_s, settings.time_limit_s + settings.problem_timeout_s + 300)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    with fleet_service(client.server):
        lease = client.claim(fp, worker, max_keys=n, lease_s=min(lease_s, 86400.0))
    return FleetLease(client, lease.lease_id, [parse_key(k) for k in lease.keys])


def complete_queue(
    lease: FleetLease, store: Store, fp: Fingerprint, finished: set[str]
) -> dict[str, Any] | None:
    """Send the winning runs' measurements of the leased keys a run ``finished``. One left
    unfinished (a timeout's baseline, a partial's first pass) keeps its winner here but is not
    sent: the service puts it back in the queue, for a run that finishes it."""
    if lease.lease_id is None:
        return None
    winners = {w.key: w for w in store.winners(fp.device_class) if w.measured_under(fp)}
    runs: list[list[Measurement]] = []
    for key in (str(k) for k in lease.keys if str(k) in finished):
        w = winners.get(key)
        if w is not None:
            runs.append(
                [m for m in store.measurements(fp.device_class, key) if m.run_id == w.run_id]
            )
    sent = [m for ms in runs for m in ms]
    if len(sent) > BATCH:  # one completion carries one batch: the baseline and winner suffice
        sent = [m for ms in runs for m in ms if m.is_baseline or _won(m, winners)]
    with fleet_service(lease.client.server):
        try:
            return lease.client.complete(lease.lease_id, fp, sent)
        except CompletedEarlier:
            return {"answer_lost": True}


def queue_summary(lease: FleetLease, done: dict[str, Any] | None) -> str:
    """One line on a lease's completion: what the service took back, or that nothing was
    leased."""
    if lease.lease_id is None or done is None:
        return "fleet queue: nothing leased (no queued keys for this device), nothing to complete"
    if done.get("answer_lost"):
        return (f"fleet queue: lease {lease.lease_id} completed (the service's answer was lost "
                "and a resend found it completed: what it took back is not known here)")  # fmt: skip
    parts = [f"{len(done['done'])} done", f"{len(done['requeued'])} requeued",
             f"{len(done['failed'])} failed", f"{done['accepted']} measurements accepted"]  # fmt: skip
    expired = " (the lease had run out: its keys went back to the queue)"
    return (f"fleet queue: lease {lease.lease_id} completed: {', '.join(parts)}"
            f"{expired if done['lease_expired'] else ''}")  # fmt: skip


def _won(m: Measurement, winners: dict[str, Winner]) -> bool:
    w = winners[m.key]
    return m.source == w.source and m.params == w.params


def _label(key: Key, problems: ProblemSet) -> str:
    from tuner.offline import report

    return report.shape_label(key.label, problems.label(key))


LINE_WIDTH = 80  # a winner's label in a progress line: past it, its least telling words go


def _describe(result: Result, problems: ProblemSet) -> str:
    label = escape(_label(result.key, problems))  # a file's name may hold [ ]
    if result.status == "tuned" and result.winner:
        speedup = result.winner["baseline_us"] / result.winner["median_us"]
        winner = escape(candidate_label(result.winner["candidate"], LINE_WIDTH))
        return f"[green]tuned[/green] {label} -> {winner}, {speedup:.2f}x ({result.seconds:.1f} s)"
    if result.status == "skipped":
        return f"[dim]skipped[/dim] {label}: tuned meanwhile by another process"
    # a problem cut short keeps a verdict, and its error ends saying which (KEPT_ENDINGS)
    color = "yellow" if result.status == PARTIAL else "red"  # no fault of the problem's
    return f"[{color}]{result.status}[/{color}] {label}: {escape(clipped_error(result.error, 300))}"


def run_with_progress(
    todo: list[Key],
    problems: ProblemSet,
    store_path: Path,
    settings: RunSettings,
    retune: set[str],
) -> RunSummary:
    from tuner.offline.tune_all import run

    in_flight: dict[int, str] = {}
    parked: set[str] = set()  # problems whose first pass ended, their second not
    with progress_bar(console) as bar:
        task = bar.add_task("starting workers", total=len(todo))

        def on_event(event: Event) -> None:
            kind, data = event
            if kind == "ready":
                bar.console.print(f"worker {data[0]} ready on {data[1]}")
            elif kind == "start":
                in_flight[data[0]] = _label(data[1], problems)
                parked.discard(str(data[1]))  # its second pass
            elif kind == "parked":  # its shared kernels' candidates are timed once compiled
                in_flight.pop(data[0], None)
                parked.add(str(data[1]))
            elif kind == "result":
                in_flight.pop(data.worker, None)
                parked.discard(str(data.key))
                bar.console.print(_describe(data, problems))
                bar.advance(task)
            elif kind == "notice":
                bar.console.print(f"[yellow]{escape(data)}[/yellow]")
            waiting = (
                f"awaiting shared kernels: {counted(len(parked), 'problem')}" if parked else ""
            )
            shown = " | ".join([*in_flight.values(), waiting] if waiting else in_flight.values())
            bar.update(task, description=escape(clipped(shown, 60)) or "waiting")

        return run(todo, store_path, settings, on_event=on_event, retune=retune)


def _check_op_kept_some(files: ProblemSet, sources: Sources) -> None:
    """ConfigError when files are the only source and --op leaves none of their problems: a
    wrong --op or a wrong file, refused before a cache is made, not a run that does nothing."""
    if sources.op is None or sources.misses or sources.queue or len(files.only(sources.op)):
        return
    raise ConfigError(f"--op {sources.op}: the files given hold no {sources.op} problems, "
                      "nothing to tune")  # fmt: skip


def run_ops(files: ProblemSet, sources: Sources) -> set[str]:
    """The ops a run may tune, known before the cache is opened: ``--op``'s; else those of its
    files' problems, and every op where recorded misses or the fleet's queue add problems."""
    if sources.op is not None:
        return {sources.op}
    if sources.misses or sources.queue:
        return set(OPS)
    return {key.op for key in files}


def _plan(
    problems: ProblemSet,
    untuned: list[Key],
    todo: list[Key],
    launches: dict[str, str],
    launch: str,
    fp: Fingerprint,
    unfinished: set[str],
) -> str:
    """The run's plan in a line: how many problems are tuned already (and, with --force, that
    they are tuned again: not "0 already tuned"), how many to tune, and why some of those are
    tuned again (an earlier run left them unfinished, or chose for another launch mode)."""
    tuned = len(problems) - len(untuned)
    again = " (--force: tuned again)" if tuned and len(todo) > len(untuned) else ""
    relaunched = sum(launches.get(str(k), launch) != launch for k in untuned)
    left = sum(str(k) in unfinished for k in untuned)
    why = [f"{left} left unfinished by an earlier run"] if left else []
    if relaunched:
        why.append(f"{relaunched} re-tuned: chosen for another launch mode than {launch}")
    return (f"{counted(len(problems), 'distinct problem')} on {fp.device_class}: {tuned} already "
            f"tuned{again}, {len(todo)} to tune" + (f" ({'; '.join(why)})" if why else ""))  # fmt: skip


def _runnable_here(keys: list[Key], problems: ProblemSet, fp: Fingerprint) -> list[Key]:
    """``keys`` less those this device cannot run (``report.unsupported``), each named in a
    line: said at the start, not failed once the rest are tuned."""
    from tuner.offline.report import unsupported

    kept = []
    for key in keys:
        if (why := unsupported(key, fp)) is None:
            kept.append(key)
        else:
            label = escape(_label(key, problems))
            console.print(f"  [yellow]cannot run here[/yellow] {label}: {why}")
    return kept


# a run stopped by a signal exits as the shell reports one (128 + the signal), whatever its
# problems' winners: with --force the winners of before would otherwise read as a finished run
INTERRUPTED = {"ctrl-c": 130, "SIGTERM": 143}


def tune_all(
    sources: Sources, store_path: Path, settings: RunSettings, *, out: Path | None, dry_run: bool
) -> int:
    """The tune-all command. Exit status 0 when every problem ends tuned, else 1 (a run
    the cache stopped by refusing a write too); a run stopped by Ctrl-C or SIGTERM:
    ``INTERRUPTED``'s."""
    from tuner.offline import report
    from tuner.offline.tune_all import local_workers

    if sources.empty():
        raise ConfigError(
            "nothing to tune: give --model, --config, --tunableop, --misses or --queue"
        )
    files = read_files(sources, console)
    _check_op_kept_some(files, sources)
    check_sources_serve(settings.tune.sources, run_ops(files, sources))
    client = queue_client() if sources.queue and not dry_run else None
    # noted before the cache or --out's folder is made: a run that fails before it stores
    # anything unmakes them (kept_if_used); a dry run makes neither
    new = None if dry_run else NewPaths(store_path, *([out] if out is not None else []))
    # a dry run writes nothing: with no cache yet, nothing is tuned and nothing recorded; a
    # damaged one is refused, as the real run refuses it, not read for a plan it cannot keep
    # (and before --out's folder is made, which a refused cache would leave behind); an empty
    # file is no cache yet either (``unmade``): opened, it would be made one
    store = Store(":memory:" if dry_run and unmade(store_path) else store_path)
    store.verify()
    lease = None
    # an --out that cannot be made, a claim refused or no service reached: what the run made
    # is unmade, before the run wrote its first row (another command's rows keep a new cache)
    with new.kept_if_used(store) if new is not None else contextlib.nullcontext():
        if out is not None and not dry_run:
            output_dir(out)  # checked before the run, not once it is over
        journal = journal_records(store_path)  # before any claim on the fleet's queue
        fp = fingerprint()
        problems = add_recorded(files, sources, store, fp, console, None)
        if client is not None:
            workers = local_workers(settings.workers)[0]
            lease = claim_queue(client, sources.queue, fp, settings, workers)
    if not dry_run:
        try:
            store.save_device(fp)
        except ReadOnlyError as e:  # a read-only cache, or the disk full at the first write
            if lease is not None:  # its keys go back to the fleet's queue, none finished
                console.print(queue_summary(lease, complete_queue(lease, store, fp, set())))
            if new is not None:  # nothing done: the --out folder made for it goes again
                new.unmake(store)
            if not isinstance(e, WriteFailedError):
                raise  # the user's to mend: a cache that cannot be used (status 2)
            return _stopped(str(e))  # as mid-run
    if lease is not None:
        leased = add_recorded(ProblemSet(), Sources(op=sources.op), store, fp, console, lease)
        for key, labels in leased.labels.items():
            for label in labels:
                problems.add(key, label)
    launch = settings.tune.launch
    untuned = pending(store, fp, problems, journal=journal, launch=launch)
    todo = list(problems) if settings.force else untuned
    retune = kept_after_unfinished(journal, fp)
    console.print(_plan(problems, untuned, todo, current_launches(store, fp), launch, fp, retune))
    ordered = order(todo, journal, fp.device_class, settings.retries)
    for key, failures in ordered.given_up:
        console.print(
            f"  [yellow]not retried[/yellow] {escape(_label(key, problems))}: failed or timed out "
            f"{failures} times (--retries {settings.retries})"
        )
    runnable = _runnable_here(ordered.todo, problems, fp)
    summary = None
    if runnable and not dry_run:
        if out is not None:
            plots.preload()
        with fleet_artifacts(fp, store_path) as artifacts:
            summary = run_with_progress(runnable, problems, store_path, settings, retune)
            artifacts.push()
    journal = journal_records(store_path)
    # what a run left unfinished stays a miss and goes back to the fleet's queue; a leased key
    # that --op left out counts as done where a finished run of before tuned it here
    asked = [*problems, *(k for k in lease.keys if k not in problems.labels)] if lease else problems
    finished = {str(k) for k in asked} - {
        str(k) for k in pending(store, fp, asked, journal=journal, launch=launch)
    }
    unwritable = summary.unwritable if summary is not None else ""
    if sources.misses and not dry_run and not unwritable:
        store.clear_misses(fp.device_class, sorted(finished))
    if lease is not None:
        console.print(queue_summary(lease, complete_queue(lease, store, fp, finished)))
    elif sources.queue and dry_run:
        console.print(f"fleet queue: not consulted (--dry-run claims no keys; queued keys: "
                      f"GET {os.environ.get('TUNER_SERVER', '$TUNER_SERVER')}/v1/queue)")  # fmt: skip
    if dry_run:
        for key in runnable:
            console.print(f"  would tune {escape(_label(key, problems))}")
        return 0
    rep = report.build(store, fp, problems=problems, journal=journal, run=summary)
    report.render(rep, console, limit=40, written=out is not None)
    _write_report(rep, out, "tune-all")
    if unwritable:  # said last, where it is read: what the run could not do, and what to do
        return _stopped(unwritable)
    if summary is not None and summary.stopped in INTERRUPTED:
        return INTERRUPTED[summary.stopped]
    return 0 if all(r.status == "tuned" for r in rep.rows) else 1


def _stopped(why: str) -> int:
    """A run the cache stopped by refusing a write (the disk full), at its start or mid-run:
    one line naming the cause and status 1, as for work that could not be done; the problems
    it could not store stay pending, for a run once there is room."""
    fail(f"the run stopped: {why}")
    return FAILED


class _Artifacts:
    """The fleet's compiled kernels for this host, fetched before a run compiles anything, and
    the ones the run built pushed after it (when the token may publish: scope build)."""

    def __init__(self, fp: Fingerprint) -> None:
        self.client = FleetClient.from_env()
        self.fp = fp
        self.archs = host_archs(fp)

    def fetch(self, store: Store) -> None:
        if self.client is None:
            return
        with fleet_service(self.client.server):
            got = fetch_host_artifacts(self.client, store, self.fp)
        if got is not None:
            console.print(
                f"fleet: fetched {got.fetched} compiled kernels ({got.present} already here)"
            )

    def push(self) -> None:
        if self.client is None or not self.archs:
            return
        try:
            with ArtifactStore() as kernels:
                sent = push_artifacts(self.client, kernels)
        except FleetError as e:  # a token without the build scope: the results still count
            console.print(
                f"[yellow]fleet: compiled kernels not published: {escape(str(e))}[/yellow]"
            )
            return
        console.print(f"fleet: published {sent.published} compiled kernels ({sent.present} there)")


@contextlib.contextmanager
def fleet_artifacts(fp: Fingerprint, store_path: Path) -> Iterator[_Artifacts]:
    artifacts = _Artifacts(fp)
    try:
        with Store(store_path) as store:
            artifacts.fetch(store)
        yield artifacts
    finally:
        if artifacts.client is not None:
            artifacts.client.close()


def _write_report(rep: Report, out: Path | None, command: str) -> None:
    from tuner.offline import report

    if out is not None:
        json_path, png = report.write(rep, output_dir(out), title=command)
        console.print(f"wrote {json_path}" + (f" and {png}" if png else ""))

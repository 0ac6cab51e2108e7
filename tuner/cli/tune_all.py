"""The ``tuner tune-all``, ``tuner report`` and ``tuner tunableop`` commands (their bodies: the
option declarations live in ``tuner.cli.main``).

    tuner tune-all --model configs/models/llama-3-8b.yaml --op gemm --out report/
    tuner tune-all --misses --tunableop tunableop_untuned0.csv --config extra.yaml
    tuner tune-all --queue 50              # claim 50 keys from the fleet's tuning queue
    tuner report --out report/             # the same report, on demand, from the cache
    tuner tunableop export tunableop_results0.csv

tune-all gathers every source into one de-duplicated list, skips what already has a winner
for this device class and these versions, and tunes the rest (``tuner.offline.tune_all``). Fleet-queue
keys are completed on the service with the measurements of their winning runs; keys that
failed stay leased until the lease runs out and the service queues them again.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from tuner.cache import Store
from tuner.core.device import Fingerprint, fingerprint
from tuner.core.keys import parse_key
from tuner.measure.records import Measurement
from tuner.offline import report, tunableop
from tuner.offline.model_config import load_model
from tuner.offline.problem_list import ConfigError
from tuner.offline.progress import progress_bar
from tuner.offline.tune_all import (
    Event,
    ProblemSet,
    Result,
    RunOptions,
    RunSummary,
    current_keys,
    journal_path,
    pending,
    read_journal,
    run,
)


@dataclass
class Sources:
    """Where tune-all takes its problems from (any mix)."""

    models: list[Path] = field(default_factory=list)
    configs: list[Path] = field(default_factory=list)
    tunableop: list[Path] = field(default_factory=list)
    misses: bool = False
    queue: int = 0  # keys to claim from the fleet's tuning queue (0: none)
    op: str | None = None  # only "gemm" or "sdpa" problems

    def empty(self) -> bool:
        return not (self.models or self.configs or self.tunableop or self.misses or self.queue)


@dataclass
class FleetLease:
    client: Any  # tuner.fleet.client.FleetClient
    lease_id: str | None
    keys: list[str]


def collect(
    sources: Sources, store: Store, fp: Fingerprint, console: Console, lease: FleetLease | None
) -> ProblemSet:
    """Every problem the sources name, de-duplicated, with a line per source on the console.

    The local sources are read before the caller leases any fleet keys (``lease`` comes from a
    second call), so a broken file fails the run without holding keys until their lease runs out.
    """
    problems = ProblemSet()
    for path in sources.models:
        model = load_model(path)
        console.print(f"model {model.name} ({path}): {problems.add_model(model)} problems")
    for path in sources.configs:
        console.print(f"problem list {path}: {problems.add_problem_list(path)} problems")
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
    if sources.misses:
        rows = store.misses(fp.device_class)
        for bad in problems.add_misses(rows):
            console.print(f"  [yellow]skipped[/yellow] recorded miss {bad}")
        console.print(f"recorded misses on {fp.device_class}: {len(rows)} keys")
    if lease is not None:
        for key in lease.keys:
            problems.add(parse_key(key), "fleet queue")
        console.print(f"fleet queue: {len(lease.keys)} keys leased")
    return problems.only(sources.op)


def claim_queue(n: int, fp: Fingerprint, options: RunOptions, workers: int) -> FleetLease:
    """Lease ``n`` keys of this device class from the fleet service (``$TUNER_SERVER``)."""
    from tuner.fleet.client import FleetClient

    client = FleetClient.from_env()
    if client is None:
        raise ConfigError("--queue needs the fleet service: set TUNER_SERVER (and TUNER_TOKEN)")
    rounds = math.ceil(n / max(1, workers))
    lease_s = rounds * options.problem_timeout_s + 300
    if options.time_limit_s is not None:
        lease_s = min(lease_s, options.time_limit_s + options.problem_timeout_s + 300)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    lease = client.claim(fp, worker, max_keys=n, lease_s=min(lease_s, 86400.0))
    return FleetLease(client, lease.lease_id, list(lease.keys))


def complete_queue(lease: FleetLease, store: Store, fp: Fingerprint) -> dict[str, Any] | None:
    """Send the winning runs' measurements of the leased keys that now have a winner."""
    from tuner.fleet.client import BATCH

    if lease.lease_id is None:
        return None
    winners = {w.key: w for w in store.winners(fp.device_class) if w.measured_under(fp)}
    runs: list[list[Measurement]] = []
    for key in lease.keys:
        w = winners.get(key)
        if w is not None:
            runs.append(
                [m for m in store.measurements(fp.device_class, key) if m.run_id == w.run_id]
            )
    sent = [m for ms in runs for m in ms]
    if len(sent) > BATCH:  # one completion carries one batch: the baseline and winner suffice
        sent = [m for ms in runs for m in ms if m.is_baseline or _won(m, winners)]
    return lease.client.complete(lease.lease_id, fp, sent)


def _won(m: Measurement, winners: dict[str, Any]) -> bool:
    w = winners[m.key]
    return m.source == w.source and m.params == w.params


def _describe(result: Result, problems: ProblemSet) -> str:
    label = problems.label(result.key) or report.short_label(result.key)
    if result.status == "tuned" and result.winner:
        speedup = result.winner["baseline_us"] / result.winner["median_us"]
        return f"[green]tuned[/green] {label} -> {result.winner['candidate'][:60]} {speedup:.2f}x ({result.seconds:.1f} s)"
    if result.status == "skipped":
        return f"[dim]skipped[/dim] {label}: tuned meanwhile by another process"
    return f"[red]{result.status}[/red] {label}: {result.error[:300]}"


def run_with_progress(
    todo: list, problems: ProblemSet, store_path: Path, options: RunOptions, console: Console
) -> RunSummary:
    in_flight: dict[int, str] = {}
    with progress_bar(console) as bar:
        task = bar.add_task("starting workers", total=len(todo))

        def on_event(event: Event) -> None:
            kind, data = event
            if kind == "ready":
                bar.console.print(f"worker {data[0]} ready on {data[1]}")
            elif kind == "start":
                in_flight[data[0]] = problems.label(data[1]) or report.short_label(data[1])
            elif kind == "result":
                in_flight.pop(data.worker, None)
                bar.console.print(_describe(data, problems))
                bar.advance(task)
            elif kind == "notice":
                bar.console.print(f"[yellow]{data}[/yellow]")
            bar.update(task, description=" | ".join(in_flight.values())[:60] or "waiting")

        return run(todo, store_path, options, on_event=on_event)


def tune_all(
    sources: Sources,
    store_path: Path,
    options: RunOptions,
    *,
    out: Path | None,
    dry_run: bool,
    console: Console,
) -> int:
    """The tune-all command. Exit status 0 when every problem ends with a winner, else 1."""
    if sources.empty():
        raise ConfigError(
            "nothing to tune: give --model, --config, --tunableop, --misses or --queue"
        )
    store = Store(store_path)
    fp = fingerprint()
    store.save_device(fp)
    problems = collect(sources, store, fp, console, None)
    lease = None
    if sources.queue and not dry_run:
        from tuner.offline.tune_all import local_workers

        lease = claim_queue(sources.queue, fp, options, local_workers(options.workers)[0])
        for key, labels in collect(
            Sources(op=sources.op), store, fp, console, lease
        ).labels.items():
            for label in labels:
                problems.add(key, label)
    todo = pending(store, fp, problems, force=options.force)
    console.print(
        f"{len(problems)} distinct problems on {fp.device_class}: "
        f"{len(problems) - len(todo)} already tuned, {len(todo)} to tune"
    )
    summary = None
    if todo and not dry_run:
        summary = run_with_progress(todo, problems, store_path, options, console)
    if sources.misses and not dry_run:
        tuned = current_keys(store, fp)
        store.clear_misses(fp.device_class, [str(k) for k in problems if str(k) in tuned])
    if lease is not None:
        done = complete_queue(lease, store, fp)
        console.print(f"fleet queue: completed lease {lease.lease_id}: {done}")
    if dry_run:
        return 0
    rep = report.build(
        store, fp, problems=problems, journal=read_journal(journal_path(store_path)), run=summary
    )
    report.render(rep, console, limit=40)
    if out is not None:
        json_path, png = report.write(rep, out)
        console.print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return 0 if all(r.status == "tuned" for r in rep.rows) else 1


def report_command(
    sources: Sources, store_path: Path, out: Path | None, console: Console, limit: int | None
) -> None:
    """The report of the given sources' problems, or of every winner of this device class."""
    store = Store(store_path)
    fp = fingerprint()
    problems = None if sources.empty() else collect(sources, store, fp, Console(quiet=True), None)
    rep = report.build(store, fp, problems=problems, journal=read_journal(journal_path(store_path)))
    if problems is None and sources.op:
        rep.rows = [r for r in rep.rows if r.key.startswith(sources.op + ":")]
    report.render(rep, console, limit=limit)
    if out is not None:
        json_path, png = report.write(rep, out)
        console.print(f"wrote {json_path}" + (f" and {png}" if png else ""))


def tunableop_export(
    store_path: Path, output: Path, pt_version: str | None, console: Console
) -> None:
    """Write this device class's current winners that TunableOp can express as its results CSV."""
    import torch

    store = Store(store_path)
    fp = fingerprint()
    winners = [w for w in store.winners(fp.device_class, op="gemm") if w.measured_under(fp)]
    version = pt_version or tunableop.torch_version_tag(torch.__version__)
    exp = tunableop.export(winners, version)
    tmp = output.with_suffix(output.suffix + ".tmp")
    try:
        tmp.write_text("\n".join(exp.lines) + "\n")
        tmp.replace(output)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{output}: cannot write: {e.strerror}") from None
    console.print(f"wrote {output}: {exp.written} GEMMs (Validator PT_VERSION={version})")
    for key, reason in exp.skipped:
        console.print(f"  [yellow]not expressible[/yellow] {report.short_label(key)}: {reason}")


def tunableop_show(files: list[Path], console: Console) -> None:
    """The problem keys TunableOp files name, and why any line gives none."""
    imported = tunableop.import_files(files)
    for f in imported.files:
        validators = ", ".join(f"{k}={v}" for k, v in f.validators.items()) or "none"
        console.print(
            f"{f.path}: {f.kind} file, {len(f.entries)} GEMM lines, validators: {validators}"
        )
    for key, (path, entry) in imported.found.items():
        console.print(f"{path.name}:{entry.line} {entry.op},{entry.params} -> {key}")
    for path, entry, reason in imported.skipped:
        console.print(f"[yellow]skipped[/yellow] {path.name}:{entry.line} {entry.op}: {reason}")

"""Offline tuning of many problems on every local GPU: resumable, with a per-problem and a total
time limit. ``ProblemSet`` (``problem_set``) gathers the keys, ``journal.pending`` drops those
tuned already, ``run`` tunes the rest with one ``RunSettings``.

- **Workers.** One process per local GPU (one on the CPU), pinned to its GPU, supervised by
  ``tuner.tuning.supervisor``; each is handed keys one at a time down its own pipe (so the run
  knows what a worker held when it dies), tunes them with ``tuner.tuning.tune`` and commits
  each problem's measurements and winner in one transaction.
- **Resumable.** A problem with a winner for this device class and these versions is skipped, so
  a killed run (even SIGKILL) loses at most the problems in flight; workers die with the parent.
- **Compiling ahead.** One compile pool for the run (``tuner.tuning.compile_pool``) gets every
  problem up front, in the run's order: while a worker times problem i, the CPU cores compile
  the next ones. An idle worker is handed the first pending problem whose kernels are compiled,
  so the GPU never waits for one problem's compile while another's is done. Where none is, a
  problem waiting only for kernels that serve every shape (CUTLASS's, compiled once for the whole
  run) gets a *first pass*: every other candidate timed and duelled, its verdict held by the run
  (not stored); once those kernels are built its second pass times their candidates alone and
  duels them against what the first pass settled. A second pass that ends without a verdict of
  its own (cut off by its limit, crashed, or given no time) keeps the first pass's, as a timeout
  keeps the baseline; so does a problem whose run stopped before its second pass (``partial``:
  tuned again by a later run, not counted as a failure).
- **Budgets.** A problem past ``problem_timeout_s`` has its worker killed (that also covers a
  candidate that hangs or breaks its CUDA context): it is recorded as ``timeout``, keeps the
  best it measured (its baseline, which no challenger beat in a finished duel) as its winner,
  and a fresh worker takes the slot. The limit holds over both passes of a problem: its second
  gets what its first left, and none where nothing is left. Past ``time_limit_s`` no new
  problem starts.
- **Retries.** A problem that failed or timed out is tried again by later runs at most
  ``retries`` times, after every other problem, the longest-failing last (``order``).
- **Failures** (the baseline itself failing, a crashed worker) are recorded and the run goes on.
- **Ctrl-C** lets the problems in flight finish; a second Ctrl-C, or a SIGTERM, kills them; the
  run still ends with its report.

Every finished problem also gets a line in the *journal* (``tuner.offline.journal``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing import connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tuner.cache import ReadOnlyError, Store
from tuner.core.device import Fingerprint, too_big_here
from tuner.core.keys import GemmKey, Key
from tuner.measure.records import Measurement, Winner
from tuner.offline.journal import (
    KEPT_BASELINE,
    KEPT_EARLIER,
    KEPT_FIRST_PASS,
    PARTIAL,
    append_journal,
    journal_path,
    journal_records,
    kept_runs,
)
from tuner.offline.run_settings import RunSettings
from tuner.tuning import compile_pool, pruning
from tuner.tuning.compile_pool import CompilePool
from tuner.tuning.engine import TuneOutcome
from tuner.tuning.isolation import runtime_sources
from tuner.tuning.supervisor import CTX, Child, Supervised
from tuner.tuning.verdict import effective_us

log = logging.getLogger(__name__)

PARKED = "parked"  # a first pass's result: not final, never journaled
# a worker's word that the cache refused a write (read-only, the disk full): the run stops, and
# the problem it held stays pending, not failed (it is no fault of the problem's)
UNWRITABLE = "unwritable"
STOPPED_UNWRITABLE = "cache not writable"
STOPPED_NO_WORKER = "no worker could start"


# --- running -----------------------------------------------------------------------------------


@dataclass
class Result:
    key: Key
    status: str  # one of journal.STATUSES, or PARKED (a first pass's, never journaled)
    seconds: float
    worker: int
    device_class: str = ""
    winner: dict[str, Any] | None = None  # Winner.to_row() when tuned, or kept at a timeout
    error: str = ""
    wait_s: float = 0.0  # of ``seconds``: waiting for this problem's kernels to compile
    compile_s: float | None = None  # the compile pool's time on this problem (off the GPU)
    compiled: int | None = None  # candidates the compile pool compiled (or found compiled)
    pruned: dict[str, int] = field(default_factory=dict)  # left out uncompiled, by rule
    phases: dict[str, float] = field(default_factory=dict)  # of ``seconds`` (engine.PHASES)
    first_pass_s: float | None = None  # of ``seconds``: its first pass's (None: tuned whole)
    first_pass: TuneOutcome | None = None  # a first pass's outcome, for its second; not journaled


@dataclass
class RunSummary:
    results: list[Result]
    wall_s: float
    workers: int
    stopped: str = ""  # "" (finished), "ctrl-c", "SIGTERM", "time limit", STOPPED_*
    not_started: list[Key] = field(default_factory=list)
    idle_s: float = 0.0  # worker time idle while every pending problem was still compiling
    shared_compile_s: float | None = None  # the compile pool's shared job (kernels of all shapes)
    start_s: float | None = None  # until the first worker was ready (imports, device start)
    unwritable: str = ""  # why the run stopped, where the cache refused a write


@dataclass
class FirstPass:
    """A problem's first pass, held by the run until its shared kernels are compiled: the
    second pass goes on from it (``engine.tune``'s ``first_pass``); its times (its ``Result``'s,
    the wait for its own kernels included) count in the problem's."""

    outcome: TuneOutcome
    seconds: float
    wait_s: float  # of ``seconds``: waiting for its own kernels
    phases: dict[str, float]  # of ``seconds``
    spent_s: float  # of the problem's limit (its wait before the limit started is not)
    worker: int  # the slot that ran it
    device_class: str

    @classmethod
    def of(cls, result: Result, spent_s: float) -> FirstPass:
        assert result.first_pass is not None
        return cls(result.first_pass, result.seconds, result.wait_s, dict(result.phases), spent_s,
                   result.worker, result.device_class)  # fmt: skip

    def add_to(self, result: Result) -> None:
        """``result`` (how its second pass ended: tuned, failed, cut off) as the problem's:
        both passes' times."""
        result.seconds += self.seconds
        result.first_pass_s = self.seconds
        result.wait_s += self.wait_s
        for name, seconds in self.phases.items():
            result.phases[name] = result.phases.get(name, 0.0) + seconds


@dataclass
class Task:
    """One problem handed to a worker: whole, its first pass (``first``: if its shared kernels
    are still compiling once its own are), or its second (``parked``)."""

    key: Key
    retune: bool
    first: bool = False
    parked: FirstPass | None = None


# ("ready", (slot, device_class)) | ("start", (slot, key)) | ("parked", (slot, key)): a first
# pass ended | ("result", Result) | ("notice", text)
Event = tuple[str, Any]


def local_workers(requested: int | None) -> tuple[int, list[int | None]]:
    """(number of workers, the CUDA device of each: None on the CPU)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = requested or max(1, gpus)
    return n, [i % gpus if gpus else None for i in range(n)]


def run(
    keys: list[Key],
    store_path: Path,
    settings: RunSettings,
    *,
    on_event: Callable[[Event], None] | None = None,
    retune: set[str] | None = None,
) -> RunSummary:
    """Tune ``keys`` in worker processes; results are in the store as soon as each is done.
    Keys in ``retune`` are tuned even where a winner is stored (one an unfinished run kept)."""
    _, devices = local_workers(settings.workers)
    compiler = None
    if settings.compile_ahead and keys:
        compiler = CompilePool(
            keys, settings.tune, "cpu" if devices[0] is None else "cuda",
            jobs=settings.compile_jobs, sources=runtime_sources(),
        )  # fmt: skip
    pool = _Pool(store_path.resolve(), settings, devices, on_event or (lambda e: None), compiler)
    try:
        if compiler is not None:
            compiler.start()
        return pool.run(keys, retune or set())
    finally:
        if compiler is not None:
            compiler.close()


@dataclass
class _Slot:
    index: int
    worker: Supervised
    device_class: str = ""
    ready: bool = False
    done: bool = False  # exited after its sentinel or the stop signal
    task: Task | None = None  # handed to the worker, not finished (announced or not)
    ending: bool = False  # handed its sentinel
    key: Key | None = None  # the problem in flight (its task announced)
    started: float = 0.0
    start_failures: int = 0  # its workers that died before "ready", since one was last ready
    fresh: bool = True  # has not started a problem yet
    waiting: bool = False  # its problem was handed out before the compile pool had compiled it
    measured: list[Measurement] = field(default_factory=list)  # of the problem in flight

    @property
    def child(self) -> Child:
        assert self.worker.child is not None
        return self.worker.child


class _Pool:
    def __init__(
        self,
        store_path: Path,
        settings: RunSettings,
        devices: list[int | None],
        emit: Callable[[Event], None],
        compiler: CompilePool | None = None,
    ) -> None:
        self.store_path, self.settings, self.emit = store_path, settings, emit
        self.compiler = compiler
        events = compiler.events if compiler else {}
        self.journal = journal_path(store_path)
        self.stop = CTX.Event()
        self.slots = [
            _Slot(i, Supervised(worker_main, (i, d, str(store_path), settings, self.stop, events,
                                              runtime_sources()),
                                name=f"tune-all-{i}"))
            for i, d in enumerate(devices)
        ]  # fmt: skip
        self.results: list[Result] = []
        self.backlog: list[Key] = []  # not yet handed to a worker, in the run's order
        self.retune: set[str] = set()  # keys tuned even where a winner is stored
        self.rank: dict[str, int] = {}  # each key's place in the run's order
        self.parked: dict[str, FirstPass] = {}  # first passes done, second passes not
        self.first_out: set[str] = set()  # first passes handed out, not ended
        self.idle_s = 0.0  # worker time spent idle while every pending problem was compiling
        self.started = 0.0
        self.start_s: float | None = None  # until the first worker was ready
        self.interrupts = 0  # Ctrl-C presses seen by the signal handler
        self.handled = 0  # ... and acted upon
        self.terminated = False  # SIGTERM seen
        self.stopped = ""
        self.unwritable = ""  # why the cache refused a write, where it did
        self.journal_failed = False  # a journal line could not be written

    # lifecycle

    def run(self, keys: list[Key], retune: set[str]) -> RunSummary:
        started = self.started = time.perf_counter()
        self.backlog, self.retune = list(keys), retune
        self.rank = {str(k): i for i, k in enumerate(keys)}
        with self._signal_flags():
            for slot in self.slots:
                self._spawn(slot)
            try:
                while not all(s.done for s in self.slots):
                    self._step(started)
                self._keep_parked(keys)
            finally:
                self._kill_all()
        finished = {r.key for r in self.results}
        shared = self.compiler.result(compile_pool.SHARED) if self.compiler else None
        return RunSummary(
            self.results,
            time.perf_counter() - started,
            len(self.slots),
            self.stopped,
            [k for k in keys if k not in finished],
            idle_s=self.idle_s,
            shared_compile_s=shared.seconds if shared else None,
            start_s=self.start_s,
            unwritable=self.unwritable,
        )

    @contextlib.contextmanager
    def _signal_flags(self):
        """Ctrl-C and SIGTERM set flags the loop reads, instead of raising in the middle of a
        step. SIGTERM (``timeout``, ``docker stop``) counts as two Ctrl-C: stop at once, report."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_int(signum: int, frame: Any) -> None:
            self.interrupts += 1

        def on_term(signum: int, frame: Any) -> None:
            self.terminated = True
            self.interrupts += 2

        previous = {
            signal.SIGINT: signal.signal(signal.SIGINT, on_int),
            signal.SIGTERM: signal.signal(signal.SIGTERM, on_term),
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, slot: _Slot) -> None:
        """Start the slot's worker: at the run's start, or a replacement, fresh as the first."""
        slot.worker.restart()
        slot.ready, slot.task, slot.ending, slot.key, slot.measured = False, None, False, None, []
        slot.fresh = True

    def _kill_all(self) -> None:
        """Kill the workers; one that said "exit" first gets time to shut down cleanly, so that
        its own children (compile pool, isolated candidate process) exit with it."""
        for s in self.slots:
            s.worker.close(grace_s=30 if s.done else 0)

    # the loop

    def _step(self, started: float) -> None:
        live = [s.child.conn for s in self.slots if not s.done]
        t0 = time.perf_counter()
        idle = self._feed()
        for conn in connection.wait(live, timeout=0.2):
            slot = next(s for s in self.slots if s.child.conn is conn)
            try:
                self._on_message(slot, conn.recv())
            except (EOFError, OSError):
                self._on_exit(slot)
        now = time.perf_counter()
        self.idle_s += idle * (now - t0)
        for slot in self.slots:
            if slot.key and not slot.waiting and now - slot.started > self._limit(slot.key):
                slot.child.kill()
                self._drain(slot)  # what it finished before the kill stands
                if slot.key is not None and not self._keep_committed(slot):
                    limit = self.settings.problem_timeout_s
                    passes = " over its two passes" if str(slot.key) in self.parked else ""
                    self._finish(
                        slot, "timeout", f"ran past the per-problem limit of {limit:g} s{passes}"
                    )
                self._replace(slot)
        self._on_interrupts()
        limit = self.settings.time_limit_s
        if limit is not None and now - started > limit and not self.stop.is_set():
            self._halt("time limit", f"total time limit of {limit:g} s reached: no new problems")

    def _feed(self) -> int:
        """Hand each idle worker a problem (``_pick``); once none is pending and no first pass is
        out, its sentinel. Returns how many workers stay idle only because every pending problem
        is still compiling."""
        if self.stop.is_set():
            return 0
        idle = [s for s in self.slots if s.ready and not s.done and not s.ending and not s.task]
        if not self.backlog and not self.first_out:
            for slot in idle:
                self._hand(slot, None)
            return 0
        waiting = 0
        for slot in idle:
            pick = self._pick(slot.fresh) if self.backlog else None
            if pick is None:
                waiting += bool(self.backlog)
                continue
            index, first = pick
            key = self.backlog[index]
            parked = None if first else self.parked.get(str(key))
            if not self._hand(slot, Task(key, str(key) in self.retune, first, parked)):
                continue
            del self.backlog[index]
            if first:
                self.first_out.add(str(key))
        return waiting

    def _hand(self, slot: _Slot, task: Task | None) -> bool:
        """Send ``task`` (None: the sentinel) down the worker's own pipe, so that the run knows
        what a worker held if it dies before it announces it. False where the worker is dead
        already: it never held the task, which stays the run's; its pipe's end replaces it
        (``_on_exit``)."""
        try:
            slot.child.conn.send(task)
        except OSError:
            return False
        slot.task, slot.ending = task, task is None
        slot.measured = list(task.parked.outcome.measurements) if task and task.parked else []
        return True

    def _pick(self, fresh: bool) -> tuple[int, bool] | None:
        """The backlog's index of the problem to hand out next, and whether as a first pass:
        the first whose kernels are compiled (in the run's order among those), so the GPU times
        what is ready while the rest compiles; else the first pass of the first problem that
        waits only for its shared kernels; else, to a worker that has not started a problem
        yet, the first problem even while it compiles (the worker waits for its own kernels
        outside the problem's time limit, then runs a first pass if the shared ones are still
        compiling). None: nothing to hand out now."""
        ready = (i for i, key in enumerate(self.backlog) if self._compiled(key))
        if (whole := next(ready, None)) is not None:
            return whole, False
        unparked = [i for i, key in enumerate(self.backlog) if str(key) not in self.parked]
        waiting_shared = (i for i in unparked if self._job_done(self.backlog[i]))
        first = next(waiting_shared, unparked[0] if fresh and unparked else None)
        return None if first is None else (first, True)

    def _compiled(self, key: Key) -> bool:
        return self.compiler is None or self.compiler.ready(key)

    def _job_done(self, key: Key) -> bool:
        return self.compiler is None or self.compiler.job_done(key)

    def _park(self, slot: _Slot, result: Result) -> None:
        """Hold a first pass until its problem's shared kernels are compiled; the problem goes
        back to the backlog, at its place in the run's order. A first pass that used up the
        problem's limit leaves no time for a second: its verdict stands, as a timeout."""
        name = str(result.key)
        self.first_out.discard(name)
        self.parked[name] = FirstPass.of(result, time.perf_counter() - slot.started)
        if self._limit(result.key) <= 0:
            self._no_time_left(slot, result.key)
            return
        at = next(
            (i for i, key in enumerate(self.backlog) if self.rank[str(key)] > self.rank[name]),
            len(self.backlog),
        )
        self.backlog.insert(at, result.key)
        self.emit((PARKED, (slot.index, result.key)))

    def _no_time_left(self, slot: _Slot, key: Key) -> None:
        """A first pass that used up its problem's limit: the problem ends as a timeout, with its
        first pass's verdict (as a second pass cut off would leave it)."""
        limit = self.settings.problem_timeout_s
        error = f"its first pass used up the per-problem limit of {limit:g} s"
        result = Result(key, "timeout", 0.0, slot.index, slot.device_class, error=error)
        self._keep_first_pass(result, self.parked[str(key)].outcome.measurements)
        self._record(result)

    def _keep_parked(self, keys: list[Key]) -> None:
        """A run that stopped between a problem's two passes, or aborted its second, keeps its
        first pass's verdict, served meanwhile (``PARTIAL``), with what both passes measured; a
        run that finished has no problem parked."""
        for key in [k for k in keys if str(k) in self.parked]:
            first = self.parked[str(key)]
            slot = next((s for s in self.slots if s.key == key), None)  # its second pass ran
            error = "the run " + (
                "aborted its second pass" if slot else "stopped before its second pass"
            )
            result = Result(key, PARTIAL, 0.0, first.worker, first.device_class, error=error)
            self._keep_first_pass(result, slot.measured if slot else first.outcome.measurements)
            self._record(result)

    def _on_interrupts(self) -> None:
        """First Ctrl-C: no new problems; the next one (or SIGTERM): kill those in flight too."""
        new, self.handled = self.interrupts - self.handled, self.interrupts
        if not new:
            return
        why = "SIGTERM" if self.terminated else "ctrl-c"
        if self.stopped not in ("ctrl-c", "SIGTERM"):
            then = "SIGTERM: no new problems" if self.terminated else (
                "stopping: problems in flight finish (Ctrl-C again to abort them)"
            )  # fmt: skip
            self._halt(why, then)
            new -= 1
        if new:
            self.stopped = why
            self.emit(("notice", "aborting the problems in flight"))
            self._abort()

    def _abort(self) -> None:
        """Kill every worker, then keep what each finished before it died: a result already in
        its pipe, or a problem whose run it committed but had no time to report. A problem whose
        winner is stored is never reported pending, nor left out of the journal."""
        for s in self.slots:
            if s.worker.child is not None:
                s.child.kill()
        for s in self.slots:
            if s.worker.child is not None:
                self._drain(s)
                self._keep_committed(s)
            s.done = True
        self._kill_all()

    def _drain(self, slot: _Slot) -> None:
        """Handle the messages a killed worker sent before it died."""
        conn = slot.child.conn
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                self._on_message(slot, conn.recv())

    def _keep_committed(self, slot: _Slot) -> bool:
        """Record the slot's problem as tuned where its worker committed its run but died (or was
        killed) before reporting it: a stored winner is never overwritten by a lesser verdict."""
        if slot.key is None or (winner := self._committed(slot)) is None:
            return False
        seconds = time.perf_counter() - slot.started
        key, slot.key, slot.task = slot.key, None, None
        self._record(Result(key, "tuned", seconds, slot.index, slot.device_class, winner))
        return True

    def _committed(self, slot: _Slot) -> dict[str, Any] | None:
        """The stored winner of the slot's problem where this run committed it, else None."""
        runs = {m.run_id for m in slot.measured}
        with Store(self.store_path) as store:
            winner = store.winner(slot.device_class, str(slot.key))
        return winner.to_row() if winner is not None and winner.run_id in runs else None

    def _halt(self, why: str, notice: str) -> None:
        self.stopped = why
        self.stop.set()
        self.emit(("notice", notice))

    def _limit(self, key: Key) -> float:
        """The seconds a pass of ``key`` may run: the problem's limit holds over both its passes,
        so a second pass gets what its first left."""
        parked = self.parked.get(str(key))
        return self.settings.problem_timeout_s - (parked.spent_s if parked else 0.0)

    def _on_message(self, slot: _Slot, msg: tuple[str, Any]) -> None:
        kind, data = msg
        if kind == "ready":
            slot.ready, slot.device_class = True, data
            if self.start_s is None:
                self.start_s = time.perf_counter() - self.started
            self.emit(("ready", (slot.index, data)))
        elif kind == "start":
            key, first = data
            parked = self.parked.get(str(key))
            slot.key, slot.started, slot.fresh = key, time.perf_counter(), False
            slot.measured = list(parked.outcome.measurements) if parked else []
            # a first pass waits for its own job only
            slot.waiting = not (self._job_done(key) if first else self._compiled(key))
            self.emit(("start", (slot.index, key)))
        elif kind == "compiled" and slot.waiting and slot.key == data:
            slot.started, slot.waiting = time.perf_counter(), False  # its limit starts now
        elif kind == "measurement":
            slot.measured.append(Measurement.from_row(data))
        elif kind == "result":
            slot.key = slot.task = None
            self._on_result(slot, data)
        elif kind == "exit":
            slot.done = True
        elif kind == UNWRITABLE:
            self._unwritable(slot, data)

    def _unwritable(self, slot: _Slot, why: str) -> None:
        """The cache refused a worker's write: no problem of this run can be stored, so none
        starts; the one it held is not recorded (nothing of it was stored; a later run tunes it,
        not counting it against ``--retries``), nor is the worker replaced."""
        slot.key = slot.task = None
        slot.done = True
        self._cache_refused(why)

    def _cache_refused(self, why: str) -> None:
        """Stop the run, once, on the first write the cache refused (a stop already under way,
        a Ctrl-C, keeps its own reason; the refusal is still what the run ends by)."""
        if self.unwritable:
            return
        self.unwritable = why
        if not self.stop.is_set():
            self._halt(STOPPED_UNWRITABLE, f"stopping: {why}")

    def _on_result(self, slot: _Slot, result: Result) -> None:
        """A worker's task ended: a first pass waits for its second; a second pass that failed
        (it raised) keeps its first pass's verdict, as one cut off does."""
        if result.status == PARKED:
            self._park(slot, result)
            return
        if result.status == "failed" and str(result.key) in self.parked:
            result.error = f"second pass: {result.error}"
            self._keep_first_pass(result, slot.measured)
        self._record(result)

    def _on_exit(self, slot: _Slot) -> None:
        """The worker's pipe closed: a clean exit after "exit", else a crash."""
        slot.child.join(timeout=10)
        if slot.done:
            return
        code = slot.child.exitcode
        if (slot.key or slot.task) and not self._keep_committed(slot):
            when = "while tuning" if slot.key else "before it started"
            self._finish(slot, "failed", f"worker died (exit code {code}) {when} this problem")
        slot.start_failures = 0 if slot.ready else slot.start_failures + 1
        if slot.start_failures >= 2:
            self._give_up(slot, code)
            return
        self._replace(slot)

    def _give_up(self, slot: _Slot, code: int | None) -> None:
        """A slot whose worker died twice before it was ready (its GPU or its imports broken)
        is not started again; the other workers go on, and where none is left the run stops."""
        slot.done = True
        self.emit(("notice", f"worker {slot.index} failed to start twice (exit code {code}): "
                             "its device takes no more problems"))  # fmt: skip
        if all(s.done and not s.ready for s in self.slots) and not self.stop.is_set():
            self._halt(STOPPED_NO_WORKER, "stopping: no worker could start")

    def _replace(self, slot: _Slot) -> None:
        """A fresh worker takes a dead one's slot, unless the run is stopping."""
        if self.stop.is_set():
            slot.done = True
            return
        self._spawn(slot)

    def _finish(self, slot: _Slot, status: str, error: str) -> None:
        """Record the slot's problem as its worker left it (killed at its limit, or dead); one
        never announced took no time."""
        key = slot.key or (slot.task.key if slot.task else None)
        assert key is not None
        seconds = time.perf_counter() - slot.started if slot.key else 0.0
        result = Result(key, status, seconds, slot.index, slot.device_class, error=error)
        if str(key) in self.parked:
            self._keep_first_pass(result, slot.measured)
        elif status == "timeout" and (base := self._baseline(slot.measured)) is not None:
            self._keep(result, slot.measured, base, KEPT_BASELINE)
        slot.key = slot.task = None
        self._record(result)

    def _baseline(self, measured: list[Measurement]) -> Winner | None:
        """A problem cut off by its limit keeps its baseline as its winner (no challenger
        finished its duel): served meanwhile, tuned again by a later run."""
        base = next((m for m in measured if m.is_baseline and m.status == "ok"), None)
        if base is None or base.median_us is None:
            return None
        us = effective_us(base, self.settings.tune.launch)
        return Winner(
            device_class=base.device_class, key=base.key, source=base.source, params=base.params,
            median_us=us, baseline_us=us, versions=base.versions, run_id=base.run_id,
            launch=base.launch,
        )  # fmt: skip

    def _keep_first_pass(self, result: Result, measured: list[Measurement]) -> None:
        """A second pass that ends without a verdict of its own (cut off, crashed, no time left)
        leaves the problem its first pass's, stored with what both passes measured."""
        verdict = self.parked[str(result.key)].outcome.winner
        self._keep(result, measured, verdict, KEPT_FIRST_PASS)

    def _keep(
        self, result: Result, measured: list[Measurement], verdict: Winner, ending: str
    ) -> None:
        """Store what a problem cut short measured and the verdict it kept, served meanwhile;
        its status stays what ended it, so a later run tunes it again, and its error ends saying
        what it serves (``ending``). The winner stored before, current here, stays and is
        served (``KEPT_EARLIER``) where it is a finished run's (a ``--force`` re-tune cut short,
        another process's) or an unfinished run's as fast as the new verdict."""
        result.pruned = pruning.count(measured)
        kept = kept_runs(journal_records(self.store_path))  # read before the store's write lock
        try:
            with Store(self.store_path) as store:
                held = store.save_run_unless_held(
                    measured, verdict, lambda stored: outranks(stored, verdict, kept)
                )
        except ReadOnlyError as e:
            result.pruned, result.error = {}, result.error + "; nothing of it stored"
            self._cache_refused(str(e))
            return
        if held is not None:
            result.winner, result.error = held.to_row(), result.error + KEPT_EARLIER
        else:
            result.winner, result.error = verdict.to_row(), result.error + ending

    def _record(self, result: Result) -> None:
        """Journal and announce a finished problem, with what the compile pool did for it and
        its first pass's times, where it had one."""
        self.first_out.discard(str(result.key))
        if (parked := self.parked.pop(str(result.key), None)) is not None:
            parked.add_to(result)
        done = self.compiler.result(result.key) if self.compiler else None
        if done is not None:
            result.compile_s, result.compiled = done.seconds, done.compiled
        if result.status != "skipped":
            try:
                append_journal(self.journal, _journal_record(result))
            except OSError as e:  # the disk full: the cache holds what was stored, the run goes on
                if not self.journal_failed:
                    self.emit(("notice", f"journal {self.journal} not written: {e.strerror}; "
                                         "the report lacks this run's times and failures, and "
                                         "later runs its retries and cut-short problems"))  # fmt: skip
                self.journal_failed = True
        self.results.append(result)
        self.emit(("result", result))


def outranks(held: Winner, verdict: Winner, kept: set[str]) -> bool:
    """Whether the stored winner ``held`` is to stay rather than a problem's kept verdict:
    current here (these versions, this launch mode), and either a finished run's (told by its
    run, not its key: ``kept`` are the runs whose verdicts were kept, as the journal shared by
    every process on this cache names them) or at least as fast."""
    if held.versions != verdict.versions or held.launch_mode != verdict.launch_mode:
        return False
    return held.run_id not in kept or held.median_us <= verdict.median_us


def _journal_record(r: Result) -> dict[str, Any]:
    """``r`` as a journal line; its ``run_id`` is the run whose winner this attempt stored (none
    where it kept the winner stored before: that run's verdict is not this attempt's)."""
    rec = {k: v for k, v in asdict(r).items() if k not in ("key", "winner", "first_pass")}
    rec["key"] = str(r.key)
    kept_earlier = r.error.endswith(KEPT_EARLIER)
    rec["run_id"] = "" if kept_earlier else (r.winner or {}).get("run_id", "")
    rec["at"] = time.time()
    return rec


# --- the worker process ------------------------------------------------------------------------


def worker_main(
    conn: Connection,
    index: int,
    device: int | None,
    store_path: str,
    settings: RunSettings,
    stop: Any,
    compiled: dict[str, Any],
    sources: dict[str, str],
) -> None:
    """Take tasks from the parent, down ``conn``, until the sentinel or the stop signal; commit
    each problem when it is done.
    Each measurement goes to the parent as it is made (a problem cut off keeps them);
    ``compiled`` holds the run's compile-pool events, one per key; ``sources``: the parent's
    run-time sources (``runtime_sources``), registered here too."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent decides; it dies, so do we
        signal.signal(sig, signal.SIG_IGN)
    if device is not None:  # before any CUDA call: this GPU becomes device 0, here and in children
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(device + 1)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[device]
    from tuner.core.device import fingerprint
    from tuner.tuning.isolation import register_sources

    for bad in register_sources(sources):
        log.warning("tune-all worker %d: source not available: %s", index, bad)
    fp = fingerprint("cuda" if device is not None else "cpu")

    def measured(m: Measurement) -> None:
        conn.send(("measurement", m.to_row()))

    with Store(store_path) as store:
        try:
            store.save_device(fp)
        except ReadOnlyError as e:  # the disk full, ...: no problem can be stored
            conn.send((UNWRITABLE, str(e)))
            conn.send(("exit", None))
            return
        conn.send(("ready", fp.device_class))
        while not stop.is_set():
            if not conn.poll(0.5):
                continue
            task = conn.recv()
            if task is None:
                break
            conn.send(("start", (task.key, task.first)))
            waited = 0.0
            if task.first and compiled:  # a first pass only while its shared kernels compile
                waited = _wait_compiled(conn, compiled, task.key, shared=False)
                task.first = not compile_pool.ready(compiled, task.key)
            wait = (
                functools.partial(_wait_compiled, conn, compiled, task.key, not task.first)
                if compiled
                else None
            )
            try:
                result = _tune_one(task, store, fp, settings, index, measured, wait)
            except ReadOnlyError as e:  # its run could not be stored: no fault of the problem's
                conn.send((UNWRITABLE, str(e)))
                break
            if waited:  # as the engine's own wait counts: in its time, as compiling
                result.seconds += waited
                result.wait_s += waited
                result.phases["compile"] = result.phases.get("compile", 0.0) + waited
            conn.send(("result", result))
    conn.send(("exit", None))


def _wait_compiled(conn: Connection, compiled: dict[str, Any], key: Key, shared: bool) -> float:
    """Wait until the compile pool compiled ``key`` (its shared kernels too where ``shared``),
    then tell the parent (the problem's time limit starts there); the seconds waited."""
    waited = compile_pool.wait(compiled, key, shared=shared)
    conn.send(("compiled", key))
    return waited


def _tune_one(
    task: Task,
    store: Store,
    fp: Fingerprint,
    settings: RunSettings,
    index: int,
    on_result: Callable[[Measurement], None],
    compiled: Callable[[], Any] | None,
) -> Result:
    """Tune ``task``'s problem and commit it; a first pass commits nothing (``PARKED``)."""
    from tuner.tuning.engine import earlier_times, first_pass_options
    from tuner.tuning.tune import tune

    key = task.key
    t0 = time.perf_counter()
    existing = store.winner(fp.device_class, str(key))
    if (
        not (settings.force or task.retune)
        and existing is not None
        and existing.measured_under(fp)
        and existing.launch_mode == settings.tune.launch
    ):
        return Result(key, "skipped", 0.0, index, fp.device_class, existing.to_row())
    if isinstance(key, GemmKey) and (why := too_big_here(key.min_bytes)):
        return Result(key, "failed", 0.0, index, fp.device_class, error=why)
    earlier = earlier_times(store.measurements(fp.device_class, str(key)), settings.tune.launch)
    options = first_pass_options(key.op, settings.tune) if task.first else settings.tune
    parked = task.parked
    try:
        outcome = tune(
            key, options=options, on_result=on_result, compiled=compiled, earlier=earlier,
            first_pass=parked.outcome if parked else None,
        )  # fmt: skip
    except Exception as e:  # the baseline failed, or the problem cannot be set up here
        error = f"{type(e).__name__}: {e}"[:2000]
        return Result(key, "failed", time.perf_counter() - t0, index, fp.device_class, error=error)
    status = PARKED if task.first else "tuned"
    if not task.first:
        store.save_run(outcome.measurements, outcome.winner)
    result = Result(
        key, status, outcome.seconds, index, fp.device_class, outcome.winner.to_row(),
        wait_s=outcome.compile_s, pruned=outcome.pruned, phases=dict(outcome.phases),
    )  # fmt: skip
    if task.first:
        result.first_pass = outcome
    return result

"""One compile pool for a whole tuning run: every problem's shortlists compiled ahead, in order.

Compiling is most of a cold run and needs no GPU time, so a run hands every problem to the pool
up front, in the order it will tune them: while the GPU times problem i, the CPU cores compile
problem i+1 and later ones. A job compiles one problem: each source's shortlist, less what
``pruning`` drops by tile, goes through ``Source.precompile`` into the on-disk kernel caches
(Triton's, CUTLASS's), where the tuning process's ``build`` finds it. Jobs run in spawned
processes (capture hooks and CUDA state stay out of the process that times), ``jobs`` at a time,
and the cores are split between them (``TUNER_COMPILE_WORKERS``, ``TUNER_CUTLASS_JOBS``).
They run at a lower CPU priority (``COMPILE_NICENESS``, inherited by nvcc and Triton's workers)
and off one physical core (``compile_cpus``), which stays free for the tuning process (not
pinned there: the scheduler moves it to the idle core): a launch slowed by a busy CPU inflates
the host time per call that the engine weighs against the baseline's (and its probe cut-off), so
a contended run would turn down winners that an idle one keeps, and a niced compiler on the
timing thread's CPU or its hyperthread sibling still slows it.

Sources whose kernels serve every shape (``Source.shares_kernels``: CUTLASS) are not compiled
per problem: one *shared* job takes the union of every problem's shortlists for them, so each
kernel is compiled once per run, on every core, the earliest needed first, and marks each
problem ready as soon as its own kernels are. A run whose sources share none (none asked for, or
none available on its device) has no shared job: its problems are ready once their own jobs are.

A problem is compiled once both its job and its share of the shared job ended (``ready``). The
process that tunes waits only for its own problem (``wait``), through events made before the
tuning processes start, so a replaced worker waits on the same ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import connection, util
from pathlib import Path
from types import FrameType
from typing import Any

from tuner.candidates import registry
from tuner.candidates.base import Params, Source
from tuner.core.keys import Key
from tuner.core.lifetime import exit_when_orphaned
from tuner.tuning.engine import TuneOptions, candidate_shortlists
from tuner.tuning.pruning import prune_challengers
from tuner.tuning.supervisor import CTX
from tuner.tuning.trials import short_error

log = logging.getLogger(__name__)


@dataclass
class Compiled:
    """What the pool did for one problem (or, for the shared job, for the whole run)."""

    key: str
    seconds: float = 0.0
    compiled: int = 0  # candidates kept for compiling (a problem's own and its shared kernels')
    pruned: dict[str, int] = field(default_factory=dict)  # rule -> candidates left out
    errors: list[str] = field(default_factory=list)


SourceList = tuple[Source, list[Params]]
SHARED = "shared kernels"  # the shared job's ``Compiled.key``


def default_jobs(cpus: int | None = None) -> int:
    """Problems compiled at once: a source compiles one problem's shortlist over many cores
    itself, so a few jobs keep every core busy between a problem's stragglers."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(4, cpus // 4))


COMPILE_NICENESS = 10  # added to the pool's processes' niceness: compiling yields to timing
MIN_CPUS_TO_SPARE = 4  # below this many CPUs, compiling keeps them all
STOP_GRACE_S = 10.0  # for a job process to die of ``close``'s SIGTERM before it is killed


def thread_siblings(cpu: int) -> set[int]:
    """The logical CPUs of ``cpu``'s physical core (Linux sysfs; just ``cpu`` where unknown)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {cpu}
    found: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        found.update(range(int(lo), int(hi or lo) + 1))
    return found or {cpu}


def compile_cpus(
    cpus: set[int], siblings: Callable[[int], set[int]] = thread_siblings
) -> set[int] | None:
    """The CPUs compile processes may use: all of ``cpus`` but the first one's physical core,
    left free for the tuning process. None (keep them all) where fewer than
    ``MIN_CPUS_TO_SPARE`` are available or sparing the core would leave none."""
    if len(cpus) < MIN_CPUS_TO_SPARE:
        return None
    left = cpus - siblings(min(cpus))
    return left or None


def usable_cpus() -> set[int] | None:
    """The CPUs this process's compile jobs run on (``compile_cpus`` of its own), or None where
    the platform cannot pin processes or nothing is spared."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return compile_cpus(os.sched_getaffinity(0))


_READY: dict[str, Any] = {}  # in the shared job's process: key -> its shared-kernels event


def _release_and_die(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (``CompilePool.close``) in a job process: release the semaphores this process
    made (the queues of Triton's compile workers), then die of the signal. Killed holding them,
    the run's resource tracker warns of "leaked semaphore objects" as the run exits; a clean
    exit would release them but then wait for those workers, which outlive it. A second SIGTERM
    (the executor sends one once it sees a process die) must not cut this short."""
    signal.signal(signum, signal.SIG_IGN)
    util._run_finalizers(0)  # a clean exit's first step (private API)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _start_job_process(
    parent: int, cores: int, sources: dict[str, str], ready: dict[str, Any] | None = None
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's to handle
    signal.signal(signal.SIGTERM, _release_and_die)
    exit_when_orphaned(parent)  # also when the run died while this process was starting
    os.nice(COMPILE_NICENESS)
    if allowed := usable_cpus():
        os.sched_setaffinity(0, allowed)  # inherited by nvcc and Triton's compile workers
    os.environ.setdefault("TUNER_COMPILE_WORKERS", str(cores))
    os.environ.setdefault("TUNER_CUTLASS_JOBS", str(cores))
    _READY.update(ready or {})
    from tuner.tuning.isolation import register_sources

    for bad in register_sources(sources):
        log.warning("compile pool: source not available: %s", bad)


def _kept(key: Key, options: TuneOptions, device: str, out: Compiled) -> Iterator[SourceList]:
    """``key``'s sources, each with its tile-pruned shortlist; what was kept and what was pruned
    are counted into ``out``."""
    for source, shortlist in candidate_shortlists(key, device, options):
        kept, pruned = prune_challengers(key, source, shortlist, enabled=options.prune)
        for p in pruned:
            out.pruned[p.rule] = out.pruned.get(p.rule, 0) + 1
        if kept:
            out.compiled += len(kept)
            yield source, kept


def compile_problem(key: Key, options: TuneOptions, device: str) -> Compiled:
    """Job: compile ``key``'s shortlists (tile-pruned) in this process, except those of sources
    that share kernels (the shared job's); errors stay per source (the engine's build raises
    them again, one candidate at a time)."""
    t0 = time.perf_counter()
    out = Compiled(str(key))
    for source, kept in _kept(key, options, device, out):
        if source.shares_kernels:
            continue
        try:
            source.precompile(key, kept)
        except Exception as e:
            out.errors.append(f"{source.name}: {short_error(e)[:300]}")
    out.seconds = time.perf_counter() - t0
    return out


def compile_shared(keys: list[Key], options: TuneOptions, device: str) -> Compiled:
    """Job: every kernel the run's problems need from sources that share kernels, each once, in
    the run's order; each problem's event is set once its kernels are compiled (or failed)."""
    t0 = time.perf_counter()
    out = Compiled(SHARED)
    plans: dict[str, tuple[Source, list[tuple[Key, list[Params]]]]] = {}
    left = dict.fromkeys(map(str, keys), 0)  # per problem: sources whose kernels are not ready
    for key in keys:
        for source, kept in _kept(key, options, device, Compiled(str(key))):
            if source.shares_kernels:
                plans.setdefault(source.name, (source, []))[1].append((key, kept))
                left[str(key)] += 1

    def ready(name: str) -> None:
        left[name] -= 1
        if left[name] == 0:
            _READY[name].set()

    try:
        for name, n in left.items():
            if n == 0:
                _READY[name].set()
        for source, shortlists in plans.values():
            out.compiled += sum(len(kept) for _, kept in shortlists)
            try:
                source.precompile_run(shortlists, lambda i, s=shortlists: ready(str(s[i][0])))
            except Exception as e:
                out.errors.append(f"{source.name}: {short_error(e)[:300]}")
    finally:
        for event in _READY.values():
            event.set()  # a source that failed leaves its errors to the engine's build
    out.seconds = time.perf_counter() - t0
    return out


class CompilePool:
    """The run's compile jobs: the shared job, and one per problem in submission order."""

    def __init__(
        self,
        keys: list[Key],
        options: TuneOptions,
        device: str,
        *,
        jobs: int | None = None,
        sources: dict[str, str] | None = None,
    ) -> None:
        self.keys = list(dict.fromkeys(keys))
        self.options, self.device = options, device
        self.jobs = jobs or default_jobs()
        # made before any tuning process: per problem, (its job ended, its shared kernels ready)
        self.events = {str(k): (CTX.Event(), CTX.Event()) for k in self.keys}
        self.futures: dict[str, Future[Compiled]] = {}
        cpus = len(usable_cpus() or ()) or os.cpu_count() or 1  # the jobs' share of the cores
        self.executors = [
            ProcessPoolExecutor(
                max_workers=self.jobs, mp_context=CTX, initializer=_start_job_process,
                initargs=(os.getpid(), max(1, cpus // self.jobs), sources or {}),
            ),
            ProcessPoolExecutor(
                max_workers=1, mp_context=CTX, initializer=_start_job_process,
                initargs=(os.getpid(), cpus, sources or {}, {k: e[1] for k, e in self.events.items()}),
            ),
        ]  # fmt: skip

    def start(self) -> None:
        """Submit the shared job, then every problem in order; a problem's first event is set
        when its job ends, its second by the shared job."""
        problems, shared = self.executors
        if self._shares_kernels():
            future = shared.submit(compile_shared, self.keys, self.options, self.device)
            future.add_done_callback(lambda _f: self._set(1))
            self.futures[SHARED] = future
        else:
            self._set(1)
        for key in self.keys:
            name = str(key)
            future = problems.submit(compile_problem, key, self.options, self.device)
            future.add_done_callback(lambda _f, e=self.events[name][0]: e.set())
            self.futures[name] = future

    def _shares_kernels(self) -> bool:
        """Whether a source this run asks for, available here, shares kernels across shapes."""
        wanted = self.options.sources
        return any(
            source.shares_kernels
            and (wanted is None or source.name in wanted)
            and source.unavailable(self.device) is None
            for op in {key.op for key in self.keys}
            for source in registry.sources(op)
        )

    def _set(self, which: int) -> None:
        for events in self.events.values():
            events[which].set()

    def ready(self, key: Key | str) -> bool:
        """Whether ``key`` is compiled (both its events set; a key without a job: True)."""
        return ready(self.events, key)

    def job_done(self, key: Key | str) -> bool:
        """Whether ``key``'s own job ended: all but its shared kernels are compiled."""
        return all(e.is_set() for e in self.events.get(str(key), ())[:1])

    def result(self, key: Key | str) -> Compiled | None:
        """A job's outcome once it ended (None before, or if the job itself died); ``SHARED``
        names the shared job."""
        future = self.futures.get(str(key))
        if future is None or not future.done() or future.cancelled():
            return None
        try:
            return future.result()
        except Exception as e:
            return Compiled(str(key), errors=[f"compile job: {type(e).__name__}: {e}"])

    def close(self) -> None:
        """Cancel the jobs not started and stop those running: the run no longer needs them
        (an executor has no public way to stop a running job, hence its process table). Each
        process releases what it made as it dies (``_release_and_die``); one still alive after
        ``STOP_GRACE_S`` is killed, since the run's exit would wait for it."""
        processes = [p for ex in self.executors for p in getattr(ex, "_processes", {}).values()]
        for executor in self.executors:
            executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        dying = {p.sentinel: p for p in processes}  # ready once dead, whichever thread reaps it
        deadline = time.monotonic() + STOP_GRACE_S
        while dying and (left := deadline - time.monotonic()) > 0:
            for sentinel in connection.wait(list(dying), left):
                del dying[sentinel]
        for process in dying.values():
            process.kill()
        self._set(0)
        self._set(1)  # nobody waits on a job that will not run


@contextlib.contextmanager
def ahead(keys: list[Key], options: TuneOptions, device: str) -> Iterator[CompilePool | None]:
    """A started pool over ``keys`` for a run that tunes them one after the other (a suite), on
    the GPU; None on the CPU, where nothing takes long to compile."""
    if device != "cuda" or not keys:
        yield None
        return
    from tuner.tuning.isolation import runtime_sources

    pool = CompilePool(keys, options, device, sources=runtime_sources())
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


def ready(events: dict[str, Any], key: Key | str) -> bool:
    """Whether ``key`` is compiled: its events (``CompilePool.events``) all set."""
    return all(e.is_set() for e in events.get(str(key), ()))


def wait(
    events: dict[str, Any], key: Key, timeout_s: float | None = None, shared: bool = True
) -> float:
    """Block until ``key`` is compiled (no job: at once), or only its own job where not
    ``shared`` (a first pass leaves the shared kernels' candidates out); the seconds waited."""
    t0 = time.perf_counter()
    for event in events.get(str(key), ())[: 2 if shared else 1]:
        remaining = None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - t0))
        event.wait(remaining)
    return time.perf_counter() - t0

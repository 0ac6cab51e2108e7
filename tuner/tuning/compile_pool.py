"""One compile pool for a whole tuning run: every problem's shortlists compiled ahead, in order.

Compiling is most of a cold run and needs no GPU time, so a run hands every problem to the pool
up front, in the order it will tune them: while the GPU times problem i, the CPU cores compile
problem i+1 and later ones. A job compiles one problem: each source's shortlist, less what
``pruning`` drops by tile, goes through ``Source.precompile`` into the on-disk kernel caches
(Triton's, CUTLASS's), where the tuning process's ``build`` finds it. Jobs run in spawned
processes (capture hooks and CUDA state stay out of the process that times), ``jobs`` at a time,
and the cores are split between them (``TUNER_COMPILE_WORKERS``, ``TUNER_CUTLASS_JOBS``).

The process that tunes waits only for its own problem's job (``wait``), through an event made
before the tuning processes start, so a replaced worker waits on the same one.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tuner.core.keys import Key
from tuner.core.lifetime import exit_when_orphaned
from tuner.tuning.engine import TuneOptions, candidate_shortlists
from tuner.tuning.pruning import prune_challengers
from tuner.tuning.supervisor import CTX

log = logging.getLogger(__name__)


@dataclass
class Compiled:
    """What the pool did for one problem."""

    key: str
    seconds: float = 0.0
    compiled: int = 0  # candidates handed to their source's precompile
    pruned: dict[str, int] = field(default_factory=dict)  # rule -> candidates left out
    errors: list[str] = field(default_factory=list)


def default_jobs(cpus: int | None = None) -> int:
    """Problems compiled at once: a source compiles one problem's shortlist over many cores
    itself, so a few jobs keep every core busy between a problem's stragglers."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(4, cpus // 4))


def _start_job_process(cores: int, sources: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's to handle
    exit_when_orphaned()
    os.environ.setdefault("TUNER_COMPILE_WORKERS", str(cores))
    os.environ.setdefault("TUNER_CUTLASS_JOBS", str(cores))
    from tuner.tuning.isolation import register_sources

    for bad in register_sources(sources):
        log.warning("compile pool: source not available: %s", bad)


def compile_problem(key: Key, options: TuneOptions, device: str) -> Compiled:
    """Job: compile ``key``'s shortlists (tile-pruned) in this process; errors stay per source
    (the engine's build raises them again, one candidate at a time)."""
    t0 = time.perf_counter()
    out = Compiled(str(key))
    for source, shortlist in candidate_shortlists(key, device, options):
        kept, pruned = prune_challengers(key, source, shortlist, enabled=options.prune)
        for p in pruned:
            out.pruned[p.rule] = out.pruned.get(p.rule, 0) + 1
        if not kept:
            continue
        out.compiled += len(kept)
        try:
            source.precompile(key, kept)
        except Exception as e:
            out.errors.append(f"{source.name}: {type(e).__name__}: {str(e)[:300]}")
    out.seconds = time.perf_counter() - t0
    return out


class CompilePool:
    """The run's compile jobs, one per problem, in submission order."""

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
        self.events = {str(k): CTX.Event() for k in self.keys}  # made before any tuning process
        self.futures: dict[str, Future[Compiled]] = {}
        cores = max(1, (os.cpu_count() or 1) // self.jobs)
        self.executor = ProcessPoolExecutor(
            max_workers=self.jobs, mp_context=CTX, initializer=_start_job_process,
            initargs=(cores, sources or {}),
        )  # fmt: skip

    def start(self) -> None:
        """Submit every problem, in order; each one's event is set when its job ends."""
        for key in self.keys:
            name = str(key)
            future = self.executor.submit(compile_problem, key, self.options, self.device)
            future.add_done_callback(lambda _f, e=self.events[name]: e.set())
            self.futures[name] = future

    def result(self, key: Key | str) -> Compiled | None:
        """The job's outcome once it ended (None before, or if the job itself died)."""
        future = self.futures.get(str(key))
        if future is None or not future.done() or future.cancelled():
            return None
        try:
            return future.result()
        except Exception as e:
            return Compiled(str(key), errors=[f"compile job: {type(e).__name__}: {e}"])

    def close(self) -> None:
        """Cancel the jobs not started and stop those running: the run no longer needs them
        (the executor has no public way to stop a running job, hence its process table)."""
        processes = list(getattr(self.executor, "_processes", {}).values())
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for event in self.events.values():
            event.set()  # nobody waits on a job that will not run


def wait(events: dict[str, Any], key: Key, timeout_s: float | None = None) -> float:
    """Block until ``key``'s compile job ended (no job: at once); the seconds waited."""
    event = events.get(str(key))
    t0 = time.perf_counter()
    if event is not None:
        event.wait(timeout_s)
    return time.perf_counter() - t0

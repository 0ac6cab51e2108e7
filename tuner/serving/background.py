"""Builds tuned runners off the hot path.

A stored winner whose kernel is not loaded in this process may need a compile (seconds for a
Triton kernel, minutes for a CUTLASS one), or an artifact to install and load. The dispatcher
hands such a build to a ``BackgroundLoader`` and serves the baseline meanwhile; when the build
finishes it switches to the built runner. The loader runs builds in a few daemon threads (a
compile in flight never holds up the interpreter's exit), keeps at most one build per job in
flight, and remembers a failed build with its error (``failures``): it is neither retried on
every call nor silent.

Nothing here may run during a CUDA-graph capture (a kernel module load would invalidate it): the
dispatcher starts no build while capturing, and ``tuner.warmup()`` (which waits for the builds in
flight) belongs before the capture.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import Key
from tuner.core.triton_launch import interpreting

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 2


def may_compile(source: Source) -> bool:
    """Whether building ``source``'s runners may compile a kernel here, so that the build belongs
    off the hot path: sources that build kernels may, except under Triton's interpreter
    (``TRITON_INTERPRET=1``), which compiles nothing."""
    return source.builds_kernels and not interpreting()


def load_runner(source: Source, key: Key, params: Params) -> Runner:
    """Build ``source``'s runner for ``key`` with its kernels compiled, or fetched and installed
    from the artifact store, first: the runner's first call finds them built. Kernels compiled
    here are kept as artifacts for other hosts (Triton's cache manager hook)."""
    from tuner.candidates.triton_cache import share_compiled_kernels

    share_compiled_kernels()
    source.precompile(key, [params])
    runner = source.build(key, params)
    if torch.cuda.is_available():
        run_once(runner, key)
    return runner


def run_once(runner: Runner, key: Key) -> None:
    """Call a fresh runner once on sample inputs, on a side stream: a kernel that compiles or
    loads its module at its first launch (Triton's JIT, a CUTLASS module) does it here, not in
    the caller's first call."""
    from tuner.measure import samples, timing

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    stream = timing.side_stream()
    with torch.cuda.stream(stream):
        runner(*samples.make_inputs(key, str(device), gen))
    stream.synchronize()


@dataclass(frozen=True)
class LoaderStats:
    in_flight: int
    built: int
    failures: dict[str, str] = field(default_factory=dict)  # job -> error


class BackgroundLoader:
    """A small pool of daemon threads running builds, at most one per job in flight."""

    def __init__(self, workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"BackgroundLoader workers must be at least 1, got {workers}")
        self.workers = workers
        self.built = 0
        self.failures: dict[str, str] = {}
        self._refused: set[str] = set()  # failures that were refusals (``refuse``)
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], Any], Callable[[Any], None],
                                            Callable[[str], None]]] = queue.SimpleQueue()  # fmt: skip
        self._threads: list[threading.Thread] = []
        self._in_flight: set[str] = set()
        self._state = threading.Condition()

    def after_fork(self) -> BackgroundLoader:
        """A loader for a forked child, where this one's threads do not live on: as many
        workers, the failures (and refusals) recorded so far, no job in flight."""
        fresh = BackgroundLoader(self.workers)
        fresh.failures, fresh._refused = dict(self.failures), set(self._refused)
        return fresh

    def submit(
        self,
        job: str,
        build: Callable[[], Any],
        done: Callable[[Any], None],
        failed: Callable[[str], None],
    ) -> bool:
        """Run ``build`` in a worker, then ``done(result)``, or ``failed(error)`` if either raises.
        False (and nothing runs) while ``job`` is in flight already."""
        with self._state:
            if job in self._in_flight:
                return False
            self._in_flight.add(job)
            if len(self._threads) < min(self.workers, len(self._in_flight)):
                name = f"tuner-build-{len(self._threads)}"
                thread = threading.Thread(target=self._work, name=name, daemon=True)
                self._threads.append(thread)
                thread.start()
        self._jobs.put((job, build, done, failed))
        return True

    def _work(self) -> None:
        while True:
            job, build, done, failed = self._jobs.get()
            try:
                done(build())
            except Exception as e:  # a failing build must leave the baseline serving, not crash
                error = f"{type(e).__name__}: {e}"
                log.warning("background build of %s failed, the baseline serves it: %s", job, error)
                with self._state:
                    self.failures[job] = error
                failed(error)
            else:
                with self._state:
                    self.built += 1
            finally:
                with self._state:
                    self._in_flight.discard(job)
                    self._state.notify_all()

    def in_flight(self, job: str) -> bool:
        """Whether ``job`` is being built now (submitted, not yet done or failed)."""
        with self._state:
            return job in self._in_flight

    def refuse(self, job: str, error: str, why: str) -> None:
        """Record ``job`` as failed on the caller's thread (``why``: it cannot serve on this
        host, or its stored params no longer build), as a failed build is: said once, neither
        retried on later calls nor submitted again, until ``forget_refusals`` (a reload may
        bring what was lacking, or a winner with other params)."""
        log.warning("%s %s, the baseline serves it: %s", job, why, error)
        with self._state:
            self.failures[job] = error
            self._refused.add(job)

    def forget_refusals(self) -> None:
        """Drop the refusals: what this host lacked (a kernel a sync now brought) may be here."""
        with self._state:
            for job in self._refused:
                self.failures.pop(job, None)
            self._refused.clear()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until no build is in flight; False if ``timeout_s`` passed first."""
        with self._state:
            return self._state.wait_for(lambda: not self._in_flight, timeout_s)

    def stats(self) -> LoaderStats:
        with self._state:
            return LoaderStats(len(self._in_flight), self.built, dict(self.failures))

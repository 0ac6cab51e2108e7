"""Crash-isolated tuning: candidates run in a worker process that can be replaced.

A candidate can kill its process (a segfault in a library, ``os._exit``) or poison its CUDA context
(illegal address, launch failure: every later CUDA call in that process fails). ``tune_isolated``
runs ``engine.tune`` in a worker process and watches it. The worker announces each candidate
before running it and sends each measurement back, so when the worker dies the candidate in flight
is known: it is recorded as ``failed`` with the reason (exit code or signal, the end of the worker's
stderr), a fresh worker is started, and it carries on after that candidate, reusing what was
already measured. A candidate that sends nothing for ``candidate_timeout_s`` is killed and recorded
as ``timeout``. A worker whose candidate failed with a CUDA error checks its context and, if it is
broken, exits so that the next candidate gets a clean one.

Workers are reused across problems (``WorkerPool``): starting one costs an import of torch and a
CUDA context. The outcome is the same ``TuneOutcome`` as ``engine.tune`` returns.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from tuner.core.keys import Key
from tuner.measure.records import Measurement, Winner
from tuner.tuning.engine import TuneOptions, TuneOutcome
from tuner.tuning.supervisor import Child, Supervised

log = logging.getLogger(__name__)

EXIT_CONTEXT_LOST = 86  # a worker's exit code after it found its CUDA context broken
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "device-side assert",
    "CUDA_ERROR_ILLEGAL",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_MISALIGNED",
)
LOG_TAIL = 1500


# --- the worker process --------------------------------------------------------------------------


def _context_lost(m: Measurement, device: str) -> bool:
    """After a failed candidate: is this process's CUDA context unusable now?"""
    if any(marker.lower() in m.error.lower() for marker in STICKY_CUDA_ERRORS):
        return True
    if device != "cuda":
        return False
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:
        return True
    return False


def register_sources(sources: dict[str, str]) -> list[str]:
    """Register the parent's run-time sources here; the ones that cannot be imported."""
    from tuner.candidates import registry

    bad = []
    for name, target in sources.items():
        try:
            registry.register(registry.load_target(target)())
        except Exception as e:
            bad.append(f"{name} ({target}): {e!r}")
    return bad


def _serve(conn: Any) -> None:
    """Worker main loop: ("tune", ...) requests in, progress and outcomes out."""
    from tuner.tuning import engine

    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request[0] == "stop":
            return
        _, key, options, device, prior_rows, sources, earlier, first_pass = request
        for text in register_sources(sources):
            conn.send(("warning", f"source not available in the worker: {text}"))
        device = device or engine.current_device()

        def on_start(source: Any, params: dict) -> None:
            conn.send(("start", source.name, params, source.is_baseline(params)))

        def on_result(m: Measurement, device: str = device) -> None:
            conn.send(("result", m.to_row()))
            if m.status == "failed" and _context_lost(m, device):
                conn.send(("context_lost", m.candidate))
                os._exit(EXIT_CONTEXT_LOST)

        try:
            from tuner.core.device import fingerprint

            fp = fingerprint(device)
            conn.send(("hello", os.getpid(), fp.device_class, fp.version_tag))
            outcome = engine.tune(
                key,
                options=options,
                device=device,
                prior=[Measurement.from_row(r) for r in prior_rows],
                on_start=on_start,
                on_result=on_result,
                earlier=earlier,
                first_pass=first_pass,
            )
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
            continue
        rows = [m.to_row() for m in outcome.measurements]
        conn.send(
            ("done", outcome.winner.to_row(), rows, outcome.compile_s, outcome.stretched,
             outcome.phases)
        )  # fmt: skip


# --- the parent side -----------------------------------------------------------------------------


def runtime_sources() -> dict[str, str]:
    """Sources registered at run time in this process (not built in, not plugins), by target."""
    from tuner.candidates import registry
    from tuner.candidates.base import Source

    static = set(registry.BUILTIN) | {ep.name for ep in entry_points(group="tuner.sources")}
    return {
        name: f"{type(src).__module__}:{type(src).__qualname__}"
        for name, src in registry.all_sources().items()
        if isinstance(src, Source) and name not in static
    }


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_CONTEXT_LOST:
        return "exited after its CUDA context broke"
    return f"exit code {code}"


@dataclasses.dataclass
class _Run:
    """What the parent knows of one tuning while workers come and go."""

    key: Key
    run_id: str  # of every measurement and the winner, whichever worker made them
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    in_flight: tuple[str, dict, bool] | None = None
    device_class: str = ""
    versions: str = ""
    launch: str = "eager"  # the run's timing mode, as every measurement of it records

    def lost(self, status: str, error: str) -> Measurement:
        """Record the candidate in flight as ``status``; the next worker skips it."""
        assert self.in_flight is not None
        source, params, is_baseline = self.in_flight
        m = Measurement(
            device_class=self.device_class, key=str(self.key), source=source, params=params,
            status=status, is_baseline=is_baseline, error=error, versions=self.versions,
            run_id=self.run_id, launch=self.launch,
        )  # fmt: skip
        self.measurements.append(m)
        self.in_flight = None
        return m


class WorkerPool:
    """One live worker, replaced whenever a candidate takes it down."""

    def __init__(
        self, *, candidate_timeout_s: float = 600.0, idle_timeout_s: float = 3600.0
    ) -> None:
        self.candidate_timeout_s = candidate_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._slot = Supervised(
            _serve, name="tuner-worker", keep_stderr=True, stop_message=("stop",), grace_s=10
        )

    @property
    def started(self) -> list[int]:
        """The pids of every worker started, in order."""
        return self._slot.started

    def close(self) -> None:
        self._slot.close()

    def tune(
        self,
        key: Key,
        options: TuneOptions | None = None,
        *,
        device: str | None = None,
        progress: Callable[[str], None] | None = None,
        on_result: Callable[[Measurement], None] | None = None,
        earlier: Mapping[str, float] | None = None,
        first_pass: TuneOutcome | None = None,
    ) -> TuneOutcome:
        options = dataclasses.replace(options or TuneOptions(), isolate=False)
        # one run id, as the caller saw each measurement (``on_result``) and as it stores them
        run = _Run(
            key, first_pass.winner.run_id if first_pass else uuid.uuid4().hex, launch=options.launch
        )
        started = time.perf_counter()
        while True:
            worker = self._slot.live()
            worker.conn.send(
                ("tune", key, options, device, [m.to_row() for m in run.measurements],
                 runtime_sources(), dict(earlier or {}), first_pass)
            )  # fmt: skip
            outcome = self._follow(worker, run, progress, on_result)
            if outcome is not None:
                for m in outcome.measurements:
                    m.run_id = run.run_id
                outcome.winner.run_id = run.run_id
                outcome.seconds = time.perf_counter() - started
                return outcome

    def _follow(
        self,
        worker: Child,
        run: _Run,
        progress: Callable[[str], None] | None,
        on_result: Callable[[Measurement], None] | None,
    ) -> TuneOutcome | None:
        """Relay one worker's messages; the outcome, or None after the worker died."""
        while True:
            timeout = self.candidate_timeout_s if run.in_flight else self.idle_timeout_s
            if not worker.conn.poll(timeout):
                worker.kill()
                if run.in_flight is None:
                    raise TimeoutError(
                        f"tuning worker {worker.pid} sent nothing for {timeout:.0f} s outside any candidate"
                    )
                m = run.lost(
                    "timeout", f"no answer within {timeout:.0f} s; worker {worker.pid} killed"
                )
                _say(progress, f"{m.candidate}: timeout (worker {worker.pid} killed)")
                return None
            try:
                msg = worker.conn.recv()
            except (EOFError, OSError):
                return self._died(worker, run, progress)
            kind = msg[0]
            if kind == "hello":
                _, _, run.device_class, run.versions = msg
            elif kind == "start":
                run.in_flight = (msg[1], msg[2], msg[3])
            elif kind == "result":
                run.measurements.append(Measurement.from_row({**msg[1], "run_id": run.run_id}))
                run.in_flight = None
                if on_result:
                    on_result(run.measurements[-1])
            elif kind == "warning":
                log.warning("%s", msg[1])
            elif kind == "context_lost":
                _say(progress, f"{msg[1]} broke the CUDA context; replacing worker {worker.pid}")
            elif kind == "error":
                raise RuntimeError(f"{msg[1]} (in tuning worker {worker.pid})\n{msg[2]}")
            elif kind == "done":
                measurements = [Measurement.from_row(r) for r in msg[2]]
                return TuneOutcome(
                    run.key, Winner.from_row(msg[1]), measurements, compile_s=msg[3],
                    stretched=msg[4], phases=msg[5],
                )  # fmt: skip

    def _died(
        self, worker: Child, run: _Run, progress: Callable[[str], None] | None
    ) -> TuneOutcome | None:
        worker.join(timeout=30)
        how = _describe_exit(worker.exitcode)
        tail = worker.log_tail(LOG_TAIL)
        if worker.exitcode == EXIT_CONTEXT_LOST:
            return None  # the failed measurement came before the exit
        if run.in_flight is None:
            raise RuntimeError(
                f"tuning worker {worker.pid} died outside any candidate ({how})"
                + (f": {tail[-500:]}" if tail else "")
            )
        error = f"worker process {worker.pid} died ({how}) running this candidate"
        m = run.lost("failed", error + (f"; stderr: {tail[-800:]}" if tail else ""))
        _say(progress, f"{m.candidate}: failed ({error})")
        return None


def _say(progress: Callable[[str], None] | None, text: str) -> None:
    log.info("%s", text)
    if progress:
        progress(text)


_POOL: WorkerPool | None = None


def default_pool() -> WorkerPool:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(_POOL.close)
    return _POOL


def tune_isolated(
    key: Key,
    options: TuneOptions | None = None,
    *,
    device: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    earlier: Mapping[str, float] | None = None,
    first_pass: TuneOutcome | None = None,
) -> TuneOutcome:
    """``engine.tune`` in a worker process of the default pool; see the module docstring."""
    return default_pool().tune(
        key, options, device=device, progress=progress, on_result=on_result, earlier=earlier,
        first_pass=first_pass,
    )  # fmt: skip

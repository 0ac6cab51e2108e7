"""Compiling the Triton kernels of this project (their direct launch: ``tuner.core.triton_launch``).

``warm(jobs)``: compile many kernels in parallel before they are timed; ``precompile`` does it for
a source's shortlist (every Triton source's ``Source.precompile``). Triton's compiler holds the
GIL, so threads do not help; instead each job's JIT specialization is captured through
``knobs.runtime.jit_cache_hook`` (no compile happens in this process), compiled in a pool of
spawned worker processes (which need no GPU, ``TUNER_COMPILE_WORKERS`` of them), and lands in
Triton's on-disk cache, from which the first launch here loads it. Jobs of one specialization
compile once.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import triton

from tuner.candidates.base import Params
from tuner.core.lifetime import exit_when_orphaned
from tuner.core.settings import env_number
from tuner.core.triton_launch import interpreting

log = logging.getLogger(__name__)

ConfigKey = tuple[tuple[str, str, Any], ...]


def config_key(config: Params, check: Callable[[], None]) -> ConfigKey:
    """``config`` as a hashable key of (name, type, value): True == 1 and 1.0 == 1, but the
    config checks refuse a bool or a float where an int is due, so the type is part of the key.
    An unhashable value is refused: by ``check()`` (which names what the config allows) where it
    can, else (``check()`` passing it, or failing to compare it) by a ValueError naming the
    field."""
    key = tuple(sorted((name, type(value).__name__, value) for name, value in config.items()))
    try:
        hash(key)
    except TypeError:
        with contextlib.suppress(TypeError):  # a check that cannot compare the value
            check()
        for name, value in config.items():
            try:
                hash(value)
            except TypeError:
                raise ValueError(f"config[{name!r}]={value!r}: allowed a number, a string or a "
                                 f"bool") from None  # fmt: skip
        raise
    return key


# --- parallel compilation ----------------------------------------------------------------------


@dataclass
class WarmJob:
    """One kernel specialization to compile: what ``fn[grid](*args, **kwargs)`` would compile.
    ``args`` may hold ``FakeTensor``s (dtype + pointer alignment) instead of tensors."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class WarmReport:
    requested: int = 0
    compiled: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class FakeTensor:
    """Stands in for a tensor argument while capturing a specialization: dtype and alignment."""

    def __init__(self, dtype: Any, align: int = 16) -> None:
        self.dtype = dtype
        self._ptr = (1 << 20) + (align % 16)

    def data_ptr(self) -> int:
        return self._ptr


def _capture(jobs: Sequence[WarmJob]) -> list[tuple[str, str, str]]:
    """The (module, qualname, specialization) of every job the JIT has not compiled yet."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        raise RuntimeError("this Triton has no knobs.runtime.jit_cache_hook")
    captured: dict[str, tuple[str, str, str]] = {}

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        data = compile["specialization_data"]
        module = fn.module if isinstance(fn.module, str) else fn.module.__name__
        captured.setdefault(data, (module, fn.name, data))
        return True  # skip the compile here: a worker does it

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for job in jobs:
            job.fn.warmup(*job.args, grid=(1,), **job.kwargs)
    finally:
        knobs.runtime.jit_cache_hook = old
    return list(captured.values())


def _compile_one(module: str, name: str, data: str, target: tuple[str, Any, int]) -> float:
    """Worker: compile one captured specialization into Triton's on-disk cache (no GPU needed).
    Mirrors ``JITFunction.preload``, minus the driver."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    t0 = time.perf_counter()
    fn = getattr(importlib.import_module(module), name)
    obj = json.loads(data)
    constexprs = {
        tuple(k): tl.dtype(v)
        if tl.dtype.is_dtype(v)
        else tl.constexpr(v["constexpr"])
        if isinstance(v, dict) and "constexpr" in v
        else v
        for k, v in zip(obj["constant_keys"], obj["constant_vals"], strict=True)
    }
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"], strict=True))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    )
    triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__
    )
    return time.perf_counter() - t0


_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _start_worker() -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a Ctrl-C is the run's to handle, not each worker's
    exit_when_orphaned()


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = int(env_number("TUNER_COMPILE_WORKERS", min(16, os.cpu_count() or 1)))
            ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
            _pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=ctx, initializer=_start_worker
            )
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
        return _pool


def warm(jobs: Sequence[WarmJob]) -> WarmReport:
    """Compile ``jobs`` in parallel (GPU only; a no-op in the interpreter). Failures are logged
    and left for the normal launch path, which then raises the real error for that candidate."""
    report = WarmReport(requested=len(jobs))
    if interpreting() or not jobs:
        return report
    t0 = time.perf_counter()
    try:
        todo = _capture(jobs)
    except Exception as e:  # an older/newer Triton without the hook: compile lazily instead
        report.errors.append(f"capture: {e!r}")
        log.info("parallel compile unavailable, compiling on first launch: %r", e)
        return report
    if todo:
        from triton.runtime import driver

        t = driver.active.get_current_target()
        target = (t.backend, t.arch, t.warp_size)
        futures = [_get_pool().submit(_compile_one, m, n, d, target) for m, n, d in todo]
        for (_, name, _), fut in zip(todo, futures, strict=True):
            try:
                fut.result()
                report.compiled += 1
            except Exception as e:
                report.errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    report.seconds = time.perf_counter() - t0
    if report.errors:
        log.info("parallel compile: %d errors, first: %s", len(report.errors), report.errors[0])
    return report


def precompile(
    shortlist: Iterable[Params], jobs_of: Callable[[Params], list[WarmJob]]
) -> WarmReport:
    """``warm`` the kernels of every config in ``shortlist`` (``jobs_of(params)`` lists them). A
    config that does not build (``ValueError``) is skipped here and fails, with its error, when
    the engine builds it."""
    jobs: list[WarmJob] = []
    for params in shortlist:
        try:
            jobs += jobs_of(params)
        except ValueError:
            continue
    return warm(jobs)

"""Launching and compiling the Triton kernels of this project.

``Launcher``: a kernel bound to its grid, constexprs, warps and stages. The first call goes through
Triton's JIT (which compiles, or loads the binary from Triton's on-disk cache); later calls whose
*specialization guard* (strides, pointer alignment) is unchanged call the compiled kernel directly,
skipping the JIT's argument binding, which is most of the host cost of a launch (it matters for
decode GEMMs of ~10 us). ``TUNER_TRITON_FAST_LAUNCH=0`` turns the direct path off.

``warm(jobs)``: compile many kernels in parallel before they are timed. Triton's compiler holds
the GIL, so threads do not help; instead each job's JIT specialization is captured through
``knobs.runtime.jit_cache_hook`` (no compile happens in this process), compiled in a pool of
spawned worker processes (which need no GPU), and lands in Triton's on-disk cache, from which the
first launch here loads it.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import triton

from tuner.candidates.base import interpreting

log = logging.getLogger(__name__)

FAST_LAUNCH = os.environ.get("TUNER_TRITON_FAST_LAUNCH", "1") not in ("0", "")


def _knobs() -> Any:
    return getattr(triton, "knobs", None)


def _hooks_set() -> bool:
    knobs = _knobs()
    rt = getattr(knobs, "runtime", None)
    return rt is None or rt.launch_enter_hook is not None or rt.launch_exit_hook is not None


class Launcher:
    """``launcher(args, guard)`` runs ``fn[grid](*args, **constexprs)``.

    ``args`` are the kernel's runtime arguments in declaration order (all of a kernel's constexpr
    parameters must come after them); ``guard`` is any hashable that changes whenever Triton would
    specialize the call differently (strides, pointer alignment).
    """

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        constexprs: dict[str, Any],
        *,
        num_warps: int,
        num_stages: int,
    ) -> None:
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kwargs = {**constexprs, "num_warps": num_warps, "num_stages": num_stages}
        self._compiled: Any = None
        self._guard: Hashable = None
        self._tail: tuple[Any, ...] = ()
        self._fast = FAST_LAUNCH and not interpreting()
        if self._fast:
            params = getattr(fn, "params", None)
            if params is None:
                self._fast = False
            else:
                names = [p.name for p in params if p.is_constexpr]
                n_runtime = len(params) - len(names)
                if any(p.is_constexpr for p in params[:n_runtime]):
                    raise TypeError(f"{fn}: constexpr parameters must come after runtime ones")
                missing = set(names) - set(constexprs)
                if missing:
                    raise TypeError(f"{fn}: missing constexprs {sorted(missing)}")
                self._tail = tuple(constexprs[n] for n in names)

    def __call__(self, args: Sequence[Any], guard: Hashable) -> None:
        ck = self._compiled
        if ck is not None and guard == self._guard and not _hooks_set():
            device = _driver.get_current_device()
            stream = _driver.get_current_stream(device)
            g = self.grid
            ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata, None, None, None,
                   *args, *self._tail)  # fmt: skip
            return
        ck = self.fn[self.grid](*args, **self.kwargs)
        if self._fast and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
            self._compiled, self._guard = ck, guard


class _Driver:
    """Triton's active driver, looked up once (it is what the JIT itself calls per launch)."""

    def __getattr__(self, name: str) -> Any:
        from triton.runtime import driver

        value = getattr(driver.active, name)
        setattr(self, name, value)
        return value


_driver = _Driver()


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
    knobs = _knobs()
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


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = int(os.environ.get("TUNER_COMPILE_WORKERS", 0)) or min(
                16, os.cpu_count() or 1
            )
            ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
            _pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
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

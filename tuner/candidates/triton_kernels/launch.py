"""Launching and compiling the Triton kernels of this project.

``Launcher``: a kernel bound to its grid, constexprs, warps and stages. The first call goes through
Triton's JIT (which compiles, or loads the binary from Triton's on-disk cache); later calls whose
*specialization guard* (strides, pointer alignment) is unchanged launch the compiled kernel
directly with integer pointers. Triton's JIT path costs more host time per launch than
torch.matmul, and a decode GEMM's kernel is short, so the launch decides whether it wins when
called eagerly. ``TUNER_TRITON_FAST_LAUNCH=0`` (or ``off``, ``false``, ``no``) turns this off.

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
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import triton

from tuner.candidates.base import Params, interpreting
from tuner.core.lifetime import exit_when_orphaned
from tuner.core.settings import FLAGS, env_flag, env_number

log = logging.getLogger(__name__)

FAST_LAUNCH = env_flag("TUNER_TRITON_FAST_LAUNCH", FLAGS["triton_fast_launch"])


def _knobs() -> Any:
    return getattr(triton, "knobs", None)


_RUNTIME = getattr(_knobs(), "runtime", None)


def _hook_set(hook: Any) -> bool:
    """Triton >= 3.5 keeps launch hooks in a ``HookChain`` (never None): set means non-empty."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_set() -> bool:
    """A profiler's launch hooks are installed: launch through the JIT, which calls them."""
    rt = _RUNTIME
    return rt is None or _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


_stream_of: Any = None  # device index -> raw CUDA stream handle
_device: Any = None


def _current_stream() -> int:
    """The current CUDA stream of the current device, as the raw handle Triton's launcher takes."""
    global _stream_of, _device
    if _stream_of is None:
        import torch

        _device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        _stream_of = torch._C._cuda_getCurrentRawStream
    return _stream_of(_device())


class Launcher:
    """A kernel bound to its grid, constexprs, warps and stages.

    ``launcher(args, guard)`` runs ``fn[grid](*args, **constexprs)`` through Triton's JIT: ``args``
    are the runtime arguments in declaration order (a kernel's constexpr parameters must all come
    after them) and ``guard`` is any hashable that changes whenever Triton would specialize the
    call differently (strides, 16-byte alignment of the pointers). It keeps the compiled kernel;
    while ``ready(guard)``, ``raw(args)`` launches it directly with the tensors replaced by their
    ``data_ptr()`` integers, which also skips the launcher's per-pointer driver query (the JIT
    path validated those pointers on the first call). The owner sets ``verified`` after checking
    that a direct launch reproduces the JIT launch bit for bit (``GemmRunner``), or ``disable``s
    the direct path. ``scratch``: a device pointer for kernels
    that need global scratch memory (TMA descriptors made on the device), see ``scratch_bytes``.
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
        self._direct: Any = None  # the C launch function, when Triton's launcher exposes it
        self.scratch_bytes = 0
        self._tail: tuple[Any, ...] = ()
        self._fast = FAST_LAUNCH and not interpreting()
        self.verified = False  # set by the runner once a direct launch reproduced the JIT's bits
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

    @property
    def compiled(self) -> bool:
        """The JIT launched this kernel once and kept it: a direct launch is possible."""
        return self._compiled is not None

    def ready(self, guard: Hashable) -> bool:
        """Launch directly: verified by the runner, compiled, same specialization, no hooks."""
        return (
            self.verified
            and self._compiled is not None
            and guard == self._guard
            and not _hooks_set()
        )

    def disable(self) -> None:
        """Always launch through the JIT from now on."""
        self._fast, self._compiled, self.verified = False, None, False

    def raw(self, args: Sequence[Any], scratch: int | None = None) -> None:
        ck, g = self._compiled, self.grid
        if self._direct is not None:
            run = ck.run
            self._direct(g[0], g[1], g[2], _current_stream(), ck.function,
                         run.launch_cooperative_grid, run.launch_pdl, scratch, None,
                         ck.packed_metadata, None, None, None, *args, *self._tail)  # fmt: skip
            return
        ck.run(g[0], g[1], g[2], _current_stream(), ck.function, ck.packed_metadata, None, None, None,
               *args, *self._tail)  # fmt: skip

    def __call__(self, args: Sequence[Any], guard: Hashable) -> None:
        ck = self.fn[self.grid](*args, **self.kwargs)
        if self._fast and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
            self._compiled, self._guard = ck, guard
            self._bind_direct(ck)

    def _bind_direct(self, ck: Any) -> None:
        """Use the C launch function itself when the Python launcher around it only allocates
        scratch (Triton 3.x's CudaLauncher); otherwise ``raw`` goes through ``ck.run``."""
        run = ck.run
        needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
                  "profile_scratch_size", "num_ctas")  # fmt: skip
        self._direct = None
        if all(hasattr(run, a) for a in needed) and not run.profile_scratch_size:
            g = self.grid
            self.scratch_bytes = run.global_scratch_size * g[0] * g[1] * g[2] * run.num_ctas
            self._direct = run.launch


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


def verify_direct(
    launchers: Sequence[Launcher], out: Any, relaunch: Callable[[Any], Any], what: str
) -> bool:
    """Once, after a runner's first (JIT) call wrote ``out``: launch again through the direct path
    into a fresh buffer (``relaunch(buffer)``) and require the same bits (every kernel here is
    deterministic), else keep to the JIT. Returns False, to be asked again on a later call,
    while a CUDA graph is being captured (no synchronisation allowed then)."""
    if interpreting() or not all(x.compiled for x in launchers):
        return True  # no direct path to check (interpreter, FAST_LAUNCH off)
    import torch

    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    for x in launchers:
        x.verified = True
    again = torch.empty_like(out)
    relaunch(again)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[out.element_size()]
    if not torch.equal(again.view(bits), out.view(bits)):
        log.warning("%s: a direct relaunch differs from the JIT launch; direct launch off", what)
        for x in launchers:
            x.disable()
    return True


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

"""Launching a compiled Triton kernel directly, past Triton's JIT, once that is shown to be safe.

``Launcher``: a kernel bound to its grid, constexprs, warps and stages. The first call goes through
Triton's JIT (which compiles, or loads the binary from Triton's on-disk cache); later calls whose
*specialization guard* (strides, pointer alignment) is unchanged launch the compiled kernel
directly with integer pointers. Triton's JIT path costs more host time per launch than
torch.matmul, and a decode kernel is short, so the launch decides what an eager call costs.
``verify_direct`` checks once that a direct launch reproduces the JIT's bits.
``TUNER_TRITON_FAST_LAUNCH=0`` (or ``off``, ``false``, ``no``) turns this off. Here, below every
user of Triton kernels (the candidates, the quantization of activations).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from tuner.core.settings import FLAGS, env_flag

log = logging.getLogger(__name__)


def interpreting() -> bool:
    """True when Triton kernels run through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def current_gpu() -> int | None:
    """The current GPU's index, None under the interpreter or without a GPU: part of the key of
    a launch plan kept across runners, since a compiled kernel and its direct launch belong to
    the GPU that loaded it (a model spread over GPUs has a runner per GPU)."""
    import torch

    if interpreting() or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


@functools.cache
def fast_launch() -> bool:
    """``TUNER_TRITON_FAST_LAUNCH``, read when the first launcher is made, not at import: this
    module is imported before the config file fills the environment (the CLI's start, the
    process dispatcher), and a value read earlier would drop the file's."""
    return env_flag("TUNER_TRITON_FAST_LAUNCH", FLAGS["triton_fast_launch"])


@functools.cache
def _runtime() -> Any:
    """Triton's runtime knobs (launch hooks), None where this Triton has none; Triton is
    imported on the first launch, not with this module (the candidates' interface imports it)."""
    import triton

    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _hook_set(hook: Any) -> bool:
    """Triton >= 3.5 keeps launch hooks in a ``HookChain`` (never None): set means non-empty."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _hooks_set() -> bool:
    """A profiler's launch hooks are installed: launch through the JIT, which calls them."""
    rt = _runtime()
    return rt is None or _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


_stream_of: Any = None  # device index -> raw CUDA stream handle
_device: Any = None


def current_stream() -> int:
    """The current CUDA stream of the current device, as the raw handle Triton's launcher takes."""
    global _stream_of, _device
    if _stream_of is None:
        import torch

        _device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        _stream_of = torch._C._cuda_getCurrentRawStream
    return _stream_of(_device())


@dataclass(frozen=True)
class Direct:
    """One compiled specialization of a ``Launcher``'s kernel and its direct launch.

    Immutable, and taken whole by ``Launcher.ready``: a thread that found it ready launches this
    kernel even if another thread's JIT call has meanwhile bound another specialization.
    ``scratch_bytes``: the global scratch memory the kernel needs (TMA descriptors made on the
    device), to be passed as ``scratch``.
    """

    guard: Hashable
    kernel: Any
    grid: tuple[int, int, int]
    tail: tuple[Any, ...]
    c_launch: Any  # the C launch function, when Triton's launcher exposes it
    scratch_bytes: int

    def __call__(self, args: Sequence[Any], scratch: int | None = None) -> None:
        """Launch with ``args`` (the runtime arguments, tensors as ``data_ptr()`` integers)."""
        ck, (g0, g1, g2) = self.kernel, self.grid
        if self.c_launch is not None:
            run = ck.run
            self.c_launch(g0, g1, g2, current_stream(), ck.function, run.launch_cooperative_grid,
                          run.launch_pdl, scratch, None, ck.packed_metadata, None, None, None,
                          *args, *self.tail)  # fmt: skip
            return
        ck.run(g0, g1, g2, current_stream(), ck.function, ck.packed_metadata, None, None, None,
               *args, *self.tail)  # fmt: skip


def _bind(ck: Any, guard: Hashable, grid: tuple[int, int, int], tail: tuple[Any, ...]) -> Direct:
    """A ``Direct`` for ``ck``: the C launch function itself where the Python launcher around it
    only allocates scratch (Triton 3.x's CudaLauncher), else ``ck.run``."""
    run = ck.run
    needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
              "profile_scratch_size", "num_ctas")  # fmt: skip
    if all(hasattr(run, a) for a in needed) and not run.profile_scratch_size:
        scratch = run.global_scratch_size * grid[0] * grid[1] * grid[2] * run.num_ctas
        return Direct(guard, ck, grid, tail, run.launch, scratch)
    return Direct(guard, ck, grid, tail, None, 0)


class Launcher:
    """A kernel bound to its grid, constexprs, warps and stages.

    ``launcher(args, guard)`` runs ``fn[grid](*args, **constexprs)`` through Triton's JIT: ``args``
    are the runtime arguments in declaration order (a kernel's constexpr parameters must all come
    after them) and ``guard`` is any hashable that changes whenever Triton would specialize the
    call differently (strides, 16-byte alignment of the pointers). It keeps the compiled kernel;
    ``ready(guard)`` then gives its ``Direct`` launch, which takes the tensors as their
    ``data_ptr()`` integers and skips the launcher's per-pointer driver query (the JIT path
    validated those pointers on the first call). The owner sets ``verified`` after checking that
    a direct launch reproduces the JIT launch bit for bit (``GemmRunner``), or ``disable``s the
    direct path.
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
        self._direct: Direct | None = None  # the last specialization the JIT compiled
        self._tail: tuple[Any, ...] = ()
        self._fast = fast_launch() and not interpreting()
        self.verified = False  # set by the runner once a direct launch reproduced the JIT's bits
        # the threads checking the direct path (``verify_direct``; two first calls of a shared
        # plan at once each check it), the only ones that may launch it before it is verified
        self.trials: set[int] = set()
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
        return self._direct is not None

    def ready(self, guard: Hashable) -> Direct | None:
        """The direct launch for ``guard``'s specialization, or None (launch through the JIT):
        it must be verified by the runner, compiled for this guard, and no hooks installed."""
        direct = self._direct  # one read: another thread's JIT call may rebind it
        if direct is None or direct.guard != guard or _hooks_set():
            return None
        if not self.verified and threading.get_ident() not in self.trials:
            return None
        return direct

    def disable(self) -> None:
        """Always launch through the JIT from now on."""
        self._fast, self._direct, self.verified = False, None, False

    def __call__(self, args: Sequence[Any], guard: Hashable) -> None:
        ck = self.fn[self.grid](*args, **self.kwargs)
        if self._fast and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
            self._direct = _bind(ck, guard, self.grid, self._tail)


def verify_direct(
    launchers: Sequence[Launcher],
    out: Any,
    relaunch: Callable[[Any], Any],
    what: str,
    agrees: Callable[[], bool] | None = None,
) -> bool:
    """Once, after a runner's first (JIT) call wrote ``out``: launch again through the direct path
    into a fresh buffer (``relaunch(buffer)``) and require the same bits (every kernel here is
    deterministic), and ``agrees()`` where given (another output of the relaunch), else keep to
    the JIT. Only the threads checking it launch directly until the check passes. Returns
    False, to be asked again on a later call, while a CUDA graph is being captured (no
    synchronisation allowed then)."""
    if interpreting() or not all(x.compiled for x in launchers):
        return True  # no direct path to check (interpreter, fast launch off)
    import torch

    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    me = threading.get_ident()
    for x in launchers:
        x.trials.add(me)
    try:
        again = torch.empty_like(out)
        relaunch(again)
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[out.element_size()]
        same = torch.equal(again.view(bits), out.view(bits)) and (agrees is None or agrees())
    finally:
        for x in launchers:
            x.trials.discard(me)
    for x in launchers:
        if same:
            x.verified = True
        else:
            x.disable()
    if not same:
        log.warning("%s: a direct relaunch differs from the JIT launch; direct launch off", what)
    return True

"""The candidate protocol.

A *source* (torch, triton_gemm, cublaslt, ...) turns a problem key into a shortlist of candidate
*params* (small JSON objects) and builds a *runner* from (key, params). Because params are JSON, a
stored winner can be rebuilt on any host: ``source.build(key, winner.params)``.

Runners take the operands and an optional preallocated output and return the result:

    gemm:  runner(a, b, out=None) -> c        c = a @ b
    sdpa:  runner(q, k, v, out=None) -> o

They run on the current stream, do not synchronize, and honour the strides the key describes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from tuner.core.keys import Key
from tuner.core.triton_launch import interpreting

Runner = Callable[..., Any]
Params = dict[str, Any]


def triton_unavailable(
    device: str, needs: tuple[int, int] | None = None, what: str = ""
) -> str | None:
    """Why Triton kernels cannot run on ``device`` here: on the CPU only through the interpreter;
    on the GPU, ``what`` kernels only from compute capability ``needs`` on."""
    if device == "cpu":
        if not interpreting():
            return "no GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU, slowly)"
        return None
    if needs is not None:
        import torch

        cap = torch.cuda.get_device_capability()
        if cap < needs:
            return f"compute capability {cap}: {what} kernels need sm{needs[0]}{needs[1]} or newer"
    return None


class Source(ABC):
    """One family of kernels. Subclasses set ``name`` and ``op``. One source per op provides the
    baseline (what users get without us); its ``baseline_params`` name that candidate."""

    name: ClassVar[str]
    op: ClassVar[str]  # "gemm" or "sdpa"
    baseline_params: ClassVar[Params | None] = None
    # its runners call torch's own entry points (torch.mm, F.scaled_dot_product_attention, ...),
    # which tuner.torch's drop-in routes: served from inside the tuner, those calls are torch's
    calls_torch: ClassVar[bool] = False

    def is_baseline(self, params: Params) -> bool:
        return self.baseline_params is not None and params == self.baseline_params

    def chose_itself(self, source: str, params: Params) -> bool:
        """Whether a stored winner (``source``, ``params``) is this baseline itself: nothing to
        build or load, torch's own call serves it."""
        return source == self.name and self.is_baseline(params)

    def unavailable(self, device: str) -> str | None:
        """Why this source cannot run on ``device`` ("cuda" or "cpu") here, or None if it can."""
        return None

    def unsupported(self, key: Key) -> str | None:
        """Why this source has nothing for ``key``, or None."""
        return None

    def times_challengers(self, device: str) -> bool:
        """Whether this source can time a candidate other than the baseline on ``device``: a
        baseline source's only candidate is, by default, its baseline."""
        return self.baseline_params is None and self.unavailable(device) is None

    @abstractmethod
    def candidates(self, key: Key, device: str) -> list[Params]:
        """A shape-aware shortlist of params worth timing for ``key``."""

    @abstractmethod
    def build(self, key: Key, params: Params) -> Runner:
        """A runner for ``key``; raises on a config that does not compile or is invalid."""

    builds_kernels: ClassVar[bool] = False
    """Whether ``build`` (or a runner's first call) may compile a kernel: such builds belong off
    the dispatcher's hot path. Sources that compile (Triton, CUTLASS) set it."""

    def precompile(self, key: Key, shortlist: list[Params]) -> None:
        """Compile the kernels behind ``shortlist`` ahead of timing, in parallel where the source
        can, so that ``build`` finds them compiled. Optional: the default does nothing. Failures
        are left for ``build`` to raise, one candidate at a time."""
        return None

    def prepare(self, key: Key, shortlist: list[Params]) -> None:
        """Per-process set-up that the first ``build`` of ``shortlist`` (not empty) for ``key``
        needs anyway (a kernel registry, say), done while the kernels are still compiling
        elsewhere. Optional: the default does nothing; errors are left for ``build`` to raise."""
        return None

    shares_kernels: ClassVar[bool] = False
    """Whether one compiled kernel serves every shape (its params name the whole kernel): a run
    then compiles the union of all its problems' shortlists once, up front, on every core
    (``precompile_run``), instead of problem by problem."""

    def precompile_run(
        self, shortlists: list[tuple[Key, list[Params]]], ready: Callable[[int], None]
    ) -> None:
        """Compile a whole run's ``shortlists``, each kernel once, the earliest needed first;
        ``ready(i)`` is called once the kernels of ``shortlists[i]`` are all compiled (or have
        failed). The default precompiles them one after the other."""
        for i, (key, shortlist) in enumerate(shortlists):
            self.precompile(key, shortlist)
            ready(i)

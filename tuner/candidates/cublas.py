"""cuBLAS through nvmath-python's bindings (``cublasGemmEx`` / ``cublasGemmStridedBatchedEx``):
the library torch.matmul calls.

Params: ``{"algo": int}`` with ``-1`` = CUBLAS_GEMM_DEFAULT (the heuristic) and ``99..115`` the
tensor-op algorithm enum (passed as ints). The compute type follows the key: CUBLAS_COMPUTE_32F
(fp16/bf16 inputs accumulate in fp32; fp32 stays IEEE) or CUBLAS_COMPUTE_32F_FAST_TF32. Every
layout maps onto one column-major call (gemm_operands), on torch's current stream (bound to the
handle for each call) through a handle of our own, so torch's handle state is never touched. The
handle is one per device, shared by every runner and thread: a call binds its stream and that
stream's own workspace and enqueues under the handle's lock, so that no other thread's stream is
bound in between. The workspace is ours, one per stream as torch keeps one per handle and stream:
``cublasSetStream`` binds the library's default pool, which two streams' GEMMs would share.

Not through CuPy, whose cuBLAS wrappers refuse every call while a stream is capturing
("calling cuBLAS API during stream capture is currently unsupported"): such a runner can never
serve a caller that runs its step as a CUDA graph, and loses every duel on the GPU.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import numpy as np

from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import GemmKey

CUBLAS_GEMM_DEFAULT = -1
TENSOR_OP_ALGOS = tuple(range(99, 116))  # CUBLAS_GEMM_DEFAULT_TENSOR_OP, ALGO0..15_TENSOR_OP
ALGOS = (CUBLAS_GEMM_DEFAULT, *TENSOR_OP_ALGOS)
# Timed by default: only CUBLAS_GEMM_DEFAULT. The numbered algos did not beat the default beyond
# noise (bench/NOTES.md), so they would only cost tuning time; TUNER_CUBLAS_ALGOS=all (or a comma
# list) times them anyway.
DEFAULT_CANDIDATE_ALGOS = (CUBLAS_GEMM_DEFAULT,)


@functools.cache
def _library() -> Any:
    """nvmath-python's cuBLAS bindings (raises ImportError with the reason when they cannot load)."""
    from nvmath.bindings import cublas

    return cublas


_HANDLES = ops.DeviceHandles(lambda: _library().create())
_LOCKS: dict[int, threading.Lock] = {}  # handle -> the lock its stream is bound and used under
_WORKSPACES: dict[int, ops.StreamWorkspaces] = {}  # handle -> its streams' workspaces


def _lock(handle: int) -> threading.Lock:
    lock = _LOCKS.get(handle)
    return lock if lock is not None else _LOCKS.setdefault(handle, threading.Lock())


def _workspace(handle: int, device: Any, stream: int) -> tuple[int, int]:
    """(pointer, bytes) of ``stream``'s workspace on ``handle``; called under the handle's lock."""
    spaces = _WORKSPACES.get(handle)
    if spaces is None:
        spaces = _WORKSPACES[handle] = ops.StreamWorkspaces(device)
    return spaces.get(stream, ops.WORKSPACE_BYTES)


def candidate_algos() -> tuple[int, ...]:
    """The algos timed per problem: ``TUNER_CUBLAS_ALGOS=all`` or a comma list overrides."""
    env = os.environ.get("TUNER_CUBLAS_ALGOS", "").strip()
    if not env:
        return DEFAULT_CANDIDATE_ALGOS
    if env == "all":
        return ALGOS
    try:
        algos = tuple(int(x) for x in env.split(","))
        for a in algos:
            check_algo(a)
    except ValueError as e:  # the variable named: a run records this as cuBLAS's failure
        raise ValueError(
            f"TUNER_CUBLAS_ALGOS={env!r}: 'all' or a comma list of algos: {e}"
        ) from None
    return algos


def check_algo(algo: Any) -> int:
    if not isinstance(algo, int) or isinstance(algo, bool) or algo not in ALGOS:
        raise ValueError(
            f"algo must be -1 (CUBLAS_GEMM_DEFAULT) or a tensor-op algo 99..115, got {algo!r}"
        )
    return algo


class CublasGemm(Source):
    name = "cublas"
    op = "gemm"

    def unavailable(self, device: str) -> str | None:
        nvmath = ops.package_missing("nvmath", "nvmath-python")
        return ops.unavailable_reason(device, "cuBLAS", nvmath, _library)

    def unsupported(self, key: GemmKey) -> str | None:
        return "plain GEMMs only (no FP8 or INT4 path in cublasGemmEx)" if key.lowbit else None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return [{"algo": a} for a in candidate_algos()]

    def build(self, key: GemmKey, params: Params) -> Runner:
        unknown = set(params) - {"algo"}
        if unknown:
            raise ValueError(f"unknown cublas params {sorted(unknown)}; allowed: ['algo']")
        algo = check_algo(params.get("algo", CUBLAS_GEMM_DEFAULT))
        lib = _library()
        dtype = ops.CUDA_DTYPE[key.dtype]
        out_dtype = ops.CUDA_DTYPE[key.out_dtype]
        compute = ops.compute_type(key)
        # host scalars (CUBLAS_POINTER_MODE_HOST), float32 for fp32 compute types; kept alive here
        scalars = np.array([1.0, 0.0], dtype=np.float32)
        alpha, beta = scalars.ctypes.data, scalars.ctypes.data + 4
        batched = key.batch > 1
        c_align = ops.out_alignment(key)

        def run(a: Any, b: Any, out: Any = None) -> Any:
            ta, tb, convert = ops.as_tensors(a, b)
            c, user_out = ops.output_for(key, ta, out, c_align)
            call = ops.colmajor_call(key, ta, tb, c)
            handle = _HANDLES.get(ta.device)
            stream = ops.current_stream(ta.device)
            with _lock(handle):
                lib.set_stream(handle, stream)  # binds the default pool: ours goes after it
                lib.set_workspace(handle, *_workspace(handle, ta.device, stream))
                _gemm(handle, call, ta, tb, c)
            return ops.finish(c, user_out, convert)

        def _gemm(handle: int, call: ops.ColMajorCall, ta: Any, tb: Any, c: Any) -> None:
            if batched or ta.dim() == 3:
                lib.gemm_strided_batched_ex(
                    handle, call.trans_first, call.trans_second, call.m, call.n, call.k,
                    alpha, tb.data_ptr(), dtype, call.ld_first, call.stride_first,
                    ta.data_ptr(), dtype, call.ld_second, call.stride_second,
                    beta, c.data_ptr(), out_dtype, call.ld_out, call.stride_out,
                    key.batch, compute, algo,
                )  # fmt: skip
            else:
                lib.gemm_ex(
                    handle, call.trans_first, call.trans_second, call.m, call.n, call.k,
                    alpha, tb.data_ptr(), dtype, call.ld_first,
                    ta.data_ptr(), dtype, call.ld_second,
                    beta, c.data_ptr(), out_dtype, call.ld_out, compute, algo,
                )  # fmt: skip

        run.scalars = scalars  # type: ignore[attr-defined]  # alpha/beta live as long as the runner
        return run

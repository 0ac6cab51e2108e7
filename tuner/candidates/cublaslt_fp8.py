"""cuBLASLt FP8 GEMMs (``torch._scaled_mm``'s problem) through nvmath-python's bindings.

The call is ``cublaslt``'s (heuristic candidates as params, algorithms rebuilt and checked,
descriptors prepared once, ``cublasLtMatmul`` on torch's current stream) with FP8 operands, a
bf16/f16/f32 output and float32 scales read on the device:

- tensorwise: ``A_SCALE_POINTER`` / ``B_SCALE_POINTER`` at the two scalars (cuBLASLt's default
  scalar mode), the pointers nvmath's own ``MatmulQuantizationScales`` set;
- rowwise: both scale modes ``OUTER_VEC_32F`` (cuBLAS 12.9+), one scale per row of A and per
  column of B. nvmath 1.0's ``Matmul`` has no such mode (scalars or MXFP8 blocks only); its
  bindings name it. Where this cuBLASLt offers no algorithm with it, rowwise keys are declined;
- ``accum``: ``FAST_ACCUM`` 1 for "fast", 0 for "f32" (partial sums promoted to fp32).

cuBLASLt multiplies FP8 only as "TN" (its A transposed, its B not), which is exactly the key's
``x @ W.T`` read column-major: its A is our weight (b, column-major [K, N]) and its B our
activation, so ``A_SCALE_POINTER`` takes ``scale_b`` and ``B_SCALE_POINTER`` ``scale_a``. The
scale pointers are set per call only when they move (rowwise ones start at a placeholder:
the heuristic wants them set), under the runner's lock up to the enqueue (cuBLASLt reads them
when it enqueues: a graph captured earlier keeps the pointers of its capture).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner
from tuner.candidates.cublaslt import (
    CublasLtGemm,
    MatmulTypes,
    _lt,
    _LtRunner,
    heuristic_params,
)
from tuner.core.keys import FP8, GemmKey, lowbit_fields

CUDA_FP8 = {"fp8_e4m3": 28, "fp8_e5m2": 29}  # cudaDataType_t CUDA_R_8F_E4M3 / CUDA_R_8F_E5M2
MIN_CAPABILITY = (8, 9)
ALIGN = 16  # bytes: FP8 operands' pointers and leading dimensions
# Past this M a rowwise key's heuristic algorithm is also offered on a 1x2x1 cluster: the two CTAs
# along cuBLASLt's N (our activation rows) share each weight tile. For rowwise scales the
# heuristic offers one algorithm, on a 1x1x1 cluster, though the 1x2x1 one can be faster on large
# outputs. Clusters need sm90.
CLUSTER_TWIN_M = 256
CLUSTER_TWIN = "1x2x1"
CLUSTER_CAPABILITY = (9, 0)


@functools.cache
def _placeholder(index: int) -> torch.Tensor:
    """A device buffer whose address stands in for the scale vectors until a call brings its
    own: cuBLASLt answers a vector-scale heuristic query with INVALID_VALUE while the scale
    pointers are unset, though it reads no scale before a matmul."""
    return torch.zeros(4, dtype=torch.float32, device=torch.device("cuda", index))


def fp8_types(key: GemmKey, device: torch.device) -> MatmulTypes:
    """The matmul of an FP8 key: its operand and output types, its accumulation and, rowwise,
    outer-vector scales on both operands (pointed at a placeholder until the first call)."""
    attrs = [("FAST_ACCUM", int(key.accum == "fast"))]
    if key.scale == "row":
        mode = int(_lt().MatmulMatrixScale.OUTER_VEC_32F)
        placeholder = _placeholder(device.index).data_ptr()
        attrs += [("A_SCALE_MODE", mode), ("B_SCALE_MODE", mode)]
        attrs += [("A_SCALE_POINTER", placeholder), ("B_SCALE_POINTER", placeholder)]
    return MatmulTypes(
        ops.CUBLAS_COMPUTE_32F,
        CUDA_FP8[key.wdtype],
        CUDA_FP8[key.dtype],
        ops.CUDA_DTYPE[key.out_dtype],
        tuple(attrs),
    )


@functools.cache
def outer_vector_reason(index: int, accum: str) -> str | None:
    """Why this cuBLASLt has no rowwise (outer-vector) FP8 GEMM with ``accum`` on GPU ``index``,
    or None: its heuristic is asked for a small rowwise problem."""
    key = GemmKey(m=256, n=256, k=256, **{**lowbit_fields("fp8-rowwise"), "accum": accum})
    version = _lt().get_version()
    major, minor = torch.cuda.get_device_capability(index)
    device = torch.device("cuda", index)
    try:
        found = heuristic_params(key, device, types=fp8_types(key, device))
    except Exception as e:  # a scale mode this cuBLASLt does not know
        return (
            f"cuBLASLt {version} takes no outer-vector (rowwise) FP8 scales on "
            f"sm{major}{minor}: {e}"
        )
    if not found:
        return (
            f"cuBLASLt {version} offers no algorithm with outer-vector (rowwise) FP8 scales "
            f"and accum={accum!r} on sm{major}{minor}"
        )
    return None


def with_cluster_twin(
    key: GemmKey, found: list[Params], capability: tuple[int, int]
) -> list[Params]:
    """The heuristic's algorithms ``found`` and, for a rowwise key past ``CLUSTER_TWIN_M`` on a
    device of ``capability`` with clusters, its first one on a ``CLUSTER_TWIN`` cluster (checked
    like any algorithm when it is built)."""
    if key.scale != "row" or key.m <= CLUSTER_TWIN_M or not found:
        return found
    if capability < CLUSTER_CAPABILITY:
        return found
    twin = {**found[0], "cluster": CLUSTER_TWIN}
    return found if twin in found else [*found, twin]


class _Fp8Runner(_LtRunner):
    """``_scaled_mm``'s call ``(a, b, scale_a, scale_b, out=None)`` through one algorithm."""

    def __init__(
        self, key: GemmKey, params: Params, device: torch.device, types: MatmulTypes
    ) -> None:
        super().__init__(key, params, device, types)
        self.scale_lengths = ops.scale_lengths(key)

    def __call__(self, a: Any, b: Any, scale_a: Any, scale_b: Any, out: Any = None) -> Any:
        call = self._prepare(a, b, out)
        len_a, len_b = self.scale_lengths
        return self._run(
            call,
            (
                ("A_SCALE_POINTER", ops.scale_pointer("scale_b", scale_b, len_b, self.device)),
                ("B_SCALE_POINTER", ops.scale_pointer("scale_a", scale_a, len_a, self.device)),
            ),
        )


class CublasLtFp8(CublasLtGemm):
    name = "cublaslt_fp8"
    op = "gemm"

    def unavailable(self, device: str) -> str | None:
        reason = super().unavailable(device)
        if reason:
            return reason
        cap = torch.cuda.get_device_capability()
        if cap < MIN_CAPABILITY:
            return f"compute capability {cap}: cuBLASLt FP8 GEMMs need sm89 or newer"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        if key.dtype not in FP8:
            return "fp8 operands only"
        if key.align < ALIGN:
            return (
                f"align={key.align}: cuBLASLt FP8 GEMMs need {ALIGN}-byte aligned operands and "
                f"leading dimensions"
            )
        if key.scale == "row" and torch.cuda.is_available():
            return outer_vector_reason(torch.cuda.current_device(), key.accum)
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        dev = torch.device("cuda", torch.cuda.current_device())
        found = heuristic_params(key, dev, types=fp8_types(key, dev))
        return with_cluster_twin(key, found, torch.cuda.get_device_capability(dev))

    def build(self, key: GemmKey, params: Params) -> Runner:
        dev = torch.device("cuda", torch.cuda.current_device())
        return _Fp8Runner(key, params, dev, fp8_types(key, dev))

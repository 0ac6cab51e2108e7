"""CUTLASS 3 SM90 FP8 GEMMs (e4m3 x e4m3, bf16 out) via cutlass_cppgen, as ``_scaled_mm`` runs them.

Same params, compile cache, artifacts and launcher as ``cutlass_gemm``; what differs:

- the mainloop is TN (a row-major, b column-major), 128 bytes of K per tile. ``accum="f32"``
  selects CUTLASS's FP8 kernels that promote partial sums to fp32 accumulators (the
  ``_scaled_mm`` default), ``accum="fast"`` their ``FP8FastAccum`` twins;
- the epilogue is an EVT, ``D = acc * scale_a * scale_b`` (``cutlass_env.scaled_epilogue``):
  tensorwise, two float32 scalars read by the kernel through pointers; rowwise, a column
  broadcast of scale_a [M, 1] and a row broadcast of scale_b [1, N]. The scales' pointers are
  patched into the arguments per call, as the operands' are. EVT epilogues on SM90 need the TMA
  epilogue, so every config uses it: cooperative kernels, and for fast accumulation on small M
  pingpong ones (the library generates FP8 kernels with the TMA epilogue only in those
  schedules).

Kernels are shape-independent, one per (scale mode, accumulation, config), so the shortlist is
small (two or three configs per shape class) to keep the compile bill down. A tile here is the
cluster's: each CTA computes tile / cluster (the cooperative kernel wants 128 rows per CTA); a
tile the library's listing lacks is derived from a listed kernel (``cutlass_env.derived``).
"""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

import torch

from tuner.candidates import cutlass_env as env
from tuner.candidates import cutlass_gemm
from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params
from tuner.core.keys import FP8, ITEMSIZE, GemmKey

TILE_K = 128  # FP8 elements: 128 bytes of K per tile, as the library's FP8 kernels use
FP8_KERNELS = ("ws", "coop", "pingpong")  # TMA mainloops (the cp.async ones take no FP8)
FAST_ACCUM = "FP8FastAccum"  # KernelScheduleType suffix of the partial-precision twins
SMALL_M = 256  # up to here the output has few tiles along M: stream-K spreads K over the SMs


def _p(tm: int, tn: int, cluster: tuple[int, int], scheduler: str = "default") -> Params:
    return {"tile": [tm, tn, TILE_K], "cluster": list(cluster), "kernel": "coop",
            "epilogue": "tma", "scheduler": scheduler, "swizzle": 1}  # fmt: skip


SMALL = [_p(128, 128, (1, 2), "streamk"), _p(128, 256, (1, 2), "streamk"), _p(128, 128, (1, 2))]
# cutlass_cppgen takes stream-K with the plain cooperative schedule only, not its FP8FastAccum
# twin: fast accumulation on small M gets 64-row pingpong tiles instead (the library has those
# with the TMA epilogue for fast accumulation only).
SMALL_FAST = [
    {**_p(64, 128, (1, 2)), "kernel": "pingpong"},
    {**_p(64, 256, (1, 2)), "kernel": "pingpong"},
    _p(128, 128, (1, 2)),
]
# 128x192 CTAs (a tile the generator does not list: cutlass_env.derived) cut wide N into a third
# fewer tiles than 128x128 ones, which can fill a persistent kernel's last wave better; 128x128
# CTAs, as torch's own rowwise kernel; stream-K 128x192 for a ragged last wave. Wider CTAs spill
# the doubled accumulators of fp32 promotion.
LARGE = [_p(128, 384, (1, 2)), _p(128, 256, (1, 2)), _p(256, 192, (2, 1), "streamk")]


def shortlist(key: GemmKey) -> list[Params]:
    if key.m > SMALL_M:
        if key.accum == "fast":  # no fast stream-K (above)
            return [p for p in LARGE if p["scheduler"] == "default"]
        return LARGE
    return SMALL_FAST if key.accum == "fast" else SMALL


def unsupported_reason(key: GemmKey) -> str | None:
    if key.dtype not in FP8:
        return "fp8 operands only"
    if (key.dtype, key.wdtype) != ("fp8_e4m3", "fp8_e4m3"):
        return f"{key.dtype} x {key.wdtype}: e4m3 x e4m3 kernels only"
    if key.out_dtype != "bf16":
        return f"out_dtype={key.out_dtype!r}: bf16 output kernels only"
    if key.align < 16:
        return f"align={key.align}: CUTLASS FP8 kernels load through TMA (16-byte alignment)"
    if (key.n * ITEMSIZE[key.out_dtype]) % 16:
        return f"n={key.n}: output rows are not 16-byte aligned (the TMA epilogue stores 16 bytes)"
    return None


def kernel_spec(key: GemmKey, params: Params) -> env.KernelSpec:
    """The compiled kernel ``params`` name for the FP8 ``key``; ValueError naming a bad param."""
    cutlass_gemm.check_params(params)
    if params["kernel"] not in FP8_KERNELS:
        raise ValueError(
            f"cutlass_fp8 param 'kernel' must be one of {list(FP8_KERNELS)}, got "
            f"{params['kernel']!r}"
        )
    if params["epilogue"] != "tma":
        raise ValueError(
            f"cutlass_fp8 param 'epilogue' must be 'tma' (SM90 EVT epilogues need it), got "
            f"{params['epilogue']!r}"
        )
    kernel = cutlass_gemm.KERNELS[params["kernel"]] + (FAST_ACCUM if key.accum == "fast" else "")
    return env.KernelSpec(
        dtype=key.dtype,
        layout=key.layout,
        align_ab=16 // key.itemsize,
        align_c=16 // ITEMSIZE[key.out_dtype],
        tile=tuple(params["tile"]),
        cluster=tuple(params["cluster"]),
        kernel=kernel,
        epilogue="tma",
        scheduler=cutlass_gemm.SCHEDULERS[params["scheduler"]],
        wdtype="" if key.wdtype == key.dtype else key.wdtype,
        out_dtype=key.out_dtype,
        scale=key.scale,
    )


def _fields(struct: ctypes.Structure) -> dict[str, Any]:
    return dict(struct._fields_)


def _find(struct: ctypes.Structure, name: str) -> ctypes.Structure | None:
    """The sub-structure named ``name`` anywhere inside an EVT argument structure (a view into
    it: writes go to ``struct``), or None."""
    for field, kind in _fields(struct).items():
        if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            sub = getattr(struct, field)
            found = sub if field == name else _find(sub, name)
            if found is not None:
                return found
    return None


POINTER_FIELDS = ("scalar_ptrs", "ptr_col", "ptr_row")  # scalar, column and row broadcasts


def _pointer_field(root: ctypes.Structure, name: str) -> tuple[ctypes.Structure, str]:
    """(argument structure, its pointer field) of the EVT input ``name``."""
    node = _find(root, name)
    fields = [f for f in POINTER_FIELDS if node is not None and f in _fields(node)]
    if node is None or len(fields) != 1:
        raise LookupError(f"the scaled epilogue's arguments hold no pointer for {name!r}")
    return node, fields[0]


def _set_stride(stride: ctypes.Structure, values: tuple[int, ...]) -> None:
    """Write ``values`` into a cute stride tuple's runtime entries (its static _0/_1 entries are
    empty structures and stay as they are)."""
    for (field, kind), value in zip(stride._fields_, values, strict=True):
        if kind in (ctypes.c_int32, ctypes.c_int64):
            setattr(stride, field, value)


class ScaledLauncher(cutlass_gemm.KernelLauncher):
    """``_scaled_mm``'s call ``(a, b, scale_a, scale_b, out=None)`` through one kernel with the
    scaled EVT epilogue: the scales' pointers join the pointer set its params are kept by, and
    D's strides are patched into the arguments."""

    def __init__(self, op: Any, key: GemmKey, swizzle: int, device: torch.device) -> None:
        super().__init__(op, key, swizzle, device)
        root = self.args.epilogue.epilogue.output_op
        self.scale_a = _pointer_field(root, "scale_a")
        self.scale_b = _pointer_field(root, "scale_b")
        self.lengths = ops.scale_lengths(key)

    def _epilogue(self, op: Any, epilogue_t: Any, default_epilogue: bool) -> Any:
        placeholder = torch.zeros(1, dtype=torch.float32, device=self.device)  # set per call
        output_op = op.epilogue_type({"scale_a": placeholder, "scale_b": placeholder})
        return epilogue_t(output_op, 0, None, 0, None)

    def _point(self, pointers: tuple[int, ...]) -> None:
        super()._point(pointers)
        for (node, field), pointer in zip((self.scale_a, self.scale_b), pointers[3:], strict=True):
            setattr(node, field, pointer)

    def _point_out(self, pointer: int) -> None:
        ep = self.args.epilogue
        ep.arg_C.ptr_D = ep.arg_D.ptr_D = pointer

    def _stride_out(self, call: ops.ColMajorCall) -> None:
        for arg in (self.args.epilogue.arg_C, self.args.epilogue.arg_D):
            _set_stride(arg.stride_D, (call.ld_out, 1, call.stride_out))

    def __call__(self, a: Any, b: Any, scale_a: Any, scale_b: Any, out: Any = None) -> Any:
        length_a, length_b = self.lengths
        pointer_a = ops.scale_pointer("scale_a", scale_a, length_a, self.device)
        pointer_b = ops.scale_pointer("scale_b", scale_b, length_b, self.device)
        return self.launch(a, b, out, pointer_a, pointer_b)


class CutlassFp8(cutlass_gemm.CutlassGemm):
    name = "cutlass_fp8"
    launcher: ClassVar[type[cutlass_gemm.KernelLauncher]] = ScaledLauncher

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def kernel_spec(self, key: GemmKey, params: Params) -> env.KernelSpec:
        return kernel_spec(key, params)

    def offered(self, key: GemmKey) -> dict[env.KernelSpec, Params]:
        return cutlass_gemm.compilable((kernel_spec(key, p), p) for p in shortlist(key))

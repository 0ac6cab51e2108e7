"""Rowwise FP8 quantization of activations in one Triton kernel (``fp8.quantize_rowwise`` on a GPU).

torch's ops take nine kernels for it (abs, amax, the scale's cast, clamp and division, then the
row's cast, division, clamp and cast to FP8); a decode step's activations are a few rows, so each
of those kernels costs its launch and little else, four times a transformer layer. Here a program
holds one whole row in registers: it reads the row once, takes its amax, writes the scale and the
quantized row. Its arithmetic is torch's on a GPU, so the result is torch's bit for bit: the scale is
the amax times the float32 reciprocal of the format's largest value (torch divides a tensor by a
Python number so on a GPU), the row is divided by the scale rounding to nearest (``div_rn``).

Up to ``DIRECT_ROWS`` rows (decode, where the launch is most of the call's cost) the kernel is
launched as the GEMM runners launch theirs (``Launcher``): through Triton's JIT once per shape,
then directly, once a direct launch has reproduced the JIT's bits.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tuner.core.triton_launch import Launcher, verify_direct

MAX_K = 32768  # a row a program, held in registers: wider rows take torch's ops
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STAGES = 1  # no loop to pipeline; both launch paths compile the same kernel (``_LAUNCHED``)
DIRECT_ROWS = 256  # launchers kept per (rows, K): bounded; more rows are GPU time, not launch


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows(
    x_ptr, q_ptr, scale_ptr, k, x_stride, q_stride,
    FMAX: tl.constexpr, INV_FMAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < k
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(x), 0, _max_with_nan)  # a NaN makes the row NaN, as torch's amax
    scale = tl.maximum(amax, MIN_AMAX, propagate_nan=tl.PropagateNan.ALL) * INV_FMAX
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(scale_ptr + row, scale)


def takes(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """The kernel serves ``x`` as ``dtype``: 2-d, on a GPU that converts to FP8, rows it can
    hold; inside a CUDA-graph capture only once it has run for that shape of call here
    (compiling and loading its module would invalidate the capture)."""
    if not (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in INPUT_DTYPES
        and 0 < x.shape[1] <= MAX_K
        and _converts_to_fp8(x.device.index)
    ):
        return False
    return not torch.cuda.is_current_stream_capturing() or _specialization(x, dtype) in _LAUNCHED


# (device, input dtype, FP8 dtype, BLOCK) of every launch made here: the compiled kernels
_LAUNCHED: set[tuple[int | None, torch.dtype, torch.dtype, int]] = set()


def _specialization(x: torch.Tensor, dtype: torch.dtype) -> tuple:
    return x.device.index, x.dtype, dtype, triton.next_power_of_2(x.shape[1])


@functools.cache
def _converts_to_fp8(device_index: int | None) -> bool:
    """sm89 and later convert to FP8 (asked once a device, not on every call)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


@functools.cache
def _inverse(fmax: float) -> float:
    """float32's reciprocal of ``fmax``, exact as a Python float (a constexpr keeps it)."""
    return (torch.ones(()) / fmax).item()


@dataclass
class _Direct:
    """The launcher of one (device, dtypes, rows, K, floor): checked once against the JIT."""

    launcher: Launcher
    checked: bool = False


_DIRECT: dict[tuple, _Direct] = {}


def _constexprs(dtype: torch.dtype, min_amax: float, block: int) -> dict[str, float | int]:
    fmax = torch.finfo(dtype).max
    return dict(FMAX=fmax, INV_FMAX=_inverse(fmax), MIN_AMAX=min_amax, BLOCK=block)


def _warps(block: int) -> int:
    return min(16, max(1, block // 1024))


def _launch(entry: _Direct, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """One launch of ``entry``'s kernel: directly where its guard holds, else through the JIT."""
    ptrs = (x.data_ptr(), q.data_ptr(), scale.data_ptr())
    strides = (x.stride(0), q.stride(0))
    guard = (*strides, *(p % 16 for p in ptrs))
    if direct := entry.launcher.ready(guard):
        direct((*ptrs, x.shape[1], *strides))
    else:
        entry.launcher((x, q, scale, x.shape[1], *strides), guard)


def _launch_direct(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: tuple, min_amax: float
) -> None:
    """``x``'s rows quantized into ``q`` and ``scale`` by the launcher of its shape (made and
    checked against the JIT on its first call); ``spec``: ``_specialization(x, q.dtype)``."""
    m, k = x.shape
    entry = _DIRECT.get(key := (*spec, min_amax, m, k))
    if entry is None:
        block = spec[-1]
        launcher = Launcher(_quantize_rows, (m,), _constexprs(q.dtype, min_amax, block),
                            num_warps=_warps(block), num_stages=STAGES)  # fmt: skip
        entry = _DIRECT[key] = _Direct(launcher)
    _launch(entry, x, q, scale)
    if not entry.checked:
        again_scale = torch.empty_like(scale)
        entry.checked = verify_direct(
            [entry.launcher], q, lambda again: _launch(entry, x, again, again_scale),
            f"fp8_rows {m}x{k}",
            agrees=lambda: torch.equal(again_scale.view(torch.int32), scale.view(torch.int32)),
        )  # fmt: skip


def quantize(
    x: torch.Tensor, dtype: torch.dtype, min_amax: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``x`` [M, K] as ``dtype`` with a float32 [M, 1] dequantization scale per row,
    the row's amax (at least ``min_amax``) mapped to the format's largest value."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        spec = _specialization(x, dtype)
        on_its_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
        with on_its_device:  # Triton launches on the current device
            if m <= DIRECT_ROWS:
                _launch_direct(x, q, scale, spec, min_amax)
            else:
                block = spec[-1]
                _quantize_rows[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                     **_constexprs(dtype, min_amax, block), num_warps=_warps(block),
                                     num_stages=STAGES)  # fmt: skip
        _LAUNCHED.add(spec)
    return q, scale

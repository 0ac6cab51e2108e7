"""Concrete problems for a key: random inputs with the key's exact layout and alignment, a
higher-precision reference, and the tolerance a candidate's result must meet.

Inputs are fresh random numbers (never zeros: zeros hide unwritten outputs and time faster).
``input_sets`` makes as many sets as timing rotates over, so that nothing is timed from cache.

Low-bit GEMMs take what torch's ops take: INT4 ``(x, packed, scales_and_zeros)`` with the weight
in torch's packed format for the device (``tuner.quant.int4_torch``) and [K / group, N, 2]
scales and zeros; FP8 ``(a, b, scale_a, scale_b)`` with ``b`` column-major [K, N] and float32
scales per the key's granularity (``_scaled_mm``'s arguments). Their reference is a float32 GEMM
on the dequantized operands with a per-element bound derived from the formats
(``tuner.quant.tolerance``): the error of a result is the worst element's share of its bound,
and the tolerance is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tuner.core.keys import DTYPES, ITEMSIZE, GemmKey, Key, SdpaKey
from tuner.measure.timing import rotation_sets
from tuner.quant import fp8, int4, int4_torch
from tuner.quant.tolerance import (
    FP8_TENSOR_CORE_ACCUMULATE,
    FP32_ACCUMULATE,
    excess,
    gemm_tolerance,
    unit_roundoff,
)

# Relative Frobenius error ||out - ref|| / ||ref|| allowed per (dtype, compute).
TOLERANCE = {
    ("f32", "f32"): 1e-4,
    ("f32", "tf32"): 5e-3,
    ("f16", "f32"): 5e-3,
    ("bf16", "f32"): 2e-2,
}
SDPA_TOLERANCE = {"f32": 1e-4, "f16": 5e-3, "bf16": 2e-2}


@dataclass(frozen=True)
class Bounded:
    """A low-bit GEMM's float32 reference and each element's allowed error."""

    ref: torch.Tensor
    tol: torch.Tensor


def tolerance(key: Key) -> float:
    if isinstance(key, GemmKey):
        return 1.0 if key.lowbit else TOLERANCE[(key.dtype, key.compute)]
    return SDPA_TOLERANCE[key.dtype]


def _matrix(
    rows: int,
    cols: int,
    layout: str,
    batch: int,
    dtype: torch.dtype,
    align: int,
    device: str,
    gen: torch.Generator,
) -> torch.Tensor:
    """A (batch, rows, cols) operand, row-major ('n') or column-major ('t'), whose data pointer
    is offset so that its alignment class is exactly ``align`` bytes."""
    shape = (batch, rows, cols) if layout == "n" else (batch, cols, rows)
    numel = math.prod(shape)
    item = torch.finfo(dtype).bits // 8
    offset = 0 if align >= 16 else align // item
    flat = torch.randn(numel + offset, generator=gen, device=device, dtype=torch.float32).to(dtype)
    t = flat[offset:].view(shape)
    if layout == "t":
        t = t.transpose(1, 2)
    return t if batch > 1 else t[0]


def _offset(t: torch.Tensor, align: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data pointer is exactly ``align`` bytes aligned."""
    offset = 0 if align >= 16 else align // t.element_size()
    flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = flat[offset:].view(t.shape)
    out.copy_(t)
    return out


def _int4_inputs(key: GemmKey, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """x, torch's packed weight, scales_and_zeros. Scales spread over a factor of 16 and zeros
    of either sign, so that a kernel reading another group's pair is far outside the bound."""
    dt = DTYPES[key.dtype]
    x = _matrix(key.m, key.k, "n", 1, dt, key.align, device, gen)
    q = torch.randint(0, 16, (key.n, key.k), generator=gen, device=device, dtype=torch.uint8)
    shape = (key.k // key.group, key.n)
    scale = torch.exp2(torch.rand(shape, generator=gen, device=device) * 4 - 6)
    zero = torch.randn(shape, generator=gen, device=device) * 0.1
    scales_and_zeros = torch.stack([scale, zero], dim=-1).to(dt).contiguous()
    return x, int4_torch.torch_pack(q), scales_and_zeros


def _fp8_inputs(key: GemmKey, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """a [M, K] row-major, b [K, N] column-major, scale_a, scale_b as ``_scaled_mm`` takes
    them (tensorwise: 0-d; rowwise: [M, 1] and [1, N])."""
    quant = fp8.quantize_rowwise if key.scale == "row" else fp8.quantize_tensorwise

    def rand(rows: int) -> torch.Tensor:
        return torch.randn(rows, key.k, generator=gen, device=device)

    a, scale_a = quant(rand(key.m), key.dtype.removeprefix("fp8_"))
    b, scale_b = quant(rand(key.n), key.wdtype.removeprefix("fp8_"))
    return _offset(a, key.align), b.T, scale_a, scale_b.T if key.scale == "row" else scale_b


def make_inputs(key: Key, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    if isinstance(key, GemmKey) and key.wdtype == "int4":
        return _int4_inputs(key, device, gen)
    if isinstance(key, GemmKey) and key.lowbit:
        return _fp8_inputs(key, device, gen)
    if isinstance(key, GemmKey):
        dt = DTYPES[key.dtype]
        a = _matrix(key.m, key.k, key.layout[0], key.batch, dt, key.align, device, gen)
        b = _matrix(key.k, key.n, key.layout[1], key.batch, dt, key.align, device, gen)
        return a, b
    dt = DTYPES[key.dtype]

    def rand(heads: int, seq: int, dim: int) -> torch.Tensor:
        return torch.randn(
            (key.batch, heads, seq, dim), generator=gen, device=device, dtype=torch.float32
        ).to(dt)

    return (
        rand(key.q_heads, key.q_len, key.head_dim),
        rand(key.kv_heads, key.kv_len, key.head_dim),
        rand(key.kv_heads, key.kv_len, key.head_dim_v),
    )


def output_like(key: Key, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """An output buffer filled with NaN: any element a candidate fails to write shows up."""
    first = inputs[0]
    if isinstance(key, GemmKey):
        shape = (key.m, key.n) if first.dim() == 2 else (key.batch, key.m, key.n)
        return torch.full(shape, float("nan"), dtype=DTYPES[key.out_dtype], device=first.device)
    shape = (key.batch, key.q_heads, key.q_len, key.head_dim_v)
    return torch.full(shape, float("nan"), dtype=DTYPES[key.dtype], device=first.device)


def bytes_per_set(key: Key) -> int:
    if isinstance(key, GemmKey):
        return key.min_bytes
    q = key.batch * key.q_heads * key.q_len * (key.head_dim + key.head_dim_v)
    return (q * ITEMSIZE[key.dtype]) + key.kv_bytes


def input_sets(key: Key, device: str, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Inputs for ``key``, as many sets as ``timing.rotation_sets`` asks for (more than twice the
    cache together), reproducible from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [make_inputs(key, device, gen) for _ in range(rotation_sets(bytes_per_set(key), device))]


def _sdpa_reference(
    key: SdpaKey, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """fp32 (fp64 on the CPU) attention, one (batch, head) at a time to bound memory."""
    ref_dt = torch.float64 if q.device.type == "cpu" else torch.float32
    group = key.q_heads // key.kv_heads
    out = torch.empty(
        (key.batch, key.q_heads, key.q_len, key.head_dim_v), dtype=ref_dt, device=q.device
    )
    rows = torch.arange(key.q_len, device=q.device)[:, None]
    cols = torch.arange(key.kv_len, device=q.device)[None, :]
    if key.causal == "top_left":
        allowed = cols <= rows
    elif key.causal == "bottom_right":
        allowed = cols <= rows + (key.kv_len - key.q_len)
    else:
        allowed = None
    for b in range(key.batch):
        for h in range(key.q_heads):
            qh, kh, vh = (
                q[b, h].to(ref_dt),
                k[b, h // group].to(ref_dt),
                v[b, h // group].to(ref_dt),
            )
            s = (qh @ kh.T) * key.scale
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows give 0, as torch does
            out[b, h] = p @ vh
    return out


def _lowbit_reference(key: GemmKey, inputs: tuple[torch.Tensor, ...]) -> Bounded:
    """float32 GEMM on the dequantized operands. INT4: the weight's dequantization is rounded
    to the activation dtype for the tensor cores, by up to two roundings (product and sum) where
    a kernel does not fuse them. FP8: operands exact, rounding inside the tensor cores'
    accumulation; the bound is the partial-precision one for both accumulation modes, since
    random data cannot tell them apart (a source computes the mode its key names)."""
    if key.wdtype == "int4":
        x, packed, scales_and_zeros = inputs
        a = x.float()
        b = int4.dequantize(int4_torch.nibbles(packed), scales_and_zeros, key.group)
        operand, accumulate = 2 * unit_roundoff(x.dtype), FP32_ACCUMULATE
    else:
        a_q, b_q, scale_a, scale_b = inputs
        a = fp8.dequantize(a_q, scale_a)
        b = fp8.dequantize(b_q, scale_b).T
        operand, accumulate = 0.0, FP8_TENSOR_CORE_ACCUMULATE
    ref = a @ b.T
    tol = gemm_tolerance(a, b, ref, operand_unit=operand, accumulate_unit=accumulate,
                         out_dtype=DTYPES[key.out_dtype])  # fmt: skip
    return Bounded(ref, tol)


def reference(key: Key, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | Bounded:
    """The exact answer in higher precision (fp64; fp32 for attention on the GPU); for low-bit
    GEMMs, a float32 one with its per-element bound."""
    if isinstance(key, GemmKey) and key.lowbit:
        return _lowbit_reference(key, inputs)
    if isinstance(key, GemmKey):
        a, b = inputs
        return torch.matmul(a.to(torch.float64), b.to(torch.float64))
    return _sdpa_reference(key, *inputs)


def relative_error(out: torch.Tensor, ref: torch.Tensor | Bounded) -> float:
    """||out - ref|| / ||ref|| (for a ``Bounded`` reference: the worst element's error as a
    share of its bound), NaN if ``out`` has any NaN or Inf (so it can never pass)."""
    if isinstance(ref, Bounded):
        return excess(out, ref.ref, ref.tol) if torch.isfinite(out).all() else float("nan")
    # one pass in ref's precision (``out - ref`` promotes), and one read back for all three
    err, denom, finite = torch.stack((
        torch.linalg.vector_norm(out - ref), torch.linalg.vector_norm(ref),
        torch.isfinite(out).all().to(ref.dtype),
    )).tolist()  # fmt: skip
    return err / (denom or 1.0) if finite else float("nan")

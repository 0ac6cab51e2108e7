"""Concrete problems for a key: random inputs with the key's exact layout and alignment, a
higher-precision reference, and the tolerance a candidate's result must meet.

Inputs are fresh random numbers (never zeros: zeros hide unwritten outputs and time faster).
``input_sets`` makes as many sets as timing rotates over, so that nothing is timed from cache.
"""

from __future__ import annotations

import math

import torch

from tuner.core.keys import DTYPES, ITEMSIZE, GemmKey, Key, SdpaKey
from tuner.measure.timing import rotation_sets

# Relative Frobenius error ||out - ref|| / ||ref|| allowed per (dtype, compute).
TOLERANCE = {
    ("f32", "f32"): 1e-4,
    ("f32", "tf32"): 5e-3,
    ("f16", "f32"): 5e-3,
    ("bf16", "f32"): 2e-2,
}
SDPA_TOLERANCE = {"f32": 1e-4, "f16": 5e-3, "bf16": 2e-2}


def tolerance(key: Key) -> float:
    if isinstance(key, GemmKey):
        return TOLERANCE[(key.dtype, key.compute)]
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


def make_inputs(key: Key, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
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


def reference(key: Key, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The exact answer in higher precision (fp64; fp32 for attention on the GPU)."""
    if isinstance(key, GemmKey):
        a, b = inputs
        return torch.matmul(a.to(torch.float64), b.to(torch.float64))
    return _sdpa_reference(key, *inputs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, NaN if ``out`` has any NaN or Inf (so it can never pass)."""
    o = out.to(ref.dtype)
    if not torch.isfinite(o).all():
        return float("nan")
    denom = torch.linalg.vector_norm(ref).item() or 1.0
    return torch.linalg.vector_norm(o - ref).item() / denom

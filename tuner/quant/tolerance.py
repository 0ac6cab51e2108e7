"""Per-element error bounds of a GEMM against a float32 reference, derived from the formats.

Reference: ``ref = a @ b.T`` in float32 on the exact operand values (a dequantized weight, fp8
values times their scales). A kernel's output differs by
- rounding each operand to what the multiplier consumes (``operand_unit``: a weight dequantized in
  fp32 then rounded to bf16 is off by at most 2^-8 relative; exact operands give 0);
- rounding inside the accumulation (``accumulate_unit`` per addition);
- rounding the result to the output type, once: one ulp (``eps``) relative, since not every path
  rounds to nearest (Triton's CPU interpreter truncates to bf16).

The first two are sums of K independent roundings, so they grow like sqrt(K) times the root sum
of squares of the terms, not like the sum of their magnitudes; ``SIGMAS`` standard deviations of
that keep the check tight enough that a wrong nibble order, a wrong group's scale or a dropped
K tile is far outside it.
"""

from __future__ import annotations

import math

import torch

SIGMAS = 6.0
FP32_ACCUMULATE = 2.0**-24
# Hopper's fp8 tensor cores keep about 14 bits of the accumulator between promotions to fp32
FP8_TENSOR_CORE_ACCUMULATE = 2.0**-14


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding a real to ``dtype`` (round to nearest)."""
    return torch.finfo(dtype).eps / 2


def gemm_tolerance(
    a: torch.Tensor,
    b: torch.Tensor,
    ref: torch.Tensor,
    *,
    operand_unit: float,
    accumulate_unit: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Allowed |out - ref| per element of ``ref = a @ b.T`` (a: [M, K], b: [N, K], float32)."""
    a32, b32 = a.float(), b.float()
    rss = ((a32 * a32) @ (b32 * b32).T).sqrt()  # sqrt(sum_k a_k^2 b_k^2) per output element
    k = a.shape[-1]
    spread = SIGMAS * (operand_unit + accumulate_unit * math.sqrt(k)) * rss
    return spread + torch.finfo(out_dtype).eps * ref.abs() + torch.finfo(out_dtype).tiny


def excess(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    """max(|out - ref| / tol): at most 1 when every element is within its bound."""
    return float(((out.float() - ref).abs() / tol).max())

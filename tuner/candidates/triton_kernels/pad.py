"""Copy a (batch, R, K) operand of any strides into a contiguous (batch, R, KP) buffer whose K
tail is zero: rows become 16-byte aligned and K a multiple of the tile, so the GEMM kernels that
follow run without K masks and with full-width (or TMA) loads. For odd shapes (K = 4101, ...)
the copy costs far less than the unaligned GEMM it replaces."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pad_copy(
    src, dst, R, K, KP, s_b, s_r, s_k,
    BR: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    b = tl.program_id(2).to(tl.int64)
    rows = rr[:, None] < R
    x = tl.load(
        src + b * s_b + rr[:, None] * s_r + rk[None, :] * s_k,
        mask=rows & (rk[None, :] < K),
        other=0.0,
    )
    tl.store(dst + (b * R + rr[:, None]) * KP + rk[None, :], x, mask=rows & (rk[None, :] < KP))

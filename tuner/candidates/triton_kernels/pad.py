"""Copy both operands of a GEMM into contiguous K-padded buffers in one launch: A (batch, M, K)
of any strides to (batch, M, KP), B (batch, K, N) of any strides to (batch, N, KP), the K tail
zero. Rows become 16-byte aligned, so the GEMM kernels that follow get full-width loads, cp.async
pipelining and TMA. For odd shapes (K = 4101, ...) the copy costs far less than the unaligned
GEMM it replaces. Programs [0, cdiv(M, BR)) copy rows of A, the rest rows of B."""

from __future__ import annotations

import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle


@triton.jit
def pad_pair(
    a, ap, b, bp, M, N, K, KP, s_ab, s_am, s_ak, s_bb, s_bn, s_bk,
    BR: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(2).to(tl.int64)
    tiles_a = tl.cdiv(M, BR)
    if pid < tiles_a:
        src, dst, rows, s_b, s_r, s_k, r0 = a, ap, M, s_ab, s_am, s_ak, pid * BR
    else:
        src, dst, rows, s_b, s_r, s_k, r0 = b, bp, N, s_bb, s_bn, s_bk, (pid - tiles_a) * BR
    rr = r0 + tl.arange(0, BR)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    in_rows = rr[:, None] < rows
    x = tl.load(src + batch * s_b + rr[:, None] * s_r + rk[None, :] * s_k,
                mask=in_rows & (rk[None, :] < K), other=0.0)  # fmt: skip
    tl.store(
        dst + (batch * rows + rr[:, None]) * KP + rk[None, :], x, mask=in_rows & (rk[None, :] < KP)
    )


settle(globals())  # last: every JIT function above is defined

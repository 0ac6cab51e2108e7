"""Decode GEMM (M <= 8): stream B once with wide loads, multiply-add on the CUDA cores.

tl.dot needs 16 rows; for one to eight rows the tensor cores would idle on padding, and the
problem is a read of B (the weight) anyway. Each program owns BN columns of C and walks all of
K with [BN, BK] tiles of B, accumulating the [BM, BN, BK] products in fp32 registers and reducing
over K once at the end. A is re-read from L1/L2 (it is tiny).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle


@triton.jit
def gemv(
    a_ptr, b_ptr, c_ptr, M, N, K,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mask_m = rm[:, None] < M
    mask_n = rn[:, None] < N
    a_ptrs = a_ptr + batch * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak  # [BM, BK]
    b_ptrs = b_ptr + batch * s_bb + rn[:, None] * s_bn + rk[None, :] * s_bk  # [BN, BK]
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            b = tl.load(b_ptrs, mask=mask_n, other=0.0)
        else:
            mask_k = rk[None, :] < K - k0
            a = tl.load(a_ptrs, mask=mask_m & mask_k, other=0.0)
            b = tl.load(b_ptrs, mask=mask_n & mask_k, other=0.0)
        acc += a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :]
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    c = tl.sum(acc, axis=2)
    c_ptrs = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=mask_m & (rn[None, :] < N))


settle(globals())  # last: every JIT function above is defined

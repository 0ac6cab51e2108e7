"""The tiled kernel: one (BM x BN) output tile per program, grouped ordering, optional split-K.

``SPLIT_K > 1`` runs ``SPLIT_K`` programs per tile along the grid's third axis, each over a
contiguous range of K tiles, writing fp32 partials to ``ws`` ([SPLIT_K, batch, M, N]);
``splitk_reduce`` then sums them in a fixed order (deterministic: no atomics) and casts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle


@triton.jit
def tile_coords(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-tiles share each column-tile of B while it is in L2."""
    width = GROUP_M * grid_n
    group = tile // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def tiled_gemm(
    a_ptr, b_ptr, c_ptr, ws_ptr, M, N, K,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    pid_m, pid_n = tile_coords(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)

    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = split * per_split
    k_last = tl.minimum(k_first + per_split, k_tiles)

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = k_first * BK + tl.arange(0, BK)
    mask_m = rm[:, None] < M
    mask_n = rn[None, :] < N
    a_ptrs = a_ptr + batch * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(k_first, k_last):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m, other=0.0)
            b = tl.load(b_ptrs, mask=mask_n, other=0.0)
        else:
            k_left = K - kt * BK
            a = tl.load(a_ptrs, mask=mask_m & (tl.arange(0, BK)[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(tl.arange(0, BK)[:, None] < k_left) & mask_n, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    mask = mask_m & mask_n
    if SPLIT_K == 1:
        c_ptrs = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        # partials: ws[split, batch, m, n], contiguous
        plane = M * N
        w_ptrs = (
            ws_ptr + (split * tl.num_programs(1) + batch) * plane + rm[:, None] * N + rn[None, :]
        )
        tl.store(w_ptrs, acc, mask=mask)


@triton.jit
def splitk_reduce(
    ws_ptr, c_ptr, M, N, total, s_cb, s_cm, s_cn,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """c[b, m, n] = sum over s of ws[s, b, m, n], summed in order s = 0, 1, ... (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    plane = M * N
    b = offs // plane
    m = (offs % plane) // N
    n = offs % N
    tl.store(c_ptr + b * s_cb + m * s_cm + n * s_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


settle(globals())  # last: every JIT function above is defined

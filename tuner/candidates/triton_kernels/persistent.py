"""Persistent GEMM for Hopper: one program per SM walks output tiles; A, B (and C) move through
TMA tensor descriptors made on the device (``tl.make_tensor_descriptor``, triton >= 3.4).

TMA needs 16-byte aligned base pointers and leading strides, so this variant serves only keys
whose layout gives that (``align == 16``); out-of-range rows and the K tail are zero-filled by the
copy engine, so no masks are needed. When C's rows are not 16-byte aligned (N * itemsize % 16),
``C_DESC=False`` stores C through masked pointers instead. The number of programs is a runtime
argument, so one binary serves every shape of a config (a constexpr would recompile per grid).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.tiled import tile_coords

HAS_DEVICE_TMA = hasattr(tl, "make_tensor_descriptor")


@triton.jit
def persistent_tma_gemm(
    a_ptr, b_ptr, c_ptr, M, N, K, lda, ldb, ldc, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    A_ROW: tl.constexpr, B_ROW: tl.constexpr, C_DESC: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    if A_ROW:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BM, BK]
        )
    else:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[K, M], strides=[lda, 1], block_shape=[BK, BM]
        )
    if B_ROW:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[K, N], strides=[ldb, 1], block_shape=[BK, BN]
        )
    else:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[N, K], strides=[ldb, 1], block_shape=[BN, BK]
        )
    if C_DESC:
        c_desc = tl.make_tensor_descriptor(
            c_ptr, shape=[M, N], strides=[ldc, 1], block_shape=[BM, BN]
        )
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, num_programs, flatten=True):
        pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            off_k = kt * BK
            if A_ROW:  # noqa: SIM108 (constexpr branches: no ternary in Triton)
                a = a_desc.load([off_m, off_k])
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_ROW:  # noqa: SIM108
                b = b_desc.load([off_k, off_n])
            else:
                b = b_desc.load([off_n, off_k]).T
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        c = acc.to(c_ptr.dtype.element_ty)
        if C_DESC:
            c_desc.store([off_m, off_n], c)
        else:
            rm = off_m + tl.arange(0, BM)
            rn = off_n + tl.arange(0, BN)
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            tl.store(c_ptr + rm[:, None].to(tl.int64) * ldc + rn[None, :], c, mask=mask)


settle(globals())  # last: every JIT function above is defined

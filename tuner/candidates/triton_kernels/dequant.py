"""INT4 weight dequantized to a 16-bit [rows, K] weight in memory: the first half of the
``dequant_gemm`` source (a dense GEMM on the result is the second).

Reads our packed layout (``tuner.quant.int4``) through the W4A16 kernel's own tile loader
(``w4a16._weight_tile``: the same bytes, scales and zeros, and the same one rounding of
``(q - 8) * scale + zero`` to the activation dtype), and stores rows ``start .. end`` of the
weight, row-major with K contiguous, as ``F.linear`` takes a weight. One program per [BN, 128]
tile (one K chunk of a 64-row block or part of one), so a program reads one 4 KB run of the
tile-major layout at most.

The interpreter computes the tile in fp32 and truncates on a bf16 store, so there the kernel
rounds to nearest itself: its bf16 weight is bit for bit the reference's
``int4.dequantize(...).to(torch.bfloat16)``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.launch import FakeTensor, WarmJob
from tuner.candidates.triton_kernels.w4a16 import ACT_DTYPES, CHUNK_K, _weight_tile
from tuner.core.triton_launch import Launcher, interpreting, verify_direct
from tuner.quant.int4 import BLOCK_ROWS, CHUNK, check_scales_and_zeros

BLOCKS = (32, 64, 128)  # weight rows per program: parts of a 64-row block, one block or two
WARPS = 4


@triton.jit
def _round_bf16(v):
    """fp32 -> bf16, to nearest even (what a GPU's conversion does), for the interpreter."""
    bits = v.to(tl.int32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=["start", "end"])
def dequant_rows(w_ptr, sz_ptr, out_ptr, N, half, start, end, BN: tl.constexpr,
                 GROUP: tl.constexpr, RAGGED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Weight rows ``start + BN * program_id(0) + arange(BN)`` below ``end`` at K chunk
    ``program_id(1)`` into ``out`` [end - start, K] (row ``start`` first). ``start`` and ``end``
    change from one chunk of a weight to the next and are not specialized on, so one compiled
    kernel serves every chunk."""
    n0 = start + tl.program_id(0) * BN
    if n0 < end:
        k0 = tl.program_id(1) * CHUNK_K
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        w = _weight_tile(w_ptr, sz_ptr, n0, k0, N, half, dtype, BN, GROUP, RAGGED, INTERPRET)
        if INTERPRET and dtype == tl.bfloat16:
            w = _round_bf16(w)
        rl = tl.arange(0, BN)[:, None]
        offs = (n0 - start + rl).to(tl.int64) * (2 * half) + k0 + tl.arange(0, CHUNK_K)[None, :]
        tl.store(out_ptr + offs, w.to(dtype), mask=rl < end - n0)


def check_block(bn: Any) -> None:
    if bn not in BLOCKS or type(bn) is not int:
        raise ValueError(f"bn={bn!r}: allowed {BLOCKS} (weight rows per dequantizing program)")


class Dequantizer:
    """``dequant_rows`` bound to one weight shape (N, K), group, block and chunk height: each
    call fills ``out`` with rows ``start .. start + out.shape[0]`` (``start`` a multiple of 64,
    at most ``rows`` of them). The first call goes through Triton's JIT, later ones launch
    directly (``Launcher``) once a relaunch reproduced it."""

    def __init__(self, n: int, k: int, group_size: int, rows: int, bn: int) -> None:
        check_block(bn)
        if k % CHUNK:
            raise ValueError(f"K={k}: must be a multiple of {CHUNK} (our layout's chunks)")
        if rows <= 0 or (rows % BLOCK_ROWS and rows != n):
            raise ValueError(f"rows={rows}: a multiple of {BLOCK_ROWS} (the layout's blocks) "
                             f"or all N={n} rows")  # fmt: skip
        self.n, self.k, self.rows, self.group = n, k, rows, group_size
        meta = dict(BN=bn, GROUP=group_size, RAGGED=n % BLOCK_ROWS > 0, INTERPRET=interpreting())
        grid = (triton.cdiv(rows, bn), k // CHUNK)
        self.launcher = Launcher(dequant_rows, grid, meta, num_warps=WARPS, num_stages=1)
        self.checked = False

    def __call__(self, weight: torch.Tensor, sz: torch.Tensor, out: torch.Tensor,
                 start: int) -> None:  # fmt: skip
        """Rows ``start ..`` of our ``weight`` layout, dequantized by ``sz``, into ``out``; a
        ValueError names any operand the kernel would read or write out of bounds."""
        n, k = self.n, self.k
        if out.dtype not in ACT_DTYPES or out.dim() != 2 or out.shape[1] != k or \
                not out.is_contiguous():  # fmt: skip
            raise ValueError(f"out: expected a contiguous [rows, K={k}] tensor of {ACT_DTYPES}, "
                             f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")  # fmt: skip
        end = start + out.shape[0]
        if start < 0 or start % BLOCK_ROWS or out.shape[0] > self.rows or end > n:
            raise ValueError(f"start={start}, out.shape={tuple(out.shape)}: rows from a multiple "
                             f"of {BLOCK_ROWS}, at most {self.rows} of them, within N={n}")  # fmt: skip
        if weight.dtype != torch.uint8 or weight.shape != (n, k // 2) or \
                not weight.is_contiguous():  # fmt: skip
            raise ValueError(f"weight: expected a contiguous uint8 [{n}, {k // 2}] tensor, got "
                             f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
        check_scales_and_zeros(sz, n, k, self.group, out.dtype)
        for name, t in (("weight", weight), ("scales_and_zeros", sz)):
            if t.device != out.device:
                raise ValueError(f"{name}.device={t.device}: must be out's device {out.device}")
        self.fill(weight, sz, out, start, end)

    def fill(self, weight: torch.Tensor, sz: torch.Tensor, out: torch.Tensor, start: int,
             end: int) -> None:  # fmt: skip
        """``__call__`` without its checks, for a caller that made ``out`` itself: each check
        is host time on every eager call."""
        self._launch(weight, sz, out, start, end)
        if not self.checked:
            self.checked = verify_direct([self.launcher], out,
                                         lambda again: self._launch(weight, sz, again, start, end),
                                         f"dequant {self.n}x{self.k}")  # fmt: skip

    def _launch(self, weight: torch.Tensor, sz: torch.Tensor, out: torch.Tensor, start: int,
                end: int) -> None:  # fmt: skip
        ptrs = (weight.data_ptr(), sz.data_ptr(), out.data_ptr())
        guard = (out.get_device(), out.dtype, sz.dtype, *(p % 16 for p in ptrs))
        if direct := self.launcher.ready(guard):
            direct((*ptrs, self.n, self.k // 2, start, end))
        else:
            self.launcher((weight, sz, out, self.n, self.k // 2, start, end), guard)

    def jobs(self, dtype: torch.dtype) -> list[WarmJob]:
        """What the first call compiles: our uint8 weight, scales and output in ``dtype``."""
        args = (FakeTensor(torch.uint8), FakeTensor(dtype), FakeTensor(dtype), self.n,
                self.k // 2, 0, self.rows)  # fmt: skip
        return [WarmJob(dequant_rows, args, self.launcher.kwargs)]


settle(globals())  # last: every JIT function above is defined

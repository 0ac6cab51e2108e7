"""Stream-K bookkeeping shared by the decode kernels (``w4a16``, ``fp8``).

A stream-K launch cuts the ``units`` = tiles x ``steps`` (output tile, K step) units, tile-major,
into ``programs`` contiguous runs, program p taking [p U / P, (p + 1) U / P). A tile whose units
fall in several runs is summed by the last of their programs to finish (``splitk_arrival``).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from tuner.candidates.triton_kernels.splitk_arrival import reduce_if_last


@triton.jit
def owner_of(unit, units, programs):
    """The program whose run holds ``unit``: the last p with p * units // programs <= unit."""
    return (((unit + 1).to(tl.int64) * programs - 1) // units).to(tl.int32)


def owner(unit: int, units: int, programs: int) -> int:
    """The program whose run of units holds ``unit`` (as ``owner_of`` in a kernel)."""
    return ((unit + 1) * programs - 1) // units


@functools.lru_cache(maxsize=1024)
def most_parts(tiles: int, steps: int, programs: int) -> int:
    """The most runs that meet in one output tile (1: every tile is one program's): the
    kernels' ``MAX_PARTS``."""
    units = tiles * steps
    return max(owner(t * steps + steps - 1, units, programs) - owner(t * steps, units, programs)
               + 1 for t in range(tiles))  # fmt: skip


@triton.jit
def reduce_shared_tiles(ws_ptr, counts_ptr, out_ptr, lo, hi, steps, units, programs, plane, M, N,
                        ldo, BM: tl.constexpr, BN: tl.constexpr, MAX_PARTS: tl.constexpr):  # fmt: skip
    """After a program's run [lo, hi) of units: each tile it shares with other programs is
    summed by the last of them to arrive, from the float32 partials each stored at ``ws_ptr +
    rank * plane + m * N + n`` (rank: its place among the tile's programs). One row of tiles
    (M <= BM)."""
    rm = tl.arange(0, BM)
    for t in range(lo // steps, (hi - 1) // steps + 1):
        first = owner_of(t * steps, units, programs)
        parts = owner_of(t * steps + steps - 1, units, programs) - first + 1
        if parts > 1:
            rn = t * BN + tl.arange(0, BN)
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            part = rm[:, None].to(tl.int64) * N + rn[None, :]
            out_ptrs = out_ptr + rm[:, None].to(tl.int64) * ldo + rn[None, :]
            reduce_if_last(ws_ptr, counts_ptr, t, part, plane, mask, out_ptrs, parts, MAX_PARTS)

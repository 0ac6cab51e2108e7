"""Bare reads of an INT4 weight in the W4A16 decode kernel's access pattern, no arithmetic.

    python bench/w4a16_read_patterns.py --out bench/results/w4a16_read_patterns.json

The access pattern measured is a stream-K walk (no kernel of the tuner's takes it) over
[BN rows x SEG bytes] tiles of the [N, K / 2] weight, one K step at a time. Here the same runs of (tile, step) units are only
loaded (plain loads, two units in flight per program) and summed: if this read is well below the
contiguous floor (``read_all``), the access pattern costs bandwidth before any dequantization
does. ``tiles`` reads a row-major weight (a step's rows SEG bytes each, K / 2 apart);
``tile_major`` the layout of ``int4.pack`` (64-row blocks, each 64-byte chunk of a block's rows
one 4 KB run), with everything else alike.
CUDA-graph GPU time per call on rotated weights, % of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.stream_read import read_all, sums_for
from tuner.measure import timing

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qwen_down": (3584, 18944)}
# (rows per tile, bytes per row and step, warps, stages, programs per SM, tile-major)
PATTERNS = [(64, 128, 4, 1, 4, False), (64, 128, 4, 1, 4, True), (64, 128, 4, 1, 8, False),
            (64, 128, 4, 1, 8, True), (128, 128, 8, 1, 2, False), (128, 128, 8, 1, 2, True),
            (64, 256, 4, 1, 8, False), (64, 256, 4, 1, 4, True),
            (64, 512, 4, 1, 8, False)]  # fmt: skip


@triton.jit
def _tile_read(w_ptr, sums, words, steps, units, programs, BN: tl.constexpr,
               SEG: tl.constexpr, TILE_MAJOR: tl.constexpr):  # fmt: skip
    """Program p loads the units [p * units // programs, (p + 1) * units // programs), unit u
    the [BN, SEG] int32 tile (tile u // steps, step u % steps) of rows of ``words`` words; two
    units per iteration, both loads issued before either is summed."""
    p = tl.program_id(0)
    lo = (p.to(tl.int64) * units // programs).to(tl.int32)
    hi = ((p + 1).to(tl.int64) * units // programs).to(tl.int32)
    rows = tl.arange(0, BN)[:, None]
    cols = tl.arange(0, SEG)[None, :]
    acc = tl.zeros((BN, SEG), dtype=tl.int32)
    for u in range(lo, hi, 2):
        a = tl.load(w_ptr + _tile_base(u, words, steps, BN, SEG, TILE_MAJOR) + _offsets(
            rows, cols, words, TILE_MAJOR))  # fmt: skip
        b = tl.load(w_ptr + _tile_base(u + 1, words, steps, BN, SEG, TILE_MAJOR) + _offsets(
            rows, cols, words, TILE_MAJOR), mask=u + 1 < hi, other=0)  # fmt: skip
        acc += a + b
    tl.store(sums + p, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _tile_base(u, words, steps, BN: tl.constexpr, SEG: tl.constexpr, TILE_MAJOR: tl.constexpr):
    """Word offset of unit ``u``'s first row at its step: tile-major, a step's SEG words of a
    row are SEG / 16 chunks of a block (1024 words each)."""
    tile = u // steps
    step = u - tile * steps
    return (tile * BN).to(tl.int64) * words + step * (SEG * 64 if TILE_MAJOR else SEG)


@triton.jit
def _offsets(rows, cols, words, TILE_MAJOR: tl.constexpr):
    """Word offsets of a unit's [rows, cols] from its first row (``int4.pack``'s blocks: row
    rows % 64 of block rows // 64, chunk cols // 16)."""
    if TILE_MAJOR:
        return rows // 64 * 64 * words + rows % 64 * 16 + cols // 16 * 1024 + cols % 16
    return rows * words + cols


def bench_shape(name: str, n: int, k: int, copy_gbs: float, sms: int) -> list[dict[str, Any]]:
    nbytes = n * k // 2
    sets = [torch.randint(0, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
            for _ in range(timing.rotation_sets(nbytes, "cuda"))]  # fmt: skip
    sums = torch.empty(max(sums_for(sets[0]).numel(), 8 * sms), dtype=torch.int32, device="cuda")
    rows: list[dict[str, Any]] = []

    def row(what: str, fn: Any, moved: int, **extra: Any) -> None:
        us = timing.graph_time(fn).median_us
        pct = round(100 * moved / (us * 1e-6) / (copy_gbs * 1e9), 1)
        rows.append({"proj": name, "what": what, "us": round(us, 2), "pct_copy": pct, **extra})
        print(f"{name:9s} {what:8s} {us:8.2f} us {pct:6.1f}% copy {extra}", flush=True)

    def pattern(bn: int, seg: int, warps: int, stages: int, per_sm: int, tile_major: bool) -> None:
        steps = (k // 8) // (seg // 4)
        units = (n // bn) * steps
        programs = min(units, per_sm * sms)

        def call(i: int) -> None:
            _tile_read[(programs,)](sets[i % len(sets)], sums, k // 8, steps, units, programs,
                                    BN=bn, SEG=seg // 4, TILE_MAJOR=tile_major, num_warps=warps,
                                    num_stages=stages)  # fmt: skip

        row("tile_major" if tile_major else "tiles", call, units * bn * seg, bn=bn, seg_bytes=seg,
            warps=warps, stages=stages, programs=programs)  # fmt: skip

    row("contig", lambda i: read_all(sets[i % len(sets)], sums), nbytes)
    for p in PATTERNS:
        pattern(*p)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                              "copy_gbs": round(copy_gbs, 1), "rows": []}  # fmt: skip
    for name in args.proj:
        result["rows"] += bench_shape(name, *SHAPES[name], copy_gbs, sms)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

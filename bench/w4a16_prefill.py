"""INT4 (W4A16, group 128) past decode: Triton, CUTLASS and dequantize-then-GEMM configs beside
bf16 cuBLAS.

    python bench/w4a16_prefill.py --out $OUT/w4a16_prefill.json [--m 256 2048] [--sweep]
        [--row-major] [--sources cutlass_w4a16 dequant_gemm]

Per projection (the low-bit suite's eight: qkv, o, gate_up, down of Llama-3-8B and Qwen2.5-7B)
and M, every config the tuner shortlists (``triton_w4a16``: ``w4a16.configs``; ``cutlass_w4a16``:
``shortlist``; ``dequant_gemm``: ``shortlist``), always the chunk counts of ``DEQUANT_CHUNKS``
besides (its shortlist is one or two configs), with ``--row-major`` each shortlisted CUTLASS
config on the row-major A layout too (the shortlist's read A reordered), and with ``--sweep``
the wider grid below, each built as its source builds it, timed alone and then the fastest
beside bf16 cuBLAS in turn (``config_sweep``: the machinery shared with ``fp8_prefill``). The kernels compile first, CUTLASS's and Triton's at the same time;
the JSON is rewritten after every row, narrow projections first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from bench.config_sweep import Todo, arguments, compile_everything, keys_of, run, unique
from tuner.candidates import cutlass_w4a16 as cw
from tuner.candidates import dequant_gemm as dg
from tuner.candidates.base import Params
from tuner.candidates.triton_kernels import w4a16
from tuner.core.keys import GemmKey
from tuner.measure.timing import cache_bytes

FORMAT = "int4-g128"
# Triton tiled tiles swept (bm activation rows, bn weight rows, warps, stages, dots, step_sum),
# each at the K splits of ``sweep_splits``. Offline (Triton 3.6, sm_90a) a two-dot step overlaps
# its wgmmas (4 warps only with step_sum) and 3 or more stages keep a load in flight across the
# loop (at 2 the loop waits for every copy at its top); the one-dot and 2-stage tiles are their
# serialized / unpipelined twins.
SWEEP_TILED = ((64, 64, 4, 3, 2, True), (64, 64, 4, 2, 2, True), (128, 64, 4, 3, 2, True),
               (64, 128, 8, 3, 2, True), (64, 128, 8, 4, 2, True), (128, 128, 8, 3, 2, True),
               (128, 128, 8, 3, 2, False), (128, 128, 8, 2, 2, True), (64, 256, 8, 3, 2, True),
               (128, 64, 4, 3, 1, False), (64, 128, 8, 3, 1, False))  # fmt: skip
MOST_SPLITS = 4
# CUTLASS: the shortlists' cooperative stream-K kernels (tile, cluster) under each of the tile
# scheduler's runtime arguments (``cutlass_w4a16.scheduler_args``): every decomposition, split-K
# 2..MOST_CUTLASS_SPLITS ways, and the heuristic's decomposition in either raster order. No kernel
# beyond the shortlists' is compiled.
SWEEP_CUTLASS = (((128, 256), (2, 1)), ((128, 128), (2, 1)))
MOST_CUTLASS_SPLITS = 6
SWEEP_SCHEDULES = (
    {"decomposition": "dataparallel"},
    {"decomposition": "streamk"},
    *({"decomposition": "splitk", "splits": s} for s in range(2, MOST_CUTLASS_SPLITS + 1)),
    {"raster": "weight"},
    {"raster": "x"},
)
# dequant_gemm: chunk counts timed beside its shortlist (those that split N into exactly that
# many 256-row steps), and the dequantizing program's other block heights on the whole weight
DEQUANT_CHUNKS = (1, 2, 3, 4, 6, 8, 12, 16)
DEQUANT_BLOCKS = (32, 128)
SOURCES = ("triton_w4a16", "cutlass_w4a16", "dequant_gemm")


def sweep_splits(tiles: int, steps: int, sms: int) -> list[int]:
    """K splits (runs of whole steps) worth timing for ``tiles`` output tiles of ``steps`` steps:
    1, and up to ``MOST_SPLITS`` while the programs stay within two per SM."""
    return [s for s in range(1, min(MOST_SPLITS, steps) + 1) if s == 1 or tiles * s <= 2 * sms]


def sweep_triton(key: GemmKey, sms: int) -> list[Params]:
    out: list[Params] = []
    for bm, bn, warps, stages, dots, step_sum in SWEEP_TILED:
        if key.k % (w4a16.CHUNK * dots):
            continue
        tiles = triton.cdiv(key.m, bm) * triton.cdiv(key.n, bn)
        for split in sweep_splits(tiles, key.k // (w4a16.CHUNK * dots), sms):
            config = {"kernel": "tiled", "bm": bm, "bn": bn, "bk": w4a16.CHUNK, "dots": dots,
                      "split_k": split, "group_m": 8, "warps": warps, "stages": stages}  # fmt: skip
            out.append({**config, "step_sum": True} if step_sum else config)
    return out


def sweep_cutlass() -> list[Params]:
    return [cw._p(*tile, cluster, "coop", "streamk", **schedule)
            for tile, cluster in SWEEP_CUTLASS for schedule in SWEEP_SCHEDULES]  # fmt: skip


def more_dequant(key: GemmKey) -> list[Params]:
    """``DEQUANT_CHUNKS`` that ``dequant_gemm`` takes for ``key``, then the other blocks."""
    out: list[Params] = []
    for chunks in DEQUANT_CHUNKS:
        params = {"chunks": chunks, "bn": dg.DEFAULT_BN}
        try:
            dg.check_params(params, key.n)
        except ValueError:  # N does not split into exactly that many 256-row steps
            continue
        out.append(params)
    return out + [{"chunks": 1, "bn": bn} for bn in DEQUANT_BLOCKS]


def configs_of(
    key: GemmKey,
    sweep: bool,
    sms: int,
    sources: Sequence[str] = SOURCES,
    row_major: bool = False,
) -> Todo:
    """(source, params, shortlisted) of every config of ``sources`` to time for ``key``, without
    repeats."""
    shortlisted = [("triton_w4a16", p) for p in w4a16.configs(key.m, key.n, key.k, key.group)]
    shortlisted += [("cutlass_w4a16", p) for p in cw.shortlist(key)]
    l2 = cache_bytes("cuda")
    shortlisted += [("dequant_gemm", p) for p in dg.shortlist(key.m, key.n, key.k, l2, sms)]
    extra = [("dequant_gemm", p) for p in more_dequant(key)]
    extra += [("triton_w4a16", p) for p in sweep_triton(key, sms)] if sweep else []
    extra += [("cutlass_w4a16", p) for p in sweep_cutlass()] if sweep else []
    if row_major:
        extra += [("cutlass_w4a16", cw.row_major(p)) for p in cw.shortlist(key)]
    return [c for c in unique(shortlisted, extra) if c[0] in sources]


def main() -> None:
    parser = arguments(__doc__.split("\n")[0], default_m=[256, 2048])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    parser.add_argument("--row-major", action="store_true",
                        help="also each shortlisted CUTLASS config on the row-major A layout")  # fmt: skip
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    keys = keys_of(FORMAT, args.m, args.ops)
    todo = {key: configs_of(key, args.sweep, sms, args.sources, args.row_major) for _, key in keys}
    compiled = compile_everything(todo, cutlass="cutlass_w4a16", triton="triton_w4a16")
    run("w4a16_prefill", keys, todo, args.out, with_torch=False,
        extra={"sweep": args.sweep, "row_major": args.row_major, "compile_s": compiled})  # fmt: skip


if __name__ == "__main__":
    main()

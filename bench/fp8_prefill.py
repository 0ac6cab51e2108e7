"""FP8 rowwise prefill: every FP8 source's configs beside ``_scaled_mm`` and bf16 cuBLAS.

    python bench/fp8_prefill.py --out $OUT/fp8_prefill.json [--m 2048] [--ops qkv o] [--sweep]
        [--sources cublaslt_fp8]

Per projection (the low-bit suite's eight: qkv, o, gate_up, down of Llama-3-8B and Qwen2.5-7B)
and M, the shortlist of each FP8 source (``cutlass_fp8``, ``cublaslt_fp8``, ``triton_fp8``:
their ``candidates``), and with ``--sweep`` the wider grid below, each built as its source
builds it, timed alone and then the fastest beside torch's ``_scaled_mm`` (the baseline a
challenger must beat in the duel) and bf16 cuBLAS in turn (``config_sweep``: the machinery shared
with ``w4a16_prefill``). The kernels compile first, CUTLASS's and Triton's at the same time; the
JSON is rewritten after every row, narrow projections first. ``--profile-host N``: on the first
row, where the host time of a call goes (cProfile over N eager calls of ``_scaled_mm`` and of
each source's first config), printed and kept in the JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.config_sweep import (
    Todo,
    arguments,
    compile_everything,
    keys_of,
    profile_host,
    run,
    unique,
)
from tuner.candidates import cutlass_fp8, registry
from tuner.candidates.base import Params
from tuner.core.keys import GemmKey

FORMAT = "fp8-rowwise"
SOURCES = ("cutlass_fp8", "cublaslt_fp8", "triton_fp8")
# CUTLASS cooperative FP8 kernels beside the shortlist's (cluster tile, cluster, scheduler): 128x192
# CTAs (derived: the generator lists none) on either 2-CTA cluster, persistent and stream-K, and
# 256x96 CTAs; 128x128 CTAs stream-K, the tile torch's own rowwise kernel takes at these shapes
SWEEP_CUTLASS = (((128, 384), (1, 2), "default"), ((256, 192), (2, 1), "default"),
                 ((256, 192), (1, 2), "default"), ((128, 384), (1, 2), "streamk"),
                 ((256, 192), (2, 1), "streamk"), ((128, 256), (1, 2), "streamk"))  # fmt: skip
# raster swizzles (a launch-time argument, no new kernel) tried on these (tile, cluster, scheduler)
SWEEP_SWIZZLES = (2, 8)
SWIZZLED = (((128, 384), (1, 2), "default"), ((256, 192), (2, 1), "default"),
            ((128, 256), (1, 2), "default"))  # fmt: skip
# cuBLASLt tiles (its M is our N: it multiplies W @ x.T) and clusters tried on the heuristic's
# first algorithm; the ones this cuBLASLt cannot run fail at build and are recorded so
SWEEP_LT_TILES = ("128x128", "128x256", "256x128", "192x128", "128x192")
SWEEP_LT_CLUSTERS = ("1x1x1", "2x1x1", "1x2x1")


def sweep_of(source: str, shortlist: list[Params]) -> list[Params]:
    """The ``--sweep`` configs of ``source`` (its shortlist tells cuBLASLt's algorithm)."""
    if source == "cutlass_fp8":
        out = [cutlass_fp8._p(*tile, cluster, sched) for tile, cluster, sched in SWEEP_CUTLASS]
        return out + [{**cutlass_fp8._p(*tile, cluster, sched), "swizzle": s}
                      for tile, cluster, sched in SWIZZLED for s in SWEEP_SWIZZLES]  # fmt: skip
    if source == "cublaslt_fp8" and shortlist:
        first = shortlist[0]
        return [
            {**first, "tile": t, "cluster": c} for t in SWEEP_LT_TILES for c in SWEEP_LT_CLUSTERS
        ]
    return []


def configs_of(key: GemmKey, sweep: bool, sources: Sequence[str] = SOURCES) -> Todo:
    """(source, params, shortlisted) of every config of ``sources`` to time for ``key``, without
    repeats."""
    shortlisted: list[tuple[str, Params]] = []
    extra: list[tuple[str, Params]] = []
    for source in sources:
        src = registry.get(source)
        reason = src.unavailable("cuda") or src.unsupported(key)
        if reason:
            print(f"  {source}: {reason}", flush=True)
            continue
        shortlist = src.candidates(key, "cuda")
        shortlisted += [(source, p) for p in shortlist]
        extra += [(source, p) for p in sweep_of(source, shortlist)] if sweep else []
    return unique(shortlisted, extra)


def main() -> None:
    ap = arguments(__doc__.split("\n")[0], default_m=[2048])
    ap.add_argument("--profile-host", type=int, default=0, metavar="N",
                    help="first row: cProfile of N eager calls per source")  # fmt: skip
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    args = ap.parse_args()
    keys = keys_of(FORMAT, args.m, args.ops)
    todo = {key: configs_of(key, args.sweep, args.sources) for _, key in keys}
    extra: dict[str, Any] = {"sweep": args.sweep}
    extra["compile_s"] = compile_everything(todo, cutlass="cutlass_fp8", triton="triton_fp8")
    if args.profile_host:
        label, key = keys[0]
        extra["host_profile"] = {"label": label, **profile_host(key, todo[key], args.profile_host)}
    run("fp8_prefill", keys, todo, args.out, with_torch=True, extra=extra)


if __name__ == "__main__":
    main()

"""The CUDA W4A16 decode kernel (``tuner/candidates/cuda_kernels/w4a16_gemv.cu``) on a grid of its
configs, beside the Triton decode shortlist, bf16 cuBLAS and a bare read of the INT4 bytes.

    python bench/w4a16_gemv.py --out bench/results/w4a16_gemv.json

Per projection (N x K, ``lowbit_kernels.PROJECTIONS``) and M, in one process, bf16 activations,
group 128, CUDA-graph GPU time (``timing.graph_time``), weights rotated past the L2:

- **bf16**: ``torch.matmul(x, w.T)`` (cuBLAS); **read_int4**: a bare read of the packed weight;
- **w4a16**: every config of the Triton kernel's shortlist (``w4a16.configs``);
- **cuda_gemv**: every config of ``GRID`` that fits M (its libraries built first, in parallel).

"pct_copy" is the bytes read and written (weight, scales, activations, output) per second over the
device-to-device copy bandwidth. Every W4A16 config's output is checked against a float32 GEMM on
the dequantized operands (``tuner.quant.tolerance``): "excess" <= 1 passes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.lowbit_kernels import (
    PROJECTIONS,
    copies,
    header,
    nbytes,
    rotate,
    timed_row,
    write_as_it_goes,
)
from tuner.candidates import cuda_w4a16, gemm_operands
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.launch import warm
from tuner.candidates.triton_kernels.stream_read import read_all, sums_for
from tuner.measure import timing
from tuner.quant import int4
from tuner.quant.tolerance import FP32_ACCUMULATE, excess, gemm_tolerance, unit_roundoff

GROUP = 128
MS = (1, 4, 8)
# (split, slices of 16 rows per warp, stages, warps, cluster). Warps splitting K: 32-row CTAs over
# all of K (one per SM), 8-16 warps. Warps splitting rows: CTAs of 64-256 rows with K over a
# cluster, about one CTA per SM on N = 3584-4096 (112 and 224 rows: Qwen's 3584 in 32 or 16
# blocks), 4-8 stages, 16- or 32-row warps; and two CTAs per SM (128 rows, cluster of 8).
GRID = [
    ("k", 2, 4, 8, 1), ("k", 2, 3, 16, 1), ("k", 2, 3, 12, 1),
    ("rows", 1, 4, 8, 4), ("rows", 1, 6, 8, 4), ("rows", 1, 8, 8, 4), ("rows", 2, 6, 4, 4),
    ("rows", 2, 4, 4, 4), ("rows", 1, 4, 16, 8), ("rows", 1, 6, 16, 8), ("rows", 2, 4, 8, 8),
    ("rows", 2, 6, 8, 8), ("rows", 1, 8, 4, 2), ("rows", 1, 6, 7, 4), ("rows", 1, 6, 14, 8),
    ("rows", 1, 4, 8, 8), ("rows", 1, 6, 8, 8),
]  # fmt: skip


def grid_configs(m: int, n: int, k: int) -> list[dict[str, Any]]:
    """``GRID`` as configs for an (M, N, K) problem, those that fit it."""
    out = []
    for entry in GRID:
        cfg = dict(zip(cuda_w4a16.CONFIG_KEYS, entry, strict=True))
        try:
            cuda_w4a16.check_config(cfg, m, n, k, GROUP)
        except ValueError:
            continue
        out.append(cfg)
    return out


def build(projections: list[str], ms: tuple[int, ...]) -> None:
    """Every library and Triton kernel the run times, compiled in parallel before any timing."""
    started = time.perf_counter()
    cfgs = [c for name in projections for m in ms for c in grid_configs(m, *PROJECTIONS[name])]
    errors = {str(lib): e for lib, e in cuda_w4a16.compile_all(cfgs).items() if e}
    print(f"built {len({cuda_w4a16.library(c) for c in cfgs})} CUDA libraries in "
          f"{time.perf_counter() - started:.1f} s; errors: {errors}", flush=True)  # fmt: skip
    report = warm([job for name in projections for m in ms
                   for cfg in w4a16.configs(m, *PROJECTIONS[name], GROUP)
                   for job in w4a16.checked_plan(m, *PROJECTIONS[name], GROUP, cfg)
                   .jobs(torch.bfloat16)])  # fmt: skip
    print(f"precompiled {report.compiled} of {report.requested} Triton kernels in "
          f"{report.seconds:.1f} s", flush=True)  # fmt: skip


def bench_projection(name: str, ms: tuple[int, ...], copy_gbs: float) -> list[dict[str, Any]]:
    n, k = PROJECTIONS[name]
    rows: list[dict[str, Any]] = []
    stream = gemm_operands.stream_getter(torch.device("cuda", torch.cuda.current_device()))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, sz = int4.quantize(w, GROUP)
    packed = int4.pack(q)
    del q
    wd = int4.dequantize(int4.unpack(packed), sz, GROUP)
    bf = rotate(copies(w), w)
    i4 = rotate(copies(packed, sz), packed, sz)
    sums = sums_for(packed)

    def row(m: int, impl: str, fn: Callable[[int], Any], moved: int, **extra: Any) -> dict:
        r = timed_row(name, n, k, m, impl, fn, moved, copy_gbs, 0.05, **extra)
        rows.append(r)
        return r

    def one_m(m: int) -> None:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ wd.T
        tol = gemm_tolerance(x, wd, ref, operand_unit=unit_roundoff(x.dtype),
                             accumulate_unit=FP32_ACCUMULATE, out_dtype=x.dtype)  # fmt: skip
        moved = nbytes(packed, sz, x, out)
        row(m, "read_int4", lambda i: read_all(i4[i % len(i4)][0], sums), nbytes(packed))
        base = row(m, "bf16", lambda i: torch.matmul(x, bf[i % len(bf)][0].T, out=out),
                   nbytes(w, x, out))  # fmt: skip

        def checked(impl: str, cfg: dict, call: Callable[[int, torch.Tensor], Any]) -> None:
            try:
                got = torch.full_like(out, float("nan"))
                call(0, got)
                err = round(excess(got, ref, tol), 3)
                r = row(m, impl, lambda i: call(i, out), moved, config=cfg, excess=err)
                r["speedup_vs_bf16"] = round(base["us"] / r["us"], 3)
            except Exception as e:  # one config's failure is a finding, not the end of the sweep
                rows.append({"proj": name, "n": n, "k": k, "m": m, "impl": impl, "config": cfg,
                             "error": repr(e)[-500:]})  # fmt: skip
                print(f"{name:12s} m={m:3d} {impl} {cfg} FAILED {e!r}"[:300], flush=True)

        for cfg in w4a16.configs(m, n, k, GROUP):
            checked("w4a16", cfg, lambda i, o, c=cfg: w4a16.w4a16_matmul(
                x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, c, out=o))  # fmt: skip
        for cfg in grid_configs(m, n, k):
            fn = cuda_w4a16.launcher(cfg)
            checked("cuda_gemv", cfg, lambda i, o, c=cfg, f=fn: cuda_w4a16.run(
                f, c, x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, o, stream()))  # fmt: skip
        for impl in ("w4a16", "cuda_gemv"):
            ok = [r for r in rows if r["m"] == m and r["impl"] == impl and r.get("excess", 9) <= 1]
            if ok:
                min(ok, key=lambda r: r["us"])["best"] = True

    for m in ms:
        one_m(m)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", default=["down", "qwen_down", "gate_up", "qwen_gate_up"])
    ap.add_argument("--m", nargs="*", type=int, default=list(MS))
    args = ap.parse_args()
    for name in args.proj:
        if name not in PROJECTIONS:
            ap.error(f"projection {name!r}: allowed {sorted(PROJECTIONS)}")
    torch.manual_seed(0)
    build(args.proj, tuple(args.m))
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result = header(copy_gbs, group_size=GROUP, nvcc=cuda_w4a16.toolkit())
    write_as_it_goes(result, args.out, args.proj,
                     lambda name: bench_projection(name, tuple(args.m), copy_gbs))  # fmt: skip


if __name__ == "__main__":
    main()

"""Low-bit GEMMs on Llama-3-8B projections and Qwen2.5-7B's MLP: ours beside torch's.

Qwen's down projection (K = 18944, 148 chunks of 128) is the shape whose K splits poorly.

    python bench/lowbit_kernels.py --out bench/results/lowbit_kernels.json

Per projection (N x K) and M, side by side in one process, bf16 activations:

- **bf16**: ``torch.matmul(x, w.T)`` (cuBLAS), the reference speed;
- **int4pack_mm**: ``aten._weight_int4pack_mm`` (group 128, inner k tiles 8);
- **w4a16**: our kernel, every config of ``w4a16.configs`` (best first in the row, all listed);
- **w4a16_extra**: configs outside the shortlist (``--extra``, per projection), timed beside it;
- **bf16_triton** (M > 16): the tuner's bf16 Triton tiled GEMM with the best w4a16 config's
  tile, warps and stages: how much of the prefill gap to bf16 is the dequantization;
- **scaled_mm_rowwise / scaled_mm_tensorwise**: ``torch._scaled_mm`` on e4m3 operands;
- **fp8_rowwise / fp8_tensorwise**: our kernel, every config of ``fp8.configs``;
- **read_int4 / read_fp8 / read_bf16** (M <= 16): a bare streaming read of the weight's bytes:
  the floor of a weight-streaming kernel.

Weights rotate over enough copies that the set exceeds twice the L2 (``timing.rotation_sets``);
activations are quantized ahead (not timed). M <= 16: GPU time per call in a CUDA graph
(``timing.graph_time``); larger M: CUDA events (``timing.measure``). "pct_copy" is the bytes
actually read and written (weight, scales, activations, output) per second over the
device-to-device copy bandwidth. Our kernels' best configs are checked against a float32 GEMM on
the dequantized operands (``tuner.quant.tolerance``): "excess" <= 1 passes. The JSON is
rewritten after every projection; ``--formats`` picks int4 and/or fp8.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

from tuner.candidates.triton_kernels import fp8 as fp8_kernels
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.launch import warm
from tuner.candidates.triton_kernels.stream_read import BLOCK, read_all
from tuner.candidates.triton_kernels.tiled import tiled_gemm
from tuner.measure import timing
from tuner.quant import fp8, int4
from tuner.quant.tolerance import (
    FP8_TENSOR_CORE_ACCUMULATE,
    FP32_ACCUMULATE,
    excess,
    gemm_tolerance,
    unit_roundoff,
)

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336), "qwen_gate_up": (37888, 3584),
               "qwen_down": (3584, 18944)}  # fmt: skip
MS = (1, 4, 16, 256, 2048)
GROUP = 128


def time_us(fn: Callable[[int], Any], m: int, budget_s: float) -> dict[str, Any]:
    if m <= 16:
        t, how = timing.graph_time(fn), "graph"
    else:
        t, how = timing.measure(fn, device="cuda", budget_s=budget_s), "events"
    return {"us": round(t.median_us, 2), "p10_us": round(t.p10_us, 2),
            "p90_us": round(t.p90_us, 2), "timing": how}  # fmt: skip


def timed_row(name: str, n: int, k: int, m: int, impl: str, fn: Callable[[int], Any], moved: int,
              copy_gbs: float, budget_s: float, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """``fn`` timed at M = ``m`` as a result row, with its % of copy bandwidth on the ``moved``
    bytes, printed as it is measured."""
    r = {"proj": name, "n": n, "k": k, "m": m, "impl": impl, **time_us(fn, m, budget_s),
         "bytes": moved, **extra}  # fmt: skip
    r["pct_copy"] = round(100 * moved / (r["us"] * 1e-6) / (copy_gbs * 1e9), 1)
    print(f"{name:12s} m={m:5d} {impl:22s} {r['us']:9.2f} us {r['pct_copy']:6.1f}% copy "
          f"{extra.get('config', '')} {extra.get('excess', '')}", flush=True)  # fmt: skip
    return r


def copies(*parts: torch.Tensor) -> int:
    return timing.rotation_sets(sum(p.numel() * p.element_size() for p in parts), "cuda")


def rotate(n: int, *parts: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    return [parts] + [tuple(p.clone() for p in parts) for _ in range(n - 1)]


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def int4_configs(m: int, n: int, k: int, extra: list[dict]) -> list[tuple[str, dict]]:
    """(impl, config) of every W4A16 config timed on a row: the shortlist, then ``extra``."""
    shortlist = w4a16.configs(m, n, k, GROUP)
    return [("w4a16", c) for c in shortlist] + [
        ("w4a16_extra", c) for c in extra if c not in shortlist
    ]


def precompile_int4(projections: list[str], ms: tuple[int, ...],
                    extra: dict[str, list[dict]]) -> None:  # fmt: skip
    """Compile every W4A16 config the run will time, in parallel worker processes, before any
    timing (the first call then loads each kernel from Triton's cache)."""
    shapes = [(name, m, *PROJECTIONS[name]) for name in projections for m in ms]
    report = warm([job for name, m, n, k in shapes
                   for _, cfg in int4_configs(m, n, k, extra.get(name, []))
                   for job in w4a16.checked_plan(m, n, k, GROUP, cfg).jobs(torch.bfloat16)])  # fmt: skip
    print(f"precompiled {report.compiled} of {report.requested} w4a16 kernels in "
          f"{report.seconds:.1f} s; errors: {report.errors[:3]}", flush=True)  # fmt: skip


def bf16_same_tile(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict) -> None:
    """The bf16 Triton tiled GEMM x @ w.T with a w4a16 config's tile, warps and stages."""
    (m, k), n = x.shape, w.shape[0]
    bm, bn = cfg["bm"], cfg["bn"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), 1, 1)
    tiled_gemm[grid](x, w, out, out, m, n, k, 0, x.stride(0), 1, 0, 1, w.stride(0), 0,
                     out.stride(0), 1, BM=bm, BN=bn, BK=64, GROUP_M=8, SPLIT_K=1,
                     EVEN_K=k % 64 == 0, PRECISION="ieee", num_warps=cfg["warps"],
                     num_stages=cfg["stages"])  # fmt: skip


def bench_projection(name: str, n: int, k: int, ms: tuple[int, ...], copy_gbs: float,
                     budget_s: float, formats: tuple[str, ...], profile: bool = False,
                     extra: list[dict] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, sz = int4.quantize(w, GROUP)
    packed = int4.pack(q)
    tpacked = int4.to_torch_int4pack(packed, 8)
    w8, s8 = fp8.quantize_rowwise(w)
    w8t, s8t = fp8.quantize_tensorwise(w)
    del q
    bf = rotate(copies(w), w)
    i4 = rotate(copies(packed, sz), packed, sz)
    t4 = rotate(copies(tpacked, sz), tpacked, sz)
    f8 = rotate(copies(w8, s8), w8, s8)
    f8t = rotate(len(f8), w8t, s8t)
    sums = torch.empty(triton.cdiv(n * k * 2 // 4, BLOCK), device="cuda", dtype=torch.int32)

    def row(m: int, impl: str, fn: Callable[[int], Any], moved: int, **extra: Any) -> dict:
        if profile:
            return profiled(name, m, impl, fn, extra)
        r = timed_row(name, n, k, m, impl, fn, moved, copy_gbs, budget_s, **extra)
        rows.append(r)
        return r

    def one_m(m: int) -> None:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        io16 = nbytes(x, out)
        if m <= 16:  # the floor of the weight-streaming (decode) rows
            row(m, "read_bf16", lambda i: read_all(bf[i % len(bf)][0], sums), nbytes(w))
            row(m, "read_int4", lambda i: read_all(i4[i % len(i4)][0], sums), nbytes(packed))
            row(m, "read_fp8", lambda i: read_all(f8[i % len(f8)][0], sums), nbytes(w8))
        base = row(m, "bf16", lambda i: torch.matmul(x, bf[i % len(bf)][0].T, out=out),
                   nbytes(w) + io16)  # fmt: skip
        if "int4" in formats:
            int4_rows(m, x, out, io16, base)
        if "fp8" in formats:
            fp8_rows(m, x, out, base)

    def int4_rows(m: int, x: torch.Tensor, out: torch.Tensor, io16: int, base: dict) -> None:
        row(m, "int4pack_mm", lambda i: torch.ops.aten._weight_int4pack_mm(
            x, t4[i % len(t4)][0], GROUP, t4[i % len(t4)][1]), nbytes(packed, sz) + io16)  # fmt: skip
        ours = []
        for impl, cfg in int4_configs(m, n, k, extra or []):
            try:
                ours.append(row(m, impl, lambda i, c=cfg: w4a16.w4a16_matmul(
                    x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, c, out=out),
                    nbytes(packed, sz) + io16, config=cfg))  # fmt: skip
            except Exception as e:  # one config's failure is a finding, not the end of the sweep
                rows.append({"proj": name, "n": n, "k": k, "m": m, "impl": impl,
                             "config": cfg, "error": repr(e)[-500:]})  # fmt: skip
                print(f"{name:8s} m={m:5d} {impl} {cfg} FAILED {e!r}"[:300], flush=True)
        if profile:
            return
        for extra_row in (r for r in ours if r["impl"] == "w4a16_extra"):
            extra_row["speedup_vs_bf16"] = round(base["us"] / extra_row["us"], 3)
        best = min((r for r in ours if r["impl"] == "w4a16"), key=lambda r: r["us"], default=None)
        if best is None:  # every shortlisted config failed (recorded above): nothing to check
            return
        best["best"] = True
        best["speedup_vs_bf16"] = round(base["us"] / best["us"], 3)
        wd = int4.dequantize(int4.unpack(packed), sz, GROUP)
        got = w4a16.w4a16_matmul(x, packed, sz, GROUP, best["config"])
        ref = x.float() @ wd.T
        best["excess"] = round(excess(got, ref, gemm_tolerance(
            x, wd, ref, operand_unit=unit_roundoff(x.dtype), accumulate_unit=FP32_ACCUMULATE,
            out_dtype=x.dtype)), 3)  # fmt: skip
        del wd
        if m > 16:
            row(m, "bf16_triton", lambda i: bf16_same_tile(x, bf[i % len(bf)][0], out,
                best["config"]), nbytes(w) + io16, config=best["config"])  # fmt: skip

    def fp8_rows(m: int, x: torch.Tensor, out: torch.Tensor, base: dict) -> None:
        x8, sx8 = fp8.quantize_rowwise(x)
        x8t, sx8t = fp8.quantize_tensorwise(x)
        io8 = nbytes(x8, out)
        row(m, "scaled_mm_rowwise", lambda i: torch._scaled_mm(
            x8, f8[i % len(f8)][0].T, sx8, f8[i % len(f8)][1].T, out_dtype=torch.bfloat16),
            nbytes(w8, s8, sx8) + io8)  # fmt: skip
        row(m, "scaled_mm_tensorwise", lambda i: torch._scaled_mm(
            x8t, f8t[i % len(f8t)][0].T, sx8t, f8t[i % len(f8t)][1], out_dtype=torch.bfloat16),
            nbytes(w8) + io8)  # fmt: skip
        ours = []
        for cfg in fp8_kernels.configs(m, n, k):
            ours.append(row(m, "fp8_rowwise", lambda i, c=cfg: fp8_kernels.fp8_matmul(
                x8, f8[i % len(f8)][0], sx8, f8[i % len(f8)][1], c, out=out),
                nbytes(w8, s8, sx8) + io8, config=cfg))  # fmt: skip
        if profile:
            return
        best = min(ours, key=lambda r: r["us"])
        best["best"] = True
        best["speedup_vs_bf16"] = round(base["us"] / best["us"], 3)
        da, db = fp8.dequantize(x8, sx8), fp8.dequantize(w8, s8)
        ref = da @ db.T
        got = fp8_kernels.fp8_matmul(x8, w8, sx8, s8, best["config"])
        best["excess"] = round(excess(got, ref, gemm_tolerance(
            da, db, ref, operand_unit=0.0, accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE,
            out_dtype=torch.bfloat16)), 3)  # fmt: skip
        del da, db
        for cfg in fp8_kernels.configs(m, n, k):
            ours.append(row(m, "fp8_tensorwise", lambda i, c=cfg: fp8_kernels.fp8_matmul(
                x8t, f8t[i % len(f8t)][0], sx8t, f8t[i % len(f8t)][1], c, out=out),
                nbytes(w8) + io8, config=cfg))  # fmt: skip
        best = min((r for r in ours if r["impl"] == "fp8_tensorwise"), key=lambda r: r["us"])
        best["best"] = True
        best["speedup_vs_bf16"] = round(base["us"] / best["us"], 3)

    for m in ms:
        one_m(m)
    return rows


def profiled(name: str, m: int, impl: str, fn: Callable[[int], Any], extra: dict) -> dict:
    """``--profile``: one call after a warm-up, inside an NVTX range that Nsight Compute
    selects (``--nvtx --nvtx-include profile/``), so only that launch is counted."""
    fn(0)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn(1)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"profiled {name} m={m} {impl} {extra.get('config', '')}", flush=True)
    return {"impl": impl, "us": 1.0}


def header(copy_gbs: float, **extra: Any) -> dict[str, Any]:
    """A kernel bench's JSON before its rows: device, versions, the copy bandwidth, ``extra``."""
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "copy_gbs": round(copy_gbs, 1), **extra,
              "rows": []}  # fmt: skip
    print(f"{result['device']}: copy {copy_gbs:.0f} GB/s", flush=True)
    return result


def write_as_it_goes(
    result: dict[str, Any], out: str, names: list[str], rows_of: Callable[[str], list[Any]]
) -> None:
    """``rows_of(name)`` added to ``result['rows']`` for each name, the JSON rewritten after each:
    a run cut off by its time limit keeps what it measured."""
    t0 = time.time()
    for name in names:
        result["rows"] += rows_of(name)
        result["seconds"] = round(time.time() - t0, 1)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", help=f"default: all of {list(PROJECTIONS)} and --shape's")
    ap.add_argument("--m", nargs="*", type=int, default=list(MS))
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per event-timed point")
    ap.add_argument("--formats", nargs="*", default=["int4", "fp8"], choices=["int4", "fp8"])
    ap.add_argument("--profile", action="store_true",
                    help="no timing: each kernel once in an NVTX range 'profile', for ncu")  # fmt: skip
    ap.add_argument("--shape", nargs="*", default=[], metavar="NAME=N,K",
                    help="more projections (timed when --proj names them, or by default)")  # fmt: skip
    ap.add_argument("--extra", type=json.loads, default={},
                    help='W4A16 configs beside the shortlist, JSON {"proj": [config, ...]}')  # fmt: skip
    args = ap.parse_args()
    for spec in args.shape:
        name, _, dims = spec.partition("=")
        n_k = dims.split(",")
        if not name or len(n_k) != 2 or not all(d.isdigit() for d in n_k):
            ap.error(f"--shape {spec!r}: expected NAME=N,K with integers N and K")
        PROJECTIONS[name] = (int(n_k[0]), int(n_k[1]))
    args.proj = args.proj or list(PROJECTIONS)
    for name in [*args.proj, *args.extra]:
        if name not in PROJECTIONS:
            ap.error(f"projection {name!r}: allowed {sorted(PROJECTIONS)} (or add it with --shape)")
    torch.manual_seed(0)
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result = header(copy_gbs, group_size=GROUP)
    if "int4" in args.formats:
        precompile_int4(args.proj, tuple(args.m), args.extra)

    def rows_of(name: str) -> list[dict[str, Any]]:
        n, k = PROJECTIONS[name]
        return bench_projection(name, n, k, tuple(args.m), copy_gbs, args.budget,
                                tuple(args.formats), args.profile, args.extra.get(name, []))  # fmt: skip

    write_as_it_goes(result, args.out, args.proj, rows_of)


if __name__ == "__main__":
    main()

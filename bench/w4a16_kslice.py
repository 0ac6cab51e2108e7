"""A bench-only W4A16 decode design (``bench/w4a16_kslice.cu``: x the mma's A operand, the weight
streamed into registers, warps over tile groups and shares of K) beside the product's decode
kernels, bf16 cuBLAS and a bare read of the INT4 bytes, in one run.

    python bench/w4a16_kslice.py --out kslice.json --proj down qwen_down --m 1 8 16

Per projection (``lowbit_kernels.PROJECTIONS``) and M: CUDA-graph GPU times, weights rotated past
the L2 (as ``w4a16_gemv.py``). Every config's output is checked against a float32 GEMM on the
dequantized operands ("excess" <= 1 passes). The kslice configs are every (build, cluster, tile
groups, shares of K) whose grid fills the SMs in one round and whose shares of K are within 10% of even.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import itertools
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
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
from tuner.candidates import cuda_library, cuda_w4a16, gemm_operands
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.stream_read import read_all, sums_for
from tuner.measure import timing
from tuner.quant import int4
from tuner.quant.tolerance import FP32_ACCUMULATE, excess, gemm_tolerance, unit_roundoff

SOURCE = Path(__file__).with_suffix(".cu")
GROUP = 128
SLICE = 128
SMEM_LIMIT = 227 * 1024
# (tiles a warp, slices ahead, most warps a CTA, CTAs an SM)
BUILDS = [(4, 2, 16, 1), (2, 4, 16, 1), (2, 2, 16, 1), (4, 3, 12, 1), (8, 1, 12, 1), (7, 1, 16, 1)]
# bench variants of a build (a fifth field of a BUILDS entry): its loads, or the stream alone
VARIANTS = {
    "nc": "-DKS_LOAD=1",
    "plain": "-DKS_LOAD=2",
    "copies": "-DKS_COPIES_ONLY=1",
    "xg4": "-DKS_XGROUP=4",
    "xg8": "-DKS_XGROUP=8",
    "xg8copies": "-DKS_XGROUP=8 -DKS_COPIES_ONLY=1",
    "ring": "-DKS_XGROUP=8 -DKS_RING=1",
    "ringcopies": "-DKS_XGROUP=8 -DKS_RING=1 -DKS_COPIES_ONLY=1",
}
PRODUCT = [("k", 2, 2, 16, 1), ("k", 4, 2, 8, 2), ("k", 4, 2, 12, 1, False, 4), ("k", 2, 2, 4, 1),
           ("k", 4, 2, 8, 1)]  # fmt: skip


def pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> the kslice layout, int32 [K / 128, N / 8, 32 lanes, 4 words]."""
    n, k = q.shape
    v = q.to(torch.int64).reshape(n // 8, 8, k // SLICE, 8, 16)  # tile, g, slice, block, kk
    words = torch.zeros(k // SLICE, n // 8, 8, 4, 4, dtype=torch.int64, device=q.device)
    for t, word, p in itertools.product(range(4), range(4), range(8)):
        block = 2 * word + (p % 4 >= 2)
        kk = 2 * t + (p >= 4) + 8 * (p % 2)
        words[:, :, :, t, word] |= v[:, :, :, block, kk].permute(2, 0, 1) << (4 * p)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(k // SLICE, n // 8, 32, 4).to(torch.int32).contiguous()


def build(spec: tuple, out_dir: Path) -> Path:
    tiles, ahead, warps, min_ctas, *variant = spec
    path = out_dir / f"kslice_{tiles}_{ahead}_{warps}_{min_ctas}_{'_'.join(variant)}.so"
    flags = [f"-DKS_TILES={tiles}", f"-DKS_AHEAD={ahead}", f"-DKS_WARPS={warps}",
             f"-DKS_MIN_CTAS={min_ctas}", *(f for v in variant for f in VARIANTS[v].split())]  # fmt: skip
    cmd = [cuda_library.nvcc_build.nvcc_path() or "nvcc", "-O3", "-arch=sm_90a", "-std=c++17",
           "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v", *flags, "-o", str(path),
           str(SOURCE)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    regs = [line for line in done.stderr.splitlines() if "registers" in line or "spill" in line]
    print(f"built {path.name}: {' | '.join(r.strip() for r in regs)}", flush=True)
    return path


def configs(n: int, k: int, sms: int) -> list[dict[str, Any]]:
    """Every kslice config that fills the SMs in one round, its longest share of K within 10%
    of the mean."""
    nt, s = n // 8, k // SLICE
    out = []
    for tiles, ahead, max_warps, min_ctas, *variant in BUILDS:
        for c in (1, 2, 4, 8):
            if s % c:
                continue
            sc = s // c
            for groups, shares in itertools.product(range(1, max_warps + 1), range(1, 17)):
                warps = groups * shares
                if warps > max_warps or warps < 7 or shares > sc:
                    continue
                if -(-sc // shares) * shares > 1.1 * sc:  # the longest share's excess
                    continue
                r = groups * tiles
                blocks = -(-nt // r)
                ctas = blocks * c
                ring = any(v.startswith("ring") for v in variant)
                area = (ahead + 1) * tiles * 32 * 24 if ring else 16 * 8 * tiles * 4
                smem = 16 * (sc * SLICE + 8) * 2 + warps * area + 16 * (8 * r + 8) * 4 + sc * 8
                if smem * min_ctas > SMEM_LIMIT or ctas > sms * min_ctas:
                    continue
                if ctas < 0.85 * sms * min_ctas or nt % tiles:
                    continue
                out.append({"build": [tiles, ahead, max_warps, min_ctas, *variant], "cluster": c,
                            "groups": groups, "warps": warps, "ctas": ctas})  # fmt: skip
    return out


def bench_projection(name: str, ms: tuple[int, ...], copy_gbs: float,
                     libs: dict[tuple, Callable[..., int]]) -> list[dict[str, Any]]:  # fmt: skip
    n, k = PROJECTIONS[name]
    rows: list[dict[str, Any]] = []
    stream = gemm_operands.stream_getter(torch.device("cuda", torch.cuda.current_device()))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, sz = int4.quantize(w, GROUP)
    ours, product = pack(q), int4.pack(q)
    wd = int4.dequantize(q, sz, GROUP)
    del q
    bf = rotate(copies(w), w)
    ks = rotate(copies(ours, sz), ours, sz)
    i4 = rotate(copies(product, sz), product, sz)
    sums = sums_for(product)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

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
        moved = nbytes(product, sz, x, out)
        row(m, "read_int4", lambda i: read_all(i4[i % len(i4)][0], sums), nbytes(product))
        base = row(m, "bf16", lambda i: torch.matmul(x, bf[i % len(bf)][0].T, out=out),
                       nbytes(w, x, out))  # fmt: skip

        def checked(impl: str, cfg: Any, call: Callable[[int, torch.Tensor], Any]) -> None:
            try:
                got = torch.full_like(out, float("nan"))
                call(0, got)
                err = round(excess(got, ref, tol), 3)
                r = row(m, impl, lambda i: call(i, out), moved, config=cfg, excess=err)
                r["speedup_vs_bf16"] = round(base["us"] / r["us"], 3)
            except Exception as e:  # one config's failure is a finding, not the end of the run
                rows.append({"proj": name, "n": n, "k": k, "m": m, "impl": impl, "config": cfg,
                                 "error": repr(e)[-500:]})  # fmt: skip
                print(f"{name:12s} m={m:3d} {impl} {cfg} FAILED {e!r}"[:300], flush=True)

        if m == 16:
            for cfg in w4a16.configs(m, n, k, GROUP):
                checked("w4a16", cfg, lambda i, o, c=cfg: w4a16.w4a16_matmul(
                        x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, c, out=o))  # fmt: skip
        for entry in PRODUCT:
            cfg = {**cuda_w4a16.DEFAULTS,
                       **dict(zip(cuda_w4a16.CONFIG_KEYS, entry, strict=False))}  # fmt: skip
            try:
                cuda_w4a16.check_config(cfg, m, n, k, GROUP)
            except ValueError:
                continue
            fn = cuda_w4a16.launcher(cfg)
            checked("cuda_gemv", cfg, lambda i, o, f=fn, c=cfg: cuda_w4a16.run(
                    f, c, x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, o, stream()))  # fmt: skip
        for cfg in configs(n, k, sms):
            fn = libs.get(tuple(cfg["build"]))
            if fn is None:
                continue

            def call(i: int, o: torch.Tensor, f: Callable[..., int] = fn,
                         c: dict = cfg) -> None:  # fmt: skip
                wk, szk = ks[i % len(ks)]
                err = f(x.data_ptr(), wk.data_ptr(), szk.data_ptr(), o.data_ptr(), m, n, k,
                            c["groups"], c["warps"], c["cluster"], stream())  # fmt: skip
                if err:
                    raise RuntimeError(f"kslice launch failed: CUDA error {err}")

            checked("kslice" + "".join(f"_{v}" for v in cfg["build"][4:]), cfg, call)
        for impl in ("w4a16", "cuda_gemv", "kslice", *(f"kslice_{v}" for v in VARIANTS)):
            ok = [r for r in rows if r["m"] == m and r["impl"] == impl and r.get("excess", 9) <= 1]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                best["best"] = True
                print(f"  best {impl}: {best['us']} us {best.get('config')}", flush=True)

    for m in ms:
        one_m(m)
    return rows


def load(path: Path) -> Callable[..., int]:
    fn = ctypes.CDLL(str(path)).kslice_gemv_launch
    fn.argtypes = [*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 6, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", default=["down", "qwen_down", "gate_up", "qwen_gate_up"],
                    choices=sorted(PROJECTIONS))  # fmt: skip
    ap.add_argument("--m", nargs="*", type=int, default=[1, 8, 16])
    ap.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="T,AHEAD,WARPS,MIN[,VARIANT]",
        help=f"builds instead of BUILDS; VARIANT one of {sorted(VARIANTS)}",
    )
    ap.add_argument("--no-product", action="store_true", help="leave the product's kernels out")
    args = ap.parse_args()
    if args.build:
        BUILDS[:] = [tuple(int(p) if p.isdigit() else p for p in b.split(",")) for b in args.build]
    if args.no_product:
        PRODUCT.clear()
    torch.manual_seed(0)
    out_dir = Path(tempfile.mkdtemp(prefix="kslice_"))
    with concurrent.futures.ThreadPoolExecutor(len(BUILDS)) as pool:
        futures = {spec: pool.submit(build, spec, out_dir) for spec in BUILDS}
    libs = {}
    for spec, fut in futures.items():
        try:
            libs[spec] = load(fut.result())
        except Exception as e:
            print(f"build {spec} FAILED: {e}", flush=True)
    entries = [cuda_w4a16.CONFIG_KEYS[: len(e)] for e in PRODUCT]
    cuda_w4a16.compile_all([{**cuda_w4a16.DEFAULTS, **dict(zip(keys, e, strict=True))}
                            for keys, e in zip(entries, PRODUCT, strict=True)])  # fmt: skip
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result = header(copy_gbs, group_size=GROUP, nvcc=cuda_library.toolkit())
    write_as_it_goes(result, args.out, args.proj,
                     lambda name: bench_projection(name, tuple(args.m), copy_gbs, libs))  # fmt: skip


if __name__ == "__main__":
    main()

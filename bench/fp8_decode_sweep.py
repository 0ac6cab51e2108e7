"""FP8 rowwise decode (M <= 16): a grid of split-K tiles beside the shortlist and a bare read.

    python bench/fp8_decode_sweep.py --out fp8_decode_sweep.json --proj down qwen_down --m 1 16
        [--shortlist | --swap | --cuda [--trace] [--variant NAME=FLAGS ...]]

Picks the decode shortlist of ``fp8.configs`` from measurements rather than guesses: every
config of ``GRID``, of the shortlist itself (``--shortlist``) or of the shortlist beside its
swapped twins (``--swap``, then more swapped tiles), or of the shortlist beside the CUDA
kernel of ``cuda_fp8`` (``--cuda``: its shortlist, then ``CUDA_BUILDS`` at every cluster; with
``--trace``, the best one's bench-only twin that stamps each CTA, summarised; with ``--variant
pdl=-DFP8_GEMV_DEPENDENT=1``, each CUDA config's twin built with those flags, timed beside it
in the same passes: an A/B of a kernel change in one run), on the same rotated
weights (``lowbit_kernels``' projections and rotation), CUDA-graph GPU time per call, in grid
order and then in reverse (a drift over the run shows as a gap between the two passes), and
each config's output against a float32 GEMM on the dequantized operands ("excess" <= 1
passes). All kernels are compiled first in worker processes (``launch.warm``), so the timing
process compiles nothing; ``--precompile-only`` stops there (warming Triton's cache for a later
``lowbit_kernels`` run of the shortlist). A config that cannot run a shape is recorded with its
error. The JSON is rewritten after every projection.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import nvcc_twins
from bench.lowbit_kernels import (
    PROJECTIONS,
    copies,
    header,
    nbytes,
    rotate,
    time_us,
    write_as_it_goes,
)
from tuner.candidates import cuda_fp8, cuda_library, nvcc_build
from tuner.candidates.triton_kernels import fp8 as fp8_kernels
from tuner.candidates.triton_kernels.launch import warm
from tuner.candidates.triton_kernels.stream_read import read_all, sums_for
from tuner.measure import timing
from tuner.quant import fp8
from tuner.quant.tolerance import FP8_TENSOR_CORE_ACCUMULATE, excess, gemm_tolerance

# (bn, bk, splits, interleaved, warps, stages) of the tiled kernel; splits apply where N is not
# wide (``fp8.wide``: one split per tile there).
# Around the one-program-per-SM tile (32 x 512, one split, 6 stages).
GRID = [
    (32, 512, 1, False, 4, 5), (32, 512, 1, False, 4, 7), (32, 512, 1, False, 4, 8),
    (32, 512, 1, False, 8, 6), (32, 1024, 1, False, 4, 4), (32, 256, 1, False, 4, 8),
    (16, 512, 1, False, 4, 8), (64, 256, 2, True, 4, 6), (64, 256, 2, True, 4, 8),
]  # fmt: skip


# Swapped tiles (``swap``: b @ a.T, a wgmma whose n is x's rows) beyond the shortlist's own,
# (bn, bk, dots a step, splits, interleaved, warps, stages).
SWAPPED = [(64, 128, 2, 4, True, 8, 4), (64, 128, 2, 2, True, 8, 6), (64, 128, 2, 6, True, 8, 3),
           (64, 128, 2, 4, False, 4, 4), (64, 128, 2, 8, True, 4, 2), (64, 128, 2, 4, True, 4, 3)]  # fmt: skip


def swap_configs(m: int, n: int, k: int) -> list[dict[str, Any]]:
    """The shortlist's swapped tiles (two 128-wide dots a step; in precise mode each dot's sum
    is added apart) beside the same tiles as they were before (one 256-wide dot, not swapped)
    and swapped with one dot, each with an 8-row x tile too up to M = 8; the shortlist's other
    tiles; then ``SWAPPED`` (one split on wide N)."""
    out: list[dict[str, Any]] = []
    for cfg in fp8_kernels.configs(m, n, k):
        if not cfg.get("swap"):
            out.append(cfg)
            continue
        plain = {key: v for key, v in cfg.items() if key not in ("swap", "dots")} | {"bk": 256}
        for variant in (cfg, {**plain, "swap": True}):
            for rows in ({}, {"bm": 8}) if m <= 8 else ({},):
                out.append({**variant, **rows})
        out.append(plain)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, dots, split, interleave, warps, stages in SWAPPED:
        split = 1 if fp8_kernels.wide(n, sms) else split
        cfg = {"kernel": "tiled", "bm": 16, "bn": bn, "bk": bk, "dots": dots, "split_k": split,
               "group_m": 1, "warps": warps, "stages": stages, "swap": True}  # fmt: skip
        if split > 1 and interleave:
            cfg["interleave"] = True
        for rows in ({}, {"bm": 8}) if m <= 8 else ({},):
            if {**cfg, **rows} not in out:
                out.append({**cfg, **rows})
    return out


# (stages, atoms) libraries of ``cuda_fp8`` timed at each of its clusters (``--cuda``)
CUDA_BUILDS = ((10, 1), (5, 2), (6, 2), (8, 2))
# bench-only twins of the CUDA configs: name -> extra nvcc flags (``--variant`` adds more)
VARIANTS = {"trace": ["-DFP8_GEMV_TRACE=1"]}
TWIN_DIR = Path(tempfile.gettempdir()) / "tuner_fp8_twins"
PHASES = ("wait", "first", "loop", "sum", "store")  # between successive clock64 stamps


def cuda_grid(m: int, n: int, k: int) -> list[dict[str, Any]]:
    """``cuda_fp8``'s shortlist, then ``CUDA_BUILDS`` at every cluster, those that fit."""
    out = cuda_fp8.configs(m, n, k)
    for stages, atoms in CUDA_BUILDS:
        for cluster in cuda_fp8.CLUSTERS:
            cfg = {"stages": stages, "atoms": atoms, "cluster": cluster}
            try:
                cuda_fp8.check_config(cfg, m, n, k)
            except ValueError:
                continue
            if cfg not in out:
                out.append(cfg)
    return out


def twin_path(cfg: dict[str, Any], variant: str) -> Path:
    """Where the twin of ``cfg``'s library built with ``VARIANTS[variant]`` lies."""
    return (
        TWIN_DIR / f"{cuda_fp8.library(cfg).digest}_{nvcc_twins.tag(variant, VARIANTS[variant])}.so"
    )


def build_cuda(cfgs: list[dict[str, Any]], variants: list[str]) -> None:
    """The libraries of ``cfgs`` (the product's, through its cache), then their bench-only
    twins of ``variants`` (names in ``VARIANTS``), nvcc in parallel."""
    errors = {
        str(lib): e for lib, e in cuda_library.compile_all(map(cuda_fp8.library, cfgs)).items() if e
    }
    print(f"cuda_fp8 libraries: errors {errors}", flush=True)
    commands = {}
    for cfg in cfgs:
        for variant in variants:
            path = twin_path(cfg, variant)
            commands[path] = nvcc_twins.twin_command(cuda_fp8.library(cfg), path, VARIANTS[variant])
    nvcc_twins.build(commands)


def read_trace(cfg: dict[str, Any], ctas: int) -> dict[str, Any]:
    """Where the traced twin's last launch spent its time, from its CTAs' stamps (ns; clock64
    spans converted with the median ratio of each CTA's globaltimer and clock64 spans)."""
    lib = ctypes.CDLL(str(twin_path(cfg, "trace")))
    cap, fields = ctypes.c_int(), ctypes.c_int()
    lib.fp8_gemv_trace_shape(ctypes.byref(cap), ctypes.byref(fields))
    f = fields.value
    buf = (ctypes.c_ulonglong * (cap.value * f))()
    if err := lib.fp8_gemv_trace(buf):
        raise RuntimeError(f"fp8_gemv_trace: CUDA error {err}")
    t = [list(buf[i * f : (i + 1) * f]) for i in range(min(ctas, cap.value))]
    ratios = sorted((r[2] - r[1]) / max(1, r[8] - r[3]) for r in t)
    ns, t0 = ratios[len(ratios) // 2], min(r[1] for r in t)

    def spread(values: list[float]) -> list[float]:
        v = sorted(values)
        return [round(v[int(q * (len(v) - 1))]) for q in (0, 0.5, 0.9, 1)]

    out = {"ns_per_clock": round(ns, 4), "span_ns": max(r[2] for r in t) - t0,
           "start_ns": spread([r[1] - t0 for r in t]),
           "loop_end_ns": spread([r[1] - t0 + ns * (r[6] - r[3]) for r in t]),
           "end_ns": spread([r[1] - t0 + ns * (r[8] - r[3]) for r in t])}  # fmt: skip
    for i, phase in enumerate(PHASES):
        out[f"{phase}_ns"] = spread([ns * (r[4 + i] - r[3 + i]) for r in t])
    return out


def grid_configs(m: int, n: int, k: int) -> list[dict[str, Any]]:
    """``GRID`` as configs for N (one split each on wide N), then the shortlist's others."""
    out: list[dict[str, Any]] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, split, interleave, warps, stages in GRID:
        split = 1 if fp8_kernels.wide(n, sms) else split
        cfg = {"kernel": "tiled", "bm": 16, "bn": bn, "bk": bk, "split_k": split, "group_m": 1,
               "warps": warps, "stages": stages}  # fmt: skip
        if split > 1 and interleave:
            cfg["interleave"] = True
        if cfg not in out:
            out.append(cfg)
    return out + [c for c in fp8_kernels.configs(m, n, k) if c not in out]


def precompile(
    shapes: list[tuple[int, int, int]], which: str, scales: list[str], precise: bool
) -> None:
    """Compile every config's kernels for every shape and scaling in worker processes."""
    jobs = []
    for m, n, k in shapes:
        for cfg in candidates(m, n, k, which):
            if "atoms" in cfg:
                continue
            for scale in scales:
                try:
                    jobs += fp8_kernels.jobs(m, n, k, cfg, rowwise=scale == "row",
                                             precise=precise)  # fmt: skip
                except ValueError:
                    continue  # recorded with its error when timed
    report = warm(jobs)
    print(f"precompiled {report.compiled} of {report.requested} fp8 kernels in "
          f"{report.seconds:.1f} s; errors: {report.errors[:3]}", flush=True)  # fmt: skip


def candidates(
    m: int, n: int, k: int, which: str, variants: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Triton's configs, then (``--cuda``) ``cuda_grid``'s, each followed by its twins of
    ``variants``."""
    if which == "swap":
        return swap_configs(m, n, k)
    if which == "grid":
        return grid_configs(m, n, k)
    cuda = cuda_grid(m, n, k) if which == "cuda" else []
    twins = [{**cfg, "variant": v} for cfg in cuda for v in variants]
    return fp8_kernels.configs(m, n, k) + cuda + twins


def matmul(cfg: dict[str, Any], precise: bool) -> Any:
    """``f(a, b, scale_a, scale_b, out)`` running one config (b the weight [N, K])."""
    if "atoms" not in cfg:
        return lambda a, b, sa, sb, out: fp8_kernels.fp8_matmul(a, b, sa, sb, cfg, out=out,
                                                                precise=precise)  # fmt: skip
    plain = {key: cfg[key] for key in cuda_fp8.CONFIG_KEYS}
    variant = cfg.get("variant")
    path = (
        twin_path(plain, variant) if variant else nvcc_build.library_path(cuda_fp8.library(plain))
    )
    fn = cuda_library.load(path, cuda_fp8.ENTRY, cuda_fp8.ARGTYPES)

    def cuda(a, b, sa, sb, out):
        rowwise = sa.numel() > 1 or sb.numel() > 1
        cuda_fp8.run(fn, plain, a, b, sa, sb, out, rowwise, torch.cuda.current_stream().cuda_stream)
        return out

    return cuda


def sweep(
    name: str,
    ms: list[int],
    which: str,
    copy_gbs: float,
    precise: bool,
    trace: bool,
    variants: tuple[str, ...],
) -> list[dict[str, Any]]:
    n, k = PROJECTIONS[name]
    w8, s8 = fp8.quantize_rowwise(torch.randn(n, k, device="cuda") * 0.02)
    sets = rotate(copies(w8, s8), w8, s8)
    rows: list[dict[str, Any]] = []
    for m in ms:
        rows += sweep_m(name, m, sets, which, copy_gbs, precise, trace, variants)
    return rows


def sweep_m(
    name: str,
    m: int,
    sets: list[tuple[torch.Tensor, ...]],
    which: str,
    copy_gbs: float,
    precise: bool,
    trace: bool = False,
    variants: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The bare read, then every config at one M: checked, then timed in two passes;
    ``precise``: partial sums promoted to fp32 (``_scaled_mm``'s default), else fast;
    ``trace``: the best cuda_fp8 config's traced twin timed too, with its stamps summarised;
    ``variants``: each cuda_fp8 config's twins of these, timed in the same passes."""
    w8, s8 = sets[0]
    (n, k), sums = w8.shape, sums_for(w8)
    x8, sx8 = fp8.quantize_rowwise(torch.randn(m, k, device="cuda"))
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    moved = nbytes(w8, s8, x8, sx8, out)
    da, db = fp8.dequantize(x8, sx8), fp8.dequantize(w8, s8)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0,
                         accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE, out_dtype=out.dtype)  # fmt: skip
    del da, db
    base = {"proj": name, "n": n, "k": k, "m": m}
    read = time_us(lambda i: read_all(sets[i % len(sets)][0], sums), m, 0.0)
    rows = [{**base, "impl": "read_fp8", **read, "bytes": nbytes(w8),
             "pct_copy": pct(nbytes(w8), read["us"], copy_gbs)}]  # fmt: skip
    timed: list[dict[str, Any]] = []
    for cfg in candidates(m, n, k, which, variants):
        row = {**base, "impl": "fp8_rowwise", "config": cfg, "bytes": moved}
        try:
            got = matmul(cfg, precise)(x8, w8, sx8, s8, torch.full_like(out, float("nan")))
            row["excess"] = round(excess(got, ref, tol), 3)
        except Exception as e:  # a config that cannot run this shape is a finding
            row["error"] = repr(e)[-300:]
            print(f"{name:9s} m={m:2d} {cfg} FAILED {e!r}"[:300], flush=True)
            rows.append(row)
            continue
        timed.append(row)

    def call(cfg: dict[str, Any]) -> Any:
        fn = matmul(cfg, precise)
        return lambda i: fn(x8, sets[i % len(sets)][0], sx8, sets[i % len(sets)][1], out)

    for rnd, order in enumerate((timed, timed[::-1])):
        for row in order:
            row[f"us_{rnd}"] = time_us(call(row["config"]), m, 0.0)["us"]
    for row in timed:
        row["us"] = round((row["us_0"] + row["us_1"]) / 2, 2)
        row["pct_copy"] = pct(moved, row["us"], copy_gbs)
    for i, row in enumerate(sorted(timed, key=lambda r: r["us"])):
        row["rank"] = i
        print(f"{name:9s} m={m:2d} {row['us']:7.2f} us {row['pct_copy']:5.1f}% "
              f"({row['us_0']:.2f}/{row['us_1']:.2f}) x{row['excess']:.2f} {label(row['config'])}",
              flush=True)  # fmt: skip
    print(f"{name:9s} m={m:2d} read {read['us']:.2f} us {rows[0]['pct_copy']}%", flush=True)
    product = (r for r in timed if "atoms" in r["config"] and "variant" not in r["config"])
    best = min(product, key=lambda r: r["us"], default=None)
    if trace and best is not None:
        cfg = {**best["config"], "variant": "trace"}
        row = {**base, "impl": "cuda_fp8_trace", "config": cfg, "bytes": moved,
               **time_us(call(cfg), m, 0.0)}  # fmt: skip
        row["trace"] = read_trace(cfg, (n + 63) // 64 * cfg["cluster"])
        print(f"{name:9s} m={m:2d} traced {row['us']:.2f} us {row['trace']}", flush=True)
        rows.append(row)
    return rows + timed


def pct(moved: int, us: float, copy_gbs: float) -> float:
    return round(100 * moved / (us * 1e-6) / (copy_gbs * 1e9), 1)


def label(cfg: dict[str, Any]) -> str:
    if "atoms" in cfg:
        twin = f" [{cfg['variant']}]" if "variant" in cfg else ""
        return (f"cuda_fp8 {cfg['stages']} stages x{cfg['atoms']} atoms cluster {cfg['cluster']}"
                f"{twin}")  # fmt: skip
    il = "i" if cfg.get("interleave") else ""
    swap = f" swap bm{cfg['bm']}" if cfg.get("swap") else ""
    dots = f"x{cfg['dots']}" if cfg.get("dots", 1) > 1 else ""
    return (f"tiled {cfg['bn']}x{cfg['bk']}{dots} split {cfg.get('split_k', 1)}{il} w{cfg['warps']} "
            f"s{cfg['stages']}{swap}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", default=["down", "qwen_down"], choices=list(PROJECTIONS))
    ap.add_argument("--m", nargs="*", type=int, default=[1, 16])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--shortlist", action="store_true", help="fp8.configs instead of GRID")
    mode.add_argument("--swap", action="store_true",
                       help="fp8.configs as they are and swapped, then SWAPPED")  # fmt: skip
    mode.add_argument("--cuda", action="store_true",
                      help="fp8.configs beside cuda_fp8's (its shortlist, then CUDA_BUILDS)")  # fmt: skip
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="with --cuda: the best cuda_fp8 config's stamps at each M")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="with --cuda: also time each CUDA config built with these extra nvcc "
                         "flags, e.g. pdl=-DFP8_GEMV_DEPENDENT=1")  # fmt: skip
    ap.add_argument("--precise", action="store_true",
                    help="partial sums promoted to fp32, as the suite's accum=f32 keys run")  # fmt: skip
    ap.add_argument("--scales", nargs="*", default=["row"], choices=["row", "tensor"],
                    help="scalings to precompile (the sweep times rowwise)")  # fmt: skip
    args = ap.parse_args()
    if any(not 1 <= m <= 16 for m in args.m):
        ap.error(f"--m {args.m}: decode sizes only, 1 .. 16")
    if (args.variant or args.trace) and not args.cuda:
        ap.error("--variant and --trace time twins of the CUDA configs: they need --cuda")
    variants = nvcc_twins.take_variants(ap, args.variant, VARIANTS)
    which = ("shortlist" if args.shortlist else "swap" if args.swap
             else "cuda" if args.cuda else "grid")  # fmt: skip
    shapes = [(m, *PROJECTIONS[p]) for p in args.proj for m in args.m]
    if which == "cuda":
        twins = [*variants, *(["trace"] if args.trace else [])]
        build_cuda([c for shape in shapes for c in cuda_grid(*shape)], twins)
    precompile(shapes, which, args.scales, args.precise)
    if args.precompile_only:
        return
    torch.manual_seed(0)
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result = header(copy_gbs, configs=which, precise=args.precise,
                    variants={v: VARIANTS[v] for v in variants})  # fmt: skip
    write_as_it_goes(result, args.out, args.proj,
                     lambda name: sweep(name, args.m, which, copy_gbs, args.precise,
                                        args.trace, variants))  # fmt: skip


if __name__ == "__main__":
    main()

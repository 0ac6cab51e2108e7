"""The CUDA W4A16 decode kernel (``tuner/candidates/cuda_kernels/w4a16_gemv.cu``) on a grid of its
configs, beside the Triton decode shortlist, bf16 cuBLAS and a bare read of the INT4 bytes.

    python bench/w4a16_decode_grid.py --out bench/results/w4a16_gemv.json

Per projection (N x K, ``lowbit_kernels.PROJECTIONS``) and M, in one process, bf16 activations,
group 128, CUDA-graph GPU time (``timing.graph_time``), weights rotated past the L2:

- **bf16**: ``torch.matmul(x, w.T)`` (cuBLAS); **read_int4**: a bare read of the packed weight;
- **w4a16**: every config of the Triton kernel's shortlist (``w4a16.configs``);
- **cuda_gemv**: every config of ``GRID`` that fits M (its libraries built first, in parallel).

"pct_copy" is the bytes read and written (weight, scales, activations, output) per second over the
device-to-device copy bandwidth. Every W4A16 config's output is checked against a float32 GEMM on
the dequantized operands (``tuner.quant.tolerance``): "excess" <= 1 passes; it is checked again
after the config's timed replays ("excess_after": a kernel must leave any state it keeps between
calls as it found it).

With ``--trace``, ``TRACED`` configs also run a bench-only build of their library (``VARIANTS``:
extra ``-D`` flags, built beside the run) that stamps each CTA (``%globaltimer`` at its start and
end, ``clock64`` at its start, after its setup, when warp 0's first chunk landed, at each warp's
last chunk, once the warps' partials are in shared memory, at its end); the row carries the
stamps and a summary (impl "cuda_gemv_trace"). With ``--baseline PATH``, every config is also
built from the kernel source at PATH (another version of ``w4a16_gemv.cu``, e.g. the committed
one, whose entry point takes the same arguments: checked) and timed right before the current one
(impl "cuda_gemv_baseline"): an A/B of a kernel change on one machine in one run; ``--variant
NAME=FLAGS`` (repeatable) does the same for the current source built with extra ``-D`` flags
(impl "cuda_gemv_NAME", e.g. ``traced=-DGEMV_TRACE=1``, whose row then carries the trace of its last
launch, or ``copies=-DGEMV_COPIES_ONLY=1``: the
rings streamed with no compute, what the copies alone cost, or ``empty=-DGEMV_EMPTY=1``: each
config's grid launched and returning at once; their outputs are wrong, excess nan);
``--wide-warps W`` does the same for 64-row warps at M > 8 (the product's builds take 8; a
``--variant`` built with ``-DGEMV_WIDE_WARPS=W`` caps their registers to fit up to W);
``--launch-floor`` adds "read_noop", the bare read's grid of programs that return at once (the
floor beside ``empty``);
``--config SPLIT,SLICES,STAGES,WARPS,CLUSTER[,STAGGER[,TEAMS[,CARVEOUT]]]`` (repeatable; STAGGER 0
or 1, TEAMS row blocks a CTA, CARVEOUT the percent of the SM's most shared memory, or -1 for the
driver's choice) times (and traces) those configs instead of ``GRID`` (and ``TRACED``);
``--repeat R`` times each config's builds R times in turn (the A/B's noise); ``--max-warps W``
with a ``--variant`` built with ``-DGEMV_MAX_WARPS=W`` lets configs take up to W warps a CTA (the
product's builds take 16): they run on that variant (and the traced build), the others refuse
them.
``--profile``: no timing, the bare read and each config of ``PROFILED`` (or of ``--config``) once
in an NVTX range "profile" for Nsight Compute (as ``bench/lowbit_kernels.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from bench import nvcc_twins
from bench.lowbit_kernels import (
    PROJECTIONS,
    copies,
    header,
    nbytes,
    profiled,
    rotate,
    timed_row,
    write_as_it_goes,
)
from tuner.candidates import cuda_library, cuda_w4a16, gemm_operands
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.launch import warm
from tuner.candidates.triton_kernels.stream_read import BLOCK, read_all, sums_for
from tuner.measure import timing
from tuner.quant import int4
from tuner.quant.tolerance import FP32_ACCUMULATE, excess, gemm_tolerance, unit_roundoff

GROUP = 128
MS = (1, 4, 8)
# (split, slices of 16 rows per warp, stages, warps, cluster). Warps splitting K: 32-row CTAs over
# all of K (one per SM), 8-16 warps, 2-4 stages; 64-row CTAs over half of K (cluster 2: x's slab
# copied once per 64 rows, ahead where x weighs most). Warps splitting rows: 256-row CTAs with K
# over a cluster of 8 (Qwen down M = 8's winner).
GRID = [
    ("k", 2, 2, 16, 1), ("k", 2, 4, 8, 1), ("k", 2, 3, 16, 1), ("k", 2, 3, 12, 1),
    ("k", 4, 2, 8, 2), ("k", 4, 3, 8, 2), ("k", 4, 2, 16, 2), ("rows", 2, 4, 8, 8),
]  # fmt: skip
TRACED = [("k", 2, 2, 16, 1), ("k", 4, 2, 8, 1), ("k", 4, 2, 8, 2), ("k", 4, 2, 3, 1)]
PROFILED = [("k", 2, 2, 16, 1), ("k", 2, 4, 8, 1)]
VARIANTS = {"trace": ["-DGEMV_TRACE=1"], "baseline": []}
VARIANT_DIR = Path(tempfile.gettempdir()) / "w4a16_gemv_variants"
# a trace row's fields (w4a16_gemv.cu): sm id, globaltimer at start / end, clock64 at start,
# after its setup, warp 0's first chunk, after the sums, at the end; then each warp's last chunk
SMID, G_START, G_END, C_START, C_SETUP, C_FIRST, C_SUMMED, C_END, C_WARP = range(9)


def shape_of(proj: str) -> tuple[int, int]:
    """(N, K) of a named projection, or of an ad-hoc ``NxK`` (a probe beside the named ones)."""
    if proj in PROJECTIONS:
        return PROJECTIONS[proj]
    n, sep, k = proj.partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise ValueError(
            f"projection {proj!r}: allowed {sorted(PROJECTIONS)} or NxK, e.g. 4096x18944"
        )
    return int(n), int(k)


def as_config(entry: tuple) -> dict[str, Any]:
    """A ``GRID`` entry (split, slices, stages, warps, cluster[, stagger[, teams[, carveout]]])
    as a config."""
    # a stagger, teams or carveout left out: its default
    keys = cuda_w4a16.CONFIG_KEYS[: len(entry)]
    return {**cuda_w4a16.DEFAULTS, **dict(zip(keys, entry, strict=True))}


def parse_config(text: str) -> tuple:
    """``"k,4,2,8,2"`` (or ``"k,4,2,3,1,1"``: staggered; ``"k,4,2,12,1,0,4"``: four row blocks a
    CTA; ``"k,4,2,2,1,0,1,72"``: 72% of the most shared memory, ``-1`` the driver's choice) as a
    ``GRID`` entry; ValueError naming the text unless it is one."""
    parts = text.split(",")
    if (
        len(parts) not in (5, 6, 7, 8)
        or parts[0] not in cuda_w4a16.SPLITS
        or not all(p.isdigit() for p in parts[1:7])
        or parts[5:6] not in ([], ["0"], ["1"])
        or not all(p == "-1" or (p.isdigit() and int(p) <= 100) for p in parts[7:])
    ):
        raise ValueError(f"--config {text!r}: expected SPLIT,SLICES,STAGES,WARPS,CLUSTER[,STAGGER"
                         f"[,TEAMS[,CARVEOUT]]] with SPLIT in {cuda_w4a16.SPLITS}, STAGGER 0 or 1 "
                         "and CARVEOUT -1 (the driver's) or 0 to 100, e.g. k,4,2,8,2, k,4,2,3,1,1, "
                         "k,4,2,12,1,0,4 or k,4,2,2,1,0,1,72")  # fmt: skip
    carveout = [None if p == "-1" else int(p) for p in parts[7:]]
    return (parts[0], *map(int, parts[1:5]), *(p == "1" for p in parts[5:6]),
            *map(int, parts[6:7]), *carveout)  # fmt: skip


ENTRY = re.compile(r"int w4a16_gemv\((.*?)\)\s*\{", re.S)


def entry_arguments(source: Path) -> str | None:
    """The arguments of the kernel source's entry point, whitespace and comments aside (None if
    it has none): a baseline must take the ones ``cuda_w4a16.run`` passes."""
    found = ENTRY.search(source.read_text())
    return " ".join(re.sub(r"//[^\n]*", "", found.group(1)).split()) if found else None


def build_digest(source: Path) -> str:
    """The digest of ``source`` with the headers nvcc takes for it (``build_variants``): those
    next to it, else the kernel folder's (a copy of another version made elsewhere)."""
    digest = hashlib.sha256(cuda_library.source_digest(source).encode())
    for name in cuda_library.LOCAL_INCLUDE.findall(source.read_bytes()):
        if not (source.parent / name.decode()).is_file():
            digest.update(cuda_library.source_digest(cuda_library.KERNELS / name.decode()).encode())
    return digest.hexdigest()[:12]


def variant_path(cfg: dict[str, Any], variant: str, source: Path = cuda_w4a16.SOURCE) -> Path:
    name = nvcc_twins.tag(variant, VARIANTS[variant])
    return VARIANT_DIR / f"{cuda_w4a16.library(cfg).digest}_{name}_{build_digest(source)}.so"


def build_variants(
    pairs: list[tuple[dict[str, Any], str]], source: Path = cuda_w4a16.SOURCE
) -> None:
    """The bench-only libraries of (config, variant) pairs built from ``source``, nvcc in
    parallel."""
    other = None if source == cuda_w4a16.SOURCE else source
    commands = {}
    for cfg, variant in pairs:
        path = variant_path(cfg, variant, source)
        lib = cuda_w4a16.library(cfg)
        commands[path] = nvcc_twins.twin_command(lib, path, VARIANTS[variant], other)
    nvcc_twins.build(commands)


@triton.jit
def _noop(sums):
    pass


def read_noop(buf: torch.Tensor, sums: torch.Tensor) -> None:
    """``read_all``'s grid (programs, warps) over ``buf``, each program returning at once."""
    _noop[(triton.cdiv(buf.numel() * buf.element_size() // 4, BLOCK),)](sums, num_warps=8)


def read_trace(path: Path, ctas: int) -> list[list[int]]:
    """The stamps of the last launch of the traced library at ``path``, one row per CTA."""
    lib = ctypes.CDLL(str(path))
    cap, fields = ctypes.c_int(), ctypes.c_int()
    lib.w4a16_gemv_trace_shape(ctypes.byref(cap), ctypes.byref(fields))
    buf = (ctypes.c_ulonglong * (cap.value * fields.value))()
    if err := lib.w4a16_gemv_trace(buf):
        raise RuntimeError(f"w4a16_gemv_trace: CUDA error {err}")
    f = fields.value
    return [list(buf[i * f : (i + 1) * f]) for i in range(min(ctas, cap.value))]


def last_launch(trace: list[list[int]]) -> list[list[int]]:
    """The rows of a trace that the last launch wrote (a variant's grid need not be the one
    ``grid_configs`` would launch; rows of an earlier, larger grid began long before)."""
    latest = max(t[G_START] for t in trace)
    return [t for t in trace if t[G_START] > latest - 100_000 and t[G_END] >= t[G_START]]


def spread(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {q: round(v[min(len(v) - 1, int(p * len(v)))], 1)
            for q, p in (("min", 0), ("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1))}  # fmt: skip


def trace_summary(trace: list[list[int]], warps: int) -> dict[str, Any]:
    """Where a launch's time went, from its CTAs' stamps (ns; SM clocks converted with the
    median ratio of each CTA's globaltimer and clock64 spans)."""
    ratios = sorted((t[G_END] - t[G_START]) / max(1, t[C_END] - t[C_START]) for t in trace)
    ns = ratios[len(ratios) // 2]
    t0 = min(t[G_START] for t in trace)
    last = [max(t[C_WARP : C_WARP + warps]) for t in trace]
    first = [min(t[C_WARP : C_WARP + warps]) for t in trace]
    ends = sorted(range(len(trace)), key=lambda i: trace[i][G_START] + ns * (
        trace[i][C_END] - trace[i][C_START]))  # fmt: skip
    return {
        "ns_per_clock": round(ns, 4),
        "span_ns": max(t[G_END] for t in trace) - t0,
        "start_ns": spread([t[G_START] - t0 for t in trace]),
        "end_ns": spread([t[G_START] - t0 + ns * (t[C_END] - t[C_START]) for t in trace]),
        "setup_ns": spread([ns * (t[C_SETUP] - t[C_START]) for t in trace]),
        "first_chunk_ns": spread([ns * (t[C_FIRST] - t[C_SETUP]) for t in trace]),
        "stream_ns": spread([ns * (last[i] - t[C_FIRST]) for i, t in enumerate(trace)]),
        "warp_spread_ns": spread([ns * (last[i] - first[i]) for i in range(len(trace))]),
        "sum_ns": spread([ns * (t[C_SUMMED] - last[i]) for i, t in enumerate(trace)]),
        "store_ns": spread([ns * (t[C_END] - t[C_SUMMED]) for t in trace]),
        "cta_ns": spread([ns * (t[C_END] - t[C_START]) for t in trace]),
        "last_sms": [trace[i][SMID] for i in ends[-8:]],
        "first_sms": [trace[i][SMID] for i in ends[:8]],
    }


def grid_configs(
    m: int, n: int, k: int, entries: list[tuple] | None = None
) -> list[dict[str, Any]]:
    """``entries`` (default ``GRID``) as configs for an (M, N, K) problem, those that fit it."""
    out = []
    for entry in GRID if entries is None else entries:
        cfg = as_config(entry)
        try:
            cuda_w4a16.check_config(cfg, m, n, k, GROUP)
        except ValueError:
            continue
        out.append(cfg)
    return out


def build(projections: list[str], ms: tuple[int, ...], trace: bool, baseline: Path | None,
          variants: list[str]) -> None:  # fmt: skip
    """Every library and Triton kernel the run times, compiled in parallel before any timing."""
    started = time.perf_counter()
    shapes = [(m, *shape_of(name)) for name in projections for m in ms]
    cfgs = [c for shape in shapes for c in grid_configs(*shape)]
    errors = {str(lib): e for lib, e in cuda_w4a16.compile_all(cfgs).items() if e}
    if trace:
        build_variants([(c, "trace") for shape in shapes for c in grid_configs(*shape, TRACED)])
    if baseline is not None:
        build_variants([(c, "baseline") for c in cfgs], baseline)
    build_variants([(c, v) for c in cfgs for v in variants])
    print(f"built {len({cuda_w4a16.library(c) for c in cfgs})} CUDA libraries and the variants in "
          f"{time.perf_counter() - started:.1f} s; errors: {errors}", flush=True)  # fmt: skip
    report = warm([job for name in projections for m in ms
                   for cfg in w4a16.configs(m, *shape_of(name), GROUP)
                   for job in w4a16.checked_plan(m, *shape_of(name), GROUP, cfg)
                   .jobs(torch.bfloat16)])  # fmt: skip
    print(f"precompiled {report.compiled} of {report.requested} Triton kernels in "
          f"{report.seconds:.1f} s", flush=True)  # fmt: skip


def bench_projection(name: str, ms: tuple[int, ...], copy_gbs: float, trace: bool = False,
                     profile: bool = False, baseline: Path | None = None,
                     repeats: int = 1, variants: tuple[str, ...] = (),
                     launch_floor: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    n, k = shape_of(name)
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

        def gemv(fn: cuda_w4a16.Launcher, cfg: dict) -> Callable[[int, torch.Tensor], Any]:
            return lambda i, o: cuda_w4a16.run(fn, cfg, x, i4[i % len(i4)][0],
                                               i4[i % len(i4)][1], GROUP, o, stream())  # fmt: skip

        if profile:
            profiled(name, m, "read_int4", lambda i: read_all(i4[i % len(i4)][0], sums), {})
            for cfg in grid_configs(m, n, k, PROFILED):
                call = gemv(cuda_w4a16.launcher(cfg), cfg)
                profiled(name, m, "cuda_gemv", lambda i, f=call: f(i, out), {"config": cfg})
            return
        row(m, "read_int4", lambda i: read_all(i4[i % len(i4)][0], sums), nbytes(packed))
        if launch_floor:
            row(m, "read_noop", lambda i: read_noop(i4[i % len(i4)][0], sums), 0)
        base = row(m, "bf16", lambda i: torch.matmul(x, bf[i % len(bf)][0].T, out=out),
                   nbytes(w, x, out))  # fmt: skip

        def checked(impl: str, cfg: dict, call: Callable[[int, torch.Tensor], Any],
                    **extra: Any) -> None:  # fmt: skip
            try:
                got = torch.full_like(out, float("nan"))
                call(0, got)
                err = round(excess(got, ref, tol), 3)
                r = row(m, impl, lambda i: call(i, out), moved, config=cfg, excess=err, **extra)
                r["speedup_vs_bf16"] = round(base["us"] / r["us"], 3)
                # checked again after the timed replays: a kernel that hands partials between
                # CTAs through a workspace must leave it as it found it, call after call
                got.fill_(float("nan"))
                call(0, got)
                r["excess_after"] = round(excess(got, ref, tol), 3)
            except Exception as e:  # one config's failure is a finding, not the end of the sweep
                rows.append({"proj": name, "n": n, "k": k, "m": m, "impl": impl, "config": cfg,
                             "error": repr(e)[-500:]})  # fmt: skip
                print(f"{name:12s} m={m:3d} {impl} {cfg} FAILED {e!r}"[:300], flush=True)

        for cfg in w4a16.configs(m, n, k, GROUP):
            checked("w4a16", cfg, lambda i, o, c=cfg: w4a16.w4a16_matmul(
                x, i4[i % len(i4)][0], i4[i % len(i4)][1], GROUP, c, out=o))  # fmt: skip
        for cfg, rep in itertools.product(grid_configs(m, n, k), range(repeats)):
            if baseline is not None:
                fn = cuda_w4a16.load(variant_path(cfg, "baseline", baseline))
                checked("cuda_gemv_baseline", cfg, gemv(fn, cfg), repeat=rep)
            for variant in variants:
                fn = cuda_w4a16.load(variant_path(cfg, variant))
                checked(f"cuda_gemv_{variant}", cfg, gemv(fn, cfg), repeat=rep)
                if "-DGEMV_TRACE=1" in VARIANTS[variant] and "error" not in rows[-1]:
                    stamps = last_launch(read_trace(variant_path(cfg, variant), 1 << 20))
                    rows[-1]["trace"] = trace_summary(stamps, cfg["warps"])
                    print(f"  trace {variant} {cfg}: {rows[-1]['trace']}", flush=True)
            checked("cuda_gemv", cfg, gemv(cuda_w4a16.launcher(cfg), cfg), repeat=rep)
        for cfg in grid_configs(m, n, k, TRACED) if trace else []:
            path = variant_path(cfg, "trace")
            checked("cuda_gemv_trace", cfg, gemv(cuda_w4a16.load(path), cfg))
            if "error" in rows[-1]:
                continue
            rows_per_cta = 16 * cfg["slices"] * (cfg["warps"] if cfg["split"] == "rows" else 1)
            blocks = -(-n // rows_per_cta)
            ctas = -(-blocks // cfg["teams"]) * cfg["cluster"]
            stamps = read_trace(path, ctas)
            rows[-1]["trace"] = trace_summary(stamps, cfg["warps"])
            rows[-1]["stamps"] = stamps
            print(f"  trace {cfg}: {rows[-1]['trace']}", flush=True)
        for impl in (
            "w4a16",
            "cuda_gemv",
            "cuda_gemv_baseline",
            *(f"cuda_gemv_{v}" for v in variants),
        ):
            ok = [
                r
                for r in rows
                if r["m"] == m
                and r["impl"] == impl
                and r.get("excess", 9) <= 1
                and r.get("excess_after", 0) <= 1
            ]
            if ok:
                min(ok, key=lambda r: r["us"])["best"] = True

    for m in ms:
        one_m(m)
    return rows


def variant_flag(ap: argparse.ArgumentParser, option: str, macro: str, value: int, low: int,
                 high: int) -> str:  # fmt: skip
    """``-D{macro}={value}``, which a ``--variant`` must be built with for ``option`` to take
    ``value`` in ``[low, high]``; else the parser's error naming both."""
    flag = f"-D{macro}={value}"
    if not (low <= value <= high and any(flag in flags for flags in VARIANTS.values())):
        ap.error(f"{option} {value}: allowed {low} to {high}, with a --variant built with {flag}")
    return flag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--proj", nargs="*", default=["down", "qwen_down", "gate_up", "qwen_gate_up"])
    ap.add_argument("--m", nargs="*", type=int, default=list(MS))
    ap.add_argument("--trace", action="store_true",
                    help="also time the traced builds of TRACED (or of --config) and keep "
                         "their stamps")  # fmt: skip
    ap.add_argument("--baseline", type=Path,
                    help="also time every config built from this version of w4a16_gemv.cu")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also time every config built with these extra nvcc flags")  # fmt: skip
    ap.add_argument("--config", action="append", default=[],
                    metavar="SPLIT,SLICES,STAGES,WARPS,CLUSTER[,STAGGER[,TEAMS[,CARVEOUT]]]",
                    help="time (or with --profile, profile) these configs instead of GRID (PROFILED)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each config's builds this many times in turn (an A/B's noise)")  # fmt: skip
    ap.add_argument("--max-warps", type=int, default=cuda_w4a16.MAX_WARPS,
                    help="warps a CTA the configs may take, for a --variant built with "
                         "-DGEMV_MAX_WARPS of the same number (the product's builds: 16)")  # fmt: skip
    ap.add_argument("--wide-warps", type=int, default=cuda_w4a16.WIDE_MAX_WARPS,
                    help="64-row warps a CTA may take at M > 8, for a --variant built with "
                         "-DGEMV_WIDE_WARPS of the same number (the product's builds: 8)")  # fmt: skip
    ap.add_argument("--launch-floor", action="store_true",
                    help="also time read_noop: the bare read's grid, each program returning at once")  # fmt: skip
    ap.add_argument("--profile", action="store_true",
                    help="no timing: read_int4 and PROFILED once each in an NVTX range 'profile'")  # fmt: skip
    args = ap.parse_args()
    for name in args.proj:
        try:
            shape_of(name)
        except ValueError as e:
            ap.error(str(e))
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: at least 1")
    variants = nvcc_twins.take_variants(ap, args.variant, VARIANTS)
    if args.max_warps != cuda_w4a16.MAX_WARPS:
        flag = variant_flag(ap, "--max-warps", "GEMV_MAX_WARPS", args.max_warps,
                            cuda_w4a16.MAX_WARPS + 1, 32)  # fmt: skip
        cuda_w4a16.MAX_WARPS = args.max_warps  # configs past 16 warps run on that variant only
        VARIANTS["trace"] = [*VARIANTS["trace"], flag]
    if args.wide_warps != cuda_w4a16.WIDE_MAX_WARPS:
        flag = variant_flag(ap, "--wide-warps", "GEMV_WIDE_WARPS", args.wide_warps,
                            cuda_w4a16.WIDE_MAX_WARPS + 1, 12)  # fmt: skip
        cuda_w4a16.WIDE_MAX_WARPS = args.wide_warps  # the product's builds refuse the extra warps
        VARIANTS["trace"] = [*VARIANTS["trace"], flag]
    if args.config:
        try:
            GRID[:] = PROFILED[:] = TRACED[:] = [parse_config(c) for c in args.config]
        except ValueError as e:
            ap.error(str(e))
    if args.baseline is not None:
        if not args.baseline.is_file():
            ap.error(f"--baseline {args.baseline}: no such file")
        theirs, ours = entry_arguments(args.baseline), entry_arguments(cuda_w4a16.SOURCE)
        if theirs != ours:
            ap.error(f"--baseline {args.baseline}: its entry point takes ({theirs}), this "
                     f"source's ({ours}); give it the same arguments first")  # fmt: skip
    torch.manual_seed(0)
    build(args.proj, tuple(args.m), args.trace, args.baseline, list(variants))
    if args.profile:
        for name in args.proj:
            bench_projection(name, tuple(args.m), 0.0, profile=True)
        return
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    result = header(copy_gbs, group_size=GROUP, nvcc=cuda_library.toolkit())
    write_as_it_goes(result, args.out, args.proj, lambda name: bench_projection(
        name, tuple(args.m), copy_gbs, args.trace, baseline=args.baseline, repeats=args.repeat,
        variants=variants, launch_floor=args.launch_floor))  # fmt: skip


if __name__ == "__main__":
    main()

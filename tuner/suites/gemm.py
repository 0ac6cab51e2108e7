"""``tuner bench gemm --suite llama``: tuned GEMMs against cuBLAS (torch.matmul), side by side.

The suite (parts selectable with ``--part``; each part writes ``gemm_llama_<part>.json``/``.png``
and a tuned cache ``gemm_llama_<part>.db`` into ``--out``):

- ``bf16-8b``, ``bf16-70b``: the projections of Llama-3-8B / 70B at TP 1 (qkv, o, gate_up, down;
  configs/models/*.yaml, expanded by tuner.offline.model_config) with M in 1, 2, 4, ..., 16384,
  bf16. ``F.linear(x, W)`` computes x @ W.T with W stored (N, K) row-major: layout ``nt``, as
  tuner.torch dispatches it;
- ``odd``: dims that are not multiples of 8 or 16 (4097 x 4099 x 4101, 127 x 5120 x 3333, ...), bf16;
- ``fp16``: the Llama-3-8B projections at M in 1, 16, 128, 1024, 8192 in fp16;
- ``fp32``: the same in fp32 with TF32 off and with TF32 on.

Each part is tuned by tuner.suites.runner (tune, then time cuBLAS and the winner alternately on
the same inputs). Added here: per-row achieved bandwidth of decode shapes (M <= 16) as a share of
the measured device-to-device copy bandwidth, also in CUDA graphs (``timing.graph_time``), a
re-check of each non-baseline winner's repeat calls (Triton runners launch the compiled kernel
directly after the first call), a warm re-tune of a sample of rows (compiled kernels cached: the
warm tuning time), Inductor max-autotune on a few shapes per part (its ratio and compile time),
and the suite's targets in the summary.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from tuner.cache import Store
from tuner.candidates import registry
from tuner.core.console import output_console
from tuner.core.keys import GemmKey, parse_key
from tuner.measure import samples, timing
from tuner.measure.records import candidate_params
from tuner.offline.model_config import gemm_key, load_model
from tuner.offline.plots import geomean
from tuner.suites import catalog
from tuner.suites.runner import (
    marked_if_interrupted,
    pct_of_copy,
    print_figures,
    print_notes,
    quick_cpu_note,
    quick_on_cpu,
    rate,
    run_suite,
    save_result,
    speedup_drawing,
    verdict_notes,
)
from tuner.suites.sdpa import recheck
from tuner.tuning import compile_pool
from tuner.tuning.compile_pool import CompilePool
from tuner.tuning.engine import TuneOptions, TuneOutcome, current_device
from tuner.tuning.tune import tune

console = output_console()

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"  # a source checkout
MODELS = {"8b": "llama-3-8b.yaml", "70b": "llama-3-70b.yaml"}
OPS = catalog.MODEL_OPS
M_BF16 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_SMALL = (1, 16, 128, 1024, 8192)
ODD = ((4097, 4099, 4101), (127, 5120, 3333), (1, 4099, 4101), (33, 11001, 4097),
       (2049, 2050, 1026), (8191, 3001, 1999))  # fmt: skip
PARTS = catalog.GEMM_PARTS
# Inductor max-autotune compiles for minutes over a whole part; these few shapes per part suffice
INDUCTOR = {
    "bf16-8b": ("8B qkv M=1", "8B gate_up M=128", "8B o M=4096"),
    "bf16-70b": ("70B down M=1", "70B o M=8192"),
    "odd": ("4097x4099x4101", "127x5120x3333"),
    "fp16": ("8B gate_up M=128",),
    "fp32": ("8B qkv M=1024 tf32",),
}
DECODE_M = 16

Problems = list[tuple[str, GemmKey]]


# each part's dtypes, with the suffix its rows' labels carry; the odd part's: bf16
PART_DTYPES: dict[str, tuple[tuple[str, str], ...]] = {
    "bf16-8b": (("bf16", ""),), "bf16-70b": (("bf16", ""),), "odd": (("bf16", ""),),
    "fp16": (("f16", ""),), "fp32": (("f32", " f32"), ("tf32", " tf32")),
}  # fmt: skip
QUICK_CPU_ROWS = "CPU-path rows of small shapes (N={}, K={}; the odd part's N={}, K={})".format(
    *catalog.GEMM_QUICK_CPU_SHAPE, *catalog.GEMM_QUICK_CPU_ODD_SHAPE
)


def shape_rows(
    shapes: Sequence[tuple[str, int, int]], m_sizes: Sequence[int], dtype: str, suffix: str = ""
) -> Problems:
    """(label, key) of each named (N, K) shape at each M: ``F.linear``'s layout ``nt``."""
    return [
        (f"{name} M={m}{suffix}", gemm_key(m, n, k, layout="nt", dtype=dtype))
        for name, n, k in shapes
        for m in m_sizes
    ]


def model_problems(model: str, m_sizes: Sequence[int], dtype: str, suffix: str = "") -> Problems:
    cfg = load_model(MODELS_DIR / MODELS[model])
    shapes = [(f"{model.upper()} {op}", *cfg.gemm_shape(op)) for op in OPS]
    return shape_rows(shapes, m_sizes, dtype, suffix)


def odd_problems() -> Problems:
    return [(f"{m}x{n}x{k}", gemm_key(m, n, k, layout="nt", dtype="bf16")) for m, n, k in ODD]


def llama_suite(part: str) -> Problems:
    """The (label, key) problems of one part of the suite."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {list(PARTS)}, got {part!r}")
    if part == "odd":
        return odd_problems()
    model = "70b" if part == "bf16-70b" else "8b"
    m_sizes = M_BF16 if part.startswith("bf16") else M_SMALL
    return [row for dtype, suffix in PART_DTYPES[part]
            for row in model_problems(model, m_sizes, dtype, suffix)]  # fmt: skip


def quick_cpu_problems(part: str) -> Problems:
    """``--quick``'s rows of a part on a CPU: the small shape (the odd part's for ``odd``) at
    ``catalog.GEMM_QUICK_CPU_M`` in the part's dtypes, labelled as such (``quick_cpu_name``)."""
    n, k = catalog.GEMM_QUICK_CPU_ODD_SHAPE if part == "odd" else catalog.GEMM_QUICK_CPU_SHAPE
    shape = [(catalog.quick_cpu_name(n, k), n, k)]
    return [row for dtype, suffix in PART_DTYPES[part]
            for row in shape_rows(shape, catalog.GEMM_QUICK_CPU_M, dtype, suffix)]  # fmt: skip


def chosen_problems(part: str, *, quick: bool = False, device: str | None = None) -> Problems:
    """A part's rows: all of them, or ``--quick``'s: every 4th on a GPU; on a CPU ``device``
    the small ones (``quick_cpu_problems``), since every 4th GPU row still holds GEMMs that take
    minutes each there."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {list(PARTS)}, got {part!r}")
    if quick_on_cpu(quick, device):
        return quick_cpu_problems(part)
    return llama_suite(part)[:: 4 if quick else 1]


def gemm_metrics(key: Any, us: float) -> dict[str, float]:
    return {"tflops": key.flops / us / 1e6, "gbs": key.min_bytes / us / 1e3}


class Recorder:
    """engine.tune (or the crash-isolating worker), keeping outcomes and compile statistics;
    with a run's compile pool (``compile_pool.ahead``) each problem waits for its own kernels."""

    def __init__(self, compiler: CompilePool | None = None) -> None:
        self.outcomes: dict[str, TuneOutcome] = {}
        self.compiled: dict[str, int] = {}
        self.compiler = compiler

    def __call__(self, key: Any, options: TuneOptions) -> TuneOutcome:
        wait = None
        if self.compiler is not None:
            wait = functools.partial(compile_pool.wait, self.compiler.events, key)
        outcome = tune(key, options=options, compiled=wait)
        self.outcomes[str(key)] = outcome
        src = registry.all_sources().get("triton_gemm")
        report = getattr(src, "last_warm", None)
        if report is not None:
            self.compiled[str(key)] = report.compiled
        return outcome


# --- Inductor --------------------------------------------------------------------------------------


def inductor_row(label: str, key: GemmKey, device: str, budget_s: float) -> dict[str, Any]:
    """torch.compile(max-autotune-no-cudagraphs) of a @ b for one key: compile seconds and its
    time against torch.matmul, measured alternately on the same inputs."""
    import torch._dynamo as dynamo

    dynamo.reset()
    sets = samples.input_sets(key, device, seed=2)
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    flags.allow_tf32 = key.compute == "tf32"
    try:
        compiled = torch.compile(
            lambda a, b: a @ b, mode="max-autotune-no-cudagraphs", dynamic=False
        )
        t0 = time.perf_counter()
        compiled(*sets[0])
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {"cublas": [], "inductor": []}
        for _ in range(3):
            for name, fn in (("cublas", torch.matmul), ("inductor", compiled)):
                t = timing.measure(timing.on_sets(fn, sets), device=device, budget_s=budget_s)
                times[name].append(t.median_us)
    finally:
        flags.allow_tf32 = before
    base, ind = statistics.median(times["cublas"]), statistics.median(times["inductor"])
    return {"label": label, "key": str(key), "cublas_us": base, "inductor_us": ind,
            "speedup": base / ind, "compile_s": compile_s}  # fmt: skip


# --- annotation ------------------------------------------------------------------------------------


def annotate(result: dict[str, Any], recorder: Recorder, device: str) -> None:
    copy = result["copy_gbs"]
    base_name = registry.baseline("gemm").name
    for row in result["rows"]:
        row.update(row.pop("extra", {}))
        key = parse_key(row["key"])
        assert isinstance(key, GemmKey)
        row["m"], row["n"], row["k"] = key.m, key.n, key.k
        row["pct_copy"] = 100 * row["gbs"] / copy
        row["baseline_pct_copy"] = 100 * row["baseline_gbs"] / copy
        row["kernels_compiled"] = recorder.compiled.get(row["key"])
        if row["source"] != base_name:
            params = candidate_params(row["candidate"])
            try:
                row["recheck_err"] = recheck(key, row["source"], params, device)
            except Exception as e:  # a broken winner must show, not sink the report
                row["recheck_err"] = f"{type(e).__name__}: {e}"[:300]
        outcome = recorder.outcomes.get(row["key"])
        ms = outcome.measurements if outcome else []
        row["candidates"] = {
            status: sum(m.status == status for m in ms)
            for status in ("ok", "cut", "rejected", "failed", "unsupported")
        }
        row["failures"] = [
            f"{m.candidate}: {m.error[:200]}" for m in ms if m.status in ("failed", "rejected")
        ][:5]
        if key.m <= DECODE_M and device == "cuda":
            row.update(graph_times(key, row, ms, copy))


def graph_times(key: GemmKey, row: dict[str, Any], ms: list[Any], copy: float) -> dict[str, Any]:
    """Decode rows: cuBLAS, the winner and the best Triton candidate timed inside CUDA graphs
    (``timing.graph_time``, as the SDPA suite's graph columns), as shares of the copy bandwidth
    (the kernels' own speed, launch costs left out)."""
    sets = samples.input_sets(key, "cuda", seed=3)
    ok = [m for m in ms if m.status == "ok" and m.source == "triton_gemm"]
    best = min(ok, key=lambda m: m.median_us or float("inf"), default=None)
    base = registry.baseline("gemm")
    runners = {"graph_baseline": base.build(key, base.baseline_params)}
    if row["source"] != base.name:
        params = candidate_params(row["candidate"])
        runners["graph_winner"] = registry.get(row["source"]).build(key, params)
    if best is not None:
        runners["graph_triton"] = registry.get("triton_gemm").build(key, best.params)
    out: dict[str, Any] = {}
    for name, run in runners.items():
        try:
            us = timing.graph_time_over(run, sets).median_us
        except Exception as e:  # capture can fail for a library; the eager numbers stand
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        out[f"{name}_us"] = us
        out[f"{name}_pct_copy"] = pct_of_copy(key.min_bytes, us, copy)
    return out


def warm_retune(problems_: Problems, options: TuneOptions, sample: int) -> list[dict[str, Any]]:
    """Re-tune an even sample of the part's rows: every kernel is compiled by now."""
    if sample <= 0 or not problems_:
        return []
    step = max(1, len(problems_) // sample)
    out = []
    for label, key in problems_[::step][:sample]:
        t0 = time.perf_counter()
        tune(key, options=options)
        out.append({"label": label, "key": str(key), "tune_s": time.perf_counter() - t0})
    return out


def graph_served_pct(row: dict[str, Any]) -> float | None:
    """A decode row's CUDA-graph share of copy bandwidth as served (the better of the winner's
    and cuBLAS's), or None where no graph was tried (no GPU): no reading is no 0%. A capture
    that failed counts 0%, so a row whose graphs all failed still shows in the minimum."""
    tried = [name for name in ("winner", "baseline")
             if f"graph_{name}_pct_copy" in row or f"graph_{name}_error" in row]  # fmt: skip
    return max((row.get(f"graph_{name}_pct_copy", 0.0) for name in tried), default=None)


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The suite's targets over this part's rows (where the part has such rows)."""
    rows = result["rows"]
    if not rows:
        return {}
    speed = [r["speedup"] for r in rows]
    decode = [r for r in rows if r["m"] <= DECODE_M]
    large = [
        r
        for r in rows
        if min(r["m"], r["n"], r["k"]) >= 4096 and r["k"] % 8 == 0 and r["n"] % 8 == 0
    ]
    odd = [r for r in rows if (r["m"], r["n"], r["k"]) == (4097, 4099, 4101)]
    warm = [w["tune_s"] for w in result.get("warm_retune", [])]
    return {
        "n_below_0.98": sum(s < 0.98 for s in speed),
        "geomean": geomean(speed),
        "decode_n": len(decode),
        "decode_min_pct_copy": min((r["pct_copy"] for r in decode), default=None),
        "decode_n_below_75pct_copy": sum(r["pct_copy"] < 75 for r in decode),
        "decode_graph_min_pct_copy": min(
            (pct for r in decode if (pct := graph_served_pct(r)) is not None), default=None
        ),
        "decode_graph_triton_min_pct_copy": min(
            (r["graph_triton_pct_copy"] for r in decode if "graph_triton_pct_copy" in r),
            default=None,
        ),
        "large_aligned_min": min((r["speedup"] for r in large), default=None),
        "odd_4097": odd[0]["speedup"] if odd else None,
        "median_tune_s_first": statistics.median(r["tune_s"] for r in rows),
        "median_tune_s_warm": statistics.median(warm) if warm else None,
    }


def print_report(result: dict[str, Any]) -> None:
    for r in result["rows"]:
        err = r.get("recheck_err")
        if isinstance(err, str) or (err is not None and not err <= 5e-2):
            console.print(
                f"[red]{escape(r['label'])}: winner recheck failed: {escape(str(err))}[/red]"
            )
        for f in r["failures"]:
            console.print(f"[yellow]{escape(r['label'])}: {escape(f)}[/yellow]")
        if r["m"] <= DECODE_M:
            graph = " ".join(
                f"{n} {r[f'graph_{n}_pct_copy']:.0f}%"
                for n in ("baseline", "winner", "triton")
                if f"graph_{n}_pct_copy" in r
            )
            console.print(
                f"{r['label']:<28} cuBLAS {rate(r['baseline_gbs'])} GB/s ({r['baseline_pct_copy']:.0f}%) -> "
                f"{rate(r['gbs'])} GB/s ({r['pct_copy']:.0f}% of copy)"
                + (f"; in CUDA graphs: {graph}" if graph else "")
            )

    for r in result.get("inductor", []):
        if "error" in r:
            console.print(f"[yellow]inductor {r['label']}: {r['error'][:200]}[/yellow]")
        else:
            console.print(
                f"inductor {r['label']:<24} {r['speedup']:.2f}x vs cuBLAS, compiled in {r['compile_s']:.1f} s"
            )
    print_notes(result)
    if result["targets_judged"]:
        print_figures("targets", result["targets"])


def inductor_problems(part: str, problems_: Problems, device: str) -> Problems:
    """The rows Inductor max-autotune is timed on: those of the part's few ``INDUCTOR`` shapes
    chosen, on a GPU (max-autotune tunes GPU kernels)."""
    return [(label, key) for label, key in problems_
            if device == "cuda" and label in INDUCTOR.get(part, ())]  # fmt: skip


def no_inductor(parts: dict[str, Problems], device: str | None = None) -> str | None:
    """Why some chosen part times no Inductor row (``inductor_problems``) on ``device`` (default:
    this host's), or None: said where ``--inductor`` is asked for, which would otherwise leave
    ``"inductor": []`` with no word."""
    device = device or current_device()
    if device != "cuda":
        return (
            "no CUDA GPU here: Inductor max-autotune is timed on a GPU only; no Inductor row runs"
        )
    left = [p for p, rows in parts.items() if not inductor_problems(p, rows, device)]
    if not left:
        return None
    shapes = "; ".join(f"{p}'s {', '.join(INDUCTOR[p])}" for p in left)
    return (f"the rows chosen hold none of the shapes it is timed on ({shapes}): no Inductor "
            "row runs there")  # fmt: skip


def inductor_or_error(label: str, key: GemmKey, device: str, budget_s: float) -> dict[str, Any]:
    """``inductor_row``, or the error that stopped it: Inductor failing on a shape is a finding,
    not a crash."""
    try:
        return inductor_row(label, key, device, budget_s)
    except Exception as e:
        return {"label": label, "key": str(key), "error": f"{type(e).__name__}: {e}"[:500]}


def run_part(
    part: str,
    problems_: Problems,
    out: Path,
    options: TuneOptions,
    *,
    inductor: bool,
    warm_sample: int,
) -> dict[str, Any]:
    device = current_device()
    name = f"gemm_llama_{part}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    title = f"GEMM {part}: tuned vs cuBLAS (torch.matmul)"
    if note := quick_cpu_note((label for label, _ in problems_), QUICK_CPU_ROWS):
        title += f": {QUICK_CPU_ROWS}"
    result: dict[str, Any] = {}  # run_suite's, once its rows are done
    draw = speedup_drawing(title)
    missing = "the warm re-tune, Inductor and targets"
    with (
        Store(out / f"{name}.db") as store,
        marked_if_interrupted(out, name, result, missing, draw),  # the pool's closing too
    ):
        with compile_pool.ahead([k for _, k in problems_], options, device) as compiler:
            recorder = Recorder(compiler)
            result.update(run_suite(
                name, problems_, out_dir=out, title=title, options=options, metrics=gemm_metrics,
                store=store, tuner=recorder, write=False,
            ))  # fmt: skip
        annotate(result, recorder, device)
        result["warm_retune"] = warm_retune(problems_, options, warm_sample)
        result["inductor"] = [
            inductor_or_error(label, key, device, options.budget_s)
            for label, key in (inductor_problems(part, problems_, device) if inductor else [])
        ]
        result["targets"] = targets(result)
        result.update(verdict_notes(device, note))
        result["wall_s"] = time.perf_counter() - started
        save_result(out, name, result, draw)
    print_report(result)
    return result

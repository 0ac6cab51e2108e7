"""The library GEMM sources on the GPU: each one's best against torch.matmul, and the measurements
their design rests on.

    python bench/libs_bench.py --out libs.json              the table (default sections)
    python bench/libs_bench.py --details --out details.json cuBLAS algo enum, cuBLASLt rebuild and
                                                            launch overhead, CUTLASS compile/load
    python bench/libs_bench.py --precompile --out c.json    compile the CUTLASS kernels both need
    python bench/libs_bench.py --env                        versions and imports

The table tunes each (shape, source) through ``tuner.tuning.isolation`` (a crash-isolated worker process) with
only that source and the torch baseline, so every ratio compares two measurements of the same run.
Errors are recorded in the JSON, never fatal: a section that breaks says why.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SHAPES = [(1, 6144, 4096), (128, 28672, 4096), (4097, 4099, 4101), (8192, 8192, 8192)]
SOURCES = ("cublas", "cublaslt", "cutlass")


def gemm_key(m: int, n: int, k: int, dtype: str = "bf16", layout: str = "nn", **kw: Any) -> Any:
    """The key of packed operands: the largest alignment class the shape allows."""
    from tuner.core.keys import GemmKey

    for align in (16, 8, 4, 2):
        try:
            return GemmKey(
                m=m, n=n, k=k, layout=layout, dtype=dtype, out_dtype=dtype, align=align, **kw
            )
        except ValueError:
            continue
    raise ValueError(f"no alignment class fits {m}x{n}x{k}")


def guarded(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def write(path: Path | None, data: dict) -> None:
    text = json.dumps(data, indent=1, default=str)
    if path is None:
        print(text)
        return
    from tuner.core.atomic import write_atomic

    write_atomic(path, text)


# --- environment ---------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import importlib
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "cupy-cuda13x", "nvmath-python", "nvidia-cutlass",
                 "cuda-bindings", "cuda-core", "cuda-pathfinder", "numpy"):  # fmt: skip
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    for module in ("nvmath.bindings.cublas", "nvmath.bindings.cublasLt", "cuda.core",
                   "nvmath.linalg.advanced"):  # fmt: skip
        try:
            mod = importlib.import_module(module)
            out[f"import {module}"] = getattr(mod, "__file__", "ok")
        except Exception as e:
            out[f"import {module}"] = f"FAILED {type(e).__name__}: {e}"
    from tuner.candidates import registry

    out["sources"] = {
        name: (src if isinstance(src, str) else src.unavailable("cuda") or "available")
        for name, src in registry.all_sources().items()
    }
    from tuner.candidates import nvcc_build

    out["nvcc"] = nvcc_build.nvcc_path()
    return out


# --- CUTLASS compiles ------------------------------------------------------------------------------


def precompile_keys() -> list[Any]:
    """The problems whose CUTLASS kernels the table and tests/test_gemm_libraries.py need."""
    return [gemm_key(*s) for s in SHAPES] + [
        gemm_key(4096, 4096, 4096, layout=layout) for layout in ("nn", "nt", "tn", "tt")
    ] + [gemm_key(4096, 4096, 4096, dtype="f16"),
         gemm_key(4096, 4096, 4096, dtype="f32", layout="nt", compute="tf32")]  # fmt: skip


def precompile() -> dict[str, Any]:
    from tuner.candidates import cutlass_env, cutlass_gemm, nvcc_build

    started = time.perf_counter()
    specs: dict[Any, None] = {}
    for i, key in enumerate(precompile_keys()):
        if cutlass_gemm.unsupported_reason(key):
            continue
        offered = cutlass_gemm.offered(key)
        # the tests take the first offered config of their 4096^3 keys
        for spec in list(offered)[: None if i < len(SHAPES) else 1]:
            specs[spec] = None
    errors = cutlass_env.compile_all(list(specs))
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 1),
        "jobs": nvcc_build.default_jobs(len(specs)),
        "kernels": [
            {"spec": json.loads(s.to_json()), **(nvcc_build.compiled_info(s) or {}), "error": e}
            for s, e in errors.items()
        ],
    }


# --- the table -----------------------------------------------------------------------------------


def summarize(outcome: Any, source: str) -> dict[str, Any]:
    from tuner.tuning.verdict import effective_us

    base = outcome.baseline
    mine = [m for m in outcome.measurements if m.source == source]
    ok = [m for m in mine if m.status == "ok"]
    row: dict[str, Any] = {
        "torch_us": round(base.median_us, 2),
        "torch_eager_us": round(effective_us(base, "eager"), 2),
        "tune_s": round(outcome.seconds, 2),
        "statuses": dict(collections.Counter(m.status for m in mine)),
        "winner": outcome.winner.candidate,
    }
    if ok:
        best = min(ok, key=lambda m: m.median_us)
        row.update(
            best=best.candidate, best_us=round(best.median_us, 2),
            best_eager_us=round(effective_us(best, "eager"), 2),
            spread=round(best.spread, 3), vs_torch=round(base.median_us / best.median_us, 3),
        )  # fmt: skip
    errors = [
        f"{m.candidate}: {m.status}: {m.error}" for m in mine if m.status not in ("ok", "cut")
    ]
    row["errors"] = errors[:4]
    return row


def tune_one(pool: Any, key: Any, options: Any, source: str) -> dict[str, Any]:
    return summarize(pool.tune(key, options), source)


def table(budget: float, shapes: list[tuple[int, int, int]], sources: list[str]) -> dict[str, Any]:
    from tuner.tuning.engine import TuneOptions
    from tuner.tuning.isolation import WorkerPool

    pool = WorkerPool()
    rows = []
    try:
        for shape in shapes:
            key = gemm_key(*shape)
            row: dict[str, Any] = {
                "shape": "x".join(map(str, shape)),
                "key": str(key),
                "sources": {},
            }
            for source in sources:
                options = TuneOptions(budget_s=budget, sources=[source])
                row["sources"][source] = guarded(tune_one, pool, key, options, source)
                print(shape, source, json.dumps(row["sources"][source])[:300], flush=True)
            rows.append(row)
    finally:
        pool.close()
    return {"budget_s": budget, "workers_started": len(pool.started), "rows": rows}


# --- details ---------------------------------------------------------------------------------------


def _time(fn: Any, *args: Any) -> dict[str, float]:
    from tuner.measure import timing

    t = timing.measure(lambda i: fn(*args), device="cuda", budget_s=0.1)
    return {"median_us": round(t.median_us, 2), "p10_us": round(t.p10_us, 2),
            "p90_us": round(t.p90_us, 2), "host_us": round(t.host_us, 2)}  # fmt: skip


def cublas_algos() -> dict[str, Any]:
    """Does the gemmEx algo argument change anything on this GPU?"""
    import torch

    from tuner.candidates import cublas
    from tuner.measure import samples

    src = cublas.CublasGemm()
    out = {}
    for shape in ((4096, 4096, 4096), (128, 28672, 4096)):
        key = gemm_key(*shape)
        a, b = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
        per = {}
        for algo in cublas.ALGOS:
            run = src.build(key, {"algo": algo})
            per[algo] = guarded(_time, run, a, b)
        per["torch"] = _time(torch.matmul, a, b)
        out[str(key)] = per
    return out


def cublaslt_rebuild() -> dict[str, Any]:
    """Each heuristic algorithm rebuilt from its params: same config, same bytes?"""
    from tuner.candidates import cublaslt
    from tuner.candidates import gemm_operands as ops

    src = cublaslt.CublasLtGemm()
    out = {}
    for shape in ((4096, 4096, 4096), (1, 6144, 4096)):
        key = gemm_key(*shape)
        params_list = src.candidates(key, "cuda")
        runner0 = src.build(key, params_list[0])
        desc = cublaslt._Descriptors(key, ops.packed_call(key))
        found = desc.heuristic(
            runner0.handle, cublaslt._Alignments.of(key), cublaslt.HEURISTIC_LIMIT
        )
        rows = []
        for i in range(len(found)):
            params = cublaslt.to_params(
                cublaslt.read_config(found["algo"][i : i + 1]), cublaslt._enums()
            )
            runner = guarded(src.build, key, params)
            if isinstance(runner, dict):
                rows.append({"params": params, **runner})
                continue
            rows.append({
                "params": params, "rebuilt_by_init": runner.rebuilt,
                "same_bytes_as_heuristic": bytes(found["algo"][i]) == bytes(runner.algo[0]),
                "workspace": int(found["workspace_size"][i]),
            })  # fmt: skip
        out[str(key)] = {"count": len(params_list), "algorithms": rows}
    return out


def launch_overhead() -> dict[str, Any]:
    """Host time per eager call on a tiny problem (what decides small-M winners)."""
    import torch

    from tuner.candidates import registry
    from tuner.measure import samples

    key = gemm_key(64, 64, 64)
    a, b = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
    runs: dict[str, Any] = {"torch.matmul": lambda: torch.matmul(a, b)}
    for name in SOURCES:
        src = registry.get(name)
        if src.unavailable("cuda") is None:
            try:
                runs[name] = src.build(key, src.candidates(key, "cuda")[0])
            except Exception as e:
                runs[name] = f"{type(e).__name__}: {e}"
    try:
        from nvmath.linalg.advanced import Matmul

        mm = Matmul(a, b)
        mm.plan()
        runs["nvmath Matmul.execute"] = mm.execute
    except Exception as e:
        runs["nvmath Matmul.execute"] = f"{type(e).__name__}: {e}"
    out = {}
    for name, fn in runs.items():
        if isinstance(fn, str):
            out[name] = {"error": fn}
            continue
        f = fn if name.startswith(("torch", "nvmath")) else (lambda r=fn: r(a, b))
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                f()
            samples.append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
        out[name] = {"host_us_per_call": round(statistics.median(samples), 2)}
    return out


def cutlass_loads() -> dict[str, Any]:
    """Compile time (recorded by the compiler processes) and in-process load time per kernel."""
    from tuner.candidates import cutlass_env, cutlass_gemm, nvcc_build

    out = []
    for spec in cutlass_gemm.offered(gemm_key(*SHAPES[0])) | cutlass_gemm.offered(
        gemm_key(*SHAPES[-1])
    ):
        info = nvcc_build.compiled_info(spec)
        if info is None:
            continue  # never compile here: details must not wait for nvcc
        t0 = time.perf_counter()
        err = guarded(cutlass_env.load, spec)
        out.append({"kernel": info.get("name"), "compile_s": info.get("seconds"),
                    "load_s": round(time.perf_counter() - t0, 3),
                    "error": err.get("error") if isinstance(err, dict) else None})  # fmt: skip
    return {"kernels": out}


def cutlass_reference_path() -> dict[str, Any]:
    """One kernel launched by cutlass_cppgen's own path (GemmArguments + operation.run) and by
    the tuner's launcher: both against fp64, and the host time each spends per call."""
    import torch
    from cuda.bindings import driver
    from cutlass_cppgen.backend.gemm_operation import GemmArguments
    from cutlass_cppgen.shape import GemmCoord
    from cutlass_library import GemmUniversalMode

    from tuner.candidates import cutlass_env, cutlass_gemm, nvcc_build, registry
    from tuner.candidates import gemm_operands as ops
    from tuner.measure import samples

    key = gemm_key(4096, 4096, 4096)
    spec, params = next(iter(cutlass_gemm.offered(key).items()))
    if nvcc_build.compiled_info(spec) is None:
        return {"skipped": f"{spec} is not compiled"}
    op = cutlass_env.load(spec)
    a, b = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
    ref = samples.reference(key, (a, b))
    d = torch.full((key.m, key.n), float("nan"), dtype=a.dtype, device="cuda")
    stream = driver.CUstream(ops.current_stream(a.device))

    def theirs() -> None:
        args = GemmArguments(
            operation=op, problem_size=GemmCoord(key.m, key.n, key.k), A=a, B=b, C=d, D=d,
            output_op=op.epilogue_type(1.0, 0.0), gemm_mode=GemmUniversalMode.Gemm,
            split_k_slices=1, stream=stream,
        )  # fmt: skip
        op.run(args)

    runner = registry.get("cutlass").build(key, params)
    out: dict[str, Any] = {"kernel": op.procedural_name()}
    for name, fn in (("cutlass_cppgen", theirs), ("tuner", lambda: runner(a, b, out=d))):
        d.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = samples.relative_error(d, ref)
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        out[name] = {"rel_err": err, "host_us_per_call": round(host, 1), **_time(fn)}
    return out


def details(save: Any) -> dict[str, Any]:
    """Each section is saved as soon as it is done (a timeout keeps what finished)."""
    data: dict[str, Any] = {}
    for name, fn in (
        ("cublaslt_rebuild", cublaslt_rebuild),
        ("launch_overhead", launch_overhead),
        ("cutlass_reference_path", cutlass_reference_path),
        ("cutlass_loads", cutlass_loads),
        ("cublas_algos", cublas_algos),
    ):
        data[name] = guarded(fn)
        save(data)
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget", type=float, default=0.1, help="timing budget per candidate, s")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="table shapes, MxNxK,... (bf16, row-major)")  # fmt: skip
    parser.add_argument("--sources", default=",".join(SOURCES), help="table sources, a,b,...")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--env", action="store_true")
    group.add_argument("--details", action="store_true")
    group.add_argument("--precompile", action="store_true")
    args = parser.parse_args()
    import torch

    started = time.perf_counter()
    data: dict[str, Any] = {"argv": sys.argv[1:]}
    if torch.cuda.is_available():
        data["device"] = torch.cuda.get_device_name()
    if args.env:
        data["env"] = guarded(environment)
    elif args.details:
        details(lambda sections: write(args.out, {**data, **sections}))
        data.update(json.loads(args.out.read_text()) if args.out else {})
    elif args.precompile:
        data["precompile"] = guarded(precompile)
    else:
        from tuner.core.device import fingerprint

        data["fingerprint"] = guarded(lambda: fingerprint().to_dict())
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        data["table"] = guarded(table, args.budget, shapes, args.sources.split(","))
    data["seconds"] = round(time.perf_counter() - started, 1)
    write(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

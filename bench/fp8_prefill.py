"""FP8 rowwise prefill: every FP8 source's configs beside ``_scaled_mm`` and bf16 cuBLAS.

    python bench/fp8_prefill.py --out $OUT/fp8_prefill.json [--m 2048] [--ops qkv o] [--sweep]

Per projection (the low-bit suite's eight: qkv, o, gate_up, down of Llama-3-8B and Qwen2.5-7B)
and M, the shortlist of each FP8 source (``cutlass_fp8``, ``cublaslt_fp8``, ``triton_fp8``:
their ``candidates``), and with ``--sweep`` the wider grid below, each built as its source
builds it and timed alone (``w4a16_prefill.time_config``: CUDA-graph GPU time and eager time over
the key's rotating input sets, error against the float32 reference). Then the fastest few by
either time, torch's ``_scaled_mm`` (the baseline a challenger must beat in the duel), torch's
bf16 call on the same shape (bf16 cuBLAS) and the fastest shortlisted config of each source are
taken in turn (``runner.in_turn``: four eager rounds, two of CUDA graphs), as the low-bit
suite's ``retime`` judges a prefill row.

CUTLASS kernels compile (one pool for the whole run, ``precompile_run``) while the Triton
kernels compile in their worker processes; the JSON is rewritten after every row, the narrow
projections first. ``--profile-host N``: on the first row, where the host time of a call goes
(cProfile over N eager calls of ``_scaled_mm`` and of each source's first config), printed and
kept in the JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.w4a16_prefill import time_config
from tuner.candidates import cutlass_fp8, registry
from tuner.candidates.base import Params
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import samples
from tuner.suites.lowbit import bf16_twin, problems
from tuner.suites.runner import Timed, in_turn

FORMAT = "fp8-rowwise"
SOURCES = ("cutlass_fp8", "cublaslt_fp8", "triton_fp8")
BASELINE = "torch_lowbit"  # torch._scaled_mm
# CUTLASS cooperative FP8 kernels the generator lists beside the shortlist's (tile, cluster,
# scheduler): 128x128 is the tile torch's own rowwise kernel takes at these shapes
SWEEP_CUTLASS = (((128, 128), (1, 2), "default"), ((128, 128), (2, 1), "default"),
                 ((128, 128), (1, 2), "streamk"), ((128, 128), (2, 1), "streamk"),
                 ((128, 256), (1, 2), "streamk"), ((128, 256), (2, 1), "streamk"),
                 ((128, 256), (2, 1), "default"), ((256, 128), (1, 2), "default"))  # fmt: skip
# raster swizzles (a launch-time argument, no new kernel) tried on these (tile, cluster, scheduler)
SWEEP_SWIZZLES = (2, 8)
SWIZZLED = (((128, 128), (1, 2), "default"), ((128, 128), (1, 2), "streamk"))
# cuBLASLt tiles (its M is our N: it multiplies W @ x.T) and clusters tried on the heuristic's
# first algorithm; the ones this cuBLASLt cannot run fail at build and are recorded so
SWEEP_LT_TILES = ("128x128", "128x256", "256x128", "192x128", "128x192")
SWEEP_LT_CLUSTERS = ("1x1x1", "2x1x1", "1x2x1")
SIDE_BY_SIDE = 3  # the fastest configs by GPU time and by eager time that are timed in turn
NARROW_FIRST = ("qkv", "o", "down", "gate_up")


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


def configs_of(key: GemmKey, sweep: bool) -> list[tuple[str, Params, bool]]:
    """(source, params, shortlisted) of every config to time for ``key``, without repeats."""
    out: list[tuple[str, Params, bool]] = []
    seen: set[str] = set()
    for source in SOURCES:
        src = registry.get(source)
        reason = src.unavailable("cuda") or src.unsupported(key)
        if reason:
            print(f"  {source}: {reason}", flush=True)
            continue
        shortlist = src.candidates(key, "cuda")
        extra = sweep_of(source, shortlist) if sweep else []
        for i, params in enumerate(shortlist + extra):
            name = f"{source}:{json.dumps(params, sort_keys=True)}"
            if name not in seen:
                seen.add(name)
                out.append((source, params, i < len(shortlist)))
    return out


def compile_everything(todo: dict[GemmKey, list[tuple[str, Params, bool]]]) -> dict[str, float]:
    """CUTLASS kernels (one pool, a thread driving nvcc processes) and Triton kernels (worker
    processes, key by key) at the same time; seconds each took."""
    seconds: dict[str, float] = {}

    def run(source: str) -> None:
        t0 = time.perf_counter()
        lists = [(key, [p for s, p, _ in cs if s == source]) for key, cs in todo.items()]
        registry.get(source).precompile_run([(k, ps) for k, ps in lists if ps], lambda _i: None)
        seconds[source] = round(time.perf_counter() - t0, 1)

    thread = threading.Thread(target=run, args=("cutlass_fp8",))
    thread.start()
    run("triton_fp8")
    thread.join()
    print(f"compiled: {seconds}", flush=True)
    return seconds


def bench_key(label: str, key: GemmKey, todo: list[tuple[str, Params, bool]]) -> dict[str, Any]:
    sets = samples.input_sets(key, "cuda", seed=1)
    ref = samples.reference(key, sets[0])
    rows, runners = [], {}
    base = registry.baseline(key.op, key)
    for source, params, shortlisted in [(BASELINE, base.baseline_params, True), *todo]:
        row, runner = time_config(key, source, params, sets, ref)
        row["shortlisted"] = shortlisted
        rows.append(row)
        if runner is not None and row["error"] <= 1:
            runners[len(rows) - 1] = runner
        print(f"  {source:13s} {json.dumps(params, sort_keys=True)[:140]:140s} "
              + (f"GPU {row['gpu_us']:7.1f} eager {row['eager_us']:7.1f} host "
                 f"{row['host_us']:5.1f} err {row['error']:.2f}" if "gpu_us" in row
                 else row["failed"][:120]), flush=True)  # fmt: skip
    del ref
    good = [i for i in runners if i > 0]
    picked = [0]
    for column in ("gpu_us", "eager_us"):
        picked += sorted(good, key=lambda i: rows[i][column])[:SIDE_BY_SIDE]
    for source in SOURCES:
        listed = [i for i in good if rows[i]["shortlisted"] and rows[i]["source"] == source]
        if listed:
            picked.append(min(listed, key=lambda i: rows[i]["eager_us"]))
    timed: dict[str, Timed] = {f"fp8_{i}": (runners[i], sets) for i in dict.fromkeys(picked)}
    twin = bf16_twin(key)
    bf16 = registry.baseline(twin.op, twin)  # torch's bf16 call: cuBLAS
    timed["bf16"] = (
        bf16.build(twin, bf16.baseline_params),
        samples.input_sets(twin, "cuda", seed=1),
    )
    eager = in_turn(timed, "cuda", graph=False, rounds=4, budget_s=0.05)
    graph = in_turn(timed, "cuda", graph=True, rounds=2)
    torch_eager, torch_gpu = eager["fp8_0"], graph["fp8_0"]
    for name in timed:
        if name.startswith("fp8_"):
            rows[int(name[4:])]["in_turn"] = {
                "eager_us": eager[name], "gpu_us": graph[name],
                "vs_torch_eager": torch_eager / eager[name], "vs_torch_gpu": torch_gpu / graph[name],
                "vs_bf16_eager": eager["bf16"] / eager[name], "vs_bf16_gpu": graph["bf16"] / graph[name],
            }  # fmt: skip
    result = {"label": label, "key": str(key), "m": key.m, "n": key.n, "k": key.k,
              "bf16": {"eager_us": eager["bf16"], "gpu_us": graph["bf16"]}, "configs": rows}  # fmt: skip
    turned = [i for i in good if "in_turn" in rows[i]]
    if turned:
        i = min(turned, key=lambda i: rows[i]["in_turn"]["eager_us"])
        result["best"] = {"source": rows[i]["source"], "params": rows[i]["params"],
                          "shortlisted": rows[i]["shortlisted"], **rows[i]["in_turn"]}  # fmt: skip
    best, torch_row = result.get("best", {}), rows[0].get("in_turn", {})
    print(f"{label}: bf16 eager {eager['bf16']:.1f} GPU {graph['bf16']:.1f}; _scaled_mm eager "
          f"{torch_eager:.1f} ({torch_row.get('vs_bf16_eager', 0):.3f}x bf16); best "
          f"{best.get('source')} eager {best.get('eager_us', 0):.1f} "
          f"({best.get('vs_torch_eager', 0):.3f}x torch, {best.get('vs_bf16_eager', 0):.3f}x "
          f"bf16), GPU {best.get('vs_torch_gpu', 0):.3f}x torch", flush=True)  # fmt: skip
    return result


def profile_host(key: GemmKey, todo: list[tuple[str, Params, bool]], calls: int) -> dict[str, str]:
    """cProfile's top entries (by own time) over ``calls`` eager calls of ``_scaled_mm`` and of
    each source's first config, by source."""
    sets = samples.input_sets(key, "cuda", seed=1)
    base = registry.baseline(key.op, key)
    firsts = {BASELINE: base.baseline_params}
    for source, params, _ in todo:
        firsts.setdefault(source, params)
    out: dict[str, str] = {}
    for source, params in firsts.items():
        runner = registry.get(source).build(key, params)
        for s in sets:  # first calls on each set (layouts made once) are set-up
            runner(*s)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(calls):
            runner(*sets[i % len(sets)])
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out[source] = text.getvalue()
        print(f"--- host profile {source} ({calls} calls)\n{out[source]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=[2048])
    ap.add_argument("--ops", nargs="+", default=list(NARROW_FIRST), choices=NARROW_FIRST)
    ap.add_argument("--sweep", action="store_true", help="also the bench's wider config grid")
    ap.add_argument("--profile-host", type=int, default=0, metavar="N",
                    help="first row: cProfile of N eager calls per source")  # fmt: skip
    args = ap.parse_args()
    keys = [(label, key) for m in args.m for op in args.ops
            for label, key in problems([FORMAT], [m], [op])]  # fmt: skip
    todo = {key: configs_of(key, args.sweep) for _, key in keys}
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": "fp8_prefill", "device": fp.name,
                              "versions": fp.versions, "sweep": args.sweep, "rows": []}  # fmt: skip
    t0 = time.perf_counter()
    result["compile_s"] = compile_everything(todo)
    if args.profile_host:
        label, key = keys[0]
        result["host_profile"] = {"label": label, **profile_host(key, todo[key], args.profile_host)}
    for label, key in keys:
        print(f"{label} ({len(todo[key])} configs)", flush=True)
        result["rows"].append(bench_key(label, key, todo[key]))
        result["seconds"] = round(time.perf_counter() - t0, 1)
        Path(args.out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

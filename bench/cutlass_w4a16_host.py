"""Host and GPU time per eager call of the CUTLASS INT4 launcher (``cutlass_w4a16``), apart, beside
the bf16 baseline (torch) on the same shape.

    python bench/cutlass_w4a16_host.py --out $OUT/cutlass_w4a16_host.json

Per shape and kernel config: the eager event time the suites report (``timing.measure`` over the
rotating input sets) and its host time per call; the GPU time alone (``timing.graph_time``); host
time per call of N back-to-back calls (perf_counter, no sync in between) split into the Python
part (checks, memo lookups, output allocation: ``W4A16Launcher.operands``), the ctypes call of a
known pointer set, and the library's own steps timed in C++ (``W4A16Launcher.step_times_us``:
can_implement, initialize, initialize and launch: what a call pays without initialized params
kept for its pointer set).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tuner.candidates import cutlass_env, registry
from tuner.candidates import cutlass_w4a16 as w4
from tuner.candidates import gemm_operands as ops
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import samples, timing
from tuner.offline.model_config import gemm_key
from tuner.suites.lowbit import bf16_twin

# name -> (N, K): the projections whose INT4 rows were host-bound
SHAPES = {
    "qwen-o": (3584, 3584),
    "qwen-qkv": (4608, 3584),
    "llama-o": (4096, 4096),
    "llama-qkv": (6144, 4096),
}


def per_call_us(fn: Callable[[int], Any], calls: int) -> float:
    """Host microseconds per call of ``calls`` back-to-back calls, the GPU drained around them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    spent = time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / calls * 1e6


def eager_and_graph(fn: Callable[[int], Any], calls: int) -> dict[str, float]:
    eager = timing.measure(fn, device="cuda", budget_s=0.1)
    return {
        "event_us": eager.median_us,
        "measure_host_us": eager.host_us,
        "host_us": per_call_us(fn, calls),
        "gpu_us": timing.graph_time(fn).median_us,
    }


def int4_row(key: GemmKey, params: dict[str, Any], calls: int, reps: int) -> dict[str, Any]:
    launcher = w4.CutlassW4A16().build(key, params)
    sets = samples.input_sets(key, "cuda", seed=1)
    fn = timing.on_sets(launcher, sets)
    row: dict[str, Any] = {"params": params, "sets": len(sets), **eager_and_graph(fn, calls)}
    prepared = [launcher.operands(*s) for s in sets]
    stream = ops.current_stream(launcher.device)
    row["python_us"] = per_call_us(lambda i: launcher.operands(*sets[i % len(sets)]), calls)
    row["ctypes_known_us"] = per_call_us(
        lambda i: launcher.run(launcher.plan, *prepared[i % len(prepared)][0], stream), calls
    )
    steps = launcher.step_times_us(prepared[0][0], reps)
    torch.cuda.synchronize()
    row["steps_us"] = steps
    row["init_each_call_host_us"] = (
        row["python_us"] + steps["can_implement"] + steps["initialize_and_launch"]
    )
    return row


def bf16_row(key: GemmKey, calls: int) -> dict[str, Any]:
    twin = bf16_twin(key)
    base = registry.baseline(twin.op, twin)
    runner = base.build(twin, base.baseline_params)
    sets = samples.input_sets(twin, "cuda", seed=1)
    return {"source": base.name, **eager_and_graph(timing.on_sets(runner, sets), calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["qwen-o", "llama-qkv"], choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[256])
    # back-to-back calls: few enough that the launch queue does not fill and make the host wait
    # for the GPU (then a host figure reads the GPU's time)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    faulthandler.enable()  # a crash in the library shows where it happened
    keys = [
        (f"{name} M={m}", gemm_key(m, *SHAPES[name], layout="nt", dtype="int4-g128"))
        for name in args.shapes
        for m in args.m
    ]
    specs = [w4.kernel_spec(k, p) for _, k in keys for p in w4.shortlist(k)]
    compiled = cutlass_env.compile_all(specs)
    errors = {s: e for s, e in compiled.items() if e is not None}
    if errors:
        raise RuntimeError(f"kernels did not compile: {errors}")
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": "cutlass_w4a16_host", "device": fp.name,
                              "versions": fp.versions, "calls": args.calls, "reps": args.reps,
                              "rows": []}  # fmt: skip
    for label, key in keys:
        bf16 = bf16_row(key, args.calls)
        print(f"{label}: bf16 {bf16['event_us']:.1f} us (host {bf16['host_us']:.1f}, GPU "
              f"{bf16['gpu_us']:.1f})", flush=True)  # fmt: skip
        configs = []
        for params in w4.shortlist(key):
            try:
                r = int4_row(key, params, args.calls, args.reps)
            except Exception as e:  # one config's failure leaves the others' figures
                configs.append({"params": params, "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"  {json.dumps(params)}: {configs[-1]['error']}", flush=True)
                continue
            configs.append(r)
            steps = " ".join(f"{k} {v:.1f}" for k, v in r["steps_us"].items())
            print(f"  {json.dumps(params)}: {r['event_us']:.1f} us (host {r['host_us']:.1f}, "
                  f"GPU {r['gpu_us']:.1f}; python {r['python_us']:.1f}, ctypes known "
                  f"{r['ctypes_known_us']:.1f}; C++ {steps}; init each call "
                  f"{r['init_each_call_host_us']:.1f})", flush=True)  # fmt: skip
        timed = [r["event_us"] for r in configs if "event_us" in r]
        best = bf16["event_us"] / min(timed) if timed else None
        result["rows"].append({"label": label, "key": str(key), "bf16": bf16, "int4": configs,
                               "best_vs_bf16": best})  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))  # each row as it ends


if __name__ == "__main__":
    main()

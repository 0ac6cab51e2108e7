"""INT4 (W4A16, group 128) past decode: Triton and CUTLASS configs beside bf16 cuBLAS.

    python bench/w4a16_prefill.py --out $OUT/w4a16_prefill.json [--m 256 2048] [--sweep]

Per projection (the low-bit suite's eight: qkv, o, gate_up, down of Llama-3-8B and Qwen2.5-7B)
and M, every config the tuner shortlists (``triton_w4a16``: ``w4a16.configs``; ``cutlass_w4a16``:
``shortlist``), and with ``--sweep`` the wider grid below, each built as its source builds it:

- its GPU time alone (``timing.graph_time`` over the key's rotating input sets) and its eager time
  (``timing.measure_sets``), one config after another, and its error against the float32
  reference (``samples.relative_error``, <= 1 passes);
- then the fastest few by either time, torch's bf16 call on the same shape (bf16 cuBLAS) and the
  fastest shortlisted config taken in turn (``runner.in_turn``: three eager rounds, one of CUDA
  graphs), as the low-bit suite's ``retime`` judges a row past decode.

Every CUTLASS kernel compiles (``cutlass_env.compile_all``) while the Triton kernels compile in
their worker processes (``launch.warm``); the JSON is rewritten after every row, narrow
projections first.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from tuner.candidates import cutlass_env, registry
from tuner.candidates import cutlass_w4a16 as cw
from tuner.candidates.base import Params
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.launch import warm
from tuner.core.device import fingerprint
from tuner.core.keys import DTYPES, GemmKey
from tuner.measure import samples, timing
from tuner.suites.lowbit import bf16_twin, problems
from tuner.suites.runner import Timed, in_turn

FORMAT = "int4-g128"
# Triton tiled tiles swept (bm activation rows, bn weight rows, warps, stages, dots, step_sum)
# at K splits 1, 2, 4, and stream-K tiles (bm, bn, warps, stages, programs per SM), which take
# M <= bm only
SWEEP_TILED = ((128, 64, 4, 3, 1, False), (64, 64, 4, 3, 1, False), (64, 64, 4, 4, 1, False),
               (256, 64, 8, 2, 1, False), (128, 64, 8, 3, 1, False), (256, 128, 8, 2, 1, False),
               (128, 64, 8, 2, 2, False), (64, 64, 4, 2, 2, True), (128, 64, 4, 2, 2, True),
               (64, 128, 8, 3, 2, True))  # fmt: skip
SWEEP_SPLITS = (1, 2, 4)
SWEEP_STREAM = ((256, 64, 8, 2, 1), (256, 128, 8, 2, 1))
# CUTLASS mixed-input kernels the generator lists beside the shortlists' (tile, cluster, kernel,
# scheduler)
SWEEP_CUTLASS = (((64, 128), (2, 1), "ws", "default"), ((128, 128), (2, 1), "pingpong", "default"),
                 ((64, 256), (2, 1), "ws", "default"), ((64, 128), (1, 2), "pingpong", "default"),
                 ((128, 256), (2, 1), "coop", "default"), ((256, 128), (2, 1), "coop", "default"),
                 ((128, 128), (1, 2), "coop", "streamk"))  # fmt: skip
SIDE_BY_SIDE = 3  # the fastest configs by GPU time and by eager time that are timed in turn
NARROW_FIRST = ("qkv", "o", "down", "gate_up")


def sweep_triton(key: GemmKey, sms: int) -> list[Params]:
    out: list[Params] = []
    for bm, bn, warps, stages, dots, step_sum in SWEEP_TILED:
        for split in SWEEP_SPLITS:
            if key.k % (w4a16.CHUNK * dots * split) == 0:
                config = {"kernel": "tiled", "bm": bm, "bn": bn, "bk": w4a16.CHUNK, "dots": dots,
                          "split_k": split, "group_m": 8, "warps": warps, "stages": stages}  # fmt: skip
                out.append({**config, "step_sum": True} if step_sum else config)
    for bm, bn, warps, stages, per_sm in SWEEP_STREAM:
        units = triton.cdiv(key.n, bn) * (key.k // w4a16.CHUNK)
        if key.m <= bm:
            out.append({"kernel": "stream_k", "bm": bm, "bn": bn, "bk": w4a16.CHUNK, "dots": 1,
                        "programs": min(units, per_sm * sms), "warps": warps, "stages": stages})  # fmt: skip
    return out


def sweep_cutlass() -> list[Params]:
    return [cw._p(*tile, cluster, kernel, scheduler) for tile, cluster, kernel, scheduler in
            SWEEP_CUTLASS]  # fmt: skip


def configs_of(key: GemmKey, sweep: bool, sms: int) -> list[tuple[str, Params, bool]]:
    """(source, params, shortlisted) of every config to time for ``key``, without repeats."""
    shortlisted = [("triton_w4a16", p) for p in w4a16.configs(key.m, key.n, key.k, key.group)]
    shortlisted += [("cutlass_w4a16", p) for p in cw.shortlist(key)]
    extra = [("triton_w4a16", p) for p in sweep_triton(key, sms)] if sweep else []
    extra += [("cutlass_w4a16", p) for p in sweep_cutlass()] if sweep else []
    out: list[tuple[str, Params, bool]] = []
    seen: set[str] = set()
    for i, (source, params) in enumerate(shortlisted + extra):
        name = f"{source}:{json.dumps(params, sort_keys=True)}"
        if name not in seen:
            seen.add(name)
            out.append((source, params, i < len(shortlisted)))
    return out


def compile_everything(todo: dict[GemmKey, list[tuple[str, Params, bool]]]) -> dict[str, Any]:
    """CUTLASS libraries (a thread driving nvcc processes) and Triton kernels (worker processes),
    at the same time; what failed to compile, by spec."""
    specs = [cw.kernel_spec(key, p) for key, cs in todo.items() for s, p, _ in cs
             if s == "cutlass_w4a16"]  # fmt: skip
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}

    def cutlass() -> None:
        t0 = time.perf_counter()
        for spec, error in cutlass_env.compile_all(specs).items():
            if error is not None:
                errors[str(spec)] = error[:300]
        seconds["cutlass"] = time.perf_counter() - t0

    thread = threading.Thread(target=cutlass)
    thread.start()
    jobs = []
    for key, cs in todo.items():
        for source, params, _ in cs:
            if source == "triton_w4a16":
                try:
                    plan = w4a16.checked_plan(key.m, key.n, key.k, key.group, params)
                except ValueError as e:
                    errors[json.dumps(params)] = str(e)
                    continue
                jobs += plan.jobs(DTYPES[key.dtype], key.align)
    report = warm(jobs)
    seconds["triton"] = report.seconds
    thread.join()
    print(f"compiled: CUTLASS {len(set(specs))} in {seconds.get('cutlass', 0):.0f} s, Triton "
          f"{report.compiled} of {report.requested} in {report.seconds:.0f} s; errors "
          f"{len(errors) + len(report.errors)}", flush=True)  # fmt: skip
    return {"seconds": seconds, "errors": errors, "triton_errors": report.errors[:10]}


def time_config(
    key: GemmKey, source: str, params: Params, sets: list[tuple[Any, ...]], ref: Any
) -> tuple[dict[str, Any], Callable[..., Any] | None]:
    """One config's row (times, error) and its runner (None if it failed)."""
    row: dict[str, Any] = {"source": source, "params": params}
    try:
        runner = registry.get(source).build(key, params)
        out = samples.output_like(key, sets[0])
        runner(*sets[0], out=out)
        row["error"] = samples.relative_error(out, ref)
        row["gpu_us"] = timing.graph_time(timing.on_sets(runner, sets)).median_us
        eager = timing.measure_sets(runner, sets, device="cuda", budget_s=0.05)
        row["eager_us"], row["host_us"] = eager.median_us, eager.host_us
    except Exception as e:  # one config's failure is a finding, not the end of the sweep
        torch.cuda.synchronize()
        row["failed"] = f"{type(e).__name__}: {e}"[:400]
        return row, None
    return row, runner


def bench_key(label: str, key: GemmKey, todo: list[tuple[str, Params, bool]]) -> dict[str, Any]:
    sets = samples.input_sets(key, "cuda", seed=1)
    ref = samples.reference(key, sets[0])
    twin = bf16_twin(key)
    rows, runners = [], {}
    for source, params, shortlisted in todo:
        row, runner = time_config(key, source, params, sets, ref)
        row["shortlisted"] = shortlisted
        rows.append(row)
        if runner is not None and row["error"] <= 1:
            runners[len(rows) - 1] = runner
        print(f"  {source:14s} {json.dumps(params, sort_keys=True)[:150]:150s} "
              + (f"GPU {row['gpu_us']:7.1f} eager {row['eager_us']:7.1f} host "
                 f"{row['host_us']:5.1f} err {row['error']:.2f}" if "gpu_us" in row
                 else row["failed"][:120]), flush=True)  # fmt: skip
    del ref
    good = list(runners)
    picked: list[int] = []
    for column in ("gpu_us", "eager_us"):
        picked += sorted(good, key=lambda i: rows[i][column])[:SIDE_BY_SIDE]
    listed = [i for i in good if rows[i]["shortlisted"]]
    if listed:
        picked.append(min(listed, key=lambda i: rows[i]["eager_us"]))
    timed: dict[str, Timed] = {f"int4_{i}": (runners[i], sets) for i in dict.fromkeys(picked)}
    base = registry.baseline(twin.op, twin)  # torch's bf16 call: cuBLAS
    timed["bf16"] = (
        base.build(twin, base.baseline_params),
        samples.input_sets(twin, "cuda", seed=1),
    )
    eager = in_turn(timed, "cuda", graph=False, rounds=3, budget_s=0.05)
    graph = in_turn(timed, "cuda", graph=True, rounds=1)
    turns = {name: {"eager_us": eager[name], "gpu_us": graph[name]} for name in timed}
    for name, t in turns.items():
        if name.startswith("int4_"):
            t["vs_bf16_eager"] = eager["bf16"] / t["eager_us"]
            t["vs_bf16_gpu"] = graph["bf16"] / t["gpu_us"]
            rows[int(name[5:])]["in_turn"] = t
    result = {"label": label, "key": str(key), "m": key.m, "n": key.n, "k": key.k,
              "bf16": turns["bf16"], "configs": rows}  # fmt: skip
    for scope, pool in (("best_shortlisted", listed), ("best", good)):
        turned = [i for i in pool if "in_turn" in rows[i]]
        if turned:
            i = min(turned, key=lambda i: rows[i]["in_turn"]["eager_us"])
            result[scope] = {"source": rows[i]["source"], "params": rows[i]["params"],
                             **rows[i]["in_turn"]}  # fmt: skip
    bs = result.get("best_shortlisted", {})
    print(f"{label}: bf16 eager {eager['bf16']:.1f} GPU {graph['bf16']:.1f}; best shortlisted "
          f"{bs.get('source')} eager {bs.get('vs_bf16_eager', 0):.3f}x GPU "
          f"{bs.get('vs_bf16_gpu', 0):.3f}x", flush=True)  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--ops", nargs="+", default=list(NARROW_FIRST), choices=NARROW_FIRST)
    ap.add_argument("--sweep", action="store_true", help="also the bench's wider config grid")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    keys = [(label, key) for m in args.m for op in args.ops
            for label, key in problems([FORMAT], [m], [op])]  # fmt: skip
    todo = {key: configs_of(key, args.sweep, sms) for _, key in keys}
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": "w4a16_prefill", "device": fp.name,
                              "versions": fp.versions, "sweep": args.sweep, "rows": []}  # fmt: skip
    t0 = time.perf_counter()
    result["compile"] = compile_everything(todo)
    for label, key in keys:
        print(f"{label} ({len(todo[key])} configs)", flush=True)
        result["rows"].append(bench_key(label, key, todo[key]))
        result["seconds"] = round(time.perf_counter() - t0, 1)
        Path(args.out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

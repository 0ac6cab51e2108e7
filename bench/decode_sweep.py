"""Where split-KV decode time goes on small-batch shapes: CUDA-graph replay, GPU time only.

    python bench/decode_sweep.py --out results/decode_sweep.json
    ncu --clock-control none -k regex:'_read_kv|_decode' python bench/decode_sweep.py --profile

Per shape (the decode shapes of ``tuner bench sdpa`` that read >= 32 MB of K/V and missed 80% of
copy bandwidth), side by side in one process:

- **floor**: the best of a small grid of a pure streaming read of the same K and V bytes (sum per
  program): what any one-pass kernel can reach at this size, launch and ramp included;
- **copy**: ``torch.Tensor.copy_`` of K and V (reads and writes the bytes: twice the traffic);
- **torch**: torch's default SDPA;
- **triton_decode**: a config grid by total programs (128..1024), warps per program, bn and
  stages, with programmatic dependent launch (pdl), every point with its time, the best first;
- **parts**: the best two-pass configs' pass 1 alone and pass 2 alone;
- **back to back**: torch and the best config of each kind also timed without the fence.

All times are per call in a CUDA graph (``timing.graph_time``) rotating over input sets larger
than the L2, each call after a one-element torch kernel without PDL whose own time is subtracted
(the timer's fence: a PDL kernel's launch overlaps a foreign kernel's end, as in a model, not its
own previous call); % of copy uses the 2 GiB copy bandwidth of ``tuner.suites.runner``.
``--profile`` launches the best floor and a few decode configs of the first shape a few times
eagerly, for Nsight Compute to read their counters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates import registry
from tuner.candidates.triton_attention import output_for
from tuner.candidates.triton_decode import DecodeKernels
from tuner.core.device import fingerprint
from tuner.core.keys import SdpaKey
from tuner.measure import samples, timing
from tuner.measure.timing import copy_bandwidth_gbs

SHAPES = {  # label -> (batch, q_len, kv_len); 32 q heads, 8 kv heads, head dim 128, bf16
    "q1 b1 kv8k": (1, 1, 8192),
    "q4 b1 kv8k": (1, 4, 8192),
    "q1 b8 kv1k": (8, 1, 1024),
    "q4 b8 kv1k": (8, 4, 1024),
}
PROGRAMS = (128, 256, 512, 1024)  # pass-1 programs (splits x batch x kv heads) in the grid
FLOOR_GRID = [(1024, 4, 8), *itertools.product((2048, 4096, 8192), (1,), (4, 8, 16))]


@triton.jit
def _read_kv(K, V, Sums, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        acc += tl.load(K + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Sums + pid, tl.sum(acc, 0))


def read_runner(block: int, iters: int, warps: int) -> Any:
    """A runner with the SDPA runners' call shape that only streams K and V."""
    sums: dict[int, torch.Tensor] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any = None) -> Any:
        n = k.numel()
        grid = triton.cdiv(n, block * iters)
        s = sums.setdefault(grid, torch.empty(grid, device=k.device, dtype=torch.float32))
        _read_kv[(grid,)](k, v, s, n, BLOCK=block, ITERS=iters, num_warps=warps)
        return out

    return run


def copy_runner() -> Any:
    dst: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any = None) -> Any:
        dk, dv = dst.setdefault(k.shape, (torch.empty_like(k), torch.empty_like(v)))
        dk.copy_(k)
        dv.copy_(v)
        return out

    return run


def decode_grid(key: SdpaKey) -> list[dict[str, Any]]:
    """PDL two-pass configs by warps per program (fewer warps, more programs per SM), tile width,
    stages and total programs; and two configs without PDL as the reference."""
    n_kv = key.batch * key.kv_heads
    out = []
    for bn, warps, stages, pdl in [
        *itertools.product((32, 64, 128), (1, 2, 4), (2, 3), (True,)),
        (128, 4, 3, False),
        (64, 4, 3, False),
    ]:
        tiles = triton.cdiv(key.kv_len, bn)
        for splits in sorted({max(1, p // n_kv) for p in PROGRAMS if p // n_kv <= tiles}):
            out.append({"bn": bn, "splits": splits, "warps": warps, "stages": stages,
                        "fused": False, "pdl": pdl})  # fmt: skip
    return out


def parts_us(key: SdpaKey, params: dict[str, Any], sets: list) -> dict[str, float]:
    """Pass 1 alone and pass 2 alone of a two-pass config (graph time each)."""
    kernels = DecodeKernels(key, params)
    outs = [output_for(key, s[0]) for s in sets]
    n = len(sets)
    device = outs[0].device

    def split(i: int) -> None:  # the scratch of the stream being captured (one per stream)
        kernels.split(*sets[i % n], outs[i % n], *kernels.work.get(device))

    def merge(i: int) -> None:
        kernels.merge(outs[i % n], kernels.work.get(device)[0])

    return {
        "split_us": timing.graph_time(split).median_us,
        "merge_us": timing.graph_time(merge).median_us,
    }


def back_to_back_us(runner: Any, sets: list) -> float:
    """Graph time of ``runner`` called back to back, without the fence ``graph_us`` puts between
    calls: a PDL kernel's launch then also hides behind its own previous call."""
    return timing.graph_time(timing.on_sets(runner, sets), fenced=False).median_us


def graph_us(runner: Any, sets: list) -> float:
    """Fenced graph time per call of ``runner`` over ``sets`` (``timing.graph_time``)."""
    return timing.graph_time(timing.on_sets(runner, sets)).median_us


def pick_kinds(timed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best point of each (warps, pdl) kind."""
    out = []
    for kind in itertools.product((1, 2, 4), (False, True)):
        same = [p for p in timed if (p["params"]["warps"], p["params"]["pdl"]) == kind]
        out += [dict(p) for p in same[:1]]
    return out


def shape_key(batch: int, q_len: int, kv_len: int) -> SdpaKey:
    causal = "bottom_right" if q_len > 1 else "none"
    return SdpaKey(batch=batch, q_heads=32, kv_heads=8, q_len=q_len, kv_len=kv_len,
                   head_dim=128, causal=causal, dtype="bf16")  # fmt: skip


def precompile_grid(keys: list[SdpaKey]) -> float:
    """The grid's kernels into Triton's disk cache, in parallel (``Source.precompile``)."""
    started = time.perf_counter()
    decode = registry.get("triton_decode")
    for key in keys:
        decode.precompile(key, decode_grid(key))
    return time.perf_counter() - started


def sweep_shape(label: str, key: SdpaKey, copy: float, deadline: float) -> dict[str, Any]:
    sets = samples.input_sets(key, "cuda", seed=0)

    def pct(us: float) -> float:
        return 100 * key.kv_bytes / us / 1e3 / copy

    row: dict[str, Any] = {"label": label, "key": str(key), "kv_bytes": key.kv_bytes}
    floor = []
    for block, iters, warps in FLOOR_GRID:
        us = graph_us(read_runner(block, iters, warps), sets)
        floor.append(
            {"block": block, "iters": iters, "warps": warps, "us": us, "pct_copy": pct(us)}
        )
    floor.sort(key=lambda r: r["us"])
    row["floor"], row["floor_grid"] = floor[0], floor
    row["copy_us"] = graph_us(copy_runner(), sets)
    base = registry.baseline("sdpa")
    row["torch_us"] = graph_us(base.build(key, base.baseline_params), sets)
    row["torch_pct_copy"] = pct(row["torch_us"])
    decode = registry.get("triton_decode")
    points = []
    for params in decode_grid(key):
        if time.monotonic() > deadline:
            row["cut_short"] = True
            break
        try:
            us = graph_us(decode.build(key, params), sets)
        except Exception as e:  # reported with the point, the sweep goes on
            points.append({"params": params, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        points.append({"params": params, "us": us, "pct_copy": pct(us)})
    points.sort(key=lambda p: p.get("us", float("inf")))
    row["triton"] = points
    best = points[0] if points and "us" in points[0] else None
    timed = [p for p in points if "us" in p]
    two_pass = [p for p in timed if DecodeKernels(key, p["params"]).plan.two_pass][:3]
    row["parts"] = [{"params": p["params"], "us": p["us"], **parts_us(key, p["params"], sets)}
                    for p in two_pass]  # fmt: skip
    picked = [{"params": "torch", "us": row["torch_us"]}, *pick_kinds(timed)]
    for p in picked:
        runner = base.build(key, base.baseline_params) if p["params"] == "torch" else None
        p["back_to_back_us"] = back_to_back_us(runner or decode.build(key, p["params"]), sets)
    row["back_to_back"] = picked
    print(
        f"{label:14} floor {floor[0]['us']:6.1f} us ({floor[0]['pct_copy']:3.0f}%)  "
        f"copy {row['copy_us']:6.1f} us  torch {row['torch_us']:6.1f} us "
        f"({row['torch_pct_copy']:3.0f}%)  triton best "
        + (f"{best['us']:6.1f} us ({best['pct_copy']:3.0f}%) {best['params']}" if best else "-"),
        flush=True,
    )
    for p in row["parts"]:
        print(f"    parts {p['params']}: {p['us']:.1f} = split {p['split_us']:.1f} + merge "
              f"{p['merge_us']:.1f} us alone", flush=True)  # fmt: skip
    for p in row["back_to_back"]:
        print(f"    {p['params']}: {p['us']:.1f} us fenced, {p['back_to_back_us']:.1f} back to back",
              flush=True)  # fmt: skip
    return row


def profile(key: SdpaKey) -> None:
    """Each kernel of interest twice (the second launch is the direct one), synchronised."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = samples.make_inputs(key, "cuda", gen)
    n_kv = key.batch * key.kv_heads
    configs = [
        {"bn": 128, "splits": 128 // n_kv, "warps": 4, "stages": 3},
        {"bn": 64, "splits": 512 // n_kv, "warps": 1, "stages": 3},
    ]
    runners = [read_runner(4096, 1, 8)] + [
        registry.get("triton_decode").build(key, c) for c in configs
    ]
    for run in runners:
        for _ in range(2):
            run(q, k, v)
            torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="labels, comma-separated")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--workers", type=int, default=14, help="parallel Triton compiles")
    ap.add_argument(
        "--profile", action="store_true", help="launch a few kernels for ncu, no timing"
    )
    args = ap.parse_args()
    if args.profile:
        profile(shape_key(*SHAPES[args.shapes.split(",")[0]]))
        return
    deadline = time.monotonic() + args.time_limit
    copy = copy_bandwidth_gbs("cuda")
    fp = fingerprint("cuda")
    result: dict[str, Any] = {
        "benchmark": "decode_sweep", "device": fp.name, "versions": fp.versions,
        "copy_gbs": copy, "rows": [],
    }  # fmt: skip
    keys = {label: shape_key(*SHAPES[label]) for label in args.shapes.split(",")}
    os.environ["TUNER_COMPILE_WORKERS"] = str(args.workers)  # read when the compile pool starts
    result["compile_s"] = precompile_grid(list(keys.values()))
    for label, key in keys.items():
        result["rows"].append(sweep_shape(label, key, copy, deadline))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

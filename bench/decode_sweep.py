"""Where split-KV decode time goes on small-batch shapes: CUDA-graph replay, GPU time only.

    python bench/decode_sweep.py --out results/decode_sweep.json

Per shape (the decode shapes of ``tuner bench sdpa`` that read >= 32 MB of K/V and missed 80% of
copy bandwidth in session 2), side by side in one process:

- **floor**: the best of a small grid of a pure streaming read of the same K and V bytes (sum per
  program): what any one-pass kernel can reach at this size, launch and ramp included;
- **copy**: ``torch.Tensor.copy_`` of K and V (reads and writes the bytes: twice the traffic);
- **torch**: torch's default SDPA;
- **triton_decode**: a wider config grid than the tuner searches (bn, warps, stages, splits,
  fused merge), every point with its time, the best first.

All times are per call in a CUDA graph of 16 calls rotating over input sets larger than the L2
(``tuner.sdpa_bench.graph_us``); % of copy uses the 2 GiB copy bandwidth of ``tuner.suite``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import torch
import triton
import triton.language as tl

from tuner import bench, problems
from tuner.candidates import registry
from tuner.device import fingerprint
from tuner.keys import SdpaKey
from tuner.sdpa_bench import compile_groups, graph_us
from tuner.suite import copy_bandwidth_gbs

SHAPES = {  # label -> (batch, q_len, kv_len); 32 q heads, 8 kv heads, head dim 128, bf16
    "q1 b1 kv8k": (1, 1, 8192),
    "q4 b1 kv8k": (1, 4, 8192),
    "q1 b8 kv1k": (8, 1, 1024),
    "q1 b1 kv32k": (1, 1, 32768),
}


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
    out = []
    for bn, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
        tiles = triton.cdiv(key.kv_len, bn)
        for splits in sorted({s for s in (4, 8, 16, 33, 66, 132, 264) if s <= tiles}):
            for fused in (False, True) if splits > 1 else (False,):
                out.append(
                    {"bn": bn, "splits": splits, "warps": warps, "stages": stages, "fused": fused}
                )
    return out


def shape_key(batch: int, q_len: int, kv_len: int) -> SdpaKey:
    causal = "bottom_right" if q_len > 1 else "none"
    return SdpaKey(batch=batch, q_heads=32, kv_heads=8, q_len=q_len, kv_len=kv_len,
                   head_dim=128, causal=causal, dtype="bf16")  # fmt: skip


def precompile_grid(keys: list[SdpaKey], workers: int) -> float:
    """The grid's kernels into Triton's disk cache, in parallel (one group per kernel)."""
    decode = registry.get("triton_decode")
    target = f"{type(decode).__module__}:{type(decode).__qualname__}"
    groups: dict[tuple, list[tuple[str, str, dict[str, Any]]]] = {}
    for key in keys:
        for params in decode_grid(key):
            groups.setdefault(decode.kernel_id(key, params), []).append((target, str(key), params))
    return compile_groups(list(groups.values()), workers)


def sweep_shape(label: str, key: SdpaKey, copy: float, deadline: float) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [
        problems.make_inputs(key, "cuda", gen)
        for _ in range(bench.rotation_sets(problems.bytes_per_set(key), "cuda"))
    ]

    def pct(us: float) -> float:
        return 100 * key.kv_bytes / us / 1e3 / copy

    row: dict[str, Any] = {"label": label, "key": str(key), "kv_bytes": key.kv_bytes}
    floor = []
    for block, iters, warps in itertools.product((1024, 4096), (1, 4, 16), (4, 8)):
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
    print(
        f"{label:14} floor {floor[0]['us']:6.1f} us ({floor[0]['pct_copy']:3.0f}%)  "
        f"copy {row['copy_us']:6.1f} us  torch {row['torch_us']:6.1f} us "
        f"({row['torch_pct_copy']:3.0f}%)  triton best "
        + (f"{best['us']:6.1f} us ({best['pct_copy']:3.0f}%) {best['params']}" if best else "-"),
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="labels, comma-separated")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--workers", type=int, default=14, help="parallel Triton compiles")
    args = ap.parse_args()
    deadline = time.monotonic() + args.time_limit
    copy = copy_bandwidth_gbs("cuda")
    fp = fingerprint("cuda")
    result: dict[str, Any] = {
        "benchmark": "decode_sweep", "device": fp.name, "versions": fp.versions,
        "copy_gbs": copy, "rows": [],
    }  # fmt: skip
    keys = {label: shape_key(*SHAPES[label]) for label in args.shapes.split(",")}
    result["compile_s"] = precompile_grid(list(keys.values()), args.workers)
    for label, key in keys.items():
        result["rows"].append(sweep_shape(label, key, copy, deadline))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

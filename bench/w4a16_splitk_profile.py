"""Where a CUTLASS W4A16 call's GPU time goes when its stream-K kernel splits K: the kernel itself,
the workspace memset before it, and the rest, under each decomposition of the scheduler.

    python bench/w4a16_splitk_profile.py --out $OUT/w4a16_splitk_profile.json [--m 256] [--ops qkv o]

Per projection and M (the low-bit suite's keys): the 128 x 256 (2, 1) cooperative stream-K
kernel under each schedule of ``SCHEDULES`` and the shortlist's configs beside it, each timed
as a CUDA graph (``timing.graph_time``, as the prefill bench times them) and then run CALLS
times under torch.profiler: device time per call of every kernel a call launches (CUTLASS's
kernel, the workspace memset), so that a split's extra cost shows as kernel time or as the work
around it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.config_sweep import NARROW_FIRST, keys_of
from tuner.candidates import cutlass_w4a16 as cw
from tuner.candidates import registry
from tuner.candidates.base import Params
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import samples, timing

FORMAT = "int4-g128"
CALLS = 50
SCHEDULES = (
    {"decomposition": "dataparallel"},
    *({"decomposition": "splitk", "splits": s} for s in (2, 3, 4)),
    {"decomposition": "streamk"},
)


def configs(key: GemmKey) -> list[Params]:
    stream_k = cw._p(128, 256, (2, 1), "coop", "streamk")
    return [*cw.shortlist(key), *({**stream_k, **s} for s in SCHEDULES)]


def profiled(key: GemmKey, params: Params, sets: list[tuple[Any, ...]]) -> dict[str, Any]:
    """One config's graph time and its per-call device time by kernel."""
    runner = registry.get("cutlass_w4a16").build(key, params)
    fn = timing.on_sets(runner, sets)
    row: dict[str, Any] = {"params": params, "gpu_us": timing.graph_time(fn).median_us}
    for i in range(10):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            fn(i)
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for item in prof.key_averages():
        if item.self_device_time_total > 0:
            name = "cutlass" if "cutlass" in item.key else item.key[:60]
            kernels[name] += item.self_device_time_total / CALLS
            launches[name] += item.count
    row["device_us_per_call"] = dict(kernels)
    row["launches_per_call"] = {k: v / CALLS for k, v in launches.items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=[256])
    ap.add_argument("--ops", nargs="+", default=["qkv", "o"], choices=NARROW_FIRST)
    args = ap.parse_args()
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": "w4a16_splitk_profile", "device": fp.name,
                              "versions": fp.versions, "calls": CALLS, "rows": []}  # fmt: skip
    for label, key in keys_of(FORMAT, args.m, args.ops):
        sets = samples.input_sets(key, "cuda", seed=1)
        rows = [profiled(key, p, sets) for p in configs(key)]
        for row in rows:
            print(f"{label} {json.dumps(row)}", flush=True)
        result["rows"].append({"label": label, "key": str(key), "configs": rows})
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

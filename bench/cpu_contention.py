"""Benchmark: what busy compile processes do to the eager time of the calls a tuning run times.

    python bench/cpu_contention.py --out bench/results/cpu_contention_h100.json

A tuning run times candidates while its compile pool builds later problems' kernels at a lower
priority. This times the same eager calls (a host-bound small bf16 GEMM and an FP8 rowwise
``_scaled_mm`` whose GPU time is near its host time) three ways, interleaved over rounds: on an
idle host; beside one niced busy process per CPU on every CPU; and beside the same processes kept
off the core ``compile_pool.compile_cpus`` spares for timing. Each figure is the median per-call
time of a round of back-to-back calls ended by a synchronize; contention comes in bursts, so the
worst pass of each condition is kept beside the median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from bench.dispatch_overhead import per_call_us
from tuner.quant.fp8 import quantize_rowwise
from tuner.tuning import compile_pool

BUSY_BYTES = 16 << 20  # each busy process copies a buffer this size: cache and memory traffic


def _busy(spare: bool) -> None:
    os.nice(compile_pool.COMPILE_NICENESS)
    if spare and (allowed := compile_pool.compile_cpus(os.sched_getaffinity(0))):
        os.sched_setaffinity(0, allowed)
    buf = bytearray(BUSY_BYTES)
    while True:
        buf = bytearray(bytes(buf))


class Busy:
    """One niced busy process per CPU while inside; ``spare``: kept off the timing core."""

    def __init__(self, spare: bool) -> None:
        self.spare, self.procs = spare, []

    def __enter__(self) -> Busy:
        ctx = mp.get_context("fork")  # the children touch no CUDA: fork is safe and quick
        self.procs = [ctx.Process(target=_busy, args=(self.spare,), daemon=True)
                      for _ in range(os.cpu_count() or 1)]  # fmt: skip
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.join()


def calls() -> dict[str, Callable[[], object]]:
    """The timed eager calls: a host-bound bf16 GEMM and Qwen2.5-7B qkv in FP8 at M = 2048."""
    small_a = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    small_b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 3584, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4608, 3584, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize_rowwise(x)
    wq, sw = quantize_rowwise(w)
    return {
        "mm_bf16_16x1024x1024": lambda: torch.mm(small_a, small_b),
        "scaled_mm_rowwise_qwen_qkv_m2048": lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=8, help="interleaved passes of the three")
    args = parser.parse_args()

    conditions = {"idle": None, "busy_everywhere": False, "busy_off_timing_core": True}
    samples: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for condition, spare in conditions.items():
            for name, fn in calls().items():
                if spare is None:
                    us = per_call_us(fn, args.calls, args.rounds, torch.cuda.synchronize)
                else:
                    with Busy(spare):
                        us = per_call_us(fn, args.calls, args.rounds, torch.cuda.synchronize)
                samples.setdefault(name, {}).setdefault(condition, []).append(us)
    rows = []
    for name, by_condition in samples.items():
        idle = statistics.median(by_condition["idle"])
        row = {"call": name}
        for condition, us in by_condition.items():
            med = statistics.median(us)
            row[condition] = {"us_per_call": round(med, 2), "vs_idle": round(med / idle, 3),
                              "worst_vs_idle": round(max(us) / idle, 3),
                              "samples": [round(u, 2) for u in us]}  # fmt: skip
        rows.append(row)
        for stat in ("us_per_call", "vs_idle", "worst_vs_idle"):
            print(f"{name} {stat}", {c: row[c][stat] for c in conditions}, flush=True)
    spared = compile_pool.compile_cpus(os.sched_getaffinity(0))
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "cpus": os.cpu_count(), "timing_core": sorted(set(os.sched_getaffinity(0)) - (spared or set())),
        "busy_bytes": BUSY_BYTES, "calls": args.calls, "rounds": args.rounds, "rows": rows,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

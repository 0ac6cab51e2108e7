"""Benchmark: the idle time between the kernels of a CUDA graph, per capture of one and the same step.

    python bench/graph_gaps.py --out $OUT/graph_gaps.json

Two captures of one FP8 decoder step (``quantized_decoder --twins``) run the same kernels for
the same kernel time, yet one replays faster than the other: the difference lies between the
kernels. This benchmark asks which graphs show it, on steps far smaller than a layer: chains of
small elementwise kernels, alone or with a GEMM after every ``--between`` of them, the GEMM
in bf16 (``torch.mm``: cuBLAS) or FP8 (``torch._scaled_mm``, rowwise or tensorwise scales:
cuBLASLt, on an x quantized once beforehand: the layer's quantization kernel is left out).
Each chain is captured ``--captures`` times, each capture into its own memory pool, one after
another; then every capture of every chain is replayed in balanced rounds
(``timing.round_order``). Per capture: time a step (the graph replayed as timed, unprofiled),
its GPU work under torch.profiler (``quantized_decoder.kernel_times``: kernel time, and the
profiler's own idle time within a step and between steps), and the timed step less the
profiled kernel time, a gap: an estimate that mixes the two regimes (tracing spaces the
launches out).

JSON (device, versions, per chain and capture: step, kernel and idle time, the profiled
timeline). GPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.dropin_decoder import capture, run_header, save_json, step_us
from bench.quantized_decoder import kernel_times
from tuner.measure import timing

CHAINS = ("elementwise", "bf16", "fp8-rowwise", "fp8-tensorwise")


def chain(kind: str, args: argparse.Namespace) -> Callable[[], torch.Tensor]:
    """A step of ``args.gemms`` groups of ``args.between`` elementwise kernels on a
    ``[m, k]`` bf16 row block, each group followed by a ``[m, k] x [k, n]`` GEMM of ``kind``
    (none for ``elementwise``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = args.m, args.k, args.n
    x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    if kind == "elementwise":
        gemm = None
    elif kind == "bf16":
        gemm = lambda h: h @ w.t()  # noqa: E731
    else:
        xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        if kind == "fp8-rowwise":
            sa = torch.ones((m, 1), device="cuda")
            sb = torch.ones((1, n), device="cuda")
        else:
            sa = sb = torch.ones((), device="cuda")
        gemm = lambda h: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16)  # noqa: E731

    def step() -> torch.Tensor:
        h, out = x, x
        for _ in range(args.gemms):
            for _ in range(args.between):
                h = h * 1.0
            if gemm is not None:
                out = gemm(h)
        return out

    return step


def idle(row: dict[str, Any], kernels: int) -> dict[str, Any]:
    """A capture's timed step less its profiled kernel time: idle time a step and a gap
    (``kernels`` gaps a step, the one before the step's first kernel included; none where the
    profiler gave no sequence of the step, ``kernels`` 0)."""
    idle_us = row["step_us"] - row["kernel_us"]
    return {"idle_us": idle_us, "idle_per_gap_us": idle_us / kernels if kernels else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file.")
    parser.add_argument("--chains", nargs="+", choices=CHAINS, default=list(CHAINS))
    parser.add_argument("--captures", type=int, default=3, help="Captures of each chain.")
    parser.add_argument("--gemms", type=int, default=4, help="GEMMs (groups) a step.")
    parser.add_argument("--between", type=int, default=10, help="Elementwise kernels a group.")
    parser.add_argument("--m", type=int, default=1, help="Rows of x (tokens).")
    parser.add_argument("--k", type=int, default=4096, help="x's columns, the GEMM's K.")
    parser.add_argument("--n", type=int, default=4096, help="The GEMM's output columns.")
    parser.add_argument("--iters", type=int, default=50, help="Replays per timed round.")
    parser.add_argument(
        "--rounds", type=int, help="Rounds (default: one cycle of the balanced order)."
    )
    args = parser.parse_args(argv)
    for name in ("captures", "gemms", "iters", "m", "k", "n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: {getattr(args, name)}; at least 1")
    fp8 = [c for c in args.chains if c.startswith("fp8")]
    if fp8 and (args.k % 16 or args.n % 16):
        parser.error(f"--k {args.k}, --n {args.n}: {fp8[0]} takes multiples of 16 (_scaled_mm)")
    args.smoke = False
    if args.rounds is None:
        args.rounds = timing.order_cycle(len(args.chains) * args.captures)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_gaps.py: needs a CUDA GPU")
    started = time.perf_counter()
    result = run_header("graph_gaps", args, "cuda", {})
    graphs: dict[tuple[str, int], Callable[[], Any]] = {}
    steps = {kind: chain(kind, args) for kind in args.chains}  # held: the graphs read their tensors
    with torch.no_grad():
        for kind, step in steps.items():
            for i in range(args.captures):
                graphs[(kind, i)] = capture(step).replay
        times: dict[tuple[str, int], list[float]] = {key: [] for key in graphs}
        for r in range(args.rounds):
            for key in timing.round_order(list(graphs), r):
                times[key].append(step_us(graphs[key], args.iters))
        rows = []
        for (kind, i), replay in graphs.items():
            profiled = kernel_times(replay)
            row = {"chain": kind, "capture": i, "step_us": statistics.median(times[(kind, i)]),
                   "step_us_all": times[(kind, i)], "kernel_us": profiled["total_us"],
                   "profiled": profiled}  # fmt: skip
            row.update(idle(row, len(profiled.get("timeline", []))))
            rows.append(row)
            per_gap = row["idle_per_gap_us"] or float("nan")
            print(f"{kind:<15} capture {i}: step {row['step_us']:7.2f} us, kernels "
                  f"{row['kernel_us']:7.2f}, idle {row['idle_us']:6.2f} ({per_gap:.3f} a gap; "
                  f"profiled: {profiled.get('gaps_us', float('nan')):.2f} within a step)",
                  flush=True)  # fmt: skip
    result["rows"] = rows
    result["complete"] = True
    save_json(args.out, result, started)
    return result


if __name__ == "__main__":
    main()

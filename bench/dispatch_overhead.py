"""Benchmark: CPU overhead of the dispatcher's hit path over calling the winning runner directly.

    python bench/dispatch_overhead.py --out bench/results/dispatch_overhead_cpu.json

Both loops make the same calls on the same small tensors (so the kernel is cheap and the host
cost shows); each figure is the best of several interleaved rounds of N calls, per call (medians are
kept too). On the GPU the
calls are eager launches and the loops end with a synchronize. Target: <= 5 us per call.

Beside ``tuner.matmul``: ``tuner.sdpa`` (bf16 on a GPU, causal), ``tuner.scaled_mm`` (FP8 rowwise) and ``tuner.int4_linear`` (torch's
packed INT4, group 128), each against the runner it resolved to. On a CPU their runners are
torch's CPU ops, whose time grows fast with the shape (FP8 takes milliseconds at 1 x 128 x 256),
so their shapes are small.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tuner.core.keys import GemmKey
from tuner.quant import fp8, int4, int4_torch
from tuner.serving.dispatcher import Dispatcher
from tuner.tuning.engine import current_device

SHAPES = [(1, 64, 64), (8, 128, 128)]
SDPA_SHAPE = (1, 8, 16, 64)  # (batch, heads, seq, head_dim): a decode-sized call
FP8_SHAPE = (1, 16, 16)  # (M, N, K)
INT4_SHAPE = (1, 128, 256)


def per_call_us(
    fn: Callable[[], object], calls: int, rounds: int, sync: Callable[[], None]
) -> float:
    for _ in range(100):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def timed_row(
    key: str,
    served_by: str,
    dispatch: Callable[[], Any],
    direct: Callable[[], Any],
    args: argparse.Namespace,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """``dispatch`` against ``direct`` (the same call to the resolved runner), their loops
    interleaved so drift and other load hit both; each side keeps its best round (the
    least-disturbed one: the code path is deterministic, noise only adds)."""
    dispatch()  # resolve once: what follows is the hit path
    d, w = [], []
    for _ in range(args.rounds):
        d.append(per_call_us(dispatch, args.calls, 1, sync))
        w.append(per_call_us(direct, args.calls, 1, sync))
    row = {"key": key, "served_by": served_by, "dispatch_us": min(d), "direct_us": min(w),
           "dispatch_median_us": statistics.median(d), "direct_median_us": statistics.median(w)}  # fmt: skip
    row["overhead_us"] = row["dispatch_us"] - row["direct_us"]
    print(f"{key}: dispatch {row['dispatch_us']:.2f} us, direct {row['direct_us']:.2f} us, "
          f"overhead {row['overhead_us']:.2f} us per call")  # fmt: skip
    return row


def gemm_rows(dispatcher: Dispatcher, device: str, args, sync) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        key = str(GemmKey.from_tensors(a, b))
        run = dispatcher.gemm_runner(a, b)  # resolves the key: its choice is known after
        rows.append(timed_row(key, dispatcher.choices[key], lambda a=a, b=b: dispatcher.matmul(a, b),
                              lambda a=a, b=b, r=run: r(a, b), args, sync))  # fmt: skip
    return rows


def sdpa_rows(dispatcher: Dispatcher, device: str, args, sync) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, h, s, d = SDPA_SHAPE
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    run, res = dispatcher.resolve_sdpa(q, k, v, causal=True)
    return [timed_row(f"sdpa {res.key}", res.candidate,
                      lambda: dispatcher.sdpa(q, k, v, causal=True),
                      lambda: run(q, k, v), args, sync)]  # fmt: skip


def lowbit_rows(dispatcher: Dispatcher, device: str, args, sync) -> list[dict[str, Any]]:
    m, n, k = FP8_SHAPE
    a8, scale_a = fp8.quantize_rowwise(torch.randn(m, k, device=device))
    w8, scale_w = fp8.quantize_rowwise(torch.randn(n, k, device=device))
    fp8_args = (a8, w8.t(), scale_a, scale_w.t())
    run, res = dispatcher.resolve_scaled_mm(*fp8_args, torch.bfloat16)
    rows = [timed_row(f"scaled_mm {res.key}", res.candidate,
                      lambda: dispatcher.scaled_mm(*fp8_args, out_dtype=torch.bfloat16),
                      lambda: run(*fp8_args), args, sync)]  # fmt: skip
    m, n, k = INT4_SHAPE
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    q, scales_and_zeros = int4.quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16), 128)
    packed = int4_torch.torch_pack(q)
    run, res = dispatcher.resolve_int4(x, packed, scales_and_zeros, 128)
    rows.append(timed_row(f"int4_linear {res.key}", res.candidate,
                          lambda: dispatcher.int4_linear(x, packed, scales_and_zeros, 128),
                          lambda: run(x, packed, scales_and_zeros), args, sync))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    device = current_device()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        dispatcher = Dispatcher(Path(tmp) / "c.db", mode="lookup")
        rows = [
            row
            for make_rows in (gemm_rows, sdpa_rows, lowbit_rows)
            for row in make_rows(dispatcher, device, args, sync)
        ]
    from tuner.core.device import fingerprint

    result = {
        "benchmark": "dispatch_overhead",
        "device": fingerprint(device).to_dict(),
        "target_us": 5.0,
        "rows": rows,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

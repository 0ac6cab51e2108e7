"""CPU micro-benchmark: host time per call of ``F.linear`` and SDPA with ``tuner.torch`` on vs off.

    python bench/memo_overhead.py --out bench/results/memo_overhead_cpu.json

Small CPU tensors (the call itself is cheap, so the routing shows); no winner is stored, so every
call is served by torch: what is left is the cost of routing a repeat call (``tuner.serving.call_memo``).
Off and on alternate over rounds; the minimum per variant is reported (the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tuner.torch as tt
from tuner.core.device import fingerprint
from tuner.serving.dispatcher import Dispatcher


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 32, 64), torch.randn(1, 2, 32, 64)
    x, w = torch.randn(1, 64), torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    cases = {
        "linear": lambda: F.linear(x, w),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    samples: dict[str, dict[str, list[float]]] = {c: {"off": [], "on": []} for c in cases}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        disp = Dispatcher(Path(tmp) / "c.db")
        for _ in range(args.rounds):
            for case, fn in cases.items():
                samples[case]["off"].append(per_call_us(fn, args.calls))
                with tt.enabled(dispatcher=disp):
                    fn()  # resolves and memoises the call
                    samples[case]["on"].append(per_call_us(fn, args.calls))
    fp = fingerprint("cpu")
    rows = {}
    for case, s in samples.items():
        off, on = min(s["off"]), min(s["on"])
        rows[case] = {"off_us": off, "on_us": on, "over_us": on - off, "samples_us": s}
        print(f"{case:7} off {off:.2f} us  on {on:.2f} us  routing {on - off:.2f} us")
    result = {"benchmark": "memo_overhead", "device": fp.name, "versions": fp.versions,
              "calls": args.calls, "rounds": args.rounds, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

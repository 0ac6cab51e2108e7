"""The FP8 library sources beside ``torch._scaled_mm`` on Llama-3-8B projections.

Each key is tuned with the cuBLASLt and CUTLASS FP8 sources only (CUDA-graph GPU times, every
candidate timed to the end, nothing pruned; CUTLASS kernels not yet built are compiled first);
per key the JSON (rewritten after each key) holds torch's median, each source's best median
with its params, the sources that declined and why, and the winner.

    python3 bench/fp8_libs_bench.py --out fp8_libs.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from tuner.core.keys import GemmKey, lowbit_fields
from tuner.tuning.engine import TuneOptions, tune

SHAPES = {"qkv decode": (16, 6144, 4096), "down prefill": (2048, 4096, 14336)}
SPECS = ("fp8-tensorwise", "fp8-rowwise")
SOURCES = ("cublaslt_fp8", "cutlass_fp8")


def row(name: str, key: GemmKey, budget_s: float) -> dict:
    options = TuneOptions(
        sources=list(SOURCES), budget_s=budget_s, launch="graph", cut_factor=1e9, prune=False
    )
    outcome = tune(key, options=options, device="cuda")
    best: dict[str, dict] = {}
    timed = [m for m in outcome.measurements if m.source in SOURCES and m.status == "ok"]
    for m in sorted(timed, key=lambda m: m.median_us or math.inf, reverse=True):
        best[m.source] = {"us": round(m.median_us, 2), "params": m.params}
    declined = {
        m.source: m.error
        for m in outcome.measurements
        if m.source in SOURCES and m.status in ("unsupported", "failed")
    }
    w = outcome.winner
    return {
        "shape": name, "key": str(key), "label": key.label,
        "torch_us": round(w.baseline_us, 2), "best": best, "declined": declined,
        "winner": w.source, "winner_us": round(w.median_us, 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=0.2, help="timing budget per candidate")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "launch": "graph", "rows": []}  # fmt: skip
    for spec in SPECS:
        for name, (m, n, k) in SHAPES.items():
            r = row(name, GemmKey(m=m, n=n, k=k, **lowbit_fields(spec)), args.budget)
            result["rows"].append(r)
            mine = ", ".join(f"{s} {b['us']}" for s, b in r["best"].items())
            print(f"{r['label']}: torch {r['torch_us']} us; {mine}; winner {r['winner']}")
            with open(args.out, "w") as f:  # after every row: a call cut short keeps them
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Whether the cublas source's runner is captured in a CUDA graph, and what repeated captures
cost in GPU memory (each ``timing.graph_time`` captures two graphs, on its thread's side stream)."""

from __future__ import annotations

import argparse
import json

import torch

from tuner.candidates.registry import get
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--captures", type=int, default=50)
    args = parser.parse_args()
    key = GemmKey(m=256, n=4096, k=4096)
    a = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for name in ("cublas", "cublaslt", "torch"):
        run = get(name).build(key, get(name).candidates(key, "cuda")[0])
        err = (run(a, b).float() - (a @ b).float()).abs().max().item()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        call = timing.on_sets(run, [(a, b)])
        times = [timing.graph_time(call).median_us for _ in range(args.captures)]
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        rows[name] = {"max_abs_err_vs_torch": err, "graph_us_median": sorted(times)[len(times) // 2],
                      "captures": args.captures,
                      "device_memory_taken_mib": (free_before - free_after) / 2**20}  # fmt: skip
        print(name, rows[name])
    out = {"device": fingerprint().to_dict(), "key": str(key), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

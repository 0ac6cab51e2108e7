"""Where an eager low-bit call's host time goes, beside torch's: per row, torch's op for the format,
each source's first shortlisted config and torch's bf16 call on the same shape, each timed alone
(GPU time in a CUDA graph, eager time, host time per call), then cProfile over ``--calls`` eager
calls of each but the bf16 one.

    python bench/host_profile.py --format int4-g128 --m 256 --ops o --calls 200 \\
        --out $OUT/host_profile.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.config_sweep import compile_everything, keys_of, profile_host, time_config
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.device import fingerprint
from tuner.measure import samples
from tuner.suites.lowbit import FORMATS, bf16_twin

SOURCES = {  # (CUTLASS source, Triton source, the rest) of each kind of format
    "int4": ("cutlass_w4a16", "triton_w4a16", ("cuda_w4a16", "dequant_gemm")),
    "fp8": ("cutlass_fp8", "triton_fp8", ("cublaslt_fp8",)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--m", type=int, nargs="+", default=[256])
    ap.add_argument("--ops", nargs="+", default=["o"])
    ap.add_argument("--calls", type=int, default=200, help="eager calls per cProfile")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cutlass, triton, rest = SOURCES[args.format.split("-")[0]]
    keys = keys_of(args.format, args.m, args.ops)
    todo = {}
    for _, key in keys:
        todo[key] = []
        for name in (cutlass, triton, *rest):  # those not loaded here are left out
            if not isinstance(registry.all_sources().get(name), Source):
                continue
            source = registry.get(name)
            if source.unavailable("cuda") or source.unsupported(key):
                continue
            shortlist = source.candidates(key, "cuda")
            if shortlist:
                todo[key].append((name, shortlist[0], True))
    fp = fingerprint("cuda")
    result = {"benchmark": "host_profile", "device": fp.name, "versions": fp.versions,
              "compile_s": compile_everything(todo, cutlass=cutlass, triton=triton), "rows": []}  # fmt: skip
    for label, key in keys:
        sets = samples.input_sets(key, "cuda", seed=1)
        ref = samples.reference(key, sets[0])
        base = registry.baseline(key.op, key)
        twin = bf16_twin(key)
        bf16 = registry.baseline(twin.op, twin)
        timed = [time_config(key, s, p, sets, ref)[0]
                 for s, p, _ in [(base.name, base.baseline_params, True), *todo[key]]]  # fmt: skip
        twin_sets = samples.input_sets(twin, "cuda", seed=1)
        bf16_row = time_config(twin, bf16.name, bf16.baseline_params, twin_sets,
                               samples.reference(twin, twin_sets[0]))[0]  # fmt: skip
        for row in [*timed, bf16_row]:
            times = (f"GPU {row['gpu_us']:6.1f} eager {row['eager_us']:6.1f} host "
                     f"{row['host_us']:5.1f}" if "gpu_us" in row else row["failed"][:100])  # fmt: skip
            print(f"{label}: {row['source']:14s} {times}", flush=True)
        profiles = profile_host(key, todo[key], args.calls)
        result["rows"].append({"label": label, "key": str(key), "configs": timed,
                               "bf16": bf16_row, "profiles": profiles})  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The stream-K ws kernel (``cutlass_w4a16`` kernel ``ws_streamk``) by cluster and by grid size,
beside the ws kernel it is built from, on the INT4 suite's projections.

    python bench/w4a16_streamk.py --out $OUT/w4a16_streamk.json [--m 256] [--ops qkv o]
        [--sms 132 96 66]

Per projection and M: the shortlist's ws kernel, then ``ws_streamk`` on each cluster of
``STREAM_K_CLUSTERS`` with its grid filling each ``--sms`` count of SMs (default: all of them,
and about half), by GPU time alone (``timing.graph_time`` over the key's rotating input sets),
with its error against the float32 reference. A kernel that runs no faster on every SM than on
half of them is held back by what its CTAs share (x's reads from L2), not by its SMs.
``--shares``: the share-outs each ``ws_streamk`` config is timed with (default: every one of
``stream_k_share.SHARES``); ``cost:H,O,E`` is the cost model at those weights (helper, owner,
store).
``--profile``: each config instead only runs a few eager calls (for Nsight Compute).
``--library NAME=PATH``: also the library at PATH (another build of the stream-K kernel, e.g.
with one change to its header) as config NAME, at ``--library-cluster`` (C x 1, default 2).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.config_sweep import keys_of
from tuner.candidates import cutlass_env, stream_k_share
from tuner.candidates import cutlass_w4a16 as cw
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import samples, timing

FORMAT = "int4-g128"
DEVICE = torch.device("cuda", 0)


def configs() -> list[cw.Params]:
    ws = next(p for p in cw.MEDIUM if p["kernel"] == "ws")
    streamk = next(p for p in cw.MEDIUM if p["kernel"] == "ws_streamk")
    return [ws, *({**streamk, "cluster": c} for c in cw.STREAM_K_CLUSTERS)]


PROFILED_CALLS = 2
Runs = Callable[[stream_k_share.Layout], list[int]]


def share_of(name: str) -> Runs:
    """``--shares``' NAME: a name of ``stream_k_share.SHARES`` or ``cost:H,O,E``; ValueError
    naming what is allowed."""
    if name.startswith("cost:"):
        try:
            weights = stream_k_share.Weights(*(float(w) for w in name[5:].split(",")))
        except (TypeError, ValueError):
            weights = None
        if weights is None or min(weights) < 0:
            raise ValueError(f"--shares {name!r}: cost:H,O,E takes three weights >= 0")
        return functools.partial(stream_k_share.by_cost, weights=weights)
    if name not in stream_k_share.SHARES:
        raise ValueError(f"--shares {name!r}: allowed: {list(stream_k_share.SHARES)} or cost:H,O,E")
    return stream_k_share.SHARES[name]


def time_one(
    key: GemmKey,
    params: cw.Params,
    sms: int,
    sets: list[Any],
    ref: Any,
    profile: bool,
    library: Path | None = None,
    runs: Runs | None = None,
) -> dict:
    library = library or cw.CutlassW4A16().load(cw.kernel_spec(key, params))
    run = cw.W4A16Launcher(library, key, cw.launch_options(params), DEVICE,
                           sms=sms, runs=runs)  # fmt: skip
    out = samples.output_like(key, sets[0])
    run(*sets[0], out=out)
    if profile:
        for i in range(PROFILED_CALLS):
            run(*sets[i % len(sets)])
        torch.cuda.synchronize()
        return {"params": params, "sms": sms, "error": samples.relative_error(out, ref),
                "gpu_us": float("nan"), "p10_us": float("nan"), "p90_us": float("nan")}  # fmt: skip
    gpu = timing.graph_time(timing.on_sets(run, sets))
    return {"params": params, "sms": sms, "error": samples.relative_error(out, ref),
            "gpu_us": gpu.median_us, "p10_us": gpu.p10_us, "p90_us": gpu.p90_us}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    parser.add_argument("--m", type=int, nargs="+", default=[256], help="rows of x (default: 256)")
    parser.add_argument("--ops", nargs="+", default=["qkv", "o", "down", "gate_up"],
                        help="the projections (default: all four)")  # fmt: skip
    parser.add_argument("--sms", type=int, nargs="+", help="SM counts to fill (default: all, half)")
    parser.add_argument("--profile", action="store_true", help="only a few eager calls a config")
    parser.add_argument("--library", nargs="*", default=[], metavar="NAME=PATH",
                        help="a library built apart, timed as config NAME")  # fmt: skip
    parser.add_argument("--library-cluster", type=int, default=2,
                        choices=[c for c, _ in cw.STREAM_K_CLUSTERS],
                        help="the cluster (C x 1) the --library builds have (default: 2)")  # fmt: skip
    parser.add_argument("--shares", nargs="+", default=list(stream_k_share.SHARES),
                        help="share-outs of ws_streamk: names or cost:H,O,E")  # fmt: skip
    args = parser.parse_args()
    try:
        shares = {name: share_of(name) for name in args.shares}
    except ValueError as e:
        parser.error(str(e))
    every = torch.cuda.get_device_properties(0).multi_processor_count
    sms_counts = args.sms or [every, every // 2]
    keys = keys_of(FORMAT, args.m, args.ops)
    todo = [(key, p) for _, key in keys for p in configs()]
    compiled = cutlass_env.compile_all(list(dict.fromkeys(cw.kernel_spec(k, p) for k, p in todo)))
    failed = {str(s): e for s, e in compiled.items() if e}
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": "w4a16_streamk", "device": fp.name,
                              "versions": fp.versions, "compile_failures": failed, "rows": []}  # fmt: skip
    for label, key in keys:
        sets = samples.input_sets(key, "cuda", seed=1)
        ref = samples.reference(key, sets[0])
        row: dict[str, Any] = {"label": label, "key": str(key), "configs": []}
        streamk = {**configs()[1], "cluster": [args.library_cluster, 1]}
        todo = [
            (params, share, None)
            for params in configs()
            for share in (args.shares if params["kernel"] == "ws_streamk" else [None])
        ]
        todo += [(streamk, None, item) for item in args.library]  # fmt: skip
        for params, share, library in todo:
            streamk_sms = sms_counts if params["kernel"] == "ws_streamk" else [every]
            name, path = library.split("=", 1) if library else (params["kernel"], None)
            for sms in streamk_sms:
                runs = shares[share] if share else None
                timed = time_one(key, params, sms, sets, ref, args.profile,
                                 Path(path) if path else None, runs)  # fmt: skip
                shared_out = share or params.get("share")
                row["configs"].append({**timed, "share": shared_out, "library": library and name})
                print(
                    f"{label:34s} {name:10s} {shared_out or '':14s} cluster {params['cluster']} sms "
                    f"{sms:3d} GPU {timed['gpu_us']:7.2f} us err {timed['error']:.2f}",
                    flush=True,
                )
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

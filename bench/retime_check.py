"""A suite row's winner against torch's op again, in many ways, when its side-by-side retime
disagrees with its tuning (a winner that tuned faster and retimed slower).

    python bench/retime_check.py --suite-json bench/results/gemm_lowbit_...json.xz \
        --label "Qwen2.5-7B o M=2048 fp8-tensorwise" --out retime_check.json

For each row: the suite's own retime (``lowbit.retime``: torch's op, the winner and the two bf16
runners in turn) a few times over, then the two low-bit runners in turn round by round (eager),
each alone (eager time, host time per call, GPU time in a CUDA graph), in turn again after those
warm calls, and in turn on one input set (pointers that never move); with ``--sustained S``, the
in-turn rounds time stretches of S seconds of calls back to back, as the engine's duels of
GPU-bound calls do. With ``--timeline``, first
of all (so the process has run neither), the winner, torch's op and the winner again, each built
anew and called back to back for a second (``--timeline-s``): the time a call in batches of ten,
against the time since the first call (whether a fresh runner is slow at first, and for how
long; over seconds, a compute-bound call's time once the GPU runs at its power limit).
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import time
from typing import Any

import torch

from bench.lowbit_kernels import header
from tuner.core.keys import parse_key
from tuner.measure import samples, timing
from tuner.measure.records import candidate_params
from tuner.suites.lowbit import bf16_twin, retime
from tuner.suites.runner import built, in_turn_rounds
from tuner.tuning.engine import TuneOptions

ROUNDS = 8
RETIMES = 3
BUDGET_S = 0.04
TIMELINE_S = 1.0
TIMELINE_BATCH = 10  # calls between two syncs
TIMELINE_BUCKET_MS = 100  # the printed summary: the median batch of each bucket


def rounds(runners: dict[str, Any], sustained_s: float = 0.0) -> dict[str, list[float]]:
    """Each round's eager time of each runner, timed in turn as the suite's retime does (in
    ``timing.round_order``); ``sustained_s``: over stretches of calls back to back, as the
    engine's duels of GPU-bound calls, after an untimed round that brings the GPU to its power
    limit."""
    times = in_turn_rounds(runners, "cuda", graph=False, rounds=ROUNDS, budget_s=BUDGET_S,
                           warmup_rounds=1 if sustained_s else 0, sustained_s=sustained_s)  # fmt: skip
    return {name: [round(t.median_us, 2) for t in ts] for name, ts in times.items()}


def alone(runner: Any, sets: list[tuple[Any, ...]]) -> dict[str, float]:
    t = timing.measure_sets(runner, sets, device="cuda", budget_s=0.2)
    graph = timing.graph_time(timing.on_sets(runner, sets))
    return {"eager_us": t.median_us, "host_us": t.host_us, "gpu_us": graph.median_us}


def timeline(
    runner: Any, sets: list[tuple[Any, ...]], seconds: float = TIMELINE_S
) -> list[tuple[float, float]]:
    """(ms since the first call, us a call) of each batch of ``runner``'s calls, back to back
    for ``seconds``."""
    fn = timing.on_sets(runner, sets)
    torch.cuda.synchronize()
    start = last = time.perf_counter()
    batches, i = [], 0
    while last - start < seconds:
        for _ in range(TIMELINE_BATCH):
            fn(i)
            i += 1
        torch.cuda.synchronize()
        now = time.perf_counter()
        batches.append(
            (round((now - start) * 1e3, 2), round((now - last) * 1e6 / TIMELINE_BATCH, 2))
        )
        last = now
    return batches


def timelines(row: dict[str, Any], seconds: float) -> dict[str, list[tuple[float, float]]]:
    """The winner, torch's op and the winner again, each built anew, on a timeline."""
    key = parse_key(row["key"])
    sets = samples.input_sets(key, "cuda", seed=1)
    out = {}
    for name in ("winner", "baseline", "winner_again"):
        base, win = built(key, row["source"], candidate_params(row["candidate"]))
        out[name] = timeline(base if name == "baseline" else win, sets, seconds)
        buckets: dict[int, list[float]] = {}
        for ms, us in out[name]:
            buckets.setdefault(int(ms // TIMELINE_BUCKET_MS), []).append(us)
        print(f"{row['label']:<42} timeline {name:<12} us a call per {TIMELINE_BUCKET_MS} ms: "
              f"{[round(statistics.median(v), 1) for _, v in sorted(buckets.items())]}")  # fmt: skip
    return out


def check(
    row: dict[str, Any], timeline_s: float | None = None, sustained_s: float = 0.0
) -> dict[str, Any]:
    key = parse_key(row["key"])
    lines = timelines(row, timeline_s) if timeline_s else None
    copy_gbs = timing.copy_bandwidth_gbs("cuda")
    suite = []
    for _ in range(RETIMES):
        again = {n: v for n, v in row.items() if not n.startswith(("eager_", "graph_"))}
        retime(again, key, bf16_twin(key), copy_gbs, TuneOptions())
        mode = "graph_" if row["timing"] == "graph" else "eager_"  # what the suite judged
        suite.append({n: round(v, 2) for n, v in again.items()
                      if n.startswith(mode) and isinstance(v, float)})  # fmt: skip
        print(f"{row['label']:<42} suite retime     {suite[-1]}")
    sets = samples.input_sets(key, "cuda", seed=1)
    base, win = built(key, row["source"], candidate_params(row["candidate"]))
    runners = {"baseline": (base, sets), "winner": (win, sets)}
    first = rounds(runners, sustained_s)
    solo = {name: alone(r, sets) for name, (r, _) in runners.items()}
    again = rounds(runners, sustained_s)
    one_set = rounds({"baseline": (base, sets[:1]), "winner": (win, sets[:1])}, sustained_s)
    result = {
        "label": row["label"], "key": row["key"], "candidate": row["candidate"],
        "sets": len(sets), "sustained_s": sustained_s, "suite": {n: row.get(n) for n in (
            "baseline_us", "winner_us", "eager_baseline_us", "eager_winner_us")},
        "suite_retimes": suite, "in_turn_first": first, "alone": solo, "in_turn_again": again,
        "in_turn_one_set": one_set,
    }  # fmt: skip
    if lines is not None:
        result["timeline"] = lines
    for name in ("in_turn_first", "in_turn_again", "in_turn_one_set"):
        med = {n: statistics.median(ts) for n, ts in result[name].items()}
        result[name + "_ratio"] = round(med["baseline"] / med["winner"], 3)
        print(f"{row['label']:<42} {name:<16} torch {med['baseline']:7.1f} us  "
              f"winner {med['winner']:7.1f} us  ratio {result[name + '_ratio']:.3f}")  # fmt: skip
    for n, s in solo.items():
        print(f"{row['label']:<42} alone {n:<9} eager {s['eager_us']:7.1f}  host "
              f"{s['host_us']:6.1f}  gpu {s['gpu_us']:7.1f} us")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite-json", required=True,
                        help="a `tuner bench gemm` result JSON (or .json.xz)")  # fmt: skip
    parser.add_argument("--label", action="append", required=True, help="a row's label")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--timeline", action="store_true",
                        help="first, each runner built anew and called back to back for a second")  # fmt: skip
    parser.add_argument("--timeline-s", type=float, default=TIMELINE_S,
                        help="seconds of each runner's timeline (with --timeline)")  # fmt: skip
    parser.add_argument("--sustained", type=float, default=0.0,
                        help="seconds of each in-turn round's stretch of calls back to back "
                        "(the engine's duels of GPU-bound calls); 0: short rounds")  # fmt: skip
    args = parser.parse_args()
    if args.timeline_s <= 0:
        parser.error(f"--timeline-s {args.timeline_s}: must be > 0")
    if args.sustained < 0:
        parser.error(f"--sustained {args.sustained}: must be >= 0")
    opener = lzma.open if args.suite_json.endswith(".xz") else open  # results are kept as .xz
    with opener(args.suite_json, "rt") as f:
        rows = {r["label"]: r for r in json.load(f)["rows"]}
    missing = [label for label in args.label if label not in rows]
    if missing:
        parser.error(f"--label {missing}: not rows of {args.suite_json}")
    served_by_torch = [label for label in args.label if rows[label]["source"] == "torch_lowbit"]
    if served_by_torch:
        parser.error(f"--label {served_by_torch}: torch's op is the winner, nothing to compare")
    out = header(timing.copy_bandwidth_gbs("cuda"), benchmark="retime_check")
    timeline_s = args.timeline_s if args.timeline else None
    out["rows"] = [check(rows[label], timeline_s, args.sustained) for label in args.label]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

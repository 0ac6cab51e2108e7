"""What the low-bit prefill benches (``w4a16_prefill``, ``fp8_prefill``) share: every config of a
projection timed alone, then the fastest few beside torch's bf16 call taken in turn, as the
low-bit suite's ``retime`` judges a row past decode.

A config's row: its GPU time alone (``timing.graph_time`` over the key's rotating input sets), its
eager time (``timing.measure_sets``) and its error against the float32 reference
(``samples.relative_error``, <= 1 passes). In turn (``runner.in_turn``, eager rounds and CUDA-graph
rounds): the ``SIDE_BY_SIDE`` fastest by either time, the fastest shortlisted config of each
source, torch's bf16 call on the same shape (bf16 cuBLAS) and, where given, torch's own op for
the format (the baseline a challenger must beat in the tuner's duel).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tuner.candidates import registry
from tuner.candidates.base import Params
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure import samples, timing
from tuner.suites.lowbit import bf16_twin, problems
from tuner.suites.runner import Timed, in_turn

SIDE_BY_SIDE = 3  # the fastest configs by GPU time and by eager time that are timed in turn
EAGER_ROUNDS = 4
GRAPH_ROUNDS = 2
NARROW_FIRST = ("qkv", "o", "down", "gate_up")  # the projections, in the order they are run

Todo = list[tuple[str, Params, bool]]  # (source, params, shortlisted)


def arguments(description: str, default_m: list[int]) -> argparse.ArgumentParser:
    """The options both prefill benches take: --out, --m, --ops, --sweep."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, nargs="+", default=default_m)
    ap.add_argument("--ops", nargs="+", default=list(NARROW_FIRST), choices=NARROW_FIRST)
    ap.add_argument("--sweep", action="store_true", help="also the bench's wider config grid")
    return ap


def keys_of(fmt: str, ms: Sequence[int], ops: Sequence[str]) -> list[tuple[str, GemmKey]]:
    """The low-bit suite's (label, key) of format ``fmt`` at each M, projection by projection."""
    return [(label, key) for m in ms for op in ops for label, key in problems([fmt], [m], [op])]


def unique(shortlisted: Sequence[tuple[str, Params]], extra: Sequence[tuple[str, Params]]) -> Todo:
    """The shortlisted configs, then the extra ones, each once."""
    out: Todo = []
    seen: set[str] = set()
    for i, (source, params) in enumerate([*shortlisted, *extra]):
        name = f"{source}:{json.dumps(params, sort_keys=True)}"
        if name not in seen:
            seen.add(name)
            out.append((source, params, i < len(shortlisted)))
    return out


def compile_everything(todo: dict[GemmKey, Todo], cutlass: str, triton: str) -> dict[str, float]:
    """The ``cutlass`` source's kernels (one pool for the run, a thread driving nvcc processes)
    and the ``triton`` source's (worker processes, key by key) at the same time; seconds each
    took. A config that fails to compile fails again, with its error, when it is built."""
    seconds: dict[str, float] = {}

    def run(source: str) -> None:
        t0 = time.perf_counter()
        lists = [(key, [p for s, p, _ in cs if s == source]) for key, cs in todo.items()]
        registry.get(source).precompile_run([(k, ps) for k, ps in lists if ps], lambda _i: None)
        seconds[source] = round(time.perf_counter() - t0, 1)

    thread = threading.Thread(target=run, args=(cutlass,))
    thread.start()
    run(triton)
    thread.join()
    print(f"compiled: {seconds}", flush=True)
    return seconds


def time_config(
    key: GemmKey, source: str, params: Params, sets: list[tuple[Any, ...]], ref: Any
) -> tuple[dict[str, Any], Callable[..., Any] | None]:
    """One config's row (times, error) and its runner (None if it failed)."""
    row: dict[str, Any] = {"source": source, "params": params}
    try:
        runner = registry.get(source).build(key, params)
        out = samples.output_like(key, sets[0])
        runner(*sets[0], out=out)
        row["error"] = samples.relative_error(out, ref)
        row["gpu_us"] = timing.graph_time(timing.on_sets(runner, sets)).median_us
        eager = timing.measure_sets(runner, sets, device="cuda", budget_s=0.05)
        row["eager_us"], row["host_us"] = eager.median_us, eager.host_us
    except Exception as e:  # one config's failure is a finding, not the end of the sweep
        row["failed"] = f"{type(e).__name__}: {e}"[:400]
        torch.cuda.synchronize()  # a sticky CUDA error raises here: then the sweep cannot go on
        return row, None
    return row, runner


def bench_key(label: str, key: GemmKey, todo: Todo, *, with_torch: bool) -> dict[str, Any]:
    """``key``'s configs timed alone, then the fastest beside bf16 cuBLAS in turn; with
    ``with_torch`` torch's op for the format first (row 0, ratios ``vs_torch_*``)."""
    sets = samples.input_sets(key, "cuda", seed=1)
    ref = samples.reference(key, sets[0])
    base = registry.baseline(key.op, key)
    first = [(base.name, base.baseline_params, True)] if with_torch else []
    rows: list[dict[str, Any]] = []
    runners: dict[int, Callable[..., Any]] = {}
    for source, params, shortlisted in [*first, *todo]:
        row, runner = time_config(key, source, params, sets, ref)
        row["shortlisted"] = shortlisted
        rows.append(row)
        if runner is not None and row["error"] <= 1:
            runners[len(rows) - 1] = runner
        print(f"  {source:14s} {json.dumps(params, sort_keys=True)[:140]:140s} "
              + (f"GPU {row['gpu_us']:7.1f} eager {row['eager_us']:7.1f} host "
                 f"{row['host_us']:5.1f} err {row['error']:.2f}" if "gpu_us" in row
                 else row["failed"][:120]), flush=True)  # fmt: skip
    del ref
    good = [i for i in runners if i >= len(first)]
    picked = [0] if with_torch and 0 in runners else []
    for column in ("gpu_us", "eager_us"):
        picked += sorted(good, key=lambda i: rows[i][column])[:SIDE_BY_SIDE]
    listed = [i for i in good if rows[i]["shortlisted"]]
    for source in dict.fromkeys(rows[i]["source"] for i in listed):
        picked.append(min((i for i in listed if rows[i]["source"] == source),
                          key=lambda i: rows[i]["eager_us"]))  # fmt: skip
    timed: dict[str, Timed] = {f"config_{i}": (runners[i], sets) for i in dict.fromkeys(picked)}
    twin = bf16_twin(key)
    bf16 = registry.baseline(twin.op, twin)  # torch's bf16 call: cuBLAS
    timed["bf16"] = (
        bf16.build(twin, bf16.baseline_params),
        samples.input_sets(twin, "cuda", seed=1),
    )
    eager = in_turn(timed, "cuda", graph=False, rounds=EAGER_ROUNDS, budget_s=0.05)
    graph = in_turn(timed, "cuda", graph=True, rounds=GRAPH_ROUNDS)
    torch_name = "config_0" if with_torch and "config_0" in timed else None
    for name in timed:
        if name.startswith("config_"):
            turn = {"eager_us": eager[name], "gpu_us": graph[name],
                    "vs_bf16_eager": eager["bf16"] / eager[name],
                    "vs_bf16_gpu": graph["bf16"] / graph[name]}  # fmt: skip
            if torch_name:
                turn["vs_torch_eager"] = eager[torch_name] / eager[name]
                turn["vs_torch_gpu"] = graph[torch_name] / graph[name]
            rows[int(name.removeprefix("config_"))]["in_turn"] = turn
    result = {"label": label, "key": str(key), "m": key.m, "n": key.n, "k": key.k,
              "bf16": {"eager_us": eager["bf16"], "gpu_us": graph["bf16"]}, "configs": rows}  # fmt: skip
    for scope, pool in (("best_shortlisted", listed), ("best", good)):
        turned = [i for i in pool if "in_turn" in rows[i]]
        if turned:
            i = min(turned, key=lambda i: rows[i]["in_turn"]["eager_us"])
            result[scope] = {"source": rows[i]["source"], "params": rows[i]["params"],
                             **rows[i]["in_turn"]}  # fmt: skip
    best = result.get("best", {})
    print(f"{label}: bf16 eager {eager['bf16']:.1f} GPU {graph['bf16']:.1f}; best "
          f"{best.get('source')} eager {best.get('eager_us', 0):.1f} "
          f"({best.get('vs_bf16_eager', 0):.3f}x bf16, GPU {best.get('vs_bf16_gpu', 0):.3f}x)"
          + (f", {best.get('vs_torch_eager', 0):.3f}x torch" if torch_name else ""), flush=True)  # fmt: skip
    return result


def profile_host(key: GemmKey, todo: list[tuple[str, Params, bool]], calls: int) -> dict[str, str]:
    """cProfile's top entries (by own time) over ``calls`` eager calls of torch's op for the
    format and of each source's first config in ``todo``, by source."""
    sets = samples.input_sets(key, "cuda", seed=1)
    base = registry.baseline(key.op, key)
    firsts = {base.name: base.baseline_params}
    for source, params, _ in todo:
        firsts.setdefault(source, params)
    out: dict[str, str] = {}
    for source, params in firsts.items():
        runner = registry.get(source).build(key, params)
        for s in sets:  # first calls on each set (layouts made once) are set-up
            runner(*s)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for i in range(calls):
            runner(*sets[i % len(sets)])
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out[source] = text.getvalue()
        print(f"--- host profile {source} ({calls} calls)\n{out[source]}", flush=True)
    return out


def run(
    benchmark: str,
    keys: Sequence[tuple[str, GemmKey]],
    todo: dict[GemmKey, Todo],
    out: str,
    *,
    with_torch: bool,
    extra: dict[str, Any] | None = None,
) -> None:
    """Every key's ``bench_key`` in order, the JSON (device, versions, ``extra``, rows)
    rewritten after each."""
    fp = fingerprint("cuda")
    result: dict[str, Any] = {"benchmark": benchmark, "device": fp.name, "versions": fp.versions,
                              **(extra or {}), "rows": []}  # fmt: skip
    t0 = time.perf_counter()
    for label, key in keys:
        print(f"{label} ({len(todo[key])} configs)", flush=True)
        result["rows"].append(bench_key(label, key, todo[key], with_torch=with_torch))
        result["seconds"] = round(time.perf_counter() - t0, 1)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()

"""Benchmark: a Llama-3-8B decoder layer quantized by ``tuner.torch.quantize_linear``, beside the
same layer in bf16, in one run.

    python bench/quantized_decoder.py --out $OUT/quantized_decoder.json --plot $OUT/quantized_decoder.png

What a user gets from ``quantize_linear(model, "int4" | "fp8")`` in a whole layer step, where the
GEMMs share the step with norms, RoPE, attention and (FP8) the activations' quantization. One
layer (``dropin_decoder.DecoderLayer``, random weights), run as these variants:

- ``bf16 torch``: the plain layer, torch's ops (what runs today); ``bf16 tuner``: the same under
  ``tuner.torch.enabled()`` (the drop-in mode's winners);
- ``int4 torch`` / ``fp8 torch``: the quantized layer served by torch's own ops
  (``_weight_int4pack_mm``, ``_scaled_mm``: a dispatcher in mode ``off``), what the format gives
  without tuning; ``int4 tuner`` / ``fp8 tuner``: the same layer served by the tuned winners;
- ``fp8 tuner, torch's act. quant``: ``fp8 tuner`` with the activations quantized by torch's ops
  (``fp8.quantize_rowwise_torch``) instead of the fused kernel: that kernel's share of the step;
- with ``--twins``, ``int4 torch, twin`` / ``fp8 torch, twin``: the torch variant captured a
  second time, an A/A pair (what the capture and its memory alone move).

1. **Record** every problem the variants make, **tune** those without a winner in the cache
   (``TUNER_CACHE``), decode first, to a deadline (as ``dropin_decoder``), then ``tuner.warmup()``
   (the winners' kernels loaded before any CUDA graph is captured, as users must).
2. **Measure** per phase (decode batches of one token against a K/V cache of ``--kv-len``, and a
   prefill of ``--prefill-seq`` tokens): time per layer step, CUDA-graph replay and eager, every
   variant in each of ``--rounds`` rounds (in a balanced order, ``timing.round_order``);
   medians, and each variant's time over ``bf16 torch``'s (> 1: faster) and, per format,
   torch's over the tuner's.
3. **Activations' quantization alone** (first, before any profiler runs): ``quantize_rowwise``
   (the fused kernel) beside torch's ops, CUDA-graph and eager time per call (the kernel launched
   directly and through Triton's JIT), at the layer's K and the phases' rows.

JSON (device, versions, tuning log, weight bytes per variant, per-phase times and ratios, which
kernel served each problem, each variant's output against bf16 torch's) and a PNG of the graph
ratios over bf16 torch. ``--smoke`` runs the whole script on the CPU with tiny dimensions (eager
only): tests/bench/test_quantized_decoder.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from bench.dropin_decoder import (
    add_tuning_arguments,
    bf16_layer,
    bind,
    build_phases,
    capture,
    make_inputs,
    profile_step,
    run_header,
    save_json,
    step_us,
    summary,
    tune_and_serve,
)
from tuner.measure import samples, timing
from tuner.quant import fp8, fp8_rows

FORMATS = ("int4", "fp8")
SMOKE_GROUP = 32  # the tiny layer's K (64, 96) takes no group of 128
ACT_QUANT_ROUNDS = 10  # rounds of the activations' quantization alone; the quickest counts


@dataclass(frozen=True)
class Variant:
    layer: str  # "bf16" or a format
    by: str  # "torch" or "tuner"
    torch_act_quant: bool = False  # fp8: the activations quantized by torch's ops
    twin: bool = False  # a second capture of the same variant: what placement alone moves

    @property
    def name(self) -> str:
        return (
            f"{self.layer} {self.by}"
            + (", torch's act. quant" if self.torch_act_quant else "")
            + (", twin" if self.twin else "")
        )


BASELINE = Variant("bf16", "torch")


def variants_of(formats: list[str], twins: bool = False) -> list[Variant]:
    """The variants measured; ``twins``: each format's torch variant twice (an A/A pair)."""
    out = [BASELINE, Variant("bf16", "tuner")]
    for fmt in formats:
        out += [Variant(fmt, "torch"), Variant(fmt, "tuner")]
        if twins:
            out.append(Variant(fmt, "torch", twin=True))
        if fmt == "fp8":
            out.append(Variant(fmt, "tuner", torch_act_quant=True))
    return out


@contextlib.contextmanager
def serving(variant: Variant, tt: Any, tuned: Any, untuned: Any) -> Iterator[None]:
    """The variant's calls go where it says: plain torch (bf16 torch), the tuned dispatcher, or
    one in mode off (a quantized layer's torch ops: its calls always go to a dispatcher)."""
    with contextlib.ExitStack() as stack:
        if variant.by == "tuner":
            stack.enter_context(tt.enabled(dispatcher=tuned))
        elif variant.layer != "bf16":
            stack.enter_context(tt.enabled(dispatcher=untuned))
        if variant.torch_act_quant:
            stack.enter_context(
                mock.patch.object(fp8, "quantize_rowwise", fp8.quantize_rowwise_torch)
            )
        yield


def slug(text: str) -> str:
    """``text`` as a file name: runs of anything but word characters, dots, = and - as one _."""
    return re.sub(r"[^\w.=-]+", "_", text)


def weight_bytes(layer: nn.Module) -> int:
    """Bytes of the layer's four projections as stored (packed weights, scales, zeros)."""
    tensors = [t for name in ("qkv", "o", "gate_up", "down")
               for t in (*getattr(layer, name).parameters(), *getattr(layer, name).buffers())]  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_phase(
    steps: dict[Variant, Callable[[], torch.Tensor]],
    within: Callable[[Any], contextlib.AbstractContextManager],
    args: argparse.Namespace,
    baseline: Any = BASELINE,
    shared_pool: bool = False,
    profile: bool = False,
    dump: Path | None = None,
) -> dict[str, Any]:
    """Every variant's step, CUDA graph (GPU) and eager, in ``timing.round_order``: the GPU's
    clock after a run of heavy steps is not what it is after light ones, so in a fixed order,
    or a shuffled one that is not balanced, a variant that more often follows a heavy one reads
    slow; each output against ``baseline``'s (bf16 torch's step; any variant with a ``name``).
    ``shared_pool``: every variant's graph in one memory pool, the phase's own (a pool freed
    with its graphs cannot be captured into again). ``profile``: after the rounds, the kernels
    of each variant's eager step and of the very graph timed (another capture of the same step
    need not run as this one does); ``dump``: a folder for those graphs as DOT."""
    out: dict[str, Any] = {}
    graphs: dict[Variant, Callable[[], Any]] = {}
    pool = torch.cuda.graph_pool_handle() if shared_pool and torch.cuda.is_available() else None
    with torch.no_grad():
        ref = steps[baseline]().float()
        for v, step in steps.items():
            with within(v):
                for _ in range(3):  # resolves every signature, loads the kernels
                    y = step()
                row = out[v.name] = {"rel_err_vs_bf16_torch": samples.relative_error(y, ref)}
                if torch.cuda.is_available():
                    dot = dump / f"{slug(v.name)}.dot" if dump else None
                    try:
                        graphs[v] = capture(step, pool=pool, dot=dot).replay
                    except RuntimeError as e:  # reported; its eager times still come
                        row["graph_error"] = f"capture failed: {e}"[:1000]
                        torch.cuda.synchronize()
        times: dict[Variant, dict[str, list[float]]] = {
            v: {"graph": [], "eager": []} for v in steps
        }
        order = list(steps)
        for r in range(args.rounds):
            for v in timing.round_order(order, r):
                if v in graphs:
                    times[v]["graph"].append(step_us(graphs[v], args.iters))
                with within(v):
                    times[v]["eager"].append(step_us(steps[v], args.iters))
        for v, step in steps.items() if profile else ():
            with within(v):
                kernels = out[v.name]["kernels"] = {"eager": kernel_times(step)}
                if v in graphs:
                    kernels["graph"] = kernel_times(graphs[v])
    graphs.clear()  # frees the graphs' memory pools
    for v, kinds in times.items():
        out[v.name].update({kind: summary(t) for kind, t in kinds.items() if t})
    return out


def ratios(times: dict[str, Any], formats: list[str]) -> dict[str, Any]:
    """Each variant over bf16 torch (> 1: faster), and per format torch's time over the tuner's
    and, with ``--twins``, over its twin's (an A/A pair: 1 but for the capture)."""
    out: dict[str, Any] = {"over_bf16_torch": {}, "tuner_over_torch": {}, "twin_over_torch": {}}
    for kind in ("graph", "eager"):
        base = times[BASELINE.name].get(kind)
        if base is None:
            continue
        out["over_bf16_torch"][kind] = {
            name: base["median_us"] / t[kind]["median_us"] for name, t in times.items() if kind in t
        }
        for other, key in (("tuner", "tuner_over_torch"), ("torch, twin", "twin_over_torch")):
            pairs = {
                layer: (times[f"{layer} torch"], times[f"{layer} {other}"])
                for layer in ("bf16", *formats)
                if f"{layer} {other}" in times
            }
            out[key][kind] = {
                layer: by_torch[kind]["median_us"] / by_other[kind]["median_us"]
                for layer, (by_torch, by_other) in pairs.items()
                if kind in by_torch and kind in by_other
            }  # fmt: skip
    return out


def kernel_times(
    step: Callable[[], Any], steps: int = 20, warm: int = 50, top: int = 40
) -> dict[str, Any]:
    """The GPU work of ``steps`` steps by name (torch.profiler: kernels, and copies or memsets
    where a step has them), after ``warm`` unprofiled ones (the clocks as sustained work leaves
    them, as in the timed rounds): time per step, the busiest ``top`` names, and the step as a
    sequence (``timeline``). Tracing each kernel changes how a graph's launches space out, so
    the idle times read here are the profiler's, not those of the timed replays."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(warm):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    spans = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            totals[event.name] += event.device_time
            spans.append((event.name, event.time_range.start, event.time_range.end))
    busiest = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_us": sum(totals.values()) / steps,
        "kernels": [{"name": name[:160], "us": t / steps} for name, t in busiest],
        **timeline(spans, steps),
    }


def timeline(spans: list[tuple[str, float, float]], steps: int) -> dict[str, Any]:
    """``steps`` steps' GPU work as (name, start, end) spans, us, as one step's sequence: each
    place's median time and median idle gap before it (after the previous work ended; the first
    place's: after the step before, ``between_steps_us``), the idle time within a step
    (``gaps_us``, the other places' gaps) and the median step period. Says whether two captures
    of one graph differ in their kernels or in the gaps between them, and where, as far as the
    profiler shows it. Empty unless there are two steps or more and every step runs the same
    names in the same order."""
    spans = sorted(spans, key=lambda s: s[1])
    n, extra = divmod(len(spans), steps) if steps > 1 else (0, 0)
    if not n or extra or any(s[0] != spans[i % n][0] for i, s in enumerate(spans)):
        return {}
    places = []
    for i in range(n):
        runs = spans[i::n]
        gaps = [spans[k * n + i][1] - spans[k * n + i - 1][2] for k in range(steps) if k * n + i]
        places.append({"name": runs[0][0][:160],
                       "us": statistics.median(end - start for _, start, end in runs),
                       "gap_before_us": statistics.median(gaps)})  # fmt: skip
    return {
        "step_period_us": statistics.median(
            spans[(k + 1) * n][1] - spans[k * n][1] for k in range(steps - 1)
        ),
        "between_steps_us": places[0]["gap_before_us"],
        "gaps_us": sum(p["gap_before_us"] for p in places[1:]),
        "timeline": places,
    }


def act_quant_times(cfg: Any, rows: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per call of the fused rowwise quantization and of torch's ops, at the layer's K (hidden:
    qkv and gate_up; intermediate: down) and the phases' rows: CUDA-graph time (the GPU's), and
    eager time back to back (the host's where it is longer), the fused kernel's both launched
    directly and through Triton's JIT (``fp8_rows.DIRECT_ROWS`` at 0); above ``DIRECT_ROWS``
    rows (``direct`` False) both take the JIT."""
    out = []
    gen = torch.Generator().manual_seed(2)
    jit = mock.patch.object(fp8_rows, "DIRECT_ROWS", 0)
    for m in rows:
        for k in sorted({cfg.hidden, cfg.intermediate}):
            x = torch.randn((m, k), generator=gen).to("cuda", torch.bfloat16)
            row: dict[str, Any] = {"m": m, "k": k, "direct": m <= fp8_rows.DIRECT_ROWS}
            for name, fn in (
                ("fused", fp8.quantize_rowwise),
                ("torch", fp8.quantize_rowwise_torch),
            ):
                graph = capture(lambda fn=fn, x=x: fn(x))
                row[f"{name}_us"] = min(
                    step_us(graph.replay, args.iters) for _ in range(ACT_QUANT_ROUNDS)
                )
            for name, fn, within in (
                ("fused_direct", fp8.quantize_rowwise, contextlib.nullcontext()),
                ("fused_jit", fp8.quantize_rowwise, jit),
                ("torch", fp8.quantize_rowwise_torch, contextlib.nullcontext()),
            ):
                with within:
                    fn(x)  # a first call of the path: compiles, checks a direct launch
                    row[f"{name}_eager_us"] = min(
                        step_us(lambda fn=fn, x=x: fn(x), args.iters)
                        for _ in range(ACT_QUANT_ROUNDS)
                    )
            row["torch_over_fused"] = row["torch_us"] / row["fused_us"]
            out.append(row)
            print(f"  act. quant m={m:<5} k={k:<6} fused {row['fused_us']:.2f} us, torch's ops "
                  f"{row['torch_us']:.2f} us ({row['torch_over_fused']:.2f}x); eager: direct "
                  f"{row['fused_direct_eager_us']:.2f}, JIT {row['fused_jit_eager_us']:.2f}, "
                  f"torch's {row['torch_eager_us']:.2f} us", flush=True)  # fmt: skip
    return out


def plot(phases: list[dict[str, Any]], path: Path, model: str) -> None:
    """Grouped bars: per phase, each variant's speedup over bf16 torch (graph times on a GPU)."""
    from tuner.offline.plots import pyplot

    plt = pyplot()
    kind = "graph" if any("graph" in p["ratios"]["over_bf16_torch"] for p in phases) else "eager"
    names = [n for n in phases[0]["variants"] if n != BASELINE.name]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(names)
    palette = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(phases))]
        values = [
            p["ratios"]["over_bf16_torch"].get(kind, {}).get(name, float("nan")) for p in phases
        ]
        bars = ax.bar(xs, [v - 1 for v in values], width, bottom=1, label=name, color=palette(i))
        ax.bar_label(bars, [f"{v:.2f}" for v in values], fontsize=6, padding=1)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}x")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(phases)), [p["label"] for p in phases])
    ax.set_ylabel("bf16 torch's step time / the variant's")
    ax.set_title(f"{model} decoder layer under quantize_linear: speedup over bf16 torch ({kind})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file.")
    parser.add_argument("--plot", type=Path, help="PNG of the ratios over bf16 torch.")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--decode-batches", default="1,4,16")
    parser.add_argument("--prefill-seq", type=int, default=2048)
    parser.add_argument("--kv-len", type=int, default=4096)
    add_tuning_arguments(parser, launch="graph", deadline_s=300.0)  # decode steps run as graphs
    parser.add_argument("--iters", type=int, default=20, help="Steps per timed round.")
    parser.add_argument(
        "--rounds",
        type=int,
        help="Rounds per phase (default: one cycle of the balanced order, in which every "
        "variant follows every other equally often).",
    )
    parser.add_argument(
        "--profile-phase",
        help="Also list the GPU kernels of each variant's eager step and of the very graph "
        "timed, in the phases whose label starts with this (e.g. 'prefill'): JSON variants' "
        "'kernels'.",
    )
    parser.add_argument(
        "--twins",
        action="store_true",
        help="Also each format's torch variant a second time, captured apart: an A/A pair that "
        "shows what the capture and its memory alone move.",
    )
    parser.add_argument(
        "--shared-pool",
        action="store_true",
        help="Capture every variant's graph into one memory pool, so that their steps' buffers "
        "lie at the same addresses (with --twins: whether placement is what an A/A pair reads).",
    )
    parser.add_argument(
        "--dump-graphs",
        type=Path,
        help="With --profile-phase: also write each profiled variant's timed CUDA graph (nodes, "
        "edges, launch shapes) as DOT files, a folder a phase. The timed graphs are then "
        "captured kept (keep_graph) and instantiated after the dump.",
    )
    parser.add_argument(
        "--profile-host-batch",
        type=int,
        help="Also profile the host side (cProfile) of the tuner-served quantized variants' "
        "eager step at this decode batch: JSON 'host_profile'.",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="Tiny dimensions on the CPU (eager only)."
    )
    args = parser.parse_args(argv)
    args.extra_batches = ""  # every phase is tuned (build_phases)
    if args.dump_graphs and not args.profile_phase:
        parser.error("--dump-graphs: the graphs dumped are those of --profile-phase; give it too")
    if args.rounds is None:
        args.rounds = timing.order_cycle(len(variants_of(args.formats, args.twins)))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    device, cfg, plain, gen = bf16_layer(args, "quantized_decoder.py")
    import tuner.torch as tt
    from tuner.serving.dispatcher import Dispatcher

    layers: dict[str, nn.Module] = {"bf16": plain}
    quantize_started = time.perf_counter()
    load_s = {}
    for fmt in args.formats:
        t0 = time.perf_counter()
        group = {"group_size": SMOKE_GROUP} if args.smoke and fmt == "int4" else {}
        layers[fmt] = tt.quantize_linear(copy.deepcopy(plain), fmt, **group)
        load_s[fmt] = time.perf_counter() - t0
    print(f"quantized in {time.perf_counter() - quantize_started:.1f} s", flush=True)
    variants = variants_of(args.formats, args.twins)
    phases = build_phases(args)
    inputs = {p: make_inputs(cfg, p, args.kv_len, gen, device, torch.bfloat16) for p in phases}
    steps = {p: {v: bind(layers[v.layer], inputs[p]) for v in variants} for p in phases}

    tuned, untuned = Dispatcher(mode="record"), Dispatcher(mode="off")
    tuned.set_buckets("exact")
    result = run_header("quantized_decoder", args, device, vars(cfg))
    result["quantize_s"] = load_s
    result["weight_bytes"] = {name: weight_bytes(layer) for name, layer in layers.items()}

    def save() -> None:
        save_json(args.out, result, started)

    runs = [steps[p][v] for p in phases for v in variants if v.by == "tuner"]
    tune_and_serve(tt, tuned, runs, args, device, result, save)

    def within(v: Variant) -> contextlib.AbstractContextManager:
        return serving(v, tt, tuned, untuned)

    if device == "cuda" and "fp8" in args.formats:  # before any profiler runs (kernel_times)
        sizes = sorted({p.batch * p.tokens for p in phases})
        result["act_quant"] = act_quant_times(cfg, sizes, args)
        save()
    rows: list[dict[str, Any]] = []
    result["phases"] = rows
    for phase in phases:
        tt.reset_stats(tuned)
        profiled = bool(
            device == "cuda" and args.profile_phase and phase.label.startswith(args.profile_phase)
        )
        dump = args.dump_graphs / slug(phase.label) if profiled and args.dump_graphs else None
        times = measure_phase(
            steps[phase], within, args, shared_pool=args.shared_pool, profile=profiled, dump=dump
        )
        row = {"phase": phase.name, "batch": phase.batch, "tokens": phase.tokens,
               "label": phase.label, "variants": times, "ratios": ratios(times, args.formats)}  # fmt: skip
        row["served"] = [{"key": r.key, "kind": r.kind, "candidate": r.candidate}
                         for r in tt.stats(tuned).rows if r.calls]  # fmt: skip
        for v in steps[phase] if profiled else ():
            for kind, k in times[v.name].get("kernels", {}).items():
                nan = float("nan")
                print(f"  {v.name}, {kind}: kernels {k['total_us']:.1f} us a step, idle "
                      f"{k.get('gaps_us', nan):.1f} within it and {k.get('between_steps_us', nan):.1f} "
                      f"between steps, period {k.get('step_period_us', nan):.1f} (profiled): "
                      + ", ".join(f"{e['name'][:40]} {e['us']:.1f}" for e in k["kernels"][:6]),
                      flush=True)  # fmt: skip
        if phase.name == "decode" and phase.batch == args.profile_host_batch:
            row["host_profile"] = {
                v.name: profile_step(tt, tuned, step)
                for v, step in steps[phase].items()
                if v.by == "tuner" and v.layer != "bf16" and not v.torch_act_quant
            }
            for name, prof in row["host_profile"].items():
                print(f"  {name}: host {prof['step_us_on']:.1f} us a step; cProfile:", flush=True)
                print("\n".join(prof["profile_on"][:40]), flush=True)
        rows.append(row)
        save()
        kind = "graph" if device == "cuda" else "eager"
        print(f"{phase.label}, {kind} time per step (us) and over bf16 torch:", flush=True)
        for v in variants:
            t = times[v.name].get(kind)
            if t:
                over = row["ratios"]["over_bf16_torch"][kind][v.name]
                print(f"  {v.name:<32} {t['median_us']:9.1f}  {over:6.3f}x", flush=True)
    result["complete"] = True
    save()
    if args.plot:
        plot(rows, args.plot, "tiny CPU smoke" if args.smoke else "Llama-3-8B")
    return result


if __name__ == "__main__":
    main()

"""Benchmark: a tuned GEMM's lead alone against its share of a layer step, one projection at a time.

    python bench/graph_context.py --out $OUT/graph_context.json --plot $OUT/graph_context.png

A winner is chosen on its own: the duel times it back to back. Inside a model's step it follows
other kernels, and a kernel may start before the one ahead of it has drained (cuBLAS launches its
GEMMs as programmatic dependent launches) or only once it has finished. This benchmark measures
what a tuned projection gains where it runs, on a Llama-3-8B layer (``dropin_decoder.DecoderLayer``,
bf16, one phase: ``--phase prefill`` or ``decode:<batch>``):

1. **Record** the phase's problems, **tune** those without a winner in the cache (``TUNER_CACHE``)
   to a deadline, ``tuner.warmup()`` (as ``dropin_decoder``).
2. **The step**, CUDA-graph replay and eager, in balanced rounds (``timing.round_order``), served
   six ways: all by torch, all by the tuner, and the tuner serving one projection only (``qkv``,
   ``o``, ``gate_up``, ``down``; torch the rest); each of those again *fenced*: a one-element
   torch kernel launched before every projection, so that no projection overlaps the kernel
   ahead of it.
3. **Each projection alone**, its winner and torch's call on the step's shapes: CUDA-graph time
   per call over ``--calls`` back-to-back calls, and fenced (the fences' own time taken off).

JSON (device, versions, tuning log, the served kernels, every variant's times, per projection its
lead alone and its saving in the step) and a PNG: per projection, the tuner's saving alone,
fenced, and in the step (graph times). ``--smoke``: the same on the CPU with tiny dimensions,
eager only (tests/bench/test_graph_context.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.dropin_decoder import (
    DecoderLayer,
    Phase,
    add_tuning_arguments,
    bf16_layer,
    bind,
    capture,
    make_inputs,
    run_header,
    save_json,
    step_us,
    tune_and_serve,
)
from bench.quantized_decoder import measure_phase
from tuner.measure import timing

PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Setup:
    """Who serves the step's projections: ``torch``, ``tuner`` (all), or one projection's name
    (the tuner that one only); ``fenced``: a plain one-element kernel before each projection."""

    served: str
    fenced: bool = False

    @property
    def name(self) -> str:
        who = self.served if self.served in ("torch", "tuner") else f"tuner {self.served} only"
        return who + (", fenced" if self.fenced else "")


BASELINE = Setup("torch")
SETUPS = [Setup(s, f) for f in (False, True) for s in ("torch", "tuner", *PROJECTIONS)]


@contextlib.contextmanager
def hooks(module: nn.Module, before: Callable[[], Any], after: Callable[[], Any]) -> Iterator[None]:
    """``before()`` and ``after()`` around every forward of ``module`` while the block runs
    (what they return is dropped: a hook's value would replace the module's inputs or output)."""

    def pre(*_: Any) -> None:
        before()

    def post(*_: Any) -> None:
        after()

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@functools.cache
def fence_kernel(device: torch.device) -> Callable[[], Any]:
    """One plain launch of a one-element torch kernel: the next kernel waits for it to end. One
    a device, kept for the process: a captured graph writes its flag on every replay."""
    flag = torch.zeros(1, device=device)
    return lambda: flag.add_(1)


@contextlib.contextmanager
def serving(setup: Setup, layer: DecoderLayer, tt: Any, disp: Any) -> Iterator[None]:
    """The layer's calls served as ``setup`` says while the block runs."""
    with contextlib.ExitStack() as stack:
        if setup.served == "tuner":
            stack.enter_context(tt.enabled(dispatcher=disp))
        elif setup.served in PROJECTIONS:
            inner = stack.enter_context(contextlib.ExitStack())  # closed even if a forward raises
            stack.enter_context(
                hooks(
                    getattr(layer, setup.served),
                    lambda: inner.enter_context(tt.enabled(dispatcher=disp)),
                    inner.close,
                )
            )
        if setup.fenced:
            fence = fence_kernel(layer.cos.device)
            for name in PROJECTIONS:
                stack.enter_context(hooks(getattr(layer, name), fence, lambda: None))
        yield


def projection_inputs(layer: DecoderLayer, rows: int, gen: torch.Generator) -> dict[str, Any]:
    """Per projection, an activation of the step's shape (``rows`` tokens) on the layer's device."""
    w = layer.qkv.weight
    return {
        name: torch.randn((rows, getattr(layer, name).in_features), generator=gen).to(
            w.device, w.dtype
        )
        for name in PROJECTIONS
    }


def linear_of(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``F.linear(x, w)`` as called when it runs (routed to the tuner while it is enabled)."""
    return lambda: F.linear(x, w)


def repeated(
    fn: Callable[[], Any], times: int, before: Callable[[], Any] | None = None
) -> Callable[[], None]:
    """``fn`` called ``times`` times in a row, each call after ``before()`` when given."""

    def run() -> None:
        for _ in range(times):
            if before is not None:
                before()
            fn()

    return run


def alone_times(
    layer: DecoderLayer, rows: int, tt: Any, disp: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Per projection: time per call of torch's and the tuner's GEMM, ``args.calls`` back to back
    and each after a fence (the fences' own time taken off). The five graphs (torch's and the
    tuner's, plain and fenced, and the fences alone) are read side by side, ``args.rounds`` rounds in ``timing.round_order``,
    each at its quickest round."""
    gen = torch.Generator().manual_seed(3)
    inputs = projection_inputs(layer, rows, gen)
    fence = fence_kernel(layer.cos.device)
    out: dict[str, Any] = {}
    for name in PROJECTIONS:
        gemm = linear_of(inputs[name], getattr(layer, name).weight)
        runs = {"fences": replayable(repeated(fence, args.calls))}
        for who, ctx in (
            ("torch", contextlib.nullcontext),
            ("tuner", lambda: tt.enabled(dispatcher=disp)),
        ):
            with ctx(), torch.no_grad():
                gemm()  # resolves the signature eagerly, before any capture
                runs[who] = replayable(repeated(gemm, args.calls))
                runs[f"{who}_fenced"] = replayable(repeated(gemm, args.calls, before=fence))
        best = dict.fromkeys(runs, math.inf)
        for r in range(args.rounds):
            for what in timing.round_order(list(runs), r):
                best[what] = min(best[what], step_us(runs[what], 1) / args.calls)
        row = {f"{who}_us": best[who] for who in ("torch", "tuner")}
        for who in ("torch", "tuner"):
            row[f"{who}_fenced_us"] = best[f"{who}_fenced"] - best["fences"]
        row["saving_us"] = row["torch_us"] - row["tuner_us"]
        row["fenced_saving_us"] = row["torch_fenced_us"] - row["tuner_fenced_us"]
        out[name] = {"fence_us": best["fences"], **row}
    return out


def replayable(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph, its replay (on the GPU); ``fn`` itself on the CPU."""
    return capture(fn).replay if torch.cuda.is_available() else fn


def winner_of(served: dict[str, str], proj: nn.Linear, phase: Phase) -> str | None:
    """The candidate that served ``proj``'s GEMM in the step (its key's M, N, K)."""
    shape = f"gemm:m={phase.batch * phase.tokens},n={proj.out_features},k={proj.in_features},"
    return next((c for key, c in served.items() if key.startswith(shape)), None)


def step_savings(times: dict[str, Any], kind: str) -> dict[str, Any]:
    """Per projection (and all four): torch's step time minus the step's with the tuner serving
    it, unfenced and fenced (> 0: the tuner saves time there)."""
    out: dict[str, Any] = {}
    for fenced in (False, True):
        base = times[Setup("torch", fenced).name].get(kind)
        if base is None:
            continue
        for served in ("tuner", *PROJECTIONS):
            t = times[Setup(served, fenced).name].get(kind)  # None: its capture failed
            saving = base["median_us"] - t["median_us"] if t else math.nan
            out.setdefault(served, {})["fenced" if fenced else "plain"] = saving
    return out


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Grouped bars per projection: the tuner's saving alone, alone fenced, and in the step."""
    from tuner.offline.plots import pyplot

    plt = pyplot()
    alone, step = result["alone"], result["step_saving_us"]
    names = [*PROJECTIONS, "tuner"]
    series = {
        "alone, back to back": [
            alone[n]["saving_us"] if n in alone else float("nan") for n in names
        ],
        "alone, fenced": [
            alone[n]["fenced_saving_us"] if n in alone else float("nan") for n in names
        ],
        "in the step": [step[n]["plain"] for n in names],
        "in the step, fenced": [step[n].get("fenced", float("nan")) for n in names],
    }
    fig, ax = plt.subplots(figsize=(10, 4.6))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7, padding=1)
    ax.axhline(0, color="black", linewidth=1)
    sources = [(result["winners"].get(n) or "?").split(":")[0] for n in PROJECTIONS]
    labels = [f"{n}\n({source})" for n, source in zip(PROJECTIONS, sources, strict=True)]
    ax.set_xticks(range(len(names)), [*labels, "all four"])
    ax.set_ylabel("torch's time - the tuner's (us per step)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_phase(text: str) -> Phase:
    if text == "prefill":
        return Phase("prefill", 1, 0)  # tokens: --prefill-seq
    name, _, batch = text.partition(":")
    if name != "decode" or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"--phase {text!r}: 'prefill' or 'decode:<batch>'")
    return Phase("decode", int(batch), 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON results file.")
    parser.add_argument("--plot", type=Path, help="PNG of the tuner's savings per projection.")
    parser.add_argument(
        "--phase", type=parse_phase, default="prefill", help="prefill or decode:<batch>."
    )
    parser.add_argument("--prefill-seq", type=int, default=2048)
    parser.add_argument("--kv-len", type=int, default=4096)
    add_tuning_arguments(parser, launch="graph", deadline_s=240.0)
    parser.add_argument("--iters", type=int, default=20, help="Steps per timed round.")
    parser.add_argument(
        "--rounds",
        type=int,
        default=timing.order_cycle(len(SETUPS)),
        help="Rounds of the step (default: one cycle of its balanced order) and of each "
        "projection alone (there the quickest round counts).",
    )
    parser.add_argument("--calls", type=int, default=10, help="Back-to-back calls, alone.")
    parser.add_argument(
        "--smoke", action="store_true", help="Tiny dimensions on the CPU (eager only)."
    )
    args = parser.parse_args(argv)
    if args.phase.name == "prefill":
        args.phase = Phase("prefill", 1, args.prefill_seq)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    device, cfg, layer, gen = bf16_layer(args, "graph_context.py")
    import tuner.torch as tt
    from tuner.serving.dispatcher import Dispatcher

    phase = args.phase
    step = bind(layer, make_inputs(cfg, phase, args.kv_len, gen, device, torch.bfloat16))
    disp = Dispatcher(mode="record")
    disp.set_buckets("exact")
    result = run_header("graph_context", args, device, vars(cfg))

    def save() -> None:
        save_json(args.out, result, started)

    tune_and_serve(tt, disp, [step], args, device, result, save)
    tt.reset_stats(disp)

    steps = {setup: step for setup in SETUPS}
    times = measure_phase(steps, lambda s: serving(s, layer, tt, disp), args, baseline=BASELINE)
    served = {r.key: r.candidate for r in tt.stats(disp).rows if r.calls}
    result["served"] = served
    result["winners"] = {
        name: winner_of(served, getattr(layer, name), phase) for name in PROJECTIONS
    }
    result["step"] = times
    save()
    kind = "graph" if device == "cuda" else "eager"
    result["step_saving_us"] = step_savings(times, kind)
    result["alone"] = alone_times(layer, phase.batch * phase.tokens, tt, disp, args)
    result["complete"] = True
    save()

    print(f"{phase.label}, {kind} time per step (us):", flush=True)
    for setup in SETUPS:
        t = times[setup.name].get(kind, {}).get("median_us", math.nan)
        print(f"  {setup.name:<30} {t:9.1f}", flush=True)
    print("the tuner's saving (us): alone / alone fenced / in the step / in the step fenced")
    for name in PROJECTIONS:
        a, s = result["alone"][name], result["step_saving_us"][name]
        print(f"  {name:<8} {a['saving_us']:7.2f} / {a['fenced_saving_us']:7.2f} / "
              f"{s['plain']:7.2f} / {s.get('fenced', float('nan')):7.2f}", flush=True)  # fmt: skip
    if args.plot:
        title = "tiny CPU smoke" if args.smoke else f"Llama-3-8B bf16 layer, {phase.label}"
        plot(result, args.plot, f"{title}: the tuner's saving, alone and in the step ({kind})")
    return result


if __name__ == "__main__":
    main()

"""Benchmark: a Llama-3-8B decoder layer with ``tuner.torch`` enabled vs disabled, in one run.

    python bench/dropin_decoder.py --out results/dropin_decoder.json --plot results/dropin_decoder.png

The layer is plain PyTorch (``nn.Linear``, ``F.scaled_dot_product_attention``, RMSNorm, RoPE) in
bf16 with Llama-3-8B's dimensions: hidden 4096, 32 query heads, 8 KV heads, head dim 128,
intermediate 14336; fused QKV and gate/up projections as vLLM runs them.

1. **Record**: every phase runs once with the dispatcher in record mode, so every GEMM and SDPA
   problem the layer makes (exact keys: layouts, alignment) is known.
2. **Tune**: each recorded problem without a current winner in the cache (``TUNER_CACHE``) is
   tuned with ``tuner.tuning.engine.tune`` and saved, decode problems first, within a deadline; what is
   left untuned is reported and served by torch's default. Then ``tuner.warmup()`` loads every
   winner, as users must before capturing a CUDA graph.
3. **Measure**, for prefill (batch 1, ``--prefill-seq`` tokens, causal) and decode (one token per
   sequence against a KV cache of ``--kv-len``, batches ``--decode-batches``, plus
   ``--extra-batches`` that are never tuned and so show the bucket policy): time per layer step,
   eager and CUDA-graph replay, tuner off and on, in interleaved rounds in a balanced order
   (median over rounds of CUDA-event time per step). Ratio = off / on (> 1: the tuner is faster). Per decode batch
   (GPU): the kernel time under the ops the tuner routes (torch.profiler, tuner off) and
   Amdahl's bound on the graph ratio if those kernels read their bytes (weights and K/V cache)
   at the memory's peak bandwidth, or at the measured copy bandwidth.
4. **Hit-path overhead** (eager, host time per call, small GEMM so the launch dominates): the
   winner's runner called directly vs ``Dispatcher.matmul`` vs ``F.linear`` under
   ``tuner.torch``, in ``--overhead-rounds`` rotating rounds. Target: at most 5 us over the
   direct call, judged on each variant's least disturbed round (as timeit does: a busy host only
   adds time); the medians are reported beside.

JSON (device, versions, tuning log, per-phase times, ratios and on-vs-off numerics, which kernel
served each problem, overhead, targets; rewritten after every stage) and a PNG of the ratios.
``--smoke`` runs the same script on the CPU with tiny dimensions (no CUDA graphs): that is how
tests/bench/test_dropin_decoder.py checks it; tests/serving/test_torch_routes.py imports its model classes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tuner.measure import samples, timing
from tuner.offline.plots import geomean

# --- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    rope_theta: float = 500000.0
    eps: float = 1e-5


LLAMA3_8B = LlamaConfig()
TINY = LlamaConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96)  # CPU smoke runs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(cfg: LlamaConfig, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_pos, head_dim), the rotate-half convention."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderLayer(nn.Module):
    """One Llama decoder layer: RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, max_pos: int) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.split = (q, kv, kv)
        self.qkv = nn.Linear(cfg.hidden, q + 2 * kv, bias=False)
        self.o = nn.Linear(q, cfg.hidden, bias=False)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        self.norm1 = RMSNorm(cfg.hidden, cfg.eps)
        self.norm2 = RMSNorm(cfg.hidden, cfg.eps)
        cos, sin = rope_tables(cfg, max_pos)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x`` (batch, tokens, hidden) at ``positions`` (tokens,).

        Without ``cache``: causal self-attention over the tokens (prefill). With ``cache`` = (k, v),
        each (batch, kv_heads, length, head_dim): the new keys and values are written at
        ``positions`` and the queries attend to the whole cache (decode: every cached position
        precedes the new token).
        """
        c = self.cfg
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(self.split, dim=-1)
        q = q.view(b, s, c.heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_cache, v_cache = cache
            k_cache.index_copy_(2, positions, k)
            v_cache.index_copy_(2, positions, v)
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, s, c.heads * c.head_dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def init_weights(layer: nn.Module, gen: torch.Generator) -> None:
    """Random weights of a realistic scale (std 0.02), norms at 1: never zeros."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


# --- one phase: inputs and a step function --------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str  # "prefill" or "decode"
    batch: int
    tokens: int  # new tokens per sequence
    tuned: bool = True  # False: its problems are never tuned (buckets show)

    @property
    def label(self) -> str:
        extra = "" if self.tuned else " (untuned M)"
        if self.name == "prefill":
            return f"prefill b={self.batch} s={self.tokens}{extra}"
        return f"decode b={self.batch}{extra}"


@dataclass(frozen=True)
class StepInputs:
    """A phase's static inputs: activations, their positions and (decode) the K/V cache."""

    x: torch.Tensor
    positions: torch.Tensor
    cache: tuple[torch.Tensor, torch.Tensor] | None


def make_inputs(
    cfg: LlamaConfig, phase: Phase, kv_len: int, gen: torch.Generator, device: Any, dtype: Any
) -> StepInputs:
    x = torch.randn((phase.batch, phase.tokens, cfg.hidden), generator=gen).to(device, dtype)
    if phase.name == "prefill":
        return StepInputs(x, torch.arange(phase.tokens, device=device), None)
    shape = (phase.batch, cfg.kv_heads, kv_len, cfg.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    return StepInputs(x, torch.tensor([kv_len - phase.tokens], device=device), (k, v))


def bind(layer: nn.Module, inputs: StepInputs) -> Callable[[], torch.Tensor]:
    """A closure running one layer step on static inputs (what a CUDA graph captures)."""
    if inputs.cache is None:
        return lambda: layer(inputs.x, inputs.positions)
    return lambda: layer(inputs.x, inputs.positions, inputs.cache)


def make_step(
    layer: DecoderLayer, phase: Phase, kv_len: int, gen: torch.Generator
) -> Callable[[], torch.Tensor]:
    """``bind`` on new inputs of the layer's device and dtype."""
    dtype = layer.qkv.weight.dtype
    return bind(layer, make_inputs(layer.cfg, phase, kv_len, gen, layer.cos.device, dtype))


# --- timing ---------------------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_us(step: Callable[[], Any], iters: int) -> float:
    """Time per step over ``iters`` back-to-back steps, host launch time included: CUDA events on
    the GPU, the host clock on the CPU (smoke runs)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t0) * 1e6 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def capture(
    step: Callable[[], Any], warmup: int = 3, dot: Path | None = None, pool: Any = None
) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (resolves every call signature eagerly), then capture one step.
    ``dot``: the graph's nodes and edges are also written there (CUDA's debug dump, DOT).
    ``pool``: the memory pool to capture into (``torch.cuda.graph_pool_handle()``), shared with
    the other graphs captured into it: their steps' buffers then lie at the same addresses."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=dot is not None)  # kept: dumped before instantiated
    with torch.cuda.graph(graph, pool=pool):
        step()
    if dot is not None:
        dot.parent.mkdir(parents=True, exist_ok=True)
        graph.debug_dump(str(dot))
        graph.instantiate()
    return graph


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_us": statistics.median(s), "min_us": s[0], "max_us": s[-1]}


# --- the benchmark --------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def build_phases(args: argparse.Namespace) -> list[Phase]:
    tuned = [Phase("decode", b, 1) for b in parse_sizes(args.decode_batches)]
    tuned.append(Phase("prefill", 1, args.prefill_seq))
    extra = [Phase("decode", b, 1, tuned=False) for b in parse_sizes(args.extra_batches)]
    return tuned + extra


def record_keys(tt: Any, disp: Any, runs: list[Callable[[], Any]]) -> list[str]:
    """The problem keys the steps make, in first-seen order (dispatcher in record mode)."""
    disp.set_mode("record")
    before = set(disp.resolutions)
    with torch.no_grad(), tt.enabled(dispatcher=disp):
        for run in runs:
            run()
    sync()
    made = [r for t, r in disp.resolutions.items() if t not in before and r.kind != "untunable"]
    return list(dict.fromkeys(r.key for r in made))


def tuning_detail(measurements: list[Any]) -> dict[str, Any]:
    """The baseline's and the fastest challenger's times as tuned (GPU and host per call): why
    the winner won."""
    timed = [m for m in measurements if m.status in ("ok", "cut") and m.median_us]
    base = next((m for m in timed if m.is_baseline), None)
    rival = min((m for m in timed if not m.is_baseline), key=lambda m: m.median_us, default=None)
    out: dict[str, Any] = {}
    for label, m in (("baseline", base), ("best_challenger", rival)):
        if m is not None:
            out[label] = {"source": m.source, "params": m.params, "status": m.status,
                          "median_us": m.median_us, "host_us": m.host_us}  # fmt: skip
    return out


def tune_missing(keys: list[str], args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """Tune the keys without a current winner, decode (small M / q_len) first, to a deadline."""
    from tuner.cache import Store, default_path
    from tuner.core.device import fingerprint
    from tuner.core.keys import parse_key
    from tuner.tuning.engine import TuneOptions, tune

    fp = fingerprint(device)
    store = Store(default_path())
    store.save_device(fp)
    current = {w.key: w for w in store.winners(fp.device_class) if w.versions == fp.version_tag}
    parsed = [parse_key(k) for k in keys]
    parsed.sort(key=lambda k: getattr(k, "m", None) or getattr(k, "q_len", 1))
    options = TuneOptions(
        budget_s=args.budget,
        max_candidates=args.max_candidates,
        sources=args.source,
        launch=args.launch,
    )
    deadline = time.monotonic() + args.tune_deadline_s
    log = []
    for key in parsed:
        row: dict[str, Any] = {"key": str(key)}
        if str(key) in current:
            w = current[str(key)]
            row.update(status="cached", winner=w.candidate, speedup=w.speedup)
        elif time.monotonic() > deadline:
            row.update(status="skipped: tuning deadline reached")
        else:
            try:
                outcome = tune(key, options=options, device=device)
            except RuntimeError as e:
                row.update(status=f"failed: {e}")
            else:
                store.save_run(outcome.measurements, outcome.winner)
                w = outcome.winner
                row.update(
                    status="tuned",
                    winner=w.candidate,
                    speedup=w.speedup,
                    seconds=round(outcome.seconds, 2),
                    **tuning_detail(outcome.measurements),
                )
        print(f"  {row['status']:<10} {row.get('winner', '')[:60]:<60} {key}", flush=True)
        log.append(row)
    store.close()
    return log


MODES = ("eager_off", "eager_on", "graph_off", "graph_on")


def measure_phase(
    tt: Any, disp: Any, step: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Eager and CUDA-graph replay (GPU only), tuner off and on, interleaved over rounds in an
    order balanced over the rounds (``timing.round_order``): after a mode's heavy steps the GPU's
    clock is not what it is after light ones, and a fixed order would charge that to the mode
    that follows."""
    row: dict[str, Any] = {}
    runs: dict[str, Callable[[], Any]] = {"eager_off": step}

    def on() -> contextlib.AbstractContextManager:
        return tt.enabled(dispatcher=disp)

    with torch.no_grad():
        ref = step().clone()
        with on():
            for _ in range(3):  # resolves every signature, compiles and loads the kernels
                out = step()
        row["rel_err_on_vs_off"] = samples.relative_error(out, ref.float())
        if torch.cuda.is_available():
            for mode, ctx in (("graph_off", contextlib.nullcontext), ("graph_on", on)):
                try:
                    with ctx():
                        runs[mode] = capture(step).replay
                except RuntimeError as e:  # reported, and the other measurements go on
                    row[f"{mode}_error"] = f"capture failed: {e}"[:1000]
                    torch.cuda.synchronize()
        modes = [mode for mode in MODES if mode in runs or mode == "eager_on"]
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        tt.reset_stats(disp)
        for r in range(args.rounds):  # balanced: in a fixed order each mode would follow one
            for mode in timing.round_order(modes, r):
                if mode == "eager_on":
                    with on():
                        times[mode].append(step_us(step, args.iters))
                else:
                    times[mode].append(step_us(runs[mode], args.iters))
        stats = tt.stats(disp)
    runs.clear()  # frees the graphs and their memory pools
    row.update({mode: summary(v) for mode, v in times.items()})
    for kind in ("eager", "graph"):
        if f"{kind}_on" in row and f"{kind}_off" in row:
            row[f"{kind}_ratio"] = row[f"{kind}_off"]["median_us"] / row[f"{kind}_on"]["median_us"]
    row["stats"] = {k: v for k, v in stats.to_dict().items() if k != "rows"}
    row["served"] = [
        {"key": r.key, "kind": r.kind, "candidate": r.candidate, "via": r.via}
        for r in stats.rows
        if r.calls
    ]
    return row


def hit_path_overhead(
    tt: Any, disp: Any, args: argparse.Namespace, device: str, dtype: torch.dtype
) -> dict[str, Any]:
    """Host time per eager call: winner runner direct vs dispatcher vs F.linear under the mode."""
    from tuner.candidates import registry
    from tuner.core.keys import GemmKey

    m, n, k = args.overhead_shape
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((m, k), generator=gen).to(device, dtype)
    w = torch.randn((n, k), generator=gen).to(device, dtype)
    wt = w.t()
    with torch.no_grad():
        disp.matmul(x, wt)  # resolve the signature
        key = GemmKey.from_tensors(x, wt)
        # the latest resolution of the key: earlier ones (record mode, before tuning) linger
        res = next((r for r in reversed(disp.resolutions.values()) if r.key == str(key)), None)
        base = registry.baseline("gemm")
        if res is not None and res.winner is not None and res.candidate != base.name:
            runner = registry.get(res.winner.source).build(key, res.winner.params)
        else:
            runner = base.build(key, base.baseline_params)

        def loop(fn: Callable[[], Any]) -> float:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.overhead_calls):
                fn()
            elapsed = time.perf_counter() - t0
            sync()
            return elapsed / args.overhead_calls * 1e6

        def linear_on() -> Any:
            with tt.enabled(dispatcher=disp):
                return loop(lambda: F.linear(x, w))

        variants: dict[str, Callable[[], float]] = {
            "runner_direct": lambda: loop(lambda: runner(x, wt)),
            "dispatcher_matmul": lambda: loop(lambda: disp.matmul(x, wt)),
            "torch_linear_off": lambda: loop(lambda: F.linear(x, w)),
            "tuner_linear_on": linear_on,
        }
        for measure in variants.values():  # warm-up round
            measure()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.overhead_rounds):  # the order rotates: none always runs first
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(variants[name]())
    med = {name: statistics.median(v) for name, v in samples.items()}
    # other processes only ever add time: the least disturbed round is the code's own cost
    # (what timeit reports); the medians show how much a busy host adds
    low = {name: min(v) for name, v in samples.items()}
    return {
        "shape": {"m": m, "n": n, "k": k, "key": str(key)},
        "serving": res.candidate if res else "?",
        "per_call_us": med,
        "min_per_call_us": low,
        "samples_us": samples,
        "dispatcher_over_runner_us": low["dispatcher_matmul"] - low["runner_direct"],
        "dropin_over_runner_us": low["tuner_linear_on"] - low["runner_direct"],
        "median_dropin_over_runner_us": med["tuner_linear_on"] - med["runner_direct"],
    }


def profile_step(
    tt: Any, disp: Any, step: Callable[[], Any], steps: int = 100, top: int = 40
) -> dict[str, Any]:
    """Where the host time of an eager step goes, tuner off and on: wall time per step (host
    launch throughput, synchronised at the end) and cProfile's busiest functions with it on."""
    import cProfile
    import io
    import pstats

    def host_us() -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return (time.perf_counter() - t0) * 1e6 / steps

    out: dict[str, Any] = {}
    with torch.no_grad():
        out["step_us_off"] = statistics.median(host_us() for _ in range(5))
        with tt.enabled(dispatcher=disp):
            out["step_us_on"] = statistics.median(host_us() for _ in range(5))
            prof = cProfile.Profile()
            prof.enable()
            host_us()
            prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    out["profile_on"] = text.getvalue().splitlines()
    return out


ROUTED_OPS = ("aten::linear", "aten::scaled_dot_product_attention")


def kernel_breakdown(step: Callable[[], Any], steps: int = 20) -> dict[str, float]:
    """GPU kernel time per step (us) under each op the tuner routes, tuner off, from
    torch.profiler: their kernels are all a tuner can make faster."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        step()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            sync()
    events = prof.key_averages()
    out: dict[str, float] = {}
    for op in ROUTED_OPS:
        out[f"{op}_us"] = sum(e.device_time_total for e in events if e.key == op) / steps
    out["routed_us"] = sum(out[f"{op}_us"] for op in ROUTED_OPS)
    return out


def peak_memory_gbs() -> float:
    """The memory's theoretical bandwidth (DDR clock x bus width): no kernel reads faster."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8 / 1e9


def routed_bytes(layer: DecoderLayer, phase: Phase, kv_len: int) -> int:
    """Bytes the routed ops of one decode step must read at least: the four weight matrices and
    the whole K/V cache (activations, a few MB at most, left out: the bound stays generous)."""
    cfg = layer.cfg
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    kv = 2 * phase.batch * cfg.kv_heads * kv_len * cfg.head_dim * layer.qkv.weight.element_size()
    return weights + kv


def speedup_bound(row: dict[str, Any], nbytes: int, bandwidths: dict[str, float]) -> dict[str, Any]:
    """Amdahl's bound on the graph step's on/off ratio: the routed ops' kernels replaced by
    kernels that read their bytes at the given bandwidth, everything else as measured. A
    tuner that only routes GEMMs and SDPA cannot beat it."""
    step, routed = row["graph_off"]["median_us"], row["breakdown"]["routed_us"]
    out: dict[str, Any] = {"routed_bytes": nbytes, "step_us": step}
    for name, gbs in bandwidths.items():
        floor = nbytes / gbs / 1e3
        out[f"floor_us_at_{name}"] = floor
        # routed kernels are profiled eagerly, the step replayed in a graph: should the first
        # exceed the second, the rest of the step counts as 0 us, not less
        out[f"max_ratio_at_{name}"] = step / (max(step - routed, 0.0) + floor)
    return out


def targets(rows: list[dict[str, Any]], overhead: dict[str, Any]) -> dict[str, Any]:
    decode = [r for r in rows if r["phase"] == "decode" and r["tuned"]]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    out: dict[str, Any] = {}
    bounds = [r["bound"]["max_ratio_at_peak"] for r in decode if "bound" in r]
    if bounds:
        out["decode_graph_bound"] = {
            "max_ratio_at_peak_min": min(bounds),
            "max_ratio_at_peak_max": max(bounds),
            "note": "Amdahl: routed kernels at the memory's peak bandwidth, the rest as measured",
        }
    for kind in ("eager", "graph"):
        ratios = [r[f"{kind}_ratio"] for r in decode if f"{kind}_ratio" in r]
        if not ratios:
            continue
        out[f"decode_{kind}"] = {
            "geomean": geomean(ratios),
            "min": min(ratios),
            "target": ">= 1.15x every tuned decode batch",
            "met": min(ratios) >= 1.15,
        }
        pre = [r[f"{kind}_ratio"] for r in prefill]
        out[f"prefill_{kind}"] = {
            "ratio": pre[0] if pre else float("nan"),
            "target": "no slower: >= 0.98x (noise)",
            "met": bool(pre) and min(pre) >= 0.98,
        }
    over = overhead["dropin_over_runner_us"]
    out["hit_path_overhead"] = {
        "dropin_over_runner_us": over,
        "dispatcher_over_runner_us": overhead["dispatcher_over_runner_us"],
        "median_dropin_over_runner_us": overhead["median_dropin_over_runner_us"],
        "target": "<= 5 us per call over the winner's runner, eager (least disturbed round)",
        "met": over <= 5,
    }
    return out


def plot(rows: list[dict[str, Any]], path: Path, model: str) -> None:
    from tuner.offline.plots import speedup_plot

    labels, ratios, groups = [], [], []
    for r in rows:
        for kind in ("eager", "graph"):
            if f"{kind}_ratio" in r:
                labels.append(f"{r['label']} {kind}")
                ratios.append(r[f"{kind}_ratio"])
                groups.append(kind)
    speedup_plot(
        labels,
        ratios,
        path,
        title=f"{model} decoder layer: tuner.torch on vs off (time per layer step)",
        groups=groups,
    )


def plot_bound(rows: list[dict[str, Any]], path: Path, model: str) -> Path | None:
    """Per decode batch: the measured CUDA-graph ratio beside Amdahl's bound at the copy and at
    the peak bandwidth, and the 1.15x target: where the target lies above what any kernel of
    the routed ops could reach."""
    decode = [r for r in rows if "bound" in r]
    if not decode:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        r["label"].removeprefix("decode ").replace(" (untuned M)", "\nuntuned M") for r in decode
    ]
    x = range(len(decode))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    series = (
        ("measured (graph, on/off)", [r["graph_ratio"] for r in decode], "tab:blue"),
        ("bound: routed kernels at copy bandwidth", [r["bound"]["max_ratio_at_copy"] for r in decode], "tab:gray"),
        ("bound: routed kernels at peak bandwidth", [r["bound"]["max_ratio_at_peak"] for r in decode], "lightgray"),
    )  # fmt: skip
    for i, (name, values, color) in enumerate(series):
        ax.bar([j + (i - 1) * width for j in x], [v - 1 for v in values], width, bottom=1,
               color=color, label=name)  # fmt: skip
    ax.axhline(1.15, color="red", linestyle="--", linewidth=1, label="target 1.15x")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("decode step speedup, tuner on / off")
    ax.set_title(f"{model} decoder layer, CUDA graph: measured vs Amdahl's bound")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bound_plot_path(plot_path: Path) -> Path:
    return plot_path.with_name(plot_path.stem + "_bound.png")


def bf16_layer(
    args: argparse.Namespace, script: str
) -> tuple[str, LlamaConfig, DecoderLayer, torch.Generator]:
    """A layer benchmark's set-up: the device (``script`` exits without a GPU unless
    ``--smoke``), Llama-3-8B's config (tiny with ``--smoke``, on one CPU thread), its layer in
    bf16 with random weights (seed 0), and the generator, which goes on to make the inputs."""
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU (or --smoke for a CPU check)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TINY if args.smoke else LLAMA3_8B
    if args.smoke:
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    layer = DecoderLayer(cfg, max_pos=max(args.kv_len, args.prefill_seq))
    init_weights(layer, gen)
    return device, cfg, layer.to(device, torch.bfloat16).eval(), gen


def save_json(path: Path, result: dict[str, Any], started: float) -> None:
    """``result`` with the seconds since ``started``, written after every stage: a run cut
    short by a timeout still leaves its data."""
    result["seconds"] = round(time.perf_counter() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def run_header(name: str, args: argparse.Namespace, device: str, config: dict) -> dict[str, Any]:
    """The head of a run's JSON: which benchmark, on what device and versions, with what."""
    from tuner.core.device import fingerprint

    fp = fingerprint(device)
    return {
        "benchmark": name,
        "smoke": args.smoke,
        "device": fp.to_dict(),
        "versions": fp.versions,
        "config": config,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "complete": False,
    }


def warm_up(disp: Any) -> dict[str, Any]:
    """``tuner.warmup()`` into ``disp``, before any CUDA graph is captured (as users must), and
    what it says: winners loaded, ready before, failures."""
    from tuner.serving.warmup import warmup

    report = warmup(progress=False, dispatcher=disp, fetch=False)
    failures = [vars(f) for f in report.failures]
    return {"loaded": report.loaded, "ready": report.ready, "failures": failures}


def tune_and_serve(
    tt: Any,
    disp: Any,
    runs: list[Callable[[], Any]],
    args: argparse.Namespace,
    device: str,
    result: dict[str, Any],
    save: Callable[[], None],
    buckets: str | None = None,
) -> None:
    """Record the problems ``runs`` make into ``disp``, tune those without a winner (none with
    ``--skip-tune``; ``save()`` after each), then have ``disp`` serve the cache's winners (by
    ``buckets``' policy where given), warmed up: the run's "recorded", "tuning" and "warmup"."""
    keys = record_keys(tt, disp, runs)
    print(f"{len(keys)} problems recorded", flush=True)
    result["recorded"] = keys
    save()
    result["tuning"] = [] if args.skip_tune else tune_missing(keys, args, device)
    save()
    disp.reload()
    disp.set_mode("lookup")
    if buckets is not None:
        disp.set_buckets(buckets)
    result["warmup"] = warm_up(disp)


def add_tuning_arguments(parser: argparse.ArgumentParser, launch: str, deadline_s: float) -> None:
    """The options ``tune_missing`` reads, with this benchmark's defaults."""
    parser.add_argument("--budget", type=float, default=0.05, help="Timing budget per candidate.")
    parser.add_argument("--max-candidates", type=int, default=None, help="Per source.")
    parser.add_argument(
        "--source",
        action="append",
        help="Only these candidate sources (repeatable; the baseline always).",
    )
    parser.add_argument(
        "--launch", choices=("eager", "graph"), default=launch, help="What tuning optimises for."
    )
    parser.add_argument("--tune-deadline-s", type=float, default=deadline_s)
    parser.add_argument("--skip-tune", action="store_true", help="Use the cache as it is.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="JSON results file (required unless --replot).")
    parser.add_argument(
        "--replot", type=Path, help="Only redraw --plot (and its _bound.png) from this JSON."
    )
    parser.add_argument("--plot", type=Path, help="PNG of the on/off ratios.")
    parser.add_argument("--decode-batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--extra-batches", default="24,48", help="Decode batches left untuned.")
    parser.add_argument("--prefill-seq", type=int, default=2048)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--buckets", default="next_tuned_above", help="Bucket policy when on.")
    add_tuning_arguments(parser, launch="eager", deadline_s=360.0)
    parser.add_argument("--iters", type=int, default=20, help="Steps per timed round.")
    parser.add_argument(
        "--rounds",
        type=int,
        default=16,
        help="Interleaved rounds per phase (a multiple of the balanced order's cycle: 4 modes on a "
        "GPU, 2 on the CPU).",
    )
    parser.add_argument("--overhead-shape", type=int, nargs=3, default=(16, 256, 256))
    parser.add_argument("--overhead-calls", type=int, default=2000)
    parser.add_argument("--overhead-rounds", type=int, default=15)
    parser.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        help="Also profile the host side of this decode batch's eager step (JSON 'profile').",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="Tiny dimensions in f32 on the CPU: checks the whole script without a GPU.",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.replot is None:
        parser.error("--out is required (or --replot with --plot)")
    if args.replot is not None and args.plot is None:
        parser.error("--replot needs --plot")
    return args


def draw(rows: list[dict[str, Any]], path: Path, model: str) -> None:
    plot(rows, path, model)
    plot_bound(rows, bound_plot_path(path), model)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        draw(saved["phases"], args.plot, "tiny CPU smoke" if saved["smoke"] else "Llama-3-8B bf16")
        return saved
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("dropin_decoder.py needs a CUDA GPU (or --smoke for a CPU check)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, cfg = (torch.float32, TINY) if args.smoke else (torch.bfloat16, LLAMA3_8B)
    if args.smoke:
        torch.set_num_threads(1)  # host timings of tiny CPU ops are noise with a thread pool

    import tuner.torch as tt
    from tuner.serving.dispatcher import Dispatcher

    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    layer = DecoderLayer(cfg, max_pos=max(args.kv_len, args.prefill_seq))
    init_weights(layer, gen)
    layer = layer.to(device, dtype).eval()
    phases = build_phases(args)
    steps = {p: make_step(layer, p, args.kv_len, gen) for p in phases}
    disp = Dispatcher(mode="record")
    disp.set_buckets("exact")

    m, n, k = args.overhead_shape
    small_x = torch.randn((m, k), generator=gen).to(device, dtype)
    small_w = torch.randn((n, k), generator=gen).to(device, dtype)
    tuned_runs = [steps[p] for p in phases if p.tuned] + [lambda: F.linear(small_x, small_w)]
    config = {**vars(cfg), "dtype": str(dtype).removeprefix("torch.")}
    result = run_header("dropin_decoder", args, device, config)

    def save() -> None:
        save_json(args.out, result, started)

    tune_and_serve(tt, disp, tuned_runs, args, device, result, save, buckets=args.buckets)
    overhead = hit_path_overhead(tt, disp, args, device, dtype)
    print(f"hit-path overhead per call (us): {json.dumps(overhead['per_call_us'])}", flush=True)
    result["overhead"] = overhead
    if args.profile_batch is not None:
        phase = Phase("decode", args.profile_batch, 1)
        step = steps.get(phase) or make_step(layer, phase, args.kv_len, gen)
        result["profile"] = profile_step(tt, disp, step)
        print(
            f"host us per step: off {result['profile']['step_us_off']:.1f}, "
            f"on {result['profile']['step_us_on']:.1f}",
            flush=True,
        )
        print("\n".join(result["profile"]["profile_on"]), flush=True)
        save()
    bandwidths: dict[str, float] = {}
    if device == "cuda":
        from tuner.measure.timing import copy_bandwidth_gbs

        bandwidths = {"peak": peak_memory_gbs(), "copy": copy_bandwidth_gbs(device)}
        result["bandwidth_gbs"] = bandwidths
    rows: list[dict[str, Any]] = []
    result["phases"] = rows
    for phase in phases:
        row: dict[str, Any] = {"phase": phase.name, "batch": phase.batch, "tokens": phase.tokens}
        row.update(label=phase.label, tuned=phase.tuned)
        row.update(measure_phase(tt, disp, steps[phase], args))
        if bandwidths and phase.name == "decode" and "graph_ratio" in row:
            row["breakdown"] = kernel_breakdown(steps[phase])
            nbytes = routed_bytes(layer, phase, args.kv_len)
            row["bound"] = speedup_bound(row, nbytes, bandwidths)
        times = "   ".join(
            f"{kind} {row[f'{kind}_off']['median_us']:.1f} -> {row[f'{kind}_on']['median_us']:.1f}"
            f" us ({row[f'{kind}_ratio']:.3f}x)"
            for kind in ("eager", "graph")
            if f"{kind}_ratio" in row
        )
        if "bound" in row:
            times += (
                f"   routed kernels {row['breakdown']['routed_us']:.1f} us, bound "
                f"{row['bound']['max_ratio_at_peak']:.3f}x"
            )
        print(f"{phase.label:<28} {times}   {row['stats']}", flush=True)
        rows.append(row)
        save()
    result["targets"] = targets(rows, overhead)
    result["complete"] = True
    save()
    if args.plot:
        draw(rows, args.plot, "tiny CPU smoke" if args.smoke else "Llama-3-8B bf16")
    print(json.dumps(result["targets"], indent=1))
    return result


if __name__ == "__main__":
    main()

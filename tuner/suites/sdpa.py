"""``tuner bench sdpa``: tuned attention against torch's default SDPA, side by side in one run.

Two suites (tuner.suites.runner runs each: tune every problem, then time torch's default and
the winner alternately on the same inputs):

- **prefill**: 16k tokens per batch (batch x seq = 16384), head dims 64 and 128, causal (torch's
  ``is_causal``) and not, 32 q heads with 32 and 8 kv heads. Reported: TFLOP/s of torch's default,
  of the winner, and of cuDNN's and the best Triton candidate's as measured while tuning.
- **decode**: q len 1 (no mask) and 4 (bottom-right causal, e.g. verifying speculated tokens
  against the cache), 32 q / 8 kv heads, head dim 128, over kv lengths and batches whose K/V fits.
  Reported: GB/s of K/V read and its share of the measured device-to-device copy bandwidth.

Triton candidates are compiled in parallel by the tuner itself (``Source.precompile``), as in
``tuner tune-all``; ``--workers`` sizes that pool (``TUNER_COMPILE_WORKERS``).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from tuner.candidates import registry
from tuner.core.console import output_console
from tuner.core.keys import Key, SdpaKey, parse_key
from tuner.measure import samples, timing
from tuner.measure.records import (
    Measurement,
    candidate_label,
    candidate_name,
    candidate_params,
    clipped,
)
from tuner.offline.plots import geomean
from tuner.suites import catalog
from tuner.suites.runner import (
    marked_if_interrupted,
    pct_of_copy,
    print_figures,
    print_notes,
    quick_cpu_note,
    quick_on_cpu,
    rate,
    run_suite,
    save_result,
    speedup_drawing,
    verdict_notes,
)
from tuner.tuning.engine import TuneOptions, TuneOutcome, current_device
from tuner.tuning.tune import tune

console = output_console()

TOKENS = 16384
PREFILL_SEQS = (512, 2048, 8192, 16384)
PREFILL_HEAD_DIMS = (64, 128)
PREFILL_KV_HEADS = (32, 8)
DECODE_KV = (1024, 8192, 32768, 131072)
DECODE_BATCH = (1, 8, 64)
DECODE_Q = (1, 4)
Q_HEADS = 32
DECODE_KV_HEADS = 8
MAX_KV_BYTES = 40e9  # decode shapes whose K/V exceeds this are left out
TARGET_KV_BYTES = 32 * 2**20  # decode shapes reading at least this much must reach 80% of copy

Problems = list[tuple[str, SdpaKey]]
QUICK_CPU_ROWS = {  # what --quick's rows on a CPU are, in each part's shapes_note
    "prefill": f"CPU-path rows of a small prefill ({catalog.SDPA_QUICK_CPU_PREFILL_SEQ} tokens)",
    "decode": "CPU-path rows of small decodes (batch 1, {} keys)".format(
        " and ".join(map(str, catalog.SDPA_QUICK_CPU_DECODE_KV))
    ),
}


def prefill_problems(
    dtype: str = "bf16",
    *,
    seqs: tuple[int, ...] = PREFILL_SEQS,
    tokens: int = TOKENS,
    kv_heads: tuple[int, ...] = PREFILL_KV_HEADS,
) -> Problems:
    """Prefill rows: each sequence length in batches of ``tokens`` tokens."""
    out = []
    for seq, d, causal, kvh in itertools.product(
        seqs, PREFILL_HEAD_DIMS, ("none", "top_left"), kv_heads
    ):
        key = SdpaKey(
            batch=tokens // seq, q_heads=Q_HEADS, kv_heads=kvh, q_len=seq, kv_len=seq,
            head_dim=d, causal=causal, dtype=dtype,
        )  # fmt: skip
        label = f"b{key.batch} s{seq} d{d} kv{kvh} {'causal' if causal != 'none' else 'full'}"
        out.append((label, key))
    return out


def decode_problems(
    dtype: str = "bf16",
    *,
    kv_lens: tuple[int, ...] = DECODE_KV,
    batches: tuple[int, ...] = DECODE_BATCH,
) -> Problems:
    """Decode rows: q len 1 and 4 against each kv length and batch whose K/V fits."""
    out = []
    for q_len, kv, batch in itertools.product(DECODE_Q, kv_lens, batches):
        key = SdpaKey(
            batch=batch, q_heads=Q_HEADS, kv_heads=DECODE_KV_HEADS, q_len=q_len, kv_len=kv,
            head_dim=128, causal="none" if q_len == 1 else "bottom_right", dtype=dtype,
        )  # fmt: skip
        if key.kv_bytes > MAX_KV_BYTES:
            continue
        out.append((f"q{q_len} b{batch} kv{kv // 1024}k ({key.kv_bytes / 1e6:.0f} MB)", key))
    return out


PARTS = {"prefill": prefill_problems, "decode": decode_problems}


def chosen_problems(
    part: str, dtype: str = "bf16", *, quick: bool = False, device: str | None = None
) -> Problems:
    """A part's rows (``PARTS``): all of them, or ``--quick``'s: every 4th on a GPU; on a CPU
    ``device`` the small ones (``catalog.SDPA_QUICK_CPU_*``, labelled so: ``quick_cpu_label``),
    since every 4th GPU row still holds 16k tokens or GBs of K/V."""
    if not quick_on_cpu(quick, device):
        return PARTS[part](dtype)[:: 4 if quick else 1]
    if part == "prefill":
        seq = catalog.SDPA_QUICK_CPU_PREFILL_SEQ
        rows = prefill_problems(dtype, seqs=(seq,), tokens=seq, kv_heads=(DECODE_KV_HEADS,))
    else:
        rows = decode_problems(dtype, kv_lens=catalog.SDPA_QUICK_CPU_DECODE_KV, batches=(1,))
    return [(catalog.quick_cpu_label(label), key) for label, key in rows]


def prefill_metrics(key: Key, us: float) -> dict[str, float]:
    assert isinstance(key, SdpaKey)
    return {"tflops": key.flops / us / 1e6}


def decode_metrics(key: Key, us: float) -> dict[str, float]:
    assert isinstance(key, SdpaKey)
    return {"kv_gbs": key.kv_bytes / us / 1e3}


# --- the command -----------------------------------------------------------------------------------


class Recorder:
    """Runs engine.tune and keeps each outcome, so rows can show candidates other than the winner."""

    def __init__(self) -> None:
        self.outcomes: dict[str, TuneOutcome] = {}

    def __call__(self, key: Key, options: TuneOptions) -> TuneOutcome:
        outcome = tune(key, options=options)
        self.outcomes[str(key)] = outcome
        return outcome


def _best(ms: list[Measurement], source: str, backend: str | None = None) -> Measurement | None:
    """The fastest measured candidate of a source (a cut one counts with its probe median)."""
    ok = [
        m for m in ms
        if m.status in ("ok", "cut") and m.source == source
        and (backend is None or m.params.get("backend") == backend)
    ]  # fmt: skip
    return min(ok, key=lambda m: m.median_us or float("inf"), default=None)


GRAPH_MAX_KV_BYTES = 1e9  # decode rows up to this size also get CUDA-graph (GPU-only) times


def add_graph_times(row: dict[str, Any], key: SdpaKey, ms: list[Measurement], copy: float) -> None:
    """CUDA-graph GPU times (``timing.graph_time``) of torch's default, of the winner and of every
    Triton decode candidate that ran while tuning (the fastest is reported), with the K/V read as
    % of copy bandwidth: what a server running its decode step as a graph sees. Runners allocate
    their output, as the dispatcher calls them (an ``out`` would cost torch's SDPA a copy)."""
    sets = samples.input_sets(key, "cuda", seed=3)
    base = registry.baseline("sdpa")
    tried: list[tuple[str, str, dict[str, Any]]] = [("baseline", base.name, base.baseline_params)]
    if row["source"] != base.name:
        tried.append(("winner", row["source"], candidate_params(row["candidate"])))
    tried += [
        ("triton", m.source, m.params)
        for m in ms
        if m.source == "triton_decode" and m.status in ("ok", "cut")
    ]
    for label, source, params in tried:
        try:
            us = timing.graph_time_over(registry.get(source).build(key, params), sets)
            us = us.median_us
        except Exception as e:  # e.g. a torch path that cannot be captured
            row[f"{label}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
            continue
        if us < row.get(f"{label}_graph_us", float("inf")):
            row[f"{label}_graph_us"] = us
            row[f"{label}_graph_pct_copy"] = pct_of_copy(key.kv_bytes, us, copy)
            row[f"{label}_graph_candidate"] = candidate_name(source, params)
    if row["source"] == base.name and "baseline_graph_us" in row:
        for field in ("us", "pct_copy", "candidate"):
            row[f"winner_graph_{field}"] = row[f"baseline_graph_{field}"]


def recheck(key: SdpaKey, source: str, params: dict[str, Any], device: str) -> float:
    """Relative error of a winner's *third* call on fresh inputs (the first call of a Triton
    runner goes through the JIT, later ones launch the compiled kernel directly, which is what
    the side-by-side timing ran); raises if a repeat call does not reproduce it bit for bit."""
    runner = registry.get(source).build(key, params)
    gen = torch.Generator(device=device).manual_seed(7)
    inputs = samples.make_inputs(key, device, gen)
    first = runner(*inputs)
    second = runner(*inputs, out=samples.output_like(key, inputs))
    third = runner(*inputs, out=samples.output_like(key, inputs))
    if not (torch.equal(first, second) and torch.equal(second, third)):
        raise RuntimeError(f"{source} {params}: repeat calls on {key} differ")
    return samples.relative_error(third, samples.reference(key, inputs))


def copy_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode target: rows reading >= 32 MB of K/V at >= 80% of copy bandwidth, on the eager
    time and on GPU time (the served winner's CUDA-graph time: eager times of short kernels are
    the host's launch time). Rows without a graph time (larger than ``GRAPH_MAX_KV_BYTES``, where
    the GPU sets the pace eagerly too, or a failed capture) count with their eager figure; how
    many did is reported."""
    big = [r for r in rows if r["kv_bytes"] >= TARGET_KV_BYTES]
    gpu = [r.get("winner_graph_pct_copy", r["pct_copy"]) for r in big]
    return {
        "n_kv_ge_32MB": len(big),
        "n_kv_ge_32MB_at_80pct": sum(r["pct_copy"] >= 80 for r in big),
        "min_pct_copy_kv_ge_32MB": min((r["pct_copy"] for r in big), default=None),
        "n_kv_ge_32MB_at_80pct_gpu": sum(p >= 80 for p in gpu),
        "min_pct_copy_kv_ge_32MB_gpu": min(gpu, default=None),
        "n_kv_ge_32MB_gpu_from_eager": sum("winner_graph_pct_copy" not in r for r in big),
    }


def annotate(result: dict[str, Any], recorder: Recorder, kind: str) -> dict[str, Any]:
    """Add per-row tuning detail (cuDNN and best Triton times, host launch times) and targets."""
    copy = result["copy_gbs"]
    for row in result["rows"]:
        row.update(row.pop("extra", {}))  # the suite nests metrics under "extra": flatten
        key = parse_key(row["key"])
        outcome = recorder.outcomes.get(row["key"])
        ms = outcome.measurements if outcome else []
        base = next((m for m in ms if m.is_baseline and m.status == "ok"), None)
        win = next((m for m in ms if m.candidate == row["candidate"] and m.status == "ok"), None)
        if row["source"] != registry.baseline("sdpa").name:
            try:
                params = candidate_params(row["candidate"])
                row["recheck_err"] = recheck(key, row["source"], params, current_device())
            except Exception as e:  # a broken winner must show, not sink the report
                row["recheck_err"] = f"{type(e).__name__}: {e}"[:300]
        row["baseline_host_us"] = base.host_us if base else None
        row["winner_host_us"] = win.host_us if win else None
        row["candidates"] = [
            {
                "candidate": m.candidate, "status": m.status, "median_us": m.median_us,
                "host_us": m.host_us, "rel_err": m.max_rel_err, "error": m.error[:300],
            }
            for m in ms
        ]  # fmt: skip
        for label, m in (
            ("default_tune", base),
            ("cudnn", _best(ms, "torch_sdpa", "cudnn")),
            ("flash", _best(ms, "torch_sdpa", "flash")),
            ("triton", _best(ms, "triton_decode" if kind == "decode" else "triton_attention")),
        ):
            us = m.median_us if m else None
            row[f"{label}_us"] = us
            if kind == "prefill":
                row[f"{label}_tflops"] = key.flops / us / 1e6 if us else None
        if kind == "decode":
            row["kv_bytes"] = key.kv_bytes
            row["pct_copy"] = 100 * row["kv_gbs"] / copy
            row["baseline_pct_copy"] = 100 * row["baseline_kv_gbs"] / copy
            if current_device() == "cuda" and key.kv_bytes <= GRAPH_MAX_KV_BYTES:
                try:
                    add_graph_times(row, key, ms, copy)
                except Exception as e:  # extra detail: never lose the suite's results over it
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    rows = result["rows"]
    s = result["summary"]
    if kind == "decode" and rows:
        s.update(copy_targets(rows))
    ratios = [r["baseline_us"] / r["triton_us"] for r in rows if r.get("triton_us")]
    if kind == "prefill" and ratios:  # none where Triton was left out (--source): no figure
        s["geomean_triton_vs_baseline"] = geomean(ratios)
    return result


def _graph_figure(row: dict[str, Any], label: str, name: str) -> str:
    us = row.get(f"{label}_graph_us")
    if us is None:
        return f"{name} n/a"
    return f"{name} {us:.1f} us ({row[f'{label}_graph_pct_copy']:.0f}%)"


def _print_extra(result: dict[str, Any], kind: str) -> None:
    for r in result["rows"]:
        err = r.get("recheck_err")
        if isinstance(err, str) or (err is not None and not err <= 5e-2):
            console.print(
                f"[red]{escape(r['label'])}: winner recheck failed: {escape(str(err))}[/red]"
            )
        for c in r["candidates"]:
            if c["status"] in ("failed", "rejected") and not c["candidate"].startswith("torch"):
                console.print(
                    f"[red]{escape(r['label'])}: {escape(candidate_label(c['candidate']))} {c['status']}: "
                    f"{escape(clipped(c['error'], 160))}[/red]"
                )
        if kind == "prefill":
            cols = " ".join(
                f"{n} {rate(r[f'{n}_tflops'])}" if r.get(f"{n}_tflops") else f"{n} -"
                for n in ("default_tune", "cudnn", "flash", "triton")
            )
            console.print(
                f"{r['label']:<32} default {rate(r['baseline_tflops'])} -> {rate(r['tflops'])} TFLOP/s  (tuning pass: {cols})"
            )
        else:
            console.print(
                f"{r['label']:<32} default {rate(r['baseline_kv_gbs'])} GB/s ({r['baseline_pct_copy']:.0f}%) -> "
                f"{rate(r['kv_gbs'])} GB/s ({r['pct_copy']:.0f}%)  host us {r['baseline_host_us'] or 0:.1f} / {r['winner_host_us'] or 0:.1f}"
            )
            if "baseline_graph_us" in r or "triton_graph_us" in r:
                parts = [
                    _graph_figure(r, "baseline", "default"),
                    _graph_figure(r, "winner", "winner"),
                    _graph_figure(r, "triton", "best triton_decode"),
                ]
                console.print(f"{'':<32} CUDA graph: {', '.join(parts)}")
    print_figures(f"{kind}: summary", result["summary"])


def run(
    suites: dict[str, list[tuple[str, SdpaKey]]],
    out: Path,
    options: TuneOptions,
    *,
    dtype: str = "bf16",
) -> dict[str, dict[str, Any]]:
    """Run each suite ("prefill" / "decode": its problems); write sdpa_<kind>.json/.png."""
    results = {}
    for kind, problems_ in suites.items():
        recorder = Recorder()
        started = time.perf_counter()
        name, title = f"sdpa_{kind}", f"SDPA {kind} ({dtype}): tuned vs torch default"
        result: dict[str, Any] = {}  # run_suite's, once its rows are done
        draw = speedup_drawing(title)
        with marked_if_interrupted(out, name, result, "its tuning detail and targets", draw):
            result.update(run_suite(
                name, problems_, out_dir=out, title=title, options=options,
                metrics=prefill_metrics if kind == "prefill" else decode_metrics, tuner=recorder,
                write=False,
            ))  # fmt: skip
            annotate(result, recorder, kind)
            labels = (row["label"] for row in result["rows"])
            result.update(
                verdict_notes(current_device(), quick_cpu_note(labels, QUICK_CPU_ROWS[kind]))
            )
            result["wall_s"] = time.perf_counter() - started
            save_result(out, name, result, draw)
        _print_extra(result, kind)
        print_notes(result)
        results[kind] = result
    return results

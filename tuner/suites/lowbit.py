"""``tuner bench gemm --suite lowbit``: low-bit GEMMs tuned, beside torch's ops and bf16 cuBLAS.

The projections of Llama-3-8B and Qwen2.5-7B (configs/models/*.yaml: qkv, o, gate_up, down) at
M in 1, 2, 4, 8, 16, 64, 256, 2048, in each format (``int4-g128``, ``fp8-rowwise``,
``fp8-tensorwise``; ``--part`` picks formats). One run, per row:

- tuning and the side-by-side timing of torch's op for the format (``aten._weight_int4pack_mm``,
  ``torch._scaled_mm``) against the winner (``tuner.suites.runner``);
- bf16 cuBLAS (``torch.matmul``) on the same shape, timed the same way: the speed the format
  is meant to beat;
- the bytes a call must move (``GemmKey.min_bytes``: every input read once, the output
  written once) as a share of the device-to-device copy bandwidth;
- decode rows (M <= 16) on a GPU: GPU times inside CUDA graphs (``timing.graph_time``) of torch's
  op, the winner and bf16 cuBLAS, each rotating over input sets larger than twice the L2 (a
  weight under the L2's size would otherwise be read from it), and a bare streaming read of
  the same number of bytes (the Triton ``stream_read`` kernel, every byte loaded once over as
  many rotated buffers): the floor.

Writes ``gemm_lowbit.json`` (rows, device and versions, targets), ``gemm_lowbit.png`` (speedup
over torch's op) and ``gemm_lowbit_vs_bf16.png`` (speedup over bf16 cuBLAS), and the tuned cache
``gemm_lowbit.db``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.triton_kernels import stream_read as stream_read_kernel
from tuner.core.keys import GemmKey, parse_key
from tuner.measure import samples, timing
from tuner.measure.records import candidate_params
from tuner.offline.model_config import gemm_key, load_model
from tuner.offline.plots import geomean, speedup_plot
from tuner.suites.gemm import MODELS_DIR, OPS, Recorder
from tuner.suites.runner import run_suite
from tuner.tuning.engine import TuneOptions, current_device

MODELS = ("llama-3-8b.yaml", "qwen2.5-7b.yaml")
M_SIZES = (1, 2, 4, 8, 16, 64, 256, 2048)
FORMATS = ("int4-g128", "fp8-rowwise", "fp8-tensorwise")
DECODE_M = 16
NAME = "gemm_lowbit"

Problems = list[tuple[str, GemmKey]]


def problems(
    formats: Sequence[str] = FORMATS,
    ms: Sequence[int] = M_SIZES,
    shapes: Sequence[tuple[str, int, int]] | None = None,
) -> Problems:
    """(label, key) per projection, M and format. ``shapes``: (name, N, K) instead of the
    models' projections."""
    if shapes is None:
        shapes = []
        for file in MODELS:
            cfg = load_model(MODELS_DIR / file)
            shapes += [(f"{cfg.name} {op}", *cfg.gemm_shape(op)) for op in OPS]
    return [
        (f"{name} M={m} {fmt}", gemm_key(m, n, k, layout="nt", dtype=fmt))
        for name, n, k in shapes
        for m in ms
        for fmt in formats
    ]


def bf16_twin(key: GemmKey) -> GemmKey:
    """The bf16 GEMM of the same shape: what the format is meant to beat."""
    return gemm_key(key.m, key.n, key.k, layout="nt", dtype="bf16")


def stream_read(nbytes: int, device: str) -> Callable[[int], Any]:
    """``fn(i)`` reading ``nbytes`` bytes with the bare streaming-read kernel, rotated over enough
    buffers that they are read from memory, not from the cache."""
    words = max(1, nbytes // 4)
    count = timing.rotation_sets(words * 4, device)
    bufs = [torch.ones(words, dtype=torch.int32, device=device) for _ in range(count)]
    sums = stream_read_kernel.sums_for(bufs[0])
    return lambda i: stream_read_kernel.read_all(bufs[i % count], sums)


def runners(key: GemmKey, row: dict[str, Any]) -> dict[str, Any]:
    """torch's op for the format (the key's baseline) and, when it is not that op, the winner."""
    base = registry.baseline("gemm", key)
    out = {"baseline": base.build(key, base.baseline_params)}
    if row["source"] != base.name:
        out["winner"] = registry.get(row["source"]).build(key, candidate_params(row["candidate"]))
    return out


def time_eager(fn: Callable[[int], Any], device: str, budget_s: float) -> float:
    return timing.measure(fn, device=device, budget_s=budget_s).median_us


def annotate(row: dict[str, Any], copy_gbs: float, device: str, budget_s: float) -> None:
    """bf16 cuBLAS beside the row, bytes and bandwidth shares; graph times for decode rows."""
    key = parse_key(row["key"])
    assert isinstance(key, GemmKey)
    twin = bf16_twin(key)
    sets = samples.input_sets(key, device, seed=1)
    bf16_sets = samples.input_sets(twin, device, seed=1)
    row.update(m=key.m, n=key.n, k=key.k, format=row["label"].rsplit(" ", 1)[-1])
    row["baseline_source"] = registry.baseline("gemm", key).name
    row["bytes"] = key.min_bytes
    row["bf16_bytes"] = twin.min_bytes
    row["bf16_us"] = time_eager(timing.on_sets(torch.matmul, bf16_sets), device, budget_s)
    row["speedup_vs_bf16"] = row["bf16_us"] / row["winner_us"]
    row["pct_copy"] = 100 * row["bytes"] / row["winner_us"] / 1e3 / copy_gbs
    row["baseline_pct_copy"] = 100 * row["bytes"] / row["baseline_us"] / 1e3 / copy_gbs
    if key.m > DECODE_M or device != "cuda":
        return
    timed = {name: timing.on_sets(run, sets) for name, run in runners(key, row).items()}
    timed["bf16"] = timing.on_sets(torch.matmul, bf16_sets)
    timed["read"] = stream_read(row["bytes"], device)
    for name, fn in timed.items():
        try:
            us = timing.graph_time(fn).median_us
        except Exception as e:  # a capture failing is a finding; the eager numbers stand
            row[f"graph_{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        moved = row["bf16_bytes"] if name == "bf16" else row["bytes"]
        row[f"graph_{name}_us"] = us
        row[f"graph_{name}_pct_copy"] = 100 * moved / us / 1e3 / copy_gbs
    row.setdefault("graph_winner_us", row.get("graph_baseline_us"))
    if "graph_winner_us" in row and "graph_baseline_us" in row:
        row["graph_speedup"] = row["graph_baseline_us"] / row["graph_winner_us"]
        if "graph_bf16_us" in row:
            row["graph_speedup_vs_bf16"] = row["graph_bf16_us"] / row["graph_winner_us"]


def served_speed(row: dict[str, Any]) -> tuple[float, float]:
    """(speedup over torch's op, over bf16): graph times for decode rows where measured."""
    if "graph_speedup" in row:
        return row["graph_speedup"], row.get("graph_speedup_vs_bf16", row["speedup_vs_bf16"])
    return row["speedup"], row["speedup_vs_bf16"]


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Targets per format over this run's rows."""
    out: dict[str, Any] = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        speeds = [served_speed(r) for r in mine]
        decode = [r for r in mine if r["m"] <= DECODE_M]
        t: dict[str, Any] = {
            "n": len(mine),
            "n_below_0.98_vs_torch": sum(s < 0.98 for s, _ in speeds),
            "geomean_vs_torch": geomean([s for s, _ in speeds]),
            "geomean_vs_bf16": geomean([b for _, b in speeds]),
            "decode_min_vs_bf16": min((served_speed(r)[1] for r in decode), default=None),
        }
        if fmt.startswith("int4"):
            big = [r for r in decode if 2 * r["n"] * r["k"] >= 64 * 2**20]
            t["decode_min_vs_bf16_weight_ge_64mb"] = min(
                (served_speed(r)[1] for r in big), default=None
            )
            t["m_ge_256_min_vs_bf16"] = min(
                (r["speedup_vs_bf16"] for r in mine if r["m"] >= 256), default=None
            )
        else:
            big = [r for r in decode if r["n"] * r["k"] >= 32 * 2**20]
            t["decode_min_graph_pct_copy_weight_ge_32mb"] = min(
                (r.get("graph_winner_pct_copy", r["pct_copy"]) for r in big), default=None
            )
            prefill = [r for r in mine if r["m"] >= 2048]
            t["prefill_min_vs_torch"] = min((r["speedup"] for r in prefill), default=None)
            t["prefill_min_vs_bf16"] = min((r["speedup_vs_bf16"] for r in prefill), default=None)
        out[fmt] = t
    return out


def run(problems_: Problems, out: Path, options: TuneOptions) -> dict[str, Any]:
    """Tune and time every row; write the JSON, both PNGs and the tuned cache into ``out``."""
    device = current_device()
    out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder()
    started = time.perf_counter()
    result = run_suite(
        NAME, problems_, out_dir=out, title="Low-bit GEMMs: tuned vs torch's op",
        options=options, store=Store(out / f"{NAME}.db"), tuner=recorder,
    )  # fmt: skip
    result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for row in result["rows"]:
        annotate(row, result["copy_gbs"], device, options.budget_s)
        outcome = recorder.outcomes.get(row["key"])
        row["failures"] = [
            f"{m.candidate}: {m.error[:200]}"
            for m in (outcome.measurements if outcome else [])
            if m.status in ("failed", "rejected")
        ][:5]
    rows = result["rows"]
    if rows:
        speedup_plot(
            [r["label"] for r in rows], [served_speed(r)[1] for r in rows],
            out / f"{NAME}_vs_bf16.png", title="Low-bit GEMMs: tuned vs bf16 cuBLAS",
            groups=[r["format"] for r in rows], floor=None,
        )  # fmt: skip
    result["targets"] = targets(rows)
    result["wall_s"] = time.perf_counter() - started
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["targets"], indent=1))
    return result

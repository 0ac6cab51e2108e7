"""``tuner bench gemm --suite lowbit``: low-bit GEMMs tuned, beside torch's ops and bf16.

The projections of Llama-3-8B and Qwen2.5-7B (configs/models/*.yaml: qkv, o, gate_up, down) at
M in 1, 2, 4, 8, 16, 64, 256, 2048, in each format (``int4-g128``, ``fp8-rowwise``,
``fp8-tensorwise``; ``--part`` picks formats, ``--quick`` few rows of each; on a machine without a
GPU, where each projection takes minutes in Triton's interpreter, ``--quick`` times one small shape
in their place, ``QUICK_CPU_SHAPE``, and the table, the JSON and the plot say so; projections named
by ``--proj`` are timed at full size there too). One run, per row:

- tuning, and torch's op for the format (``aten._weight_int4pack_mm``, ``torch._scaled_mm``)
  timed against the winner (``tuner.suites.runner``);
- bf16 on the same shape: the bf16 key tuned in the same run with the same options (what the
  tuner serves in bf16), timed against bf16 cuBLAS (``torch.matmul``);
- on a GPU, once every row is tuned and the compile pool is closed, each row's four runners timed
  again side by side (``retime``): the times it is judged on (the plain ``*_us`` columns are then
  the tuning's own); elsewhere the pairs are timed side by side as they are tuned;
- the bytes a call must move (``GemmKey.min_bytes``: every input read once, the output
  written once) as a share of the device-to-device copy bandwidth;
- decode rows (M <= 16) on a GPU: GPU times inside CUDA graphs (``timing.graph_time``) of torch's
  op, the winner, bf16 cuBLAS and the bf16 winner, each rotating over input sets larger than
  twice the L2 (a weight under the L2's size would otherwise be read from it), and a bare
  streaming read of the same number of bytes (the Triton ``stream_read`` kernel, every byte
  loaded once over as many rotated buffers): the floor. Decode rows are judged on these times,
  as decode steps run as graphs, and so they are also tuned for graph replay (``launch="graph"``,
  low-bit and bf16 alike, whatever ``--launch`` says); the other rows on eager times;
- the targets the row is judged by (``TARGETS``: the suite's targets for its format and M), each
  with its value and whether it was met. The targets are GPU targets: on a machine without CUDA
  the ratios are computed and written as on a GPU, but the run is marked not judged
  (``targets_judged``: false, ``targets_note`` says why) and neither the table nor the plot
  gives verdicts.

Writes ``gemm_lowbit.json`` (rows, device and versions, per-target counts and whether they were
judged, per-format summaries of the judged ratios; ``tuning_summary``: the suite runner's summary
of the tuning's own times, which on a GPU are not the times judged), ``gemm_lowbit.png`` (a panel
per format and measure over M, on a GPU targets drawn and misses ringed) and the tuned cache
``gemm_lowbit.db`` (low-bit and bf16 winners).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from rich.table import Table

from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.triton_kernels import stream_read as stream_read_kernel
from tuner.core.console import OutputConsole
from tuner.core.keys import GemmKey, Key, lowbit_spec, parse_key
from tuner.measure import samples, timing
from tuner.measure.records import LABEL_WIDTH, Winner, candidate_label, candidate_params
from tuner.offline.model_config import gemm_key, load_model
from tuner.offline.plots import geomean, pyplot
from tuner.suites import catalog
from tuner.suites.gemm import MODELS_DIR, OPS, Recorder
from tuner.suites.runner import NOT_JUDGED as GPU_TARGETS_ONLY
from tuner.suites.runner import (
    Rounds,
    Timed,
    built,
    console,
    in_turn_rounds,
    marked_if_interrupted,
    pct_of_copy,
    quick_cpu_note,
    quick_on_cpu,
    run_suite,
    save_result,
    side_by_side,
    steadier_rounds,
    tuned_times,
    verdict_notes,
    warning_sentence,
)
from tuner.tuning import compile_pool
from tuner.tuning.engine import TuneOptions, current_device
from tuner.tuning.verdict import heavy_rate, power_limited, sustained_duel

MODELS = ("llama-3-8b.yaml", "qwen2.5-7b.yaml")
M_SIZES = catalog.LOWBIT_M_SIZES
FORMATS = catalog.LOWBIT_FORMATS
QUICK_M = catalog.LOWBIT_QUICK_M
QUICK_CPU_M = catalog.GEMM_QUICK_CPU_M
QUICK_CPU_SHAPE = catalog.GEMM_QUICK_CPU_SHAPE  # (N, K)
QUICK_CPU_NAME = catalog.quick_cpu_name(*QUICK_CPU_SHAPE)  # its rows' shape, in their labels
QUICK_CPU_ROWS = "CPU-path rows of one small shape (N={}, K={})".format(*QUICK_CPU_SHAPE)
QUICK_OPS = catalog.LOWBIT_QUICK_OPS
DECODE_M = 16
PREFILL_M = 2048
MB = 2**20
NAME = "gemm_lowbit"
TABLE_WIDTH = 220  # logs are not terminals: rich would wrap the table at 80 columns

Problems = list[tuple[str, GemmKey]]
Row = dict[str, Any]


def problems(
    formats: Sequence[str] = FORMATS,
    ms: Sequence[int] = M_SIZES,
    ops: Sequence[str] = OPS,
    shapes: Sequence[tuple[str, int, int]] | None = None,
) -> Problems:
    """(label, key) per projection, M and format. ``shapes``: (name, N, K) instead of the
    models' ``ops`` projections."""
    for op in ops:
        if op not in OPS:
            raise ValueError(f"projection {op!r} is not one of {list(OPS)}")
    for m in ms:
        if m < 1:
            raise ValueError(f"--m must be >= 1, got {m}")
    if shapes is None:
        shapes = []
        for file in MODELS:
            cfg = load_model(MODELS_DIR / file)
            shapes += [(f"{cfg.name} {op}", *cfg.gemm_shape(op)) for op in ops]
    return [
        (f"{name} M={m} {fmt}", gemm_key(m, n, k, layout="nt", dtype=fmt))
        for name, n, k in shapes
        for m in ms
        for fmt in formats
    ]


def chosen_problems(
    formats: Sequence[str],
    *,
    quick: bool = False,
    ms: Sequence[int] | None = None,
    ops: Sequence[str] | None = None,
    device: str | None = None,
) -> Problems:
    """The rows the command line asks for: every M and projection, or ``--quick``'s few (every
    format on both models' ``QUICK_OPS`` at ``QUICK_M``; on a CPU ``device``, on the small
    ``QUICK_CPU_SHAPE`` at ``QUICK_CPU_M``), with ``ms`` and ``ops`` (when given) in place of
    either's (re-running the rows a change touched); each format, M and projection once."""
    on_cpu = quick_on_cpu(quick, device)
    if not ms:
        ms = (QUICK_CPU_M if on_cpu else QUICK_M) if quick else M_SIZES
    ms, formats = list(dict.fromkeys(ms)), list(dict.fromkeys(formats))
    if on_cpu and not ops:  # the small shape in place of the models' projections
        return problems(formats, ms, shapes=[(QUICK_CPU_NAME, *QUICK_CPU_SHAPE)])
    return problems(formats, ms, list(dict.fromkeys(ops or (QUICK_OPS if quick else OPS))))


def graph_judged(key: GemmKey, device: str) -> bool:
    """Decode rows on a GPU: timed, judged and tuned as CUDA-graph replays."""
    return device == "cuda" and key.m <= DECODE_M


def options_for(key: GemmKey, options: TuneOptions, device: str) -> TuneOptions:
    """``options``, for graph replay where the row is judged on graph times."""
    return dataclasses.replace(options, launch="graph") if graph_judged(key, device) else options


def bf16_twin(key: GemmKey) -> GemmKey:
    """The bf16 GEMM of the same shape: what the format is meant to beat."""
    return gemm_key(key.m, key.n, key.k, layout="nt", dtype="bf16")


# --- targets ---------------------------------------------------------------------------------------


def _int4(row: Row) -> bool:
    return row["format"].startswith("int4")


def _fp8_rowwise(row: Row) -> bool:
    return row["format"].startswith("fp8-rowwise")


def _decode(row: Row) -> bool:
    return row["m"] <= DECODE_M


def meant_faster_than_bf16(row: Row) -> bool:
    """Where the format is meant to beat bf16: decode (fewer bytes), and for FP8 also prefill
    (twice the tensor-core rate). INT4's prefill target is a fraction of bf16, not a win."""
    return _decode(row) or (not _int4(row) and row["m"] >= PREFILL_M)


@dataclass(frozen=True)
class Target:
    """Met when the row's ``column`` is at least ``goal``; judged on the rows ``applies`` picks
    (``where`` says which, for the report)."""

    name: str
    column: str
    goal: float
    where: str
    applies: Callable[[Row], bool]


INT4_DECODE = Target("int4 decode >= 3x bf16 cuBLAS", "vs_bf16_cublas", 3.0,
                     "int4, M <= 16, bf16 weight >= 64 MB",
                     lambda r: _int4(r) and _decode(r) and r["bf16_weight_bytes"] >= 64 * MB)  # fmt: skip
TARGETS = (
    Target("torch >= 0.98x", "vs_torch", 0.98, "every row", lambda r: True),
    Target("bf16 served >= 0.98x", "vs_bf16_served", 0.98,
           "decode rows; FP8 also at M >= 2048", meant_faster_than_bf16),
    INT4_DECODE,
    Target("int4 M>=256 >= 0.8x bf16 cuBLAS", "vs_bf16_cublas", 0.8, "int4, M >= 256",
           lambda r: _int4(r) and r["m"] >= 256),
    Target("fp8 decode >= 80% copy", "served_pct_copy", 80.0,
           "fp8-rowwise, M <= 16, FP8 weight >= 32 MB",
           lambda r: _fp8_rowwise(r) and _decode(r) and r["weight_bytes"] >= 32 * MB),
    Target("fp8 prefill >= 1.0x torch", "vs_torch", 1.0, "fp8-rowwise, M >= 2048",
           lambda r: _fp8_rowwise(r) and r["m"] >= PREFILL_M),
    Target("fp8 prefill >= 1.5x bf16 cuBLAS", "vs_bf16_cublas", 1.5, "fp8-rowwise, M >= 2048",
           lambda r: _fp8_rowwise(r) and r["m"] >= PREFILL_M),
)  # fmt: skip
FP8_GEOMEAN = Target("fp8 geomean >= 1.15x torch", "vs_torch", 1.15,
                     "the geomean of the fp8-rowwise rows", _fp8_rowwise)  # fmt: skip


def target_field(row: Row, field: str) -> float | None:
    """The ``field`` ("winner_us", "bf16_us", "winner_pct_copy", ...) the targets judge the row
    on: its retimed one in its timing mode, else the tuning's; None where it has none (a runner
    not captured). A retimed row is judged on its retime alone: a runner that raised there is
    unmeasured (a miss), its row not judged on the tuning's times in its place, as is every
    runner of a row whose retime raised (``retime_error``)."""
    retimed = row["timing"] == "graph" or any(k.startswith(("eager_", "retime_")) for k in row)
    return row.get(f"{row['timing']}_{field}" if retimed else field)


def judge(row: Row) -> None:
    """The row's served ratios in its timing mode, and each target that applies to it; for an
    eager row given a round of CUDA-graph times, the same ratios of those (``*_gpu``) and each
    target's verdict on them (a runner not captured: a miss)."""
    win = target_field(row, "winner_us")
    # a retime that raised partway may have left GPU times of some runners: none is judged
    gpu_times = {} if "retime_error" in row else row
    gpu_win = gpu_times.get("gpu_winner_us")
    for ref, column in (("baseline", "vs_torch"), ("bf16_served", "vs_bf16_served"),
                        ("bf16", "vs_bf16_cublas")):  # fmt: skip
        t = target_field(row, f"{ref}_us")
        row[column] = t / win if t and win else None
        gpu = gpu_times.get(f"gpu_{ref}_us")
        row[f"{column}_gpu"] = gpu / gpu_win if gpu and gpu_win else None
    row["served_pct_copy"] = target_field(row, "winner_pct_copy")
    row["targets"] = {}
    for t in TARGETS:
        if t.applies(row):
            value = row[t.column]
            verdict = {"goal": t.goal, "value": value, "met": value is not None and value >= t.goal}
            if any(k.startswith("gpu_") for k in row):  # an eager row timed in graphs too
                gpu_value = row.get(f"{t.column}_gpu")
                met = gpu_value is not None and gpu_value >= t.goal
                verdict |= {"gpu_value": gpu_value, "met_on_gpu": met}
            row["targets"][t.name] = verdict
    row["missed"] = [name for name, v in row["targets"].items() if not v["met"]]


def target_counts(rows: Sequence[Row]) -> dict[str, Any]:
    """Per target: rows judged, met, unmeasured (a time missing: a miss), the worst value and
    the labels of the misses, and (``on_gpu``) the same for its eager rows' CUDA-graph ratios;
    the FP8 suite geomean as one judgement."""
    out: dict[str, Any] = {}
    for t in TARGETS:
        judged = [r for r in rows if t.name in r["targets"]]
        if not judged:
            continue
        values = [r["targets"][t.name]["value"] for r in judged]
        measured = [v for v in values if v is not None]
        out[t.name] = {
            "goal": t.goal,
            "where": t.where,
            "judged": len(judged),
            "met": sum(r["targets"][t.name]["met"] for r in judged),
            "unmeasured": len(values) - len(measured),
            "worst": min(measured, default=None),
            "missed": [r["label"] for r in judged if not r["targets"][t.name]["met"]],
        }
        on_gpu = [r["targets"][t.name] for r in judged if "met_on_gpu" in r["targets"][t.name]]
        if on_gpu:  # eager rows: what their kernels' graph times alone say
            gpu_values = [v["gpu_value"] for v in on_gpu if v["gpu_value"] is not None]
            out[t.name]["on_gpu"] = {
                "judged": len(on_gpu),
                "met": sum(v["met_on_gpu"] for v in on_gpu),
                "unmeasured": len(on_gpu) - len(gpu_values),
                "worst": min(gpu_values, default=None),
            }
    fp8 = [r[FP8_GEOMEAN.column] for r in rows if FP8_GEOMEAN.applies(r)]
    if fp8:
        measured = [v for v in fp8 if v is not None]
        value = geomean(measured) if measured else None
        met = value is not None and value >= FP8_GEOMEAN.goal and len(measured) == len(fp8)
        out[FP8_GEOMEAN.name] = {
            "goal": FP8_GEOMEAN.goal, "where": FP8_GEOMEAN.where, "judged": 1, "met": int(met),
            "unmeasured": len(fp8) - len(measured), "worst": value,
            "missed": [] if met else ["fp8-rowwise rows' geomean"],
        }  # fmt: skip
    return out


TUNING_TARGET = "tuning <= bf16 (median)"
NOT_JUDGED = (
    f"{GPU_TARGETS_ONLY} (torch's CPU ops, CPU matmul as 'bf16 cuBLAS', Triton kernels where "
    "TRITON_INTERPRET=1), and CPU timings are not the product's"
)


def shapes_note(rows: Sequence[Row]) -> str | None:
    """A line saying the rows are ``--quick``'s small CPU shape, where they are, or None."""
    return quick_cpu_note((r["label"] for r in rows), QUICK_CPU_ROWS)


def format_summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Per format: geomeans of the served ratios, tuning time beside bf16's, targets met."""
    out: dict[str, Any] = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        bf16_tune = {r["bf16_key"]: r["bf16_tune_s"] for r in mine if "bf16_tune_s" in r}
        summary: dict[str, Any] = {"n": len(mine)}
        for column in ("vs_torch", "vs_bf16_served", "vs_bf16_cublas"):
            values = [r[column] for r in mine if r[column] is not None]
            summary[f"geomean_{column}"] = geomean(values) if values else None
        tune_s = statistics.median(r["tune_s"] for r in mine)
        bf16_s = statistics.median(bf16_tune.values()) if bf16_tune else None
        summary["median_tune_s"], summary["bf16_median_tune_s"] = tune_s, bf16_s
        summary["targets"] = {
            name: f"{c['met']}/{c['judged']}" for name, c in target_counts(mine).items()
        }
        # the tuning-cost target: tuning a low-bit problem costs no more than bf16 (unmeasured: missed)
        met = bf16_s is not None and tune_s <= bf16_s
        summary["targets"][TUNING_TARGET] = f"{int(met)}/1"
        out[fmt] = summary
    return out


# --- measuring -------------------------------------------------------------------------------------


def stream_read(nbytes: int, device: str) -> Timed:
    """The bare streaming-read kernel over ``nbytes`` bytes, as a runner and its input sets:
    enough buffers that they are read from memory, not from the cache."""
    words = max(1, nbytes // 4)
    count = timing.rotation_sets(words * 4, device)
    bufs = [torch.ones(words, dtype=torch.int32, device=device) for _ in range(count)]
    sums = stream_read_kernel.sums_for(bufs[0])
    return (lambda buf: stream_read_kernel.read_all(buf, sums)), [(b,) for b in bufs]


def tune_bf16(
    twins: Sequence[GemmKey], options: TuneOptions, recorder: Recorder, store: Store, device: str
) -> dict[str, Row]:
    """Each bf16 key tuned with the same options as the low-bit rows of its shape
    (``options_for``), its winner timed side by side with bf16 cuBLAS: the ``bf16_*`` columns of
    the rows of that shape (on a GPU the tuning's own times: ``retime`` times them again)."""
    out: dict[str, Row] = {}
    times = row_times(device)
    for twin in dict.fromkeys(twins):
        started = time.perf_counter()
        try:
            outcome = recorder(twin, options_for(twin, options, device))
            tune_s = time.perf_counter() - started
            store.save_run(outcome.measurements, outcome.winner)
            cublas_us, served_us = times(twin, outcome.winner, device)
        except Exception as e:  # the low-bit rows stand; their bf16 targets show as unmeasured
            out[str(twin)] = {"bf16_error": f"{type(e).__name__}: {e}"[:300]}
            console.print(f"[red]bf16 {twin.label}: {escape(str(e))}[/red]")
            continue
        out[str(twin)] = {
            "bf16_us": cublas_us, "bf16_served_us": served_us, "bf16_tune_s": tune_s,
            "bf16_phases": {name: round(s, 3) for name, s in outcome.phases.items()},
            "bf16_source": outcome.winner.source, "bf16_candidate": outcome.winner.candidate,
        }  # fmt: skip
        console.print(
            f"bf16 {twin.label:<34} {cublas_us:9.1f} us -> {served_us:9.1f} us  "
            f"{cublas_us / served_us:5.2f}x  {outcome.winner.source}"
        )
    return out


def row_times(device: str) -> Callable[[Key, Winner, str], tuple[float, float]]:
    """How rows and twins are timed as they are tuned: on a GPU ``retime`` times every runner
    again once all rows are tuned, and only those times are judged, so the tuning's own stand
    in; elsewhere the side-by-side times are the ones judged."""
    return tuned_times if device == "cuda" else side_by_side


SIDE_BY_SIDE_ROUNDS = 4  # eager rows: rounds of the four runners timed in turn, even: as many
SIDE_BY_SIDE_BUDGET_S = 0.04  # in reverse order as in order; each runner's budget in a round
EAGER_WARMUP_ROUNDS = 1  # eager rows: untimed rounds of every runner in turn before the timed ones
GRAPH_ROUNDS = 3  # decode rows: rounds of CUDA-graph times; the median outlasts one disturbed
# a runner's rounds (eager or graph) spread past this share of their median: something ran
# beside some of them (rounds of one runner in turn under the same load read close together),
# and with two of four rounds disturbed the median is neither reading
ROUNDS_DISTURBED = 0.25


POWER_CHECK_BUDGET_S = 0.02  # each runner's short, full-clock timing that decides a row's stretch
DUELS = (("baseline", "winner"), ("bf16", "bf16_served"))  # the pairs the tuning duelled


def sustained_s(
    flops: float,
    short: Mapping[str, timing.Timing],
    read_gpu: Callable[[Sequence[str]], Sequence[float] | None],
    options: TuneOptions,
    heavy_from: float,
) -> float:
    """Seconds of each sustained stretch the row's eager runners are retimed over, or 0. Each
    pair the tuning duelled (``DUELS``) is judged as the engine judged its duel
    (``verdict.sustained_duel``, ``verdict.power_limited``): from its runners' short timings
    ``short`` (runner -> Timing, taken at full clock like the duel's trials) and, where those
    allow a heavy call, their graph times (``read_gpu(names)``; ``heavy_from``:
    ``verdict.heavy_rate``). One pair judged so times the whole row over stretches."""
    if options.sustained_s <= 0:
        return 0.0
    for pair in DUELS:
        names = [name for name in pair if name in short]
        if not names:
            continue
        trial_us = [short[name].median_us for name in names]
        eager_us = [max(short[name].median_us, short[name].host_us) for name in names]
        heavy = power_limited(flops, eager_us, lambda names=names: read_gpu(names), heavy_from)
        if sustained_duel("cuda", trial_us, options, heavy):
            return options.sustained_s
    return 0.0


def power_check(row: Row, flops: float, timed: Mapping[str, Timed], options: TuneOptions) -> float:
    """The row's stretch (``sustained_s``) from readings taken now, not from its tuned times: a
    duel timed at the power limit leaves times of that clock, under which a GPU-bound call reads
    host-bound. The readings stay in the row: each runner's short eager time (``eager_check_us``)
    and, where read, its graph time (``eager_gpu_us``)."""
    if options.sustained_s <= 0:
        return 0.0
    short: dict[str, timing.Timing] = {}
    for name, (runner, sets) in timed.items():
        try:
            short[name] = timing.measure_sets(
                runner, sets, device="cuda", budget_s=POWER_CHECK_BUDGET_S
            )
        except Exception as e:  # left out of the check; the rounds record the runner's error
            torch.cuda.synchronize()
            row[f"eager_check_{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    row["eager_check_us"] = {
        name: round(max(t.median_us, t.host_us), 2) for name, t in short.items()
    }
    gpu: dict[str, float] = {}

    def read_gpu(names: Sequence[str]) -> list[float] | None:
        try:
            for name in names:
                if name not in gpu:
                    runner, sets = timed[name]
                    gpu[name] = timing.graph_time_over(runner, sets).median_us
        except Exception:  # judged on its eager times alone: not heavy
            torch.cuda.synchronize()
            return None
        return [gpu[name] for name in names]

    stretch = sustained_s(flops, short, read_gpu, options, heavy_rate("cuda"))
    if gpu:
        row["eager_gpu_us"] = {name: round(us, 2) for name, us in gpu.items()}
    return stretch


def retime(row: Row, key: GemmKey, twin: GemmKey, copy_gbs: float, options: TuneOptions) -> None:
    """The row's runners timed again once every row is tuned and the compile pool is closed:
    torch's op, the winner, bf16 cuBLAS and the bf16 winner, side by side under the same load
    (a host-bound eager call is slowed by compiles running beside it, and the low-bit rows are
    tuned while the pool still builds kernels of later rows). Decode rows: GPU times in CUDA
    graphs (``graph_*`` columns, the median of ``GRAPH_ROUNDS`` rounds), with the bare read of the
    row's bytes; other rows: eager times, the median of ``SIDE_BY_SIDE_ROUNDS`` rounds after
    ``EAGER_WARMUP_ROUNDS`` untimed ones; each round takes the runners in turn (``eager_*``).
    Each round's time is kept beside the median (``*_rounds_us``), and for eager rows the host
    time a call (``*_host_us``), so that a slow reading shows whether it was one round or all and
    whether the host was slow with it. Rounds of a runner spread past ``ROUNDS_DISTURBED`` (a
    disturbance beside some of them) are all taken again once, the steadier take judged and the
    other kept (``*_disturbed_rounds_us``). Eager rows judged at the power limit (``power_check``)
    are timed over sustained stretches (``eager_sustained_s``). Other eager rows also get one
    round of CUDA-graph times (``gpu_*_us``): where calls are host-bound, the eager ratio is the
    hosts' and the graph's says what the kernels do."""
    graph = row["timing"] == "graph"
    mode = "graph" if graph else "eager"
    sets = samples.input_sets(key, "cuda", seed=1)
    base, win = built(key, row["source"], candidate_params(row["candidate"]))
    timed: dict[str, Timed] = {"baseline": (base, sets)}
    if win is not None:
        timed["winner"] = (win, sets)
    if "bf16_source" in row:
        bf16_sets = samples.input_sets(twin, "cuda", seed=1)
        cublas, served = built(twin, row["bf16_source"], candidate_params(row["bf16_candidate"]))
        timed["bf16"] = (cublas, bf16_sets)
        if served is not None:
            timed["bf16_served"] = (served, bf16_sets)
    if graph:
        timed["read"] = stream_read(row["bytes"], "cuda")
        stretch_s = 0.0
    else:
        stretch_s = power_check(row, key.flops, timed, options)

    def failed(name: str, e: Exception) -> None:  # a capture failing is a finding: a miss
        row[f"{mode}_{name}_error"] = f"{type(e).__name__}: {e}"[:300]

    def take() -> Rounds:
        return in_turn_rounds(
            timed, "cuda", graph=graph, rounds=GRAPH_ROUNDS if graph else SIDE_BY_SIDE_ROUNDS,
            budget_s=SIDE_BY_SIDE_BUDGET_S, warmup_rounds=0 if graph else EAGER_WARMUP_ROUNDS,
            sustained_s=0.0 if graph else stretch_s, on_error=failed,
        )  # fmt: skip

    def medians(timings: list[timing.Timing]) -> list[float]:
        return [round(t.median_us, 2) for t in timings]

    if not graph and not stretch_s:  # the kernels' own times beside (host-bound calls' eager
        # ratio is their hosts'); rows at the power limit are GPU-bound, their eager ratio the
        # kernels' at the clock they keep, which a short graph timing would not run at

        def uncaptured(name: str, e: Exception) -> None:
            row[f"gpu_{name}_error"] = f"{type(e).__name__}: {e}"[:300]

        gpu = in_turn_rounds(timed, "cuda", graph=True, rounds=1, budget_s=SIDE_BY_SIDE_BUDGET_S,
                             on_error=uncaptured)  # fmt: skip
        for name, timings in gpu.items():
            row[f"gpu_{name}_us"] = timings[0].median_us
    rounds, disturbed = steadier_rounds(take, ROUNDS_DISTURBED)
    if disturbed is not None:  # the take set aside, for whoever wonders why the row was retaken
        row[f"{mode}_disturbed_rounds_us"] = {name: medians(ts) for name, ts in disturbed.items()}
    if not graph:
        row["eager_sustained_s"] = stretch_s
    for name, timings in rounds.items():
        moved = row["bf16_bytes"] if name.startswith("bf16") else row["bytes"]
        us = statistics.median(t.median_us for t in timings)
        row[f"{mode}_{name}_us"] = us
        row[f"{mode}_{name}_pct_copy"] = pct_of_copy(moved, us, copy_gbs)
        row[f"{mode}_{name}_rounds_us"] = medians(timings)
        if not graph:  # an eager call's host time: a slow round with a slow host is host-bound
            row[f"{mode}_{name}_host_us"] = [round(t.host_us, 2) for t in timings]
    for name, same in (("winner", "baseline"), ("bf16_served", "bf16")):
        if name not in timed and f"{mode}_{same}_us" in row:  # the same runner: the same times
            for column in ("us", "pct_copy", "rounds_us", "host_us"):
                if f"{mode}_{same}_{column}" in row:
                    row[f"{mode}_{name}_{column}"] = row[f"{mode}_{same}_{column}"]
            if f"gpu_{same}_us" in row:
                row[f"gpu_{name}_us"] = row[f"gpu_{same}_us"]


def annotate(row: Row, bf16: Row, copy_gbs: float, device: str, options: TuneOptions) -> None:
    """Shape, format, bytes and bandwidth shares beside the row; its bf16 columns; on a GPU its
    runners timed again side by side (``retime``); then its targets."""
    key = parse_key(row["key"])
    assert isinstance(key, GemmKey)
    twin = bf16_twin(key)
    row.update(m=key.m, n=key.n, k=key.k, format=lowbit_spec(key),
               shape=row["label"].rsplit(" M=", 1)[0])  # fmt: skip
    row["baseline_source"] = registry.baseline("gemm", key).name
    row["bytes"], row["weight_bytes"] = key.min_bytes, key.weight_bytes
    row["bf16_key"], row["bf16_bytes"] = str(twin), twin.min_bytes
    row["bf16_weight_bytes"] = twin.weight_bytes
    row.update(bf16)
    for name, moved in (("winner", "bytes"), ("baseline", "bytes"), ("bf16", "bf16_bytes"),
                        ("bf16_served", "bf16_bytes")):  # fmt: skip
        if f"{name}_us" in row:
            row[f"{name}_pct_copy"] = pct_of_copy(row[moved], row[f"{name}_us"], copy_gbs)
    row["timing"] = "graph" if graph_judged(key, device) else "eager"
    if device == "cuda":
        try:
            retime(row, key, twin, copy_gbs, options)
        except Exception as e:  # one row must not lose the suite: its times unmeasured, a miss
            row["retime_error"] = f"{type(e).__name__}: {e}"[:300]
            console.print(f"[red]{escape(row['label'])}: retime failed: {escape(str(e))}[/red]")
    judge(row)


# --- report ----------------------------------------------------------------------------------------


def shown_ratio(x: float | None) -> str:
    """A ratio for the table: three decimals, more where it is smaller (two significant digits),
    so that a CPU row's 0.00044x does not read as 0.000x."""
    if x is None:
        return "-"
    digits = max(3, 1 - math.floor(math.log10(x))) if 0 < x < math.inf else 3
    return f"{x:.{digits}f}x"


def _percent(pct: float | None) -> str:
    """A share of copy bandwidth for the table: whole points, a decimal under 10 (CPU rows)."""
    if pct is None:
        return "-"
    return f"{pct:.1f}" if pct < 10 else f"{pct:.0f}"


def print_table(
    rows: Sequence[Row], counts: dict[str, Any], formats: dict[str, Any], *, judged: bool = True
) -> None:
    """Each row's served ratios and the targets it missed; then the count of each target, and
    each format's tuning time beside bf16's. Not ``judged`` (no GPU): the ratios, then one line
    saying why there are no verdicts in place of the misses, counts and tuning verdicts."""
    graph = any(r["timing"] == "graph" for r in rows)
    how = "decode rows: CUDA-graph GPU times" if graph else "eager times"
    table = Table(title=f"low-bit GEMMs: served time ratios ({how})")
    for col in ("problem", "winner", "vs torch", "vs bf16 served", "vs bf16 cuBLAS",
                "vs bf16 cuBLAS, GPU", "% copy", "read floor %"):  # fmt: skip
        table.add_column(col)
    if judged:
        table.add_column("missed")
    for r in rows:
        pct, floor = r["served_pct_copy"], r.get("graph_read_pct_copy")
        missed = f"[red]{'; '.join(r['missed'])}[/red]" if r["missed"] else "[green]all met[/green]"
        winner = escape(candidate_label(r["candidate"], LABEL_WIDTH))
        ratios = (r["vs_torch"], r["vs_bf16_served"], r["vs_bf16_cublas"],
                  r.get("vs_bf16_cublas_gpu"))  # fmt: skip
        table.add_row(
            r["label"], winner, *map(shown_ratio, ratios), _percent(pct), _percent(floor),
            *([missed] if judged else []),
        )  # fmt: skip
    report = OutputConsole(width=TABLE_WIDTH)  # a closed pipe ends quietly, as elsewhere
    report.print(table)
    if note := shapes_note(rows):
        report.print(f"[yellow]{note}.[/yellow]")
    if not judged:
        report.print(warning_sentence(NOT_JUDGED))
        return
    for name, c in counts.items():
        color = "green" if c["met"] == c["judged"] else "red"
        worst = "" if c["worst"] is None else f", worst {c['worst']:.2f}"
        g = c.get("on_gpu")
        on_gpu = (
            f"; eager rows by their CUDA-graph times alone: {g['met']}/{g['judged']} met"
            + ("" if g["worst"] is None else f", worst {g['worst']:.2f}")
            if g
            else ""
        )
        report.print(
            f"[{color}]{name} ({c['where']}): {c['met']}/{c['judged']} met{worst}{on_gpu}[/{color}]"
        )
    against = (("vs_torch", "torch's op"), ("vs_bf16_served", "the tuner's bf16"),
               ("vs_bf16_cublas", "bf16 cuBLAS"))  # fmt: skip
    for fmt, f in formats.items():
        means = ", ".join(f"{shown_ratio(f[f'geomean_{c}'])} {name}" for c, name in against)
        report.print(f"{fmt}, geomean of the {f['n']} rows' served ratios (as judged): {means}")
        met = f["targets"][TUNING_TARGET] == "1/1"
        color, verdict = ("green", "met") if met else ("red", "missed")
        bf16 = f["bf16_median_tune_s"]
        bf16_text = "unmeasured" if bf16 is None else f"{bf16:.2f} s"
        report.print(f"[{color}]{TUNING_TARGET}, {fmt}: {f['median_tune_s']:.2f} s against bf16's "
                     f"{bf16_text}: {verdict}[/{color}]")  # fmt: skip


def _targets_on(column: str) -> list[Target]:
    return [t for t in TARGETS if t.column == column]


def _runs(ms: Sequence[int], judged: set[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive ``ms`` (sorted) that are in ``judged``."""
    runs: list[tuple[int, int]] = []
    for prev, m in zip((None, *ms), ms, strict=False):
        if m not in judged:
            continue
        if runs and prev == runs[-1][1]:
            runs[-1] = (runs[-1][0], m)
        else:
            runs.append((m, m))
    return runs


def partial_target_note(t: Target, judged: Sequence[Row], drawn: Sequence[Row]) -> str | None:
    """What a target's segment judges, where some rows drawn over its M are not judged by it
    (``INT4_DECODE``: the large weights only): without it, the lines of the others pass under
    the segment unringed and read as misses the rings forgot. None where it judges them all."""
    ms = {r["m"] for r in judged}
    if not judged or all(t.name in r["targets"] for r in drawn if r["m"] in ms):
        return None
    met = sum(r["targets"][t.name]["met"] for r in judged)
    goal = f"{t.goal:g}%" if t.column.endswith("pct_copy") else f"{t.goal:g}x"
    return f"target {goal}: {t.where} only ({met}/{len(judged)} met)"


PANELS = (
    ("vs_torch", "speedup over torch's op"),
    ("vs_bf16_served", "speedup over bf16 as the tuner serves it"),
    ("vs_bf16_cublas", "speedup over bf16 cuBLAS"),
    ("served_pct_copy", "decode: % of copy bandwidth"),
)
# each panel's unit: a ratio is the other's time over the served one's, not "served / other"
RATIO_LABEL = "x (>1: the served low-bit GEMM is faster)"
PCT_LABEL = "% of copy bandwidth (bytes moved / time)"


def plot(rows: Sequence[Row], path: Path, title: str, *, judged: bool = True) -> Path:
    """A row of panels per format, one per measure, over M: a line per projection (colour:
    projection, line style: model); each target a red dotted segment over the M it judges,
    each miss ringed in red, and a target that judges only some of the lines drawn under it
    says which in its panel's title (not ``judged``, on a machine without a GPU: none); the
    decode panel also marks the bare read's share (x), and the ratio panels an eager row's ratio
    of CUDA-graph times (hollow triangle)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    plt = pyplot()

    formats = list(dict.fromkeys(r["format"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    models = list(dict.fromkeys(s.rsplit(" ", 1)[0] for s in shapes))
    ops = list(dict.fromkeys(s.rsplit(" ", 1)[-1] for s in shapes))
    palette, styles = plt.get_cmap("tab10"), ("-", "--", "-.", ":")

    def style(shape: str) -> dict[str, Any]:
        model, op = shape.rsplit(" ", 1) if " " in shape else (shape, shape)
        return {"color": palette(ops.index(op) % 10),
                "linestyle": styles[models.index(model) % len(styles)]}  # fmt: skip

    fig, axes = plt.subplots(len(formats), len(PANELS), figsize=(5 * len(PANELS), 3.4 * len(formats) + 1.2), squeeze=False)  # fmt: skip
    ms_all = sorted({r["m"] for r in rows})
    for i, fmt in enumerate(formats):
        for j, (column, heading) in enumerate(PANELS):
            ax = axes[i][j]
            mine = [r for r in rows if r["format"] == fmt and r[column] is not None]
            if column == "served_pct_copy":
                mine = [r for r in mine if _decode(r)]
            for shape in shapes:
                pts = sorted((r for r in mine if r["shape"] == shape), key=lambda r: r["m"])
                if not pts:
                    continue
                ax.plot([r["m"] for r in pts], [r[column] for r in pts], marker="o",
                        markersize=3, **style(shape))  # fmt: skip
                on_gpu = [r for r in pts if r.get(f"{column}_gpu") is not None]
                ax.scatter([r["m"] for r in on_gpu], [r[f"{column}_gpu"] for r in on_gpu],
                           marker="^", s=22, facecolors="none",
                           edgecolors=style(shape)["color"])  # fmt: skip
                if column == "served_pct_copy":
                    floor = [r for r in pts if "graph_read_pct_copy" in r]
                    ax.scatter([r["m"] for r in floor], [r["graph_read_pct_copy"] for r in floor],
                               marker="x", color=style(shape)["color"], s=25)  # fmt: skip
            notes: list[str] = []  # the targets that judge some of the lines drawn only
            for t in _targets_on(column) if judged else ():
                on = [r for r in rows if r["format"] == fmt and t.name in r["targets"]]
                for lo, hi in _runs(ms_all, {r["m"] for r in on}):
                    ax.hlines(t.goal, lo / 1.3, hi * 1.3, colors="red", linestyles=":",
                              linewidth=1.2)  # fmt: skip
                if (note := partial_target_note(t, on, mine)) is not None:
                    notes.append(note)
                missed = [r for r in on if not r["targets"][t.name]["met"]]
                missed = [r for r in missed if r[column] is not None]
                ax.scatter([r["m"] for r in missed], [r[column] for r in missed], s=90,
                           facecolors="none", edgecolors="red", linewidths=1.2, zorder=4)  # fmt: skip
            if column != "served_pct_copy":
                ax.axhline(1.0, color="black", linewidth=0.8)
                values = [r[column] for r in mine]
                values += [r[f"{column}_gpu"] for r in mine if r.get(f"{column}_gpu")]
                if values and max(values) / max(min(values), 1e-9) > 8:
                    ax.set_yscale("log", base=2)
                # ticks in the words of the table ("16x"), not matplotlib's log labels ("2^4")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
            elif not mine:
                ax.text(0.5, 0.5, "no decode rows timed", ha="center", transform=ax.transAxes)
                ax.set_yticks([])  # an empty panel: no scale to read
            ticks = [m for m in ms_all if column != "served_pct_copy" or m <= DECODE_M]
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(m) for m in ticks])
            ax.set_title("\n".join([f"{fmt}: {heading}", *notes]), fontsize=10)
            label = PCT_LABEL if column == "served_pct_copy" else RATIO_LABEL
            log = "; log scale" if ax.get_yscale() == "log" else ""
            ax.set_ylabel(f"{label}{log}", fontsize=8)
            ax.grid(alpha=0.3)
            if i == len(formats) - 1:
                ax.set_xlabel("M (tokens)")
    handles = [Line2D([], [], label=s, marker="o", markersize=3, **style(s)) for s in shapes]
    if judged:
        handles += [
            Line2D([], [], color="red", linestyle=":", label="target"),
            Line2D([], [], marker="o", markersize=9, markerfacecolor="none",
                   markeredgecolor="red", linestyle="", label="target missed"),
        ]  # fmt: skip
    # the GPU's marks keyed only where drawn (a CPU run has neither)
    if any("graph_read_pct_copy" in r for r in rows):
        handles.append(Line2D([], [], marker="x", color="grey", linestyle="",
                              label="bare read of the bytes"))  # fmt: skip
    if any(r.get(f"{column}_gpu") is not None for r in rows for column, _ in PANELS):
        handles.append(Line2D([], [], marker="^", markerfacecolor="none", markeredgecolor="grey",
                              linestyle="", label="eager rows: the kernels' CUDA-graph ratio"))  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.suptitle(title if judged else f"{title}\n(targets judged on a GPU only: not drawn)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finish(result: dict[str, Any], bf16: dict[str, Any], twins: list[GemmKey], recorder: Recorder,
           device: str, options: TuneOptions, started: float) -> None:  # fmt: skip
    """``result``'s rows annotated with their bf16 twins and retimes, and judged."""
    rows = result["rows"]
    result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for row, twin in zip(rows, twins, strict=True):
        annotate(row, bf16[str(twin)], result["copy_gbs"], device, options)
        outcome = recorder.outcomes.get(row["key"])
        row["failures"] = [
            f"{m.candidate}: {m.error[:200]}"
            for m in (outcome.measurements if outcome else [])
            if m.status in ("failed", "rejected")
        ][:5]
    # the runner's summary is of the tuning's times: named so, beside the judged counts
    result["tuning_summary"] = result.pop("summary")
    # the counts are written wherever the run was, in the same shape; on a CPU they are marked
    # not judged (the targets are a GPU's), and neither the table nor the plot gives verdicts
    result["targets"] = target_counts(rows)
    result.update(verdict_notes(device, shapes_note(rows), NOT_JUDGED))
    result["formats"] = format_summary(rows)
    result["wall_s"] = time.perf_counter() - started


def drawing(result: dict[str, Any], png: Path) -> None:
    """The suite's plot of a finished ``result`` (``plot``), titled with its device (and, for
    ``--quick``'s CPU rows, saying so), its versions and which times it draws (``provenance``);
    drawn by the suites' one writer (``save_result``)."""
    title = f"Low-bit GEMMs on {result['device']['name']}"
    if result["shapes_note"]:
        title += f": {QUICK_CPU_ROWS}"
    plot(result["rows"], png, f"{title}\n{provenance(result)}", judged=result["targets_judged"])


VERSIONS_SHOWN = ("torch", "cuda", "cublas", "triton", "cutlass", "tuner")


def provenance(result: Mapping[str, Any]) -> str:
    """The plot's second title line: the versions that made the times (torch's op and cuBLAS
    are what the rows are judged against) and which times the lines are, CUDA-graph GPU times
    for decode rows and eager ones past them; the lines join the two at M = 16 to 64."""
    versions = result["device"].get("versions", {})
    named = ", ".join(f"{k} {versions[k]}" for k in VERSIONS_SHOWN if versions.get(k))
    how = "eager times"
    if any(r.get("timing") == "graph" for r in result["rows"]):
        how = f"M <= {DECODE_M}: CUDA-graph GPU times, larger M: eager times"
    return f"{named}; {how}" if named else how


def run(problems_: Problems, out: Path, options: TuneOptions) -> dict[str, Any]:
    """Tune and time every row and its bf16 twin; write the JSON, the PNG and the tuned cache
    into ``out``."""
    device = current_device()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    keys = [k for _, k in problems_]
    missing = "their bf16 columns, retimes and targets"
    result: dict[str, Any] = {}  # run_suite's, once its rows are done
    with (
        Store(out / f"{NAME}.db") as store,
        marked_if_interrupted(out, NAME, result, missing),  # the pool's closing too
    ):
        with compile_pool.ahead([*keys, *map(bf16_twin, keys)], options, device) as compiler:
            recorder = Recorder(compiler)
            result.update(run_suite(
                NAME, problems_, out_dir=out, title="Low-bit GEMMs: tuned vs torch's op",
                options=options, store=store, plot=False, times=row_times(device),
                tuner=lambda key, opts: recorder(key, options_for(key, opts, device)),
                write=False,
            ))  # fmt: skip
            rows = result["rows"]
            twins = [bf16_twin(parse_key(r["key"])) for r in rows]  # type: ignore[arg-type]
            bf16 = tune_bf16(twins, options, recorder, store, device)
        finish(result, bf16, twins, recorder, device, options, started)
        save_result(out, NAME, result, drawing)
    rows = result["rows"]
    print_table(rows, result["targets"], result["formats"], judged=result["targets_judged"])
    return result

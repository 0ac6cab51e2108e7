"""``tuner bench gemm`` and ``tuner bench sdpa``: tune a benchmark suite, then time the baseline
and each winner side by side (``tuner.suites``); results go to ``--out`` as JSON and plots."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.errors import output_dir
from tuner.cli.options import (
    TUNE_DEFAULTS,
    ConfirmRoundsOpt,
    ConfirmTriesOpt,
    IsolateOpt,
    LaunchOpt,
    SourcesOpt,
    SustainedOpt,
    check_sources_take_some,
    tune_options,
)
from tuner.core.console import output_console
from tuner.core.keys import Key
from tuner.core.settings import WORKERS
from tuner.suites import catalog

app = typer.Typer(
    help="Benchmark suites: tune, then time baseline and winner side by side.", no_args_is_help=True
)
BENCH_BUDGET_S = 0.05  # suites tune hundreds of problems: a shorter budget than one `tuner tune`
SuiteBudgetOpt = Annotated[
    float,
    typer.Option(min=0.001, help="Timing budget per candidate, seconds; shorter than `tuner tune`'s "
                 "since a suite tunes hundreds of problems."),
]  # fmt: skip
BENCH_OUT = Path("tuner-bench")  # in the current folder; results worth keeping are copied by hand
# said in every suite's --out help: where a run cut short puts its rows (runner.save_result)
INTERRUPTED_HELP = (
    "A run cut short (Ctrl-C) writes the rows it has as <name>.interrupted.json/.png, leaving a "
    "complete result of an earlier run in place."
)


def note_full_size_on_cpu(labels: Iterable[str], instead: str = "--quick") -> None:
    """Say, as a suite starts on a machine without a CUDA GPU, that it times full-size shapes on
    the CPU (any row but ``--quick``'s small CPU ones, ``catalog.is_quick_cpu``), slowly, and
    what times small shapes in their place (``instead``): a user who left out --quick, or chose
    the lowbit suite's projections with it, saw a run start and its rows crawl, with no word why."""
    import torch

    if torch.cuda.is_available() or all(catalog.is_quick_cpu(label) for label in labels):
        return
    output_console(stderr=True).print(
        "[yellow]note[/yellow]: no CUDA GPU here: the suite times the models' own shapes on "
        f"the CPU, slowly (a part may take hours); {instead} times small shapes in their place"
    )


def ready(rows: Sequence[tuple[str, Key]], source: list[str] | None, out: Path,
          instead: str = "--quick", tuned: Sequence[Key] = ()) -> None:  # fmt: skip
    """The checks of a suite's chosen ``rows`` before anything runs (a ``--source`` with nothing
    for any problem the suite tunes: the rows' keys, and ``tuned``, those it tunes beside them),
    then ``--out`` made and a slow CPU run said (``note_full_size_on_cpu``)."""
    check_sources_take_some(source, [*(key for _, key in rows), *tuned])
    output_dir(out)  # checked before the benchmark, not once it is over; made after the arguments
    note_full_size_on_cpu((label for label, _ in rows), instead)


@app.command("gemm")
def bench_gemm(
    suite: Annotated[
        str,
        typer.Option(
            help="Shape suite: llama, or lowbit (int4 and fp8 GEMMs; its decode rows, M <= 16, "
            "are tuned and judged for CUDA-graph replay whatever --launch says)."
        ),
    ] = "llama",
    part: Annotated[
        list[str] | None,
        typer.Option(
            help=f"Part(s) to run (repeatable): {', '.join(catalog.GEMM_PARTS)}; for lowbit the formats "
            f"{', '.join(catalog.LOWBIT_FORMATS)}; default all."
        ),
    ] = None,
    out: Annotated[
        Path,
        typer.Option(
            help="Folder for gemm_llama_<part>.json/.png/.db (lowbit: gemm_lowbit.*); not the "
            "repository's bench/results, whose committed runs a new one would overwrite. "
            + INTERRUPTED_HELP,
            file_okay=False,
        ),
    ] = BENCH_OUT,
    budget: SuiteBudgetOpt = BENCH_BUDGET_S,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    isolate: IsolateOpt = False,
    inductor: Annotated[
        bool | None,
        typer.Option(
            help="llama: also time Inductor max-autotune on a few shapes, on a GPU (default: on)."
        ),
    ] = None,
    warm_sample: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="llama: rows re-tuned warm per part (tuning time; default "
            f"{catalog.GEMM_WARM_SAMPLE}).",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            help="A smoke run: every 4th problem (llama); for lowbit each chosen format on both "
            f"models' {' and '.join(catalog.LOWBIT_QUICK_OPS)} at M "
            f"{', '.join(map(str, catalog.LOWBIT_QUICK_M))}; on a CPU, either suite times one "
            f"small shape in their place (N={catalog.GEMM_QUICK_CPU_SHAPE[0]}, "
            f"K={catalog.GEMM_QUICK_CPU_SHAPE[1]}; llama's odd part "
            f"N={catalog.GEMM_QUICK_CPU_ODD_SHAPE[0]}, K={catalog.GEMM_QUICK_CPU_ODD_SHAPE[1]}) "
            f"at M {', '.join(map(str, catalog.GEMM_QUICK_CPU_M))}, targets not judged; lowbit "
            "with --proj given, those projections at full size (minutes a row on a CPU)."
        ),
    ] = False,
    m: Annotated[
        list[int] | None,
        typer.Option(
            "--m",
            help="lowbit: only these M (repeatable; default "
            f"{', '.join(map(str, catalog.LOWBIT_M_SIZES))}, or --quick's).",
        ),
    ] = None,
    proj: Annotated[
        list[str] | None,
        typer.Option(
            help="lowbit: only these projections (repeatable): "
            f"{', '.join(catalog.MODEL_OPS)}; default all, or --quick's; full size, also "
            "with --quick on a CPU.",
        ),
    ] = None,
) -> None:
    """Tune the Llama GEMM suite and time cuBLAS (torch.matmul) against the winners; or the
    low-bit suite beside torch's int4 / FP8 ops and bf16 cuBLAS."""
    from tuner.suites import gemm, lowbit

    if suite not in ("llama", "lowbit"):
        raise ValueError(f"suite must be 'llama' or 'lowbit', got {suite!r}")
    parts = gemm.PARTS if suite == "llama" else lowbit.FORMATS
    chosen = list(dict.fromkeys(part or parts))  # a part named twice runs once
    for p in chosen:
        if p not in parts:
            raise ValueError(f"part must be one of {list(parts)}, got {p!r}")
    options = tune_options(
        budget=budget, ops=("gemm",), source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained, isolate=isolate,
    )  # fmt: skip
    if suite == "llama" and (m or proj):
        raise ValueError("--m and --proj choose rows of the lowbit suite, not of --suite llama")
    if suite == "lowbit" and (inductor is not None or warm_sample is not None):
        # named rather than ignored: the lowbit suite times neither
        raise ValueError("--inductor and --warm-sample are options of --suite llama; the lowbit "
                         "suite times no Inductor run and re-tunes no rows warm")  # fmt: skip
    if suite == "lowbit":
        rows = lowbit.chosen_problems(chosen, quick=quick, ms=m, ops=proj)
        twins = [lowbit.bf16_twin(key) for _, key in rows]  # tuned for the bf16 columns
        ready(rows, source, out, "--quick without --proj" if proj else "--quick", twins)
        lowbit.run(rows, out, options)
        return
    parts_rows = {p: gemm.chosen_problems(p, quick=quick) for p in chosen}
    ready([row for rows in parts_rows.values() for row in rows], source, out)
    if inductor and (why := gemm.no_inductor(parts_rows)):
        output_console(stderr=True).print(f"[yellow]note[/yellow]: --inductor: {why}")
    for p, problems in parts_rows.items():
        gemm.run_part(
            p, problems, out, options, inductor=inductor is not False,
            warm_sample=catalog.GEMM_WARM_SAMPLE if warm_sample is None else warm_sample,
        )  # fmt: skip


@app.command("sdpa")
def bench_sdpa(
    out: Annotated[
        Path,
        typer.Option(
            help=f"Folder for sdpa_<part>.json and .png. {INTERRUPTED_HELP}", file_okay=False
        ),
    ] = BENCH_OUT,
    part: Annotated[str, typer.Option(help="all, prefill or decode.")] = "all",
    dtype: Annotated[str, typer.Option(help="bf16, f16 or f32.")] = "bf16",
    budget: SuiteBudgetOpt = BENCH_BUDGET_S,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=int(WORKERS.high),  # $TUNER_COMPILE_WORKERS's bound: past it the pool reads none
            help="Processes compiling Triton candidates (default: $TUNER_COMPILE_WORKERS, else "
            "the compile pool's share of the cores).",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            help="A smoke run: every 4th problem; on a CPU a few small ones (prefill of one "
            f"{catalog.SDPA_QUICK_CPU_PREFILL_SEQ}-token sequence, decode at batch 1 against "
            f"{' and '.join(map(str, catalog.SDPA_QUICK_CPU_DECODE_KV))} keys): seconds in bf16, "
            "torch's SDPA alone (Triton's interpreter computes bf16 wrongly); in f16 and f32 the "
            "Triton candidates run through the interpreter too: minutes a row, 10 or more a part."
        ),
    ] = False,
) -> None:
    """Tune attention shapes and time torch's default SDPA against the winners."""
    from tuner.suites import sdpa

    if part not in ("all", *sdpa.PARTS):
        raise ValueError(f"part must be all, prefill or decode, got {part!r}")
    options = tune_options(
        budget=budget, ops=("sdpa",), source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained,
    )  # fmt: skip
    chosen = list(sdpa.PARTS) if part == "all" else [part]
    # a bad --dtype raises here, before --out is made
    suites = {p: sdpa.chosen_problems(p, dtype, quick=quick) for p in chosen}
    ready([row for rows in suites.values() for row in rows], source, out)
    if workers is not None:  # given: it wins over $TUNER_COMPILE_WORKERS, not a default does
        os.environ["TUNER_COMPILE_WORKERS"] = str(workers)  # read when the compile pool starts
    sdpa.run(suites, out, options, dtype=dtype)

"""The ``tuner`` command line.

    tuner info                                  this device, and which kernel sources can run here
    tuner tune gemm -m 128 -n 4096 -k 4096      tune one problem and store the winner
    tuner tune-all --config problems.yaml       tune a list of problems (resumable)
    tuner tune-all --model configs/models/llama-3-8b.yaml --out rep/   a model, on every GPU
    tuner report --out rep/                     per-problem speedups, summary, plot
    tuner show --op gemm                        winners as a table
    tuner export results.json / tuner import results.json

The cache is ``--cache PATH``, else ``$TUNER_CACHE``, else ``~/.cache/tuner/tuner.db``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tuner.cache import Store, StoreError, default_path
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.cli import fleet
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key, SdpaKey, parse_key
from tuner.offline.problem_list import ConfigError
from tuner.suites import gemm, sdpa
from tuner.tuning.engine import TuneOptions, current_device, tune

app = typer.Typer(
    help="Autotuned GEMM and attention kernels with a shared results cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
tune_app = typer.Typer(help="Tune one problem and store its winner.", no_args_is_help=True)
app.add_typer(tune_app, name="tune")
# Benchmark suites (tuner/suite.py). Each suite's command lives in its own module and is
# registered at the bottom of this file: bench_app.command("gemm")(gemm.command).
bench_app = typer.Typer(
    help="Benchmark suites: tune, then time baseline and winner side by side.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache",
        envvar="TUNER_CACHE",
        help="SQLite cache file.",
        show_default="~/.cache/tuner/tuner.db",
    ),
]
BudgetOpt = Annotated[float, typer.Option(min=0.001, help="Timing budget per candidate, seconds.")]
SourcesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--source", help="Only these candidate sources (repeatable); the baseline always runs."
    ),
]


def open_store(path: Path | None) -> Store:
    return Store(path or default_path())


@app.callback()
def main_options(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log debug detail.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


# --- info --------------------------------------------------------------------------------------


def source_status(src: Source | str, device: str) -> str:
    if isinstance(src, str):
        return src
    return src.unavailable(device) or "available"


@app.command()
def info() -> None:
    """Print this device's fingerprint and the status of every candidate source."""
    device = current_device()
    fp = fingerprint(device)
    t = Table(title="device", show_header=False)
    t.add_row("device class", fp.device_class)
    t.add_row("name", fp.name)
    if fp.kind == "cuda":
        t.add_row("compute capability", fp.compute_capability)
        t.add_row("SMs", str(fp.sm_count))
        t.add_row("memory", f"{fp.memory_gib} GiB")
        t.add_row("L2", f"{fp.l2_bytes / 2**20:.0f} MiB")
    else:
        t.add_row("cores", str(fp.sm_count))
    for name, version in sorted(fp.versions.items()):
        t.add_row(name, version)
    console.print(t)
    s = Table(title="candidate sources")
    for col in ("source", "op", "status"):
        s.add_column(col)
    for name, src in registry.all_sources().items():
        status = source_status(src, device)
        style = "green" if status == "available" else "yellow"
        s.add_row(name, getattr(src, "op", "?"), f"[{style}]{status}[/{style}]")
    console.print(s)


# --- tune --------------------------------------------------------------------------------------


def run_tune(key: Key, cache: Path | None, budget: float, sources: list[str] | None) -> None:
    registry.check_names(sources)
    store = open_store(cache)
    store.save_device(fingerprint())
    with console.status(f"tuning {key}"):
        outcome = tune(key, options=TuneOptions(budget_s=budget, sources=sources))
    store.save_run(outcome.measurements, outcome.winner)
    t = Table(title=str(key))
    for col in ("candidate", "status", "median us", "p10..p90", "rel err", "note"):
        t.add_column(col)
    for m in sorted(outcome.measurements, key=lambda m: (m.median_us is None, m.median_us or 0)):
        spread = f"{m.p10_us:.1f}..{m.p90_us:.1f}" if m.p10_us is not None else ""
        t.add_row(
            m.candidate + (" (baseline)" if m.is_baseline else ""), m.status,
            f"{m.median_us:.2f}" if m.median_us else "", spread,
            f"{m.max_rel_err:.1e}" if m.max_rel_err is not None else "", m.error[:60],
        )  # fmt: skip
    console.print(t)
    w = outcome.winner
    console.print(
        f"winner: [bold]{w.candidate}[/bold] {w.median_us:.2f} us, baseline {w.baseline_us:.2f} us, speedup {w.speedup:.2f}x (tuned in {outcome.seconds:.1f} s)"
    )


@tune_app.command("gemm")
def tune_gemm(
    m: Annotated[int, typer.Option("-m", help="Rows of A and C.")],
    n: Annotated[int, typer.Option("-n", help="Columns of B and C.")],
    k: Annotated[int, typer.Option("-k", help="Inner dimension.")],
    batch: int = 1,
    dtype: Annotated[str, typer.Option(help="f16, bf16 or f32.")] = "bf16",
    layout: Annotated[
        str, typer.Option(help="nn, nt, tn or tt (n: row-major, t: column-major; A then B).")
    ] = "nn",
    tf32: Annotated[bool, typer.Option(help="Allow TF32 for f32 inputs.")] = False,
    align: Annotated[int, typer.Option(help="Alignment class in bytes (16, 8, 4, 2).")] = 16,
    cache: CacheOpt = None,
    budget: BudgetOpt = 0.15,
    source: SourcesOpt = None,
) -> None:
    """Tune C = A @ B."""
    key = GemmKey(
        m=m,
        n=n,
        k=k,
        batch=batch,
        layout=layout,
        dtype=dtype,
        out_dtype=dtype,
        compute="tf32" if tf32 else "f32",
        align=align,
    )
    run_tune(key, cache, budget, source)


@tune_app.command("sdpa")
def tune_sdpa(
    q_len: Annotated[int, typer.Option(help="Query length.")],
    kv_len: Annotated[int, typer.Option(help="Key/value length.")],
    batch: int = 1,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    causal: Annotated[
        str, typer.Option(help="none, top_left (torch's is_causal) or bottom_right.")
    ] = "none",
    dtype: Annotated[str, typer.Option(help="f16 or bf16.")] = "bf16",
    cache: CacheOpt = None,
    budget: BudgetOpt = 0.15,
    source: SourcesOpt = None,
) -> None:
    """Tune scaled dot-product attention."""
    key = SdpaKey(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        causal=causal,
        dtype=dtype,
    )
    run_tune(key, cache, budget, source)


@tune_app.command("key")
def tune_key(
    key: Annotated[
        str,
        typer.Argument(
            help='A key string, e.g. "gemm:m=1,n=4096,k=4096,dtype=bf16,out_dtype=bf16".'
        ),
    ],
    cache: CacheOpt = None,
    budget: BudgetOpt = 0.15,
    source: SourcesOpt = None,
) -> None:
    """Tune the problem named by a key string (as ``tuner show`` prints them)."""
    run_tune(parse_key(key), cache, budget, source)


# --- tune-all / report / tunableop (bodies in tuner/tune_all_cmd.py, imported when run) ---------

ModelsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--model", help="Model config YAML (configs/models/*.yaml); repeatable.", exists=True,
        dir_okay=False,
    ),
]  # fmt: skip
ConfigsOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--config", "-c", help="YAML file with a 'problems:' list; repeatable.", exists=True,
        dir_okay=False,
    ),
]  # fmt: skip
TunableOpOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--tunableop", help="PyTorch TunableOp results or untuned-shapes CSV; repeatable.",
        exists=True, dir_okay=False,
    ),
]  # fmt: skip
MissesOpt = Annotated[
    bool, typer.Option("--misses", help="The keys recorded as missed here (TUNER_MODE=record).")
]
OpOpt = Annotated[str | None, typer.Option("--op", help="Only 'gemm' or only 'sdpa' problems.")]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Directory for report.json and speedup.png.", file_okay=False),
]


def _sources(model, config, tunableop_file, misses, op, queue=0):  # type: ignore[no-untyped-def]
    from tuner.cli.tune_all import Sources

    if op not in (None, "gemm", "sdpa"):
        raise ConfigError(f"--op must be 'gemm' or 'sdpa', got {op!r}")
    return Sources(model or [], config or [], tunableop_file or [], misses, queue, op)


@app.command("tune-all")
def tune_all(
    model: ModelsOpt = None,
    config: ConfigsOpt = None,
    tunableop_file: TunableOpOpt = None,
    misses: MissesOpt = False,
    queue: Annotated[
        int, typer.Option("--queue", min=0, help="Claim this many keys from the fleet's queue.")
    ] = 0,
    op: OpOpt = None,
    cache: CacheOpt = None,
    budget: BudgetOpt = 0.15,
    source: SourcesOpt = None,
    problem_timeout: Annotated[
        float, typer.Option(help="Seconds a problem may take before its worker is killed.")
    ] = 900.0,
    time_limit: Annotated[
        float | None, typer.Option(help="Seconds for the whole run; no problem starts after.")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Worker processes (default: one per local GPU).")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Retune problems that already have a current winner.")
    ] = False,
    isolate: Annotated[
        bool,
        typer.Option(help="Candidates in a replaceable process: a crash skips one candidate."),
    ] = False,
    out: OutOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be tuned.")
    ] = False,
) -> None:
    """Tune models, problem lists, TunableOp files, recorded misses and fleet-queue keys.

    All local GPUs work at once; problems tuned already are skipped (a killed run resumes);
    a report ends the run. Exit status 0 when every problem has a winner, else 1."""
    from tuner.cli.tune_all import tune_all as run_tune_all
    from tuner.offline.tune_all import RunOptions

    options = RunOptions(
        budget_s=budget, sources=source, problem_timeout_s=problem_timeout,
        time_limit_s=time_limit, workers=workers, force=force, isolate=isolate,
    )  # fmt: skip
    registry.check_names(source)
    sources = _sources(model, config, tunableop_file, misses, op, queue)
    path = cache or default_path()
    raise typer.Exit(
        run_tune_all(sources, path, options, out=out, dry_run=dry_run, console=console)
    )


@app.command("report")
def report_(
    model: ModelsOpt = None,
    config: ConfigsOpt = None,
    tunableop_file: TunableOpOpt = None,
    misses: MissesOpt = False,
    op: OpOpt = None,
    cache: CacheOpt = None,
    out: OutOpt = None,
    rows: Annotated[int | None, typer.Option(help="Table rows to print (all in JSON).")] = 60,
) -> None:
    """Baseline, winner, speedup and tuning time per problem, a summary and a speedup plot.

    Covers every winner and failure of this device class, or the problems of the sources given."""
    from tuner.cli.tune_all import report_command

    sources = _sources(model, config, tunableop_file, misses, op)
    report_command(sources, cache or default_path(), out, console, rows)


tunableop_app = typer.Typer(help="PyTorch TunableOp CSV files: show, export.", no_args_is_help=True)
app.add_typer(tunableop_app, name="tunableop")


@tunableop_app.command("show")
def tunableop_show(
    files: Annotated[list[Path], typer.Argument(help="TunableOp CSV files.", exists=True)],
) -> None:
    """The problem keys that TunableOp files name (tune them with tune-all --tunableop)."""
    from tuner.cli.tune_all import tunableop_show as show_files

    show_files(files, console)


@tunableop_app.command("export")
def tunableop_export(
    output: Annotated[Path, typer.Argument(help="CSV to write, e.g. tunableop_results0.csv.")],
    cache: CacheOpt = None,
    pt_version: Annotated[
        str | None, typer.Option(help="PT_VERSION validator (default: this torch's).")
    ] = None,
) -> None:
    """Write this device's winners that TunableOp can run (cuBLAS default, cuBLASLt algos)."""
    from tuner.cli.tune_all import tunableop_export as export_csv

    export_csv(cache or default_path(), output, pt_version, console)


# --- show / export / import --------------------------------------------------------------------


@app.command()
def show(
    cache: CacheOpt = None,
    op: Annotated[str | None, typer.Option(help="gemm or sdpa.")] = None,
    source: Annotated[str | None, typer.Option(help="Only winners from this source.")] = None,
    contains: Annotated[
        str | None, typer.Option(help="Only keys containing this text, e.g. 'dtype=bf16'.")
    ] = None,
    all_devices: Annotated[
        bool,
        typer.Option("--all-devices", help="Winners of every device class, not only this one."),
    ] = False,
    full_keys: Annotated[
        bool, typer.Option("--full-keys", help="Print full key strings instead of short labels.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List stored winners."""
    if op not in (None, "gemm", "sdpa"):
        raise ConfigError(f"--op must be 'gemm' or 'sdpa', got {op!r}")
    store = open_store(cache)
    dc = None if all_devices else fingerprint().device_class
    winners = store.winners(dc, op=op, source=source, contains=contains)
    if as_json:
        print(json.dumps([w.to_row() for w in winners], indent=1))
        return
    t = Table(title=f"{len(winners)} winners" + (f" on {dc}" if dc else ""))
    for col in ("key", "winner", "us", "baseline us", "speedup"):
        t.add_column(col, overflow="fold")
    for w in winners:
        color = "green" if w.speedup > 1.0 else "white"
        t.add_row(
            w.key if full_keys else parse_key(w.key).label,
            w.candidate,
            f"{w.median_us:.2f}",
            f"{w.baseline_us:.2f}",
            f"[{color}]{w.speedup:.2f}x[/{color}]",
        )
    console.print(t)


@app.command()
def export(
    output: Annotated[Path, typer.Argument(help="JSON file to write ('-' for stdout).")],
    cache: CacheOpt = None,
    device_class: Annotated[str | None, typer.Option(help="Only this device class.")] = None,
) -> None:
    """Export measurements and winners as JSON."""
    data = json.dumps(open_store(cache).export(device_class), indent=1)
    if str(output) == "-":
        print(data)
        return
    tmp = output.with_suffix(output.suffix + ".tmp")
    try:
        tmp.write_text(data)
        tmp.replace(output)  # never leave a half-written export behind
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"{output}: cannot write: {e.strerror}") from None
    err_console.print(f"wrote {output}")


@app.command("import")
def import_(
    input: Annotated[
        Path,
        typer.Argument(help="JSON file written by 'tuner export'.", exists=True, dir_okay=False),
    ],
    cache: CacheOpt = None,
) -> None:
    """Merge an export into the cache (idempotent, all or nothing)."""
    try:
        data = json.loads(input.read_text())
    except OSError as e:
        raise ConfigError(f"{input}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{input}: not a text file (expected a 'tuner export' JSON)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{input}: not valid JSON: {e}") from None
    counts = open_store(cache).import_(data)
    console.print(
        f"imported {counts['measurements']} new measurements, {counts['winners']} winners, {counts['devices']} devices"
    )


fleet.register(app)  # serve, token, sync, push
bench_app.command("sdpa")(sdpa.command)
bench_app.command("gemm")(gemm.command)


def main() -> None:
    """Entry point: user mistakes print one clear line and exit 2, never a traceback."""
    try:
        app()
    except (StoreError, ValueError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()

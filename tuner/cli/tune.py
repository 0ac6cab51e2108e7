"""``tuner info``, ``tuner tune gemm|sdpa|key``, ``tuner show``, ``tuner export``, ``tuner import``:
this device, one problem tuned, and the winners in the cache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cache.sqlite import unmade
from tuner.cache.store import EXPORTED_TABLES, ExportError, Store, checked_export, default_path
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.cli.errors import write_output
from tuner.cli.options import (
    TUNE_DEFAULTS,
    BudgetOpt,
    CacheOpt,
    ConfirmRoundsOpt,
    ConfirmTriesOpt,
    DeviceClassOpt,
    IsolateOpt,
    LaunchOpt,
    OpOpt,
    SourcesOpt,
    SustainedOpt,
    cache_path,
    check_op,
    check_sources_take,
    open_store,
    store_kept_if_used,
    tune_options,
    unknown_device_class,
)
from tuner.core.console import counted, output_console
from tuner.core.device import fingerprint, too_big_here
from tuner.core.guesses import did_you_mean
from tuner.core.keys import (
    ITEMSIZE,
    LOWBIT_FORMAT_NAMES,
    LOWBIT_FORMATS,
    GemmKey,
    Key,
    SdpaKey,
    default_align,
    fp8_key_error,
    lowbit_fields,
    parse_key,
)
from tuner.core.settings import KNOWN, config_path, read_config, refusal
from tuner.measure.records import ELLIPSIS, Measurement, Winner, candidate_label, clipped
from tuner.offline.problem_list import ConfigError
from tuner.tuning.options import TuneOptions

if TYPE_CHECKING:
    from tuner.tuning.engine import TuneOutcome

app = typer.Typer()
tune_app = typer.Typer(help="Tune one problem and store its winner.", no_args_is_help=True)
app.add_typer(tune_app, name="tune")
console = output_console()
NOTE_WIDTH = 200  # characters of a candidate's note in tune's table


@app.command()
def info() -> None:
    """Print this device's fingerprint and the status of every candidate source."""
    from tuner.tuning.engine import current_device

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
    console.print(settings_table())
    s = Table(title="candidate sources")
    for col in ("source", "op", "status"):
        s.add_column(col)
    for name, src in registry.all_sources().items():
        status = (src.unavailable(device) or "available") if isinstance(src, Source) else src
        style = "green" if status == "available" else "yellow"
        s.add_row(name, getattr(src, "op", "?"), f"[{style}]{status}[/{style}]")
    console.print(s)


def settings_table() -> Table:
    """Where this process's settings come from and what they are (``TUNER_*``, the config file
    filling what the environment leaves unset): the first thing to look at when nothing is
    served."""
    t = Table(title="settings", show_header=False)
    t.add_row("config file", _config_shown(config_path()))
    cache = default_path()
    t.add_row("cache (TUNER_CACHE)", f"{cache}" + ("" if cache.exists() else " (not made yet)"))
    mode = os.environ.get("TUNER_MODE")
    t.add_row("mode (TUNER_MODE)", _choice_shown("mode", mode) if mode else "lookup (the default)")
    for name in sorted(KNOWN.keys() - {"cache", "mode"}):
        if (value := os.environ.get(f"TUNER_{name.upper()}")) is not None:
            shown = value[:8] + "..." if name == "token" else _choice_shown(name, value)
            t.add_row(f"{name} (TUNER_{name.upper()})", shown)  # never a whole secret
    return t


def _config_shown(path: Path) -> str:
    """The config file's path, and whether it applies: a file that cannot be read is ignored
    whole, one with mistakes applies but for them (each logged above the table)."""
    if not path.is_file():
        return f"{path} ({'a folder, ignored' if path.is_dir() else 'none there'})"
    try:
        _, problems = read_config(path)
    except (OSError, ValueError) as e:
        return (
            f"[red]{escape(str(path))} (ignored: {escape(str(e).removeprefix(f'{path}: '))})[/red]"
        )
    if problems:
        left_out = counted(len(problems), "setting")
        return f"[yellow]{escape(str(path))} ({left_out} left out, named above)[/yellow]"
    return str(path)


def _choice_shown(name: str, value: str) -> str:
    """A setting's value, marked where it is not one of the words it takes: the first call of
    the dispatcher fails on it, or an on/off setting's default applies, and info is where a
    user looks before that."""
    why = refusal(name, value)
    return value if why is None else f"[red]{value} ({why})[/red]"


def _error_text(err: float | None, bounded: bool) -> str:
    """A candidate's numerics: a share of its format's bound (low-bit), else a relative error."""
    if err is None:
        return ""
    return f"{err:.2f}" if bounded else f"{err:.1e}"


def run_tune(key: Key, cache: Path | None, options: TuneOptions) -> None:
    """Tune ``key``, store the run and print every candidate's measurement and the winner."""
    from tuner.tuning.engine import earlier_times

    if isinstance(key, GemmKey) and (why := too_big_here(key.min_bytes)):
        raise ConfigError(f"{key}: {why}")
    check_sources_take(options.sources, key)
    fp = fingerprint()
    made = unmade(cache_path(cache))
    # a cache this command makes is removed again if the tuning fails: nothing is stored before
    with store_kept_if_used(cache) as store:
        store.check_writable()  # a cache that cannot be written is refused before the tuning
        earlier = earlier_times(store.measurements(fp.device_class, str(key)), options.launch)
        if os.environ.get("TRITON_INTERPRET") == "1" and _runs_triton(key, options):
            console.print(
                "[dim]TRITON_INTERPRET=1: Triton candidates run in its interpreter, minutes a "
                f"candidate at model sizes (--source {registry.baseline(key.op, key).name} "
                "leaves them out)[/dim]"
            )
        outcome = _tuned(key, options, earlier)
        store.save_device(fp)
        store.save_run(outcome.measurements, outcome.winner)
    # the key whole on one line, never wrapped: it is copied into `tuner tune key` and `show`
    console.print(f"key: {key}", soft_wrap=True, highlight=False, markup=False)
    t = Table()
    # a low-bit result is checked element by element against a bound derived from its format
    bounded = isinstance(key, GemmKey) and key.lowbit
    error = "error / bound" if bounded else "rel err"
    for col in ("candidate", "status", "median us", "p10..p90", error, "note"):
        t.add_column(col)
    ran = [m for m in outcome.measurements if m.status != "unsupported"]
    w = outcome.winner
    for m in sorted(ran, key=lambda m: (m.median_us is None, m.median_us or 0)):
        spread = f"{m.p10_us:.1f}..{m.p90_us:.1f}" if m.p10_us is not None else ""
        err = _error_text(m.max_rel_err, bounded)
        # rows run by trial time, so a challenger that lost its duel can head the table
        won = m.candidate == w.candidate
        roles = [role for role, held in (("baseline", m.is_baseline), ("winner", won)) if held]
        name = escape(candidate_label(m.candidate)) + (f" ({', '.join(roles)})" if roles else "")
        t.add_row(
            name, m.status, f"{m.median_us:.2f}" if m.median_us else "", spread, err,
            escape(_note_text(m.error)), style="bold" if won else None,
        )  # fmt: skip
    console.print(t)
    # sources that cannot run this problem here, one line per reason
    not_run: dict[str, list[str]] = {}
    for m in outcome.measurements:
        if m.status == "unsupported":
            not_run.setdefault(m.error, []).append(m.source)
    for reason, names in not_run.items():
        console.print(f"[dim]not run: {', '.join(names)}: {reason}[/dim]", highlight=False)
    console.print(
        f"winner ({w.launch}): [bold]{escape(candidate_label(w.candidate))}[/bold] "
        f"{w.median_us:.2f} us, baseline {w.baseline_us:.2f} us, speedup {w.speedup:.2f}x "
        f"(tuned in {outcome.seconds:.1f} s{_phases_text(outcome.phases)})"
    )
    if made:  # a mistyped --cache or $TUNER_CACHE would otherwise go unseen
        typer.echo(f"stored in a new cache: {cache_path(cache)}", err=True)


def _runs_triton(key: Key, options: TuneOptions) -> bool:
    """Whether the run times a Triton kernel (its interpreter's slowness is worth a word)."""
    return any(src.builds_kernels and src.unavailable("cpu") is None
               and src.unsupported(key) is None
               and (options.sources is None or src.name in options.sources)
               for src in registry.sources(key.op))  # fmt: skip


def _tuned(key: Key, options: TuneOptions, earlier: dict[str, float]) -> TuneOutcome:
    """``tune(key)``, its progress shown as it runs; a run that cannot finish is told as a user
    error (operands that do not fit) or an interruption (status 130), nothing stored."""
    import torch

    from tuner.tuning.tune import tune

    measured: list[Measurement] = []
    with console.status(f"tuning {key}") as status:

        def shown(m: Measurement) -> None:  # the spinner says how far the run is; without a
            # terminal (a log), a line on stderr does, the table staying alone on stdout
            measured.append(m)
            took = f" {m.median_us:.1f} us" if m.median_us else ""
            label = candidate_label(m.candidate)
            status.update(f"tuning {key}: {len(measured)} measured, last {escape(label)} "
                          f"({m.status}{took})")  # fmt: skip
            if not console.is_terminal and m.status != "unsupported":
                ran = sum(x.status != "unsupported" for x in measured)
                typer.echo(f"measured {ran}: {label} ({m.status}{took})", err=True)

        try:
            outcome = tune(key, options=options, earlier=earlier, on_result=shown)
        except KeyboardInterrupt:
            typer.echo(
                f"interrupted after {counted(len(measured), 'measurement')}: nothing stored",
                err=True,
            )
            raise typer.Exit(130) from None
        except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's refusal
            first = str(e).strip().splitlines()[0][:200]
            if isinstance(e, torch.OutOfMemoryError) or "DefaultCPUAllocator" in first:
                raise ConfigError(f"{key}: its operands do not fit in memory ({first})") from None
            raise
    return outcome


def _note_text(note: str) -> str:
    """A candidate's note cut for the table. A duel's verdict ends its note (kept, or lost and
    the tests it failed), so a long one keeps its end; any other note keeps its head (an error's
    kind comes first). The whole note stays in the cache."""
    if len(note) <= NOTE_WIDTH or "confirmation:" not in note:
        return clipped(note, NOTE_WIDTH)
    return ELLIPSIS + note[-(NOTE_WIDTH - 1) :]


def _phases_text(phases: dict[str, float]) -> str:
    """Where the tuning time went (``engine.PHASES``), the phases that took a tenth of a
    second or more: a slow tune is mostly compiling or duels, and which one says what to do."""
    shown = [f"{phase} {s:.1f} s" for phase, s in phases.items() if s >= 0.1]
    return f": {', '.join(shown)}" if shown else ""


@tune_app.command("gemm")
def tune_gemm(
    m: Annotated[int, typer.Option("-m", help="Rows of A and C.")],
    n: Annotated[int, typer.Option("-n", help="Columns of B and C.")],
    k: Annotated[int, typer.Option("-k", help="Inner dimension.")],
    batch: Annotated[int, typer.Option(help="Batch count (bmm).")] = 1,
    dtype: Annotated[
        str,
        typer.Option(
            help="f16, bf16, f32 or tf32 (f32 on the TF32 path, as --tf32); or a low-bit "
            "format: int4-g128 (also g32, g64, g256), "
            "fp8-rowwise, fp8-tensorwise, fp8-rowwise-fast, fp8-tensorwise-fast "
            "(x @ W.T: layout nt)."
        ),
    ] = "bf16",
    layout: Annotated[
        str | None,
        typer.Option(
            help="nn, nt, tn or tt (n: row-major, t: column-major; A then B). Default: nn, "
            "and nt (the only one) for a low-bit format.",
            show_default=False,
        ),
    ] = None,
    tf32: Annotated[
        bool | None,
        typer.Option(help="Allow TF32 for f32 inputs (off unless given).", show_default=False),
    ] = None,
    align: Annotated[
        int | None,
        typer.Option(
            help="Alignment class in bytes (16, 8, 4, 2). Default: the largest the shape allows.",
            show_default=False,
        ),
    ] = None,
    cache: CacheOpt = None,
    budget: BudgetOpt = TUNE_DEFAULTS.budget_s,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    isolate: IsolateOpt = False,
) -> None:
    """Tune C = A @ B."""
    options = tune_options(
        budget=budget, ops=("gemm",), source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained, isolate=isolate,
    )  # fmt: skip
    run_tune(_gemm_key(m, n, k, batch, dtype, layout, tf32, align), cache, options)


def _gemm_key(
    m: int, n: int, k: int, batch: int, dtype: str, layout: str | None, tf32: bool | None,
    align: int | None,
) -> GemmKey:  # fmt: skip
    """The key ``tune gemm`` tunes, a plain GEMM or a low-bit one named by its format, with the
    alignment as given, else the largest its dense operands allow (``default_align``).
    ``tf32``: None where neither --tf32 nor --no-tf32 was given."""
    if dtype == "tf32":  # as model configs and problem lists name it
        if tf32 is False:
            raise ValueError("--dtype tf32 is f32 on the TF32 path, and --no-tf32 refuses it: "
                             "give one of them (--dtype f32 for f32 without TF32)")  # fmt: skip
        dtype, tf32 = "f32", True
    if dtype in ITEMSIZE:
        if tf32 and dtype != "f32":
            raise ValueError(f"--dtype {dtype}: --tf32 is for f32 inputs only")
        fields: dict[str, Any] = dict(
            m=m, n=n, k=k, batch=batch, layout=layout or "nn", dtype=dtype, out_dtype=dtype,
            compute="tf32" if tf32 else "f32",
        )  # fmt: skip
        return GemmKey(**fields, align=default_align(fields) if align is None else align)
    try:
        fields = lowbit_fields(dtype)
    except ValueError:
        allowed = [*ITEMSIZE, "tf32"]
        raise ValueError(
            f"--dtype must be one of {allowed} or a low-bit format ({LOWBIT_FORMAT_NAMES}), "
            f"got {dtype!r}{did_you_mean(dtype, [*allowed, *LOWBIT_FORMATS])}"
        ) from None
    if layout not in (None, "nt"):
        raise ValueError(f"--dtype {dtype}: a low-bit GEMM is x @ W.T: --layout nt (got {layout})")
    if tf32:
        raise ValueError(f"--dtype {dtype}: --tf32 is for f32 inputs only")
    fields |= dict(m=m, n=n, k=k, batch=batch)
    key = GemmKey(**fields, align=default_align(fields) if align is None else align)
    if error := fp8_key_error(key):
        raise ValueError(error)
    return key


DEFAULT_KV_HEADS = 8  # tune sdpa's --kv-heads: Llama-3-8B's


@tune_app.command("sdpa")
def tune_sdpa(
    q_len: Annotated[int, typer.Option(help="Query length.")],
    kv_len: Annotated[int, typer.Option(help="Key/value length.")],
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    q_heads: Annotated[int, typer.Option(help="Query heads.")] = 32,
    kv_heads: Annotated[
        int | None,
        typer.Option(help="Key/value heads (fewer: grouped-query; default 8).", show_default=False),
    ] = None,
    head_dim: Annotated[int, typer.Option(help="Head dimension.")] = 128,
    head_dim_v: Annotated[
        int | None,
        typer.Option(
            help="V's head dimension, where it differs from --head-dim.", show_default=False
        ),
    ] = None,
    scale: Annotated[
        float | None,
        typer.Option(help="Softmax scale (default 1/sqrt(head dim)).", show_default=False),
    ] = None,
    causal: Annotated[
        str, typer.Option(help="none, top_left (torch's is_causal) or bottom_right.")
    ] = "none",
    dtype: Annotated[str, typer.Option(help="f16, bf16 or f32.")] = "bf16",
    cache: CacheOpt = None,
    budget: BudgetOpt = TUNE_DEFAULTS.budget_s,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    isolate: IsolateOpt = False,
) -> None:
    """Tune scaled dot-product attention."""
    options = tune_options(
        budget=budget, ops=("sdpa",), source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained, isolate=isolate,
    )  # fmt: skip
    if kv_heads is None and q_heads % DEFAULT_KV_HEADS:
        raise ValueError(
            f"--kv-heads (default {DEFAULT_KV_HEADS}) must divide --q-heads ({q_heads}): "
            "give --kv-heads"
        )
    if scale is not None and scale <= 0:  # 0 in a key string stands for the default
        raise ValueError(f"--scale must be a positive number, got {scale:g}")
    if head_dim_v is not None and head_dim_v <= 0:  # 0 in a key string stands for --head-dim
        raise ValueError(f"--head-dim-v must be a positive integer, got {head_dim_v}")
    key = SdpaKey(
        batch=batch, q_heads=q_heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
        kv_heads=DEFAULT_KV_HEADS if kv_heads is None else kv_heads,
        head_dim_v=head_dim_v or 0, causal=causal, dtype=dtype, scale=scale or 0.0,
    )  # fmt: skip
    run_tune(key, cache, options)


@tune_app.command("key")
def tune_key(
    key: Annotated[
        str,
        typer.Argument(
            help='A key string, e.g. "gemm:m=1,n=4096,k=4096,dtype=bf16,out_dtype=bf16".'
        ),
    ],
    cache: CacheOpt = None,
    budget: BudgetOpt = TUNE_DEFAULTS.budget_s,
    source: SourcesOpt = None,
    launch: LaunchOpt = TUNE_DEFAULTS.launch,
    confirm_rounds: ConfirmRoundsOpt = TUNE_DEFAULTS.confirm_rounds,
    confirm_tries: ConfirmTriesOpt = TUNE_DEFAULTS.confirm_tries,
    sustained: SustainedOpt = TUNE_DEFAULTS.sustained_s,
    isolate: IsolateOpt = False,
) -> None:
    """Tune the problem named by a key string (as 'tuner show --full-keys' prints them)."""
    parsed = parse_key(key)
    options = tune_options(
        budget=budget, ops=(parsed.op,), source=source, launch=launch, confirm_rounds=confirm_rounds,
        confirm_tries=confirm_tries, sustained=sustained, isolate=isolate,
    )  # fmt: skip
    run_tune(parsed, cache, options)


def key_contains(key: str, text: str) -> bool:
    """``show --contains``: ``text`` in the key's short label or string; with ``=``, whole
    comma-separated fields of the string (``dtype=bf16`` is not ``out_dtype=bf16``)."""
    if "=" in text:  # the fields, or the op and its fields ("gemm:m=16,n=64")
        return f",{text}," in f",{key.partition(':')[2]}," or f",{text}," in f",{key},"
    return text in key or text in parse_key(key).label


def _matching(
    store: Store, dc: str | None, op: str | None, source: str | None, contains: str | None
) -> list[Winner]:
    """The winners ``show`` lists: of device class ``dc`` (None: every one), matching its
    filters."""
    winners = store.winners(dc, op=op, source=source)
    return [w for w in winners if contains is None or key_contains(w.key, contains)]


@app.command()
def show(
    cache: CacheOpt = None,
    op: OpOpt = None,
    source: Annotated[str | None, typer.Option(help="Only winners from this source.")] = None,
    contains: Annotated[
        str | None,
        typer.Option(
            help="Only keys whose short label contains this text ('int4-g128'), or whose "
            "string does; text with '=' matches whole fields ('dtype=bf16' is not out_dtype's)."
        ),
    ] = None,
    all_devices: Annotated[
        bool,
        typer.Option("--all-devices", help="Winners of every device class, not only this one."),
    ] = False,
    device_class: DeviceClassOpt = None,
    full_keys: Annotated[
        bool,
        typer.Option(
            "--full-keys",
            help="Full key strings and candidate names instead of short labels, one winner a "
            "line, tab-separated (whole keys to copy or grep; --json gives every field).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List stored winners."""
    check_op(op)
    if as_json and full_keys:  # one would be dropped without a word
        raise ConfigError(
            "--json and --full-keys are two formats: give one (--json holds the full keys and "
            "candidate names too)"
        )
    if all_devices and device_class is not None:
        raise ConfigError("--all-devices and --device-class: give one (--all-devices shows "
                          "every device class's winners)")  # fmt: skip
    registry.check_names([source] if source else None)
    store = open_store(cache, existing=True)
    if device_class is not None and not store.winners(device_class, limit=1):
        raise unknown_device_class(store, device_class, "no winners of it")
    dc = None if all_devices else device_class or fingerprint().device_class
    winners = _matching(store, dc, op, source, contains)
    if as_json:
        print(json.dumps([w.to_row() for w in winners], indent=1))
        return
    columns = ("device class",) * (dc is None) + ("key", "winner", "launch", "us", "baseline us")
    if full_keys:  # a table would fold a long key over several lines
        print("\t".join(c.replace(" ", "_") for c in (*columns, "speedup")))
        for w in winners:
            print("\t".join((*(w.device_class,) * (dc is None), w.key, w.candidate, w.launch,
                             f"{w.median_us:.2f}", f"{w.baseline_us:.2f}", f"{w.speedup:.2f}")))  # fmt: skip
        return
    title = counted(len(winners), "winner") + (f" on {dc}" if dc else "")
    if not winners:  # no table to show; say where the winners are, if anywhere
        # the same filters' matches anywhere: none is on this device class
        others = _matching(store, None, op, source, contains) if dc else []
        elsewhere = f" ({len(others)} on other device classes: --all-devices)" if others else ""
        console.print(title + elsewhere)
        return
    t = Table(title=title)
    for col in (*columns, "speedup"):
        t.add_column(col, overflow="fold")
    # stale as on the host of the device class shown: its fingerprint's versions (this host's
    # own where the class is this host's, as its dispatcher judges them)
    own = fingerprint()
    here = own if device_class in (None, own.device_class) else store.fingerprint(device_class)
    from tuner.serving.dispatcher import stale_policy

    policy = stale_policy()  # a bad TUNER_STALE is refused before the table, not after it
    stale = 0
    for w in winners:
        color = "green" if w.speedup > 1.0 else "white"
        name = escape(candidate_label(w.candidate))
        if here and w.device_class == here.device_class and not w.measured_under(here):
            stale += 1
            name += " [yellow](stale)[/yellow]"
        t.add_row(
            *(w.device_class,) * (dc is None), parse_key(w.key).label, name, w.launch,
            f"{w.median_us:.2f}", f"{w.baseline_us:.2f}", f"[{color}]{w.speedup:.2f}x[/{color}]",
        )  # fmt: skip
    console.print(t)
    if here is None:
        console.print(
            f"[yellow]note[/yellow]: this cache holds no fingerprint of {dc} (the versions its "
            "hosts run): which of its winners are stale is not known; 'tuner sync' or a tune "
            "on such a device saves it"
        )
    if stale:
        served = (
            "served (TUNER_STALE=use, the default)"
            if policy == "use"
            else "not served: their keys are misses (TUNER_STALE=ignore)"
        )
        runs = "this host runs" if here is own else f"{dc}'s fingerprint in this cache names"
        console.print(
            f"[yellow]stale:[/yellow] {counted(stale, 'winner')} measured under other versions "
            f"than {runs} (torch, CUDA, Triton, ...: 'tuner info'): {served}; "
            "'tuner tune-all' tunes them again"
        )


@app.command()
def export(
    output: Annotated[Path, typer.Argument(help="JSON file to write ('-' for stdout).")],
    cache: CacheOpt = None,
    device_class: Annotated[str | None, typer.Option(help="Only this device class.")] = None,
) -> None:
    """Export measurements and winners as JSON."""
    store = open_store(cache, existing=True)
    exported = store.export(device_class)
    if device_class is not None and not any(exported[t] for t in EXPORTED_TABLES):
        raise unknown_device_class(store, device_class, "nothing of it")
    data = json.dumps(exported, indent=1)
    write_output(output, data)
    if str(output) != "-":
        typer.echo(f"wrote {output}", err=True)


@app.command("import")
def import_(
    input: Annotated[
        Path, typer.Argument(help="JSON file written by 'tuner export' ('-' for stdin).")
    ],
    cache: CacheOpt = None,
) -> None:
    """Merge an export into the cache (idempotent, all or nothing)."""
    try:
        data = json.loads(sys.stdin.read() if str(input) == "-" else input.read_text())
    except OSError as e:
        raise ConfigError(f"{input}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{input}: not a text file (expected a 'tuner export' JSON)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{input}: not valid JSON: {e}") from None
    except RecursionError:  # Python's decoder keeps a frame per level of nesting
        raise ConfigError(f"{input}: not valid JSON for an export: nested too deeply") from None
    try:  # checked before the cache is opened: a refused file makes no cache
        export = checked_export(data)
    except ExportError as e:  # the file's fault, not the cache's: named
        raise ConfigError(f"{input}: {e}") from None
    store = open_store(cache)
    counts = store.import_(export)
    console.print(
        f"imported {counted(counts['measurements'], 'new measurement')}, "
        f"{counted(counts['winners'], 'winner')} added or replaced, "
        f"{counted(counts['devices'], 'new device')}"
    )
    if counts["older_winners"]:
        console.print(
            f"left alone {counted(counts['older_winners'], 'winner')} older than the cache's "
            "for the same problem"
        )
    classes = {m.device_class for m in export.measurements}
    unplaced = sorted(dc for dc in classes if store.fingerprint(dc) is None)
    if unplaced:  # a fleet service files a measurement under its device's fingerprint
        n = sum(m.device_class in unplaced for m in export.measurements)
        console.print(
            f"[yellow]note:[/] {counted(n, 'measurement')} of device class "
            f"{escape(', '.join(map(repr, unplaced)))} came with no device fingerprint (the export's "
            "'devices' has none, nor does this cache): kept here, but 'tuner push' sends them "
            "only from a host of that class"
        )
    absent = [w for w in data.get("winners", []) if w["source"] not in registry.all_sources()]
    if absent:
        names = ", ".join(sorted({repr(w["source"]) for w in absent}))
        console.print(
            f"[yellow]note:[/] kept {counted(len(absent), 'winner')} of a candidate source "
            f"this host does not have ({names}): served here once it is installed"
        )

"""The command line as a user meets it: help, tables, and one-line errors for mistakes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import typer.rich_utils
from click.testing import Result
from quiet_host import ATTEMPTS, first_judged, undisturbed
from typer.testing import CliRunner

from tests.cache.damaged import damaged_cache
from tests.cache.read_only import read_only
from tuner.cache import Store
from tuner.candidates import registry
from tuner.cli.errors import MESSAGE_WIDTH
from tuner.cli.main import app
from tuner.core import console
from tuner.core.console import PIPED_WIDTH
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, parse_key
from tuner.measure.records import Measurement, Winner
from tuner.serving.dispatcher import Dispatcher
from tuner.tuning.engine import PHASES, TuneOptions
from tuner.version import __version__


def tuner(*args: str, cache=None, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TRITON_INTERPRET": "1", "COLUMNS": "200"} | extra
    if cache is not None:
        env["TUNER_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "tuner", *args],
        env=env,
        capture_output=True,
        text=True,
        check=check,
    )


def test_help_lists_the_commands():
    out = tuner("--help").stdout
    for command in ("info", "tune", "tune-all", "show", "export", "import", "bench"):
        assert command in out
    # a flag takes no value: no type shown beside it (typer's "<bool>" read as one)
    shown = tuner("show", "--help").stdout
    assert "--json" in shown and "<bool>" not in shown and "<str>" in shown
    assert tuner("show", "-h").stdout == shown  # -h as --help, on every command


def test_help_read_through_a_pipe_is_shown_whole(monkeypatch):
    """Help written to no terminal (a pipe: ``tuner tune-all --help | less``) with no width
    asked for is laid out wide, so no option text is cut with "…" as at rich's 80 columns."""
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", None)  # as without TERMINAL_WIDTH
    monkeypatch.setattr(console, "_terminal_near", lambda: False)  # as in a CI log
    # as where typer forces colours (GITHUB_ACTIONS, FORCE_COLOR): the width follows the pipe
    monkeypatch.setattr(typer.rich_utils, "FORCE_TERMINAL", True)
    colours = re.compile(r"\x1b\[[0-9;]*m")
    for path in ([], ["tune", "gemm"], ["tune-all"], ["bench", "gemm"], ["serve"]):
        result = CliRunner().invoke(
            app, [*path, "--help"], env={"COLUMNS": None, "TERMINAL_WIDTH": None}
        )
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, path
        assert max(len(colours.sub("", line)) for line in result.output.splitlines()) == (
            PIPED_WIDTH
        )
    # the python -m tuner command itself, its stdout a pipe
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    env["GITHUB_ACTIONS"] = "true"  # typer then forces colours; the help still goes to a pipe
    out = subprocess.run([sys.executable, "-m", "tuner", "tune-all", "--help"], env=env,
                         capture_output=True, stdin=subprocess.DEVNULL, text=True,
                         check=True).stdout  # fmt: skip
    out = colours.sub("", out)
    assert "…" not in out
    for whole in ("Model config YAML (configs/models/*.yaml)", "(TUNER_MODE=record)",
                  "--no-compile-ahead", "$TUNER_ARTIFACTS", "else ~/.cache/tuner/tuner.db)"):  # fmt: skip
        assert whole in out
    # a width asked for is kept
    narrow = CliRunner().invoke(app, ["tune-all", "--help"], env={"COLUMNS": "80"}).output
    assert max(len(colours.sub("", line)) for line in narrow.splitlines()) == 80


def test_verbose_logs_the_tuners_debug_not_every_librarys(tmp_path):
    """``-v`` in a fresh process: the tuner's debug lines, not matplotlib's hundreds of font-scan
    lines around them (``tuner -v bench`` printed those and nothing of the tuner's)."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import logging\n"
        "from tuner.cli.main import app\n"
        "app(['-v', 'info'], standalone_mode=False)\n"
        "print(logging.getLogger('tuner.x').isEnabledFor(logging.DEBUG),\n"
        "      logging.getLogger('matplotlib').isEnabledFor(logging.DEBUG))\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert r.stdout.split()[-2:] == ["True", "False"], r.stderr


def test_info_lists_sources_with_status(tmp_path):
    out = tuner("info", cache=tmp_path / "c.db").stdout
    assert "device class" in out and fingerprint().device_class in out
    assert "torch" in out and "available" in out


def test_tune_all_then_show_export_import(tmp_path):
    cfg = tmp_path / "problems.yaml"
    cfg.write_text(
        "problems:\n  - {op: gemm, m: 8, n: 16, k: 16, dtype: f32}\n  - {op: gemm, m: 8, n: 16, k: 16, dtype: f32}\n  - {op: sdpa, batch: 1, q_heads: 2, kv_heads: 1, q_len: 3, kv_len: 5, head_dim: 8, dtype: f32}\n"
    )
    cache = tmp_path / "c.db"
    out = tuner("tune-all", "--config", str(cfg), "--budget", "0.01", cache=cache).stdout
    assert "2 distinct problems" in out and "0 already tuned, 2 to tune" in out
    again = tuner("tune-all", "--config", str(cfg), cache=cache).stdout
    assert "2 already tuned, 0 to tune" in again
    shown = json.loads(tuner("show", "--json", cache=cache).stdout)
    assert {w["op"] for w in shown} == {"gemm", "sdpa"}
    export = tmp_path / "out.json"
    tuner("export", str(export), cache=cache)
    other = tmp_path / "other.db"
    assert "2 winners added or replaced" in tuner("import", str(export), cache=other).stdout
    assert len(Store(other).winners()) == 2
    tuner("tune-all", "--config", str(cfg), "--force", "--budget", "0.01", cache=other)
    again = tuner("import", str(export), cache=other).stdout  # older than the re-tune's
    assert "0 winners added or replaced" in again
    # a re-tune that chose the same candidate again holds the same winner, stamped later: an
    # older export of it is not an older winner
    exported = {w["key"]: w["candidate"] for w in json.loads(export.read_text())["winners"]}
    changed = sum(w.candidate != exported[w.key] for w in Store(other).winners())
    if changed:
        assert f"left alone {changed} winner" in again
    else:
        assert "left alone" not in again


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("tune", "gemm", "-m", "0", "-n", "4", "-k", "4"), "m must be a positive integer"),
        (
            ("tune", "gemm", "-m", "4", "-n", "4", "-k", "4", "--dtype", "f64"),
            "dtype must be one of",
        ),
        (("tune", "key", "gemm:m=4"), "incomplete gemm key"),
        (
            ("tune", "gemm", "-m", "64", "-n", "64", "-k", "64", "--source", "nosuch"),
            "unknown candidate source 'nosuch'",
        ),
        (
            ("tune", "gemm", "-m", "4", "-n", "4", "-k", "4", "--dtype", "fp16"),
            "got 'fp16' (did you mean 'f16'?)",
        ),
        (
            ("tune", "gemm", "-m", "4", "-n", "4", "-k", "4", "--source", "tritn_gemm"),
            "unknown candidate source 'tritn_gemm' (did you mean 'triton_gemm'?)",
        ),
        (("tune", "key", "gemm:m=4,n=4,k=4,dtype=bf61"), "got 'bf61' (did you mean 'bf16'?)"),
        (("show", "--op", "gem"), "--op must be 'gemm' or 'sdpa'"),
        (("show", "--source", "nosuch"), "unknown candidate source 'nosuch'"),
        (
            (
                "tune",
                "gemm",
                "-m",
                "8",
                "-n",
                "64",
                "-k",
                "64",
                "--dtype",
                "int4-g32",
                "--layout",
                "nn",
            ),
            "a low-bit GEMM is x @ W.T: --layout nt (got nn)",
        ),
        (
            ("tune", "gemm", "-m", "8", "-n", "64", "-k", "64", "--dtype", "int4-g32", "--tf32"),
            "--tf32 is for f32 inputs only",
        ),
        (
            ("tune", "gemm", "-m", "8", "-n", "64", "-k", "64", "--dtype", "bf16", "--tf32"),
            "--dtype bf16: --tf32 is for f32 inputs only",
        ),
        (
            ("tune", "gemm", "-m", "4", "-n", "64", "-k", "64", "--dtype", "tf32", "--no-tf32"),
            "--dtype tf32 is f32 on the TF32 path, and --no-tf32 refuses it",
        ),
        pytest.param(  # torch's CPU int4 packing takes blocks of 16 rows (CUDA: 8)
            ("tune", "gemm", "-m", "16", "-n", "24", "-k", "512", "--dtype", "int4-g128"),
            "N=24: torch's int4 packing on cpu needs a multiple of 16",
            marks=pytest.mark.cpu_host,
        ),
        (  # torch._scaled_mm takes K and N multiples of 16
            ("tune", "gemm", "-m", "4", "-n", "200", "-k", "256", "--dtype", "fp8-rowwise"),
            "fp8 needs K and N multiples of 16, as torch._scaled_mm takes them (N=200, K=256)",
        ),
    ],
)
def test_user_mistakes_get_one_line_and_exit_2(tmp_path, args, message):
    r = tuner(*args, cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("report", "--rows", "-1"), "Invalid value for '--rows': "),  # the rest is click's
        (  # typer's type check names the rule, in words its releases vary; the value refused
            # is added where they leave it out
            ("tune", "gemm", "-m", "8", "-n", "x", "-k", "8"),
            ("Invalid value for '-n': ", "'x'", " (see"),
        ),
        (
            ("tune", "gemm", "-m", "8", "-n", "8", "-k", "8", "--budget", "0"),
            ("Invalid value for '--budget': ", "0.001", "0"),
        ),
        (  # the value is quoted once: click's message names it already
            ("tune", "key", "x", "--launch", "warp"),
            "'--launch': 'warp' is not one of 'eager', 'graph'. (see",
        ),
        (("export",), "Missing argument 'output'. (see 'python -m tuner export --help')"),
        (("tunableop", "show", "nofile.csv"), "'nofile.csv' does not exist"),  # (click's case)
        (("tune-all", "--no-such-flag"), "No such option: --no-such-flag"),
        (("nosuch",), "No such command 'nosuch'. (see 'python -m tuner --help')"),
        (  # tuner's own option after a subcommand: where it goes, and the help that lists it
            ("tune", "gemm", "-m", "8", "-n", "8", "-k", "8", "-v"),
            "error: No such option after the subcommand: -v; put it before: "
            "'python -m tuner -v tune gemm ...' (see 'python -m tuner --help')",
        ),
        (("show", "--verbose"), "put it before: 'python -m tuner --verbose show ...'"),
    ],
)
def test_option_mistakes_get_the_same_one_line_as_the_rest(tmp_path, args, message):
    """What click itself refuses (a bad option value, a missing argument) reads like every other
    mistake: one ``error:`` line and where the help is, not a framed box."""
    r = tuner(*args, cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: ")
    said = (message,) if isinstance(message, str) else message
    assert all(part in r.stderr for part in said), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""


def one_winner(path):
    """A cache file holding one winner, for the commands that read one."""
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(path) as store:
        store.put_winners([Winner(fingerprint().device_class, key, "torch", {}, 2.0, 2.0)])
    return path


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("tune", "gemm", "--help"),
        ("show", "--full-keys"),
        ("export", "-"),
        ("tune-all", "--dry-run", "--model", "configs/models/llama-3-8b.yaml"),
    ],
)
def test_a_closed_stdout_ends_the_command_quietly_with_sigpipes_status(tmp_path, args):
    """``tuner show | head -1``: the command ends as ``cat`` killed by SIGPIPE would (141), with
    nothing on stderr, whether rich, click or Python's exit flush meets the closed pipe."""
    env = os.environ | {"TUNER_CACHE": str(one_winner(tmp_path / "c.db")), "COLUMNS": "200"}
    p = subprocess.Popen([sys.executable, "-m", "tuner", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    p.stdout.close()  # the reader gone before the first line is written
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == ""


def test_a_closed_stdout_does_not_hide_an_error(tmp_path):
    env = os.environ | {"TUNER_CACHE": str(one_winner(tmp_path / "c.db"))}
    out = tmp_path / "no" / "x.json"
    p = subprocess.Popen([sys.executable, "-m", "tuner", "export", str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 2
    assert err == f"error: {out}: cannot write: No such file or directory\n"


def test_version_and_winners_of_every_device_class(tmp_path):
    assert tuner("--version").stdout == f"tuner {__version__}\n"
    cache = tmp_path / "c.db"
    Store(cache).put_winners([
        Winner(dc, "gemm:m=8,n=8,k=8,dtype=f32,out_dtype=f32", "torch", {}, 1.0, 1.0)
        for dc in ("gpu-one", "gpu-two")
    ])  # fmt: skip
    shown = tuner("show", "--all-devices", cache=cache).stdout
    assert "device class" in shown and "gpu-one" in shown and "gpu-two" in shown


def test_tune_tables_what_ran_and_says_in_a_line_what_cannot_run_here(tmp_path):
    """Piped, the table stays alone on stdout and stderr says, a line each, what was measured
    (a log's progress: no spinner draws there). The winner's row says so: rows run by trial
    time, and a challenger that lost its duel can head them."""
    run = tuner("tune", "gemm", "-m", "8", "-n", "8", "-k", "8", "--dtype", "f32",
                cache=tmp_path / "c.db")  # fmt: skip
    assert "torch (baseline, winner)" in run.stdout and "unsupported" not in run.stdout
    assert run.stdout.count("winner)") == 1
    # the time and, where it took a tenth of a second, each phase's share
    phases = "|".join(PHASES)
    took = re.search(rf"\(tuned in [\d.]+ s(: ({phases}) [\d.]+ s(, ({phases}) [\d.]+ s)*)?\)\n",
                     run.stdout)  # fmt: skip
    assert took, run.stdout
    assert "not run: torch_lowbit: low-bit GEMMs only" in run.stdout
    progress = [line for line in run.stderr.splitlines() if line.startswith("measured ")]
    assert progress[0].startswith("measured 1: torch (ok ")
    assert "measured" not in run.stdout


def test_tune_marks_a_challengers_win_on_its_own_row(tmp_path, monkeypatch):
    """A challenger truly faster than torch (a memoized product) wins: its row, not torch's,
    says winner. Tuned again, into a new cache, where the host disturbed the duel
    (``first_judged``): the engine then keeps torch, by design."""
    from planted import Memoized

    monkeypatch.setattr(Memoized, "slow", False)
    caches = iter(tmp_path / f"c{attempt}.db" for attempt in range(ATTEMPTS))

    def run() -> Result:
        return CliRunner().invoke(app, [
            "tune", "gemm", "-m", "48", "-n", "40", "-k", "72", "--dtype", "f32",
            "--source", "memoized", "--budget", "0.02", "--cache", str(next(caches)),
        ], env={"COLUMNS": "200"})  # fmt: skip

    registry.register(Memoized())
    try:
        result = first_judged(run, lambda result: undisturbed(result.output))
    finally:
        registry.unregister("memoized")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}  # fmt: skip
    assert "memoized (winner)" in rows and "torch (baseline)" in rows, result.output
    assert "winner (eager): memoized" in result.output


def test_a_long_duel_note_keeps_its_verdict_in_the_table():
    """A duel's verdict ends its note: cut for tune's table, the note keeps its end; an error
    keeps its head, where its kind is."""
    from tuner.cli.tune import NOTE_WIDTH, _note_text

    duel = ("host time read again: 28.13 then 21.42 us a call, the lower kept; " * 3
            + "confirmation: 27.86 us vs baseline 26.21 us, lost: slower on the GPU (margin 2.0%; "
            "the duel took 0.1 s)")  # fmt: skip
    shown = _note_text(duel)
    assert len(shown) == NOTE_WIDTH and shown.endswith("lost: slower on the GPU (margin 2.0%; "
                                                       "the duel took 0.1 s)")  # fmt: skip
    error = "CompilationError: " + "x" * 400
    assert _note_text(error).startswith("CompilationError: ") and len(_note_text(error)) == 200
    assert _note_text("probe 27.7 us > cutoff 26.0 us") == "probe 27.7 us > cutoff 26.0 us"


def test_tunes_last_line_names_the_phases_that_took_a_tenth_of_a_second():
    from tuner.cli.tune import _phases_text

    assert _phases_text({"setup": 0.04, "compile": 70.12, "confirm": 4.06}) == (
        ": compile 70.1 s, confirm 4.1 s"
    )
    assert _phases_text({"setup": 0.01}) == _phases_text({}) == ""


def test_bad_config_names_entry_and_field(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        "problems:\n  - {op: gemm, m: 8, n: 16, k: 16}\n  - {op: gemm, m: 8, n: -1, k: 16}\n"
    )
    r = tuner("tune-all", "--config", str(cfg), cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "problems[1]: n must be a positive integer" in r.stderr


def test_one_low_bit_problem_is_tuned_by_its_format_name_and_shown_by_it(tmp_path):
    cache = tmp_path / "c.db"
    out = tuner("tune", "gemm", "-m", "2", "-n", "64", "-k", "256", "--dtype", "int4-g128",
                "--source", "torch_lowbit", "--budget", "0.01", cache=cache).stdout  # fmt: skip
    assert "winner (eager): torch_lowbit" in out
    assert "error / bound" in out  # checked against its format's per-element bound
    shown = json.loads(tuner("show", "--json", "--contains", "int4-g128", cache=cache).stdout)
    assert [w["key"] for w in shown] == [
        "gemm:m=2,n=64,k=256,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16,"
        "wdtype=int4,group=128,zeros=float,scale=group"
    ]
    assert json.loads(tuner("show", "--json", "--contains", "fp8", cache=cache).stdout) == []
    r = tuner("tune", "gemm", "-m", "2", "-n", "64", "-k", "256", "--dtype", "int4",
              cache=cache, check=False)  # fmt: skip
    assert r.returncode == 2 and "--dtype must be one of" in r.stderr and "int4-g32" in r.stderr


def test_tf32_named_as_a_dtype_is_f32_on_the_tf32_path_as_in_model_configs(tmp_path):
    cache = tmp_path / "c.db"
    tuner("tune", "gemm", "-m", "4", "-n", "8", "-k", "8", "--dtype", "tf32", "--source", "torch",
          "--budget", "0.01", cache=cache)  # fmt: skip
    shown = json.loads(tuner("show", "--json", cache=cache).stdout)
    assert [w["key"] for w in shown] == [
        "gemm:m=4,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=tf32,align=16"
    ]


def test_a_dry_run_lists_what_it_would_tune_and_writes_nothing(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("problems:\n  - {op: gemm, m: 8, n: 16, k: 16, dtype: f32}\n")
    cache = tmp_path / "c.db"
    out = tuner("tune-all", "--config", str(cfg), "--dry-run", cache=cache).stdout
    assert f"problem list {cfg}: 1 problem\n" in out  # not "1 problems"
    assert "1 distinct problem on" in out and "0 already tuned, 1 to tune" in out
    assert "would tune 8x16x16 nn f32" in out
    assert not cache.exists()
    cache.touch()  # an empty file (``touch``): SQLite would make a cache of it
    assert "would tune 8x16x16 nn f32" in tuner("tune-all", "--config", str(cfg), "--dry-run",
                                                cache=cache).stdout  # fmt: skip
    assert cache.read_bytes() == b""  # the dry run had written a new cache's tables into it


def test_a_config_refused_leaves_no_cache_behind(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("problems:\n  - {op: gemm, m: 8, n: -1, k: 16}\n")
    cache = tmp_path / "c.db"
    r = tuner("tune-all", "--config", str(cfg), cache=cache, check=False)
    assert r.returncode == 2 and "n must be a positive integer" in r.stderr
    assert not cache.exists()


def test_a_failed_tune_all_leaves_no_new_out_folder_and_a_run_that_worked_keeps_it(tmp_path):
    """A run refused before it tunes anything (a cache file of garbage bytes, with or without
    --queue) leaves nothing new: the file given stays as it was, a cache it made is unmade with
    its folders, and so are --out's, an --out that cannot be made included. A run that tuned
    keeps its cache and report."""
    problems, refused = tmp_path / "p.yaml", tmp_path / "refused.yaml"
    problems.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n")
    refused.write_text("problems:\n  - {op: gemm, m: 4, n: -1, k: 8, dtype: f32}\n")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"\x00garbage" * 100)
    a_file = tmp_path / "a_file"
    a_file.touch()
    new_cache, out = tmp_path / "new" / "c.db", tmp_path / "out" / "report"
    runs = [
        (garbage, problems, out, "garbage.db is not a SQLite database"),
        (new_cache, refused, out, "n must be a positive integer, got -1"),
        (new_cache, problems, a_file / "report", "cannot create the output directory"),
    ]
    for queue in ((), ("--queue", "2")):  # the service is never reached: a closed port
        for cache, config, where, said in runs:
            r = tuner("tune-all", "--config", str(config), "--out", str(where), *queue,
                      cache=cache, check=False, TUNER_SERVER="http://127.0.0.1:9")  # fmt: skip
            assert r.returncode == 2 and said in r.stderr, (queue, cache, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no traceback
            assert not out.parent.exists() and not new_cache.parent.exists(), (queue, cache)
    assert garbage.read_bytes() == b"\x00garbage" * 100 and a_file.read_bytes() == b""
    tuner("tune-all", "--config", str(problems), "--out", str(out), "--source", "torch",
          "--budget", "0.01", cache=new_cache)  # fmt: skip
    assert (out / "report.json").is_file() and Store(new_cache).winners()


def test_warmup_refuses_a_missing_or_broken_cache(tmp_path):
    missing = tmp_path / "typo.db"
    r = tuner("warmup", "--no-fetch", "--no-progress", cache=missing, check=False)
    assert r.returncode == 2 and "typo.db: no such cache" in r.stderr
    assert not missing.exists()
    broken = tmp_path / "notes.db"
    broken.write_text("not a database")
    r = tuner("warmup", "--no-fetch", "--no-progress", cache=broken, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert broken.read_text() == "not a database"


def test_corrupt_cache_is_reported_not_overwritten(tmp_path):
    cache = tmp_path / "c.db"
    cache.write_bytes(b"\x00garbage" * 100)
    r = tuner("show", cache=cache, check=False)
    assert r.returncode == 2 and "not a SQLite database" in r.stderr
    assert cache.read_bytes() == b"\x00garbage" * 100


def test_a_damaged_cache_fails_every_command_in_one_line_and_stays_as_it_was(tmp_path):
    cache, problems = tmp_path / "c.db", tmp_path / "p.yaml"
    before = damaged_cache(cache)
    problems.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n")
    for args in (
        ("show",), ("export", "-"), ("tune", "gemm", "-m", "8", "-n", "8", "-k", "8"),
        ("tune-all", "--config", str(problems), "--dry-run"),  # refused as the real run is
    ):  # fmt: skip
        r = tuner(*args, cache=cache, check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "c.db is corrupt" in r.stderr and "refusing to use it" in r.stderr
    assert cache.read_bytes() == before


def test_reading_commands_refuse_a_cache_that_is_not_there(tmp_path):
    typo = tmp_path / "typo" / "c.db"
    out = str(tmp_path / "tunableop.csv")
    for args in (("show",), ("export", "-"), ("report",), ("tunableop", "export", out)):
        r = tuner(*args, cache=typo, check=False)
        assert r.returncode == 2 and "c.db: no such cache: tune first" in r.stderr, (args, r.stderr)
    assert not typo.parent.exists()


def test_reading_commands_leave_an_empty_file_as_it_is(tmp_path):
    """An empty file named as the cache (made by touch, or a slip of the path) holds no
    winners: a command that only reads says so, where SQLite would have made it a cache."""
    empty = tmp_path / "notes.txt"
    empty.touch()
    out = str(tmp_path / "tunableop.csv")
    for args in (("show",), ("export", "-"), ("report",), ("tunableop", "export", out)):
        r = tuner(*args, cache=empty, check=False)
        assert r.returncode == 2 and "notes.txt: an empty file, not a cache" in r.stderr, args
    assert empty.read_bytes() == b""


def test_a_problem_too_big_for_memory_is_one_line(tmp_path):
    huge = ("tune", "gemm", "-m", "1000000", "-n", "1000000", "-k", "1000000", "--dtype", "f32")
    r = tuner(*huge, cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "its operands take 11175.9 GiB, more than this" in r.stderr


def test_compiled_kernels_live_beside_the_cache_that_cache_names(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_CACHE", "TUNER_ARTIFACTS")}
    r = subprocess.run(
        [sys.executable, "-m", "tuner", "artifacts", "--cache", str(tmp_path / "x" / "c.db")],
        env=env | {"COLUMNS": "200"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"0 compiled kernels: no store at {tmp_path / 'x' / 'artifacts'} yet" in r.stdout
    assert not (tmp_path / "x").exists()  # a listing makes nothing


def test_a_check_of_compiled_kernels_where_there_are_none_makes_no_store(tmp_path):
    """``tuner artifacts --check`` with a mistyped --cache checks what is there and makes
    nothing: no store beside it (folders and an index), and it says there is none yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_ARTIFACTS", "TUNER_SERVER")}
    typo = tmp_path / "typo" / "c.db"
    r = subprocess.run(
        [sys.executable, "-m", "tuner", "artifacts", "--check", "--cache", str(typo)],
        env=env | {"COLUMNS": "200"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"0 compiled kernels: no store at {typo.parent / 'artifacts'} yet" in r.stdout
    assert "no conflicting builds" in r.stdout
    assert not typo.parent.exists()


def test_a_listing_of_compiled_kernels_says_server_and_token_wait_for_check(tmp_path):
    """``artifacts --server URL`` without ``--check`` lists this host's kernels and asks no
    service: typed, the options are named as read by --check only; from the environment (the
    host's settings) they are not."""
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_ARTIFACTS", "TUNER_SERVER")}
    args = [sys.executable, "-m", "tuner", "artifacts", "--cache", str(tmp_path / "c.db")]
    typed = subprocess.run(
        [*args, "--server", "http://127.0.0.1:9", "--token", "t"],
        env=env | {"COLUMNS": "200"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "note: --server and --token are read by --check only" in typed.stdout
    from_env = subprocess.run(
        args, env=env | {"COLUMNS": "200", "TUNER_SERVER": "http://127.0.0.1:9"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "note:" not in from_env.stdout and "0 compiled kernels" in from_env.stdout


def test_import_of_a_non_export_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    r = tuner("import", str(bad), cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and f"{bad}: not a tuner export" in r.stderr
    assert not (tmp_path / "c.db").exists()  # a refused file makes no cache


def test_import_of_a_deep_or_huge_file_is_refused_in_one_short_line(tmp_path):
    """JSON nested deeper than Python's decoder goes, and a field holding a file's worth of
    text, are named in one line of at most MESSAGE_WIDTH characters (no traceback), and make no
    cache."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    r = tuner("import", str(deep), cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == f"error: {deep}: not valid JSON for an export: nested too deeply\n"
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "a.db") as a:
        a.put_winners([Winner("cpu-test", key, "torch", {}, median_us=1.0, baseline_us=2.0)])
    export = json.loads(tuner("export", "-", cache=tmp_path / "a.db").stdout)
    for field, value in (("params", "[" * 5000 + "]" * 5000), ("median_us", "9" * 5000),
                         ("key", "gemm:m=" + "9" * 5000)):  # fmt: skip
        bad = dict(export, winners=[dict(export["winners"][0], **{field: value})])
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        r = tuner("import", str(tmp_path / "bad.json"), cache=tmp_path / "c.db", check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[:300]
        assert "winners[0]" in r.stderr and len(r.stderr) <= len("error: \n") + MESSAGE_WIDTH
    assert not (tmp_path / "c.db").exists()


def test_import_notes_winners_of_a_source_this_host_lacks(tmp_path):
    """A plugin's winner from another host is kept (that host may install it), and said."""
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "a.db") as a:
        a.put_winners([Winner("cpu-test", key, "my_plugin", {}, median_us=1.0, baseline_us=2.0)])
    tuner("export", str(tmp_path / "e.json"), cache=tmp_path / "a.db")
    r = tuner("import", str(tmp_path / "e.json"), cache=tmp_path / "b.db")
    assert "kept 1 winner of a candidate source this host does not have ('my_plugin')" in r.stdout
    with Store(tmp_path / "b.db") as b:
        assert b.winner("cpu-test", key).source == "my_plugin"


def test_import_notes_measurements_whose_device_class_has_no_fingerprint(tmp_path):
    """A fleet service files a measurement under its device's fingerprint, so an export that
    lists none for a class (hand-made, or cut down) gives measurements 'tuner push' can send
    only from a host of that class: kept, and said; a class with a fingerprint is not named."""
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "a.db") as a:
        a.save_device(fingerprint())
        a.save_run([
            Measurement(dc, key, "torch", {}, "ok", median_us=1.0, uid=f"u{i}")
            for i, dc in enumerate(["gpu-elsewhere", "gpu-elsewhere", fingerprint().device_class])
        ])  # fmt: skip
    tuner("export", str(tmp_path / "e.json"), cache=tmp_path / "a.db")
    r = tuner("import", str(tmp_path / "e.json"), cache=tmp_path / "b.db")
    assert "imported 3 new measurements" in r.stdout
    assert (
        "note: 2 measurements of device class 'gpu-elsewhere' came with no device fingerprint"
        in " ".join(r.stdout.split())
    ), r.stdout
    assert fingerprint().device_class not in r.stdout
    with Store(tmp_path / "b.db") as b:
        assert len(b.measurements("gpu-elsewhere")) == 2


def test_show_refuses_two_formats_at_once(tmp_path):
    """``show --json --full-keys`` is refused, naming the two formats, rather than printing JSON
    and dropping --full-keys."""
    Store(tmp_path / "c.db").close()
    r = tuner("show", "--json", "--full-keys", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert "--json and --full-keys are two formats: give one" in r.stderr


def test_show_points_at_other_device_classes_and_prints_whole_keys(tmp_path):
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "c.db") as store:
        store.put_winners([Winner("gpu-elsewhere", key, "torch", {}, 2.0, 2.0)])
    r = tuner("show", cache=tmp_path / "c.db")
    assert "0 winners on" in r.stdout and "(1 on other device classes: --all-devices)" in r.stdout
    lines = tuner("show", "--all-devices", "--full-keys", cache=tmp_path / "c.db").stdout
    assert lines.splitlines() == [
        "device_class\tkey\twinner\tlaunch\tus\tbaseline_us\tspeedup",
        f"gpu-elsewhere\t{key}\ttorch\teager\t2.00\t2.00\t1.00",
    ]
    r = tuner("export", "--device-class", "nosuch", "-", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "--device-class 'nosuch': nothing of it in this cache" in r.stderr


def test_show_names_each_winner_by_its_label_and_full_keys_by_its_whole_name(tmp_path):
    """Two winners of one source differ in their labels; --full-keys and --json keep the
    name whose params rebuild the kernel."""
    dc = fingerprint().device_class
    key = "gemm:m={},n=3584,k=3584,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16"
    gemv = {"bk": 1024, "bm": 1, "bn": 2, "kernel": "gemv", "warps": 4}
    tiled = {"bk": 256, "bm": 16, "bn": 32, "group_m": 8, "kernel": "tiled", "stages": 4,
             "warps": 4}  # fmt: skip
    lt = {"cluster": "2x1x1", "custom": 0, "id": 66, "inner_shape": 0, "reduction": 0,
          "split_k": 1, "stages": "64xAUTO", "swizzle": 0, "tile": "112x128"}  # fmt: skip
    now = fingerprint().version_tag  # measured under this host's versions: not stale
    winners = [Winner(dc, key.format(1), "triton_gemm", gemv, 24.66, 29.01, versions=now),
               Winner(dc, key.format(8), "triton_gemm", tiled, 17.73, 23.33, versions=now),
               Winner(dc, key.format(2048), "cublaslt", lt, 78.72, 83.01, versions=now)]  # fmt: skip
    with Store(tmp_path / "c.db") as store:
        store.put_winners(winners)
    table = tuner("show", cache=tmp_path / "c.db").stdout
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in table.splitlines() if line.startswith("│")}  # fmt: skip
    assert rows == {
        "1x3584x3584 nt bf16": "triton_gemm gemv 1x2x1024 w4",
        "8x3584x3584 nt bf16": "triton_gemm tiled 16x32x256 w4 s4 g8",
        "2048x3584x3584 nt bf16": "cublaslt 112x128 c2x1x1 id66 s64xAUTO",
    }
    lines = tuner("show", "--full-keys", cache=tmp_path / "c.db").stdout.splitlines()[1:]
    assert sorted(line.split("\t")[1] for line in lines) == sorted(w.candidate for w in winners)
    shown = json.loads(tuner("show", "--json", cache=tmp_path / "c.db").stdout)
    assert sorted(w["candidate"] for w in shown) == sorted(w.candidate for w in winners)


def test_show_marks_winners_measured_under_other_versions_as_stale(tmp_path):
    """As ``tuner report`` and the dispatcher's warning do: ``show`` is where one looks first."""
    fp = fingerprint()
    key = "gemm:m={},n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "c.db") as store:
        store.put_winners([
            Winner(fp.device_class, key.format(1), "torch", {}, 2.0, 2.0, versions=fp.version_tag),
            Winner(fp.device_class, key.format(2), "torch", {}, 2.0, 2.0, versions="torch=2.12.0"),
        ])  # fmt: skip
    out = tuner("show", cache=tmp_path / "c.db").stdout
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.splitlines() if line.startswith("│")}  # fmt: skip
    assert rows == {"1x8x8 nn f32": "torch", "2x8x8 nn f32": "torch (stale)"}
    assert "stale: 1 winner measured under other versions than this host runs" in out
    assert "served (TUNER_STALE=use, the default)" in " ".join(out.split())
    # this host's class named: judged by this host's versions, as the dispatcher judges them,
    # even where the cache's stored fingerprint of it is older
    with Store(tmp_path / "c.db") as store:
        store.save_device(dataclasses.replace(fp, versions={"torch": "2.12.0"}))
    named = tuner("show", "--device-class", fp.device_class, cache=tmp_path / "c.db").stdout
    assert named == tuner("show", cache=tmp_path / "c.db").stdout
    out = tuner("show", cache=tmp_path / "c.db", TUNER_STALE="ignore").stdout
    assert "not served: their keys are misses (TUNER_STALE=ignore)" in " ".join(out.split())


def test_show_counts_elsewhere_only_the_winners_its_filters_match_elsewhere(tmp_path):
    here, there = fingerprint().device_class, "gpu-elsewhere"
    key = "gemm:m={},n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "c.db") as store:
        store.put_winners([Winner(here, key.format(8), "torch", {}, 2.0, 2.0),
                           Winner(there, key.format(16), "torch", {}, 2.0, 2.0)])  # fmt: skip
    nothing = tuner("show", "--contains", "no-such-shape", cache=tmp_path / "c.db").stdout
    assert nothing.strip() == f"0 winners on {here}"  # not "(2 on other device classes)"
    elsewhere = tuner("show", "--contains", "16x8x8", cache=tmp_path / "c.db").stdout
    assert elsewhere.strip() == f"0 winners on {here} (1 on other device classes: --all-devices)"


def test_report_show_and_tunableop_export_read_another_device_class(tmp_path):
    """A laptop holding an H200's results (pulled or imported) reports, lists and writes them for
    TunableOp as the H200 would: its stored fingerprint's versions tell current from stale."""
    from tuner.core.device import Fingerprint

    h200 = Fingerprint("cuda", "NVIDIA H200", "9.0", 132, 140, versions={"torch": "2.13.0"})
    key = "gemm:m=8,n=64,k=32,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16"
    stale = key.replace("m=8", "m=16")
    with Store(tmp_path / "c.db") as store:
        store.save_device(h200)
        store.put_winners(
            [
                Winner(h200.device_class, key, "torch", {}, 9.0, 10.0, versions=h200.version_tag),
                Winner(h200.device_class, stale, "torch", {}, 9.0, 10.0, versions="torch=2.12.0"),
            ]
        )
    dc = ("--device-class", h200.device_class)
    r = tuner("report", *dc, cache=tmp_path / "c.db")
    assert "8x64x32" in r.stdout and h200.device_class in r.stdout
    r = tuner("tunableop", "export", "-", *dc, "--pt-version", "2.13.0", cache=tmp_path / "c.db")
    assert r.stdout.splitlines()[1].startswith("GemmTunableOp_BFloat16_TN,tn_64_8_32_")
    assert len(r.stdout.splitlines()) == 2  # the stale winner is left out
    assert "wrote -: 1 GEMM" in r.stderr
    shown = tuner("show", *dc, cache=tmp_path / "c.db").stdout  # stale as on the H200
    assert f"2 winners on {h200.device_class}" in shown and shown.count("(stale)") == 1
    r = tuner("show", "--device-class", "nosuch", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "--device-class 'nosuch': no winners of it" in r.stderr
    r = tuner("show", *dc, "--all-devices", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "--all-devices and --device-class: give one" in r.stderr
    for command in (("report",), ("tunableop", "export", "-")):
        r = tuner(*command, "--device-class", "nosuch", cache=tmp_path / "c.db", check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert (
            f"--device-class 'nosuch': no fingerprint of it in this cache (device classes seen: "
            f"{h200.device_class})" in r.stderr
        )
    with Store(tmp_path / "c.db") as store:  # winners of a class whose device is unknown here
        store.put_winners([Winner("gpu-imported", key, "torch", {}, 9.0, 10.0)])
    shown = tuner("show", "--device-class", "gpu-imported", cache=tmp_path / "c.db").stdout
    assert "no fingerprint of gpu-imported" in " ".join(shown.split()) and "(stale)" not in shown
    r = tuner("report", "--device-class", "gpu-imported", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and (
        "--device-class 'gpu-imported': this cache holds its winners but no fingerprint of the "
        "device" in r.stderr
    )


def test_unreadable_and_unwritable_files_get_one_line(tmp_path):
    bad_yaml = tmp_path / "p.yaml"
    bad_yaml.write_text("problems:\n  - {op: gemm, m: [1\n")
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\x00\xff\xfe")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    good_yaml = tmp_path / "ok.yaml"
    good_yaml.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n")
    Store(tmp_path / "c.db").close()
    for args, message in [
        (("tune-all", "--config", str(bad_yaml)), "p.yaml: not valid YAML at line 3"),
        (("import", str(binary)), "b.json: not a text file"),
        (("tune-all", "--model", str(empty)), "empty.yaml: the file is empty"),
        (("export", str(tmp_path / "no" / "x.json")), "x.json: cannot write"),
        (("show", "--cache", str(tmp_path)), "is a directory, not a cache file"),
        (("report", "--out", str(binary / "r")), "b.json/r: cannot create the output directory"),
        (
            ("tune-all", "--config", str(good_yaml), "--out", str(binary / "r")),
            "b.json/r: cannot create the output directory",
        ),
        (("bench", "gemm", "--quick", "--out", str(binary / "r")), "b.json/r: cannot create"),
        (("bench", "sdpa", "--quick", "--out", str(binary / "r")), "b.json/r: cannot create"),
    ]:
        r = tuner(*args, cache=tmp_path / "c.db", check=False)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not Store(tmp_path / "c.db").winners()  # the run with nowhere to report never began
    r = tuner("report", "--rows", "-1", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "Invalid value for '--rows'" in r.stderr


def test_an_odd_shape_is_tuned_at_the_alignment_it_allows_and_a_wrong_one_named(tmp_path):
    cache, odd = (
        tmp_path / "c.db",
        ("tune", "gemm", "-m", "3", "-n", "5", "-k", "7", "--dtype", "f32"),
    )
    tuner(*odd, "--source", "torch", "--budget", "0.01", cache=cache)
    assert [w["key"].rpartition(",")[2] for w in json.loads(
        tuner("show", "--json", cache=cache).stdout)] == ["align=4"]  # fmt: skip
    r = tuner(*odd, "--align", "16", cache=cache, check=False)
    assert r.returncode == 2 and r.stderr.strip().endswith("this shape allows align 4"), r.stderr


def test_an_unwritable_profile_folder_is_refused_before_the_run(tmp_path):
    problems, blocker = tmp_path / "p.yaml", tmp_path / "file"
    problems.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n")
    blocker.write_text("a file, not a folder")
    r = subprocess.run(
        [sys.executable, "-m", "tuner", "tune-all", "--config", str(problems), "--budget", "0.01"],
        env=os.environ | {"TUNER_CACHE": str(tmp_path / "c.db"), "TUNER_PROFILE": str(blocker / "p")},
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr
        == f"error: {blocker / 'p'}: cannot create the TUNER_PROFILE folder: Not a directory\n"
    )
    assert not (tmp_path / "c.db").exists()  # nothing was tuned


def test_a_cache_named_from_home_is_the_one_the_library_opens(tmp_path, monkeypatch):
    """``~`` in $TUNER_CACHE, in the config file's ``cache`` and in ``--cache=`` (no shell
    expands it there) names a file under $HOME, the one the dispatcher opens."""
    home, work, export = tmp_path / "home", tmp_path / "work", tmp_path / "e.json"
    work.mkdir()
    export.write_text('{"format": "tuner-results"}')
    config = tmp_path / "config.toml"
    config.write_text('cache = "~/from-config.db"\n')
    unset = ("TUNER_CACHE", "TUNER_CONFIG", "XDG_CONFIG_HOME")  # no config file but the test's
    clean = {k: v for k, v in os.environ.items() if k not in unset} | {"HOME": str(home)}
    for name, env, args in [
        ("env.db", {"TUNER_CACHE": "~/env.db"}, []),
        ("from-config.db", {"TUNER_CONFIG": str(config)}, []),
        ("option.db", {}, ["--cache=~/option.db"]),
    ]:
        r = subprocess.run([sys.executable, "-m", "tuner", "import", str(export), *args],
                           env=clean | env, cwd=work, capture_output=True, text=True)  # fmt: skip
        assert r.returncode == 0 and (home / name).is_file(), (name, r.stderr)
    assert not (work / "~").exists()
    monkeypatch.setenv("HOME", str(home))
    assert Dispatcher("~/option.db").store_path == home / "option.db"


def test_a_read_only_cache_fails_every_writing_command_in_one_line(tmp_path):
    cache, problems, export = tmp_path / "ro.db", tmp_path / "p.yaml", tmp_path / "e.json"
    Store(cache).close()
    problems.write_text("problems:\n  - {op: gemm, m: 1, n: 8, k: 8, dtype: f32}\n")
    with Store(tmp_path / "other.db") as other:  # an export with a winner the cache lacks
        other.put_winners([Winner(device_class="cpu-x", key="gemm:m=2,n=8,k=8,dtype=f32,"
                                  "out_dtype=f32", source="torch", params={}, median_us=1.0,
                                  baseline_us=1.0)])  # fmt: skip
    tuner("export", str(export), cache=tmp_path / "other.db")
    with read_only(cache) as before:
        for args in (
            ("tune", "gemm", "-m", "1", "-n", "8", "-k", "8", "--dtype", "f32"),
            ("tune-all", "--config", str(problems), "--out", str(tmp_path / "runs" / "one")),
            ("import", str(export)),
        ):
            r = tuner(*args, cache=cache, check=False)
            assert r.returncode == 2, (args, r.stderr)
            assert r.stderr.startswith(f"error: {cache} is read-only"), (args, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert cache.read_bytes() == before
    assert not (tmp_path / "runs").exists(), "tune-all left the --out folders it made"


def test_launch_and_confirmation_options_reach_the_winner(tmp_path):
    cache = tmp_path / "c.db"
    key = "gemm:m=8,n=8,k=8,dtype=f32,out_dtype=f32"
    r = tuner("tune", "key", key, "--source", "torch", "--launch", "graph", "--confirm-rounds",
              "0", "--budget", "0.01", cache=cache)  # fmt: skip
    cpu = not torch.cuda.is_available()
    assert ("no CUDA GPU here: --launch graph times each call eagerly" in r.stderr) == cpu
    cfg = tmp_path / "p.yaml"
    cfg.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n")
    tuner("tune-all", "--config", str(cfg), "--launch", "graph", "--confirm-tries", "1",
          "--budget", "0.01", cache=cache)  # fmt: skip
    shown = json.loads(tuner("show", "--json", cache=cache).stdout)
    assert len(shown) == 2 and {w["launch"] for w in shown} == {"graph"}
    r = tuner("tune", "key", key, "--launch", "warp", cache=cache, check=False)
    assert r.returncode == 2 and "'warp' is not one of 'eager', 'graph'" in r.stderr
    tuner("tune", "key", key, "--source", "torch", "--sustained", "0", "--budget",
          "0.01", cache=cache)  # fmt: skip
    r = tuner("tune", "key", key, "--sustained", "-1", cache=cache, check=False)
    assert r.returncode == 2 and "--sustained" in r.stderr and "Traceback" not in r.stderr


def test_the_sustained_stretch_reaches_the_tuning_options():
    from tuner.cli.options import tune_options

    assert tune_options(budget=0.1, ops=("gemm",), sustained=0.3).sustained_s == 0.3
    assert tune_options(budget=0.1, ops=("gemm",)).sustained_s == TuneOptions().sustained_s


def test_every_command_has_help_text():
    from typer.main import get_command

    from tuner.cli.main import app

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, (*path, name))

    for path, command in walk(get_command(app), ()):
        assert (command.help or "").strip(), path
        for param in command.params:  # options and arguments
            assert (getattr(param, "help", None) or "").strip(), (path, param.name)


def test_show_contains_matches_whole_key_fields_when_given_one() -> None:
    from tuner.cli.tune import key_contains

    fp8 = "gemm:m=16,n=64,k=64,batch=1,layout=nt,dtype=fp8_e4m3,out_dtype=bf16,compute=f32,align=16,wdtype=fp8_e4m3,scale=row,accum=f32"
    bf16 = "gemm:m=16,n=64,k=64,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16"
    assert [key_contains(k, "dtype=bf16") for k in (fp8, bf16)] == [False, True]
    assert key_contains(bf16, "m=16,n=64") and not key_contains(bf16, "m=1")
    assert key_contains(bf16, "gemm:m=16") and not key_contains(fp8, bf16)
    assert key_contains(fp8, "fp8-rowwise") and key_contains(fp8, "e4m3")  # label, substring


SDPA_ARGS = (
    "--q-len",
    "1",
    "--kv-len",
    "64",
    "--q-heads",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
)
SDPA_KEY = "sdpa:batch=1,q_heads=2,kv_heads=2,q_len=1,kv_len=64,head_dim=16,dtype=f32"


def test_tune_sdpa_takes_a_v_head_dim_and_a_scale_and_names_the_default_it_refuses(tmp_path):
    """A model's problem with its own V head dim or scale is tuned by the command as by a key
    string, and shows apart from the default one; heads the default --kv-heads does not divide
    say which default refused them."""
    cache = tmp_path / "c.db"
    tuner("tune", "sdpa", *SDPA_ARGS, "--head-dim-v", "8", "--scale", "0.3", "--dtype", "f32",
          "--source", "torch_sdpa", "--budget", "0.01", cache=cache)  # fmt: skip
    (shown,) = json.loads(tuner("show", "--json", cache=cache).stdout)
    key = parse_key(shown["key"])
    assert (key.head_dim_v, key.scale) == (8, 0.3)
    assert "d16 dv8 f32 scale 0.3" in tuner("show", cache=cache).stdout
    r = tuner("tune", "sdpa", "--q-len", "1", "--kv-len", "8", "--q-heads", "4", cache=cache,
              check=False)  # fmt: skip
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "error: --kv-heads (default 8) must divide --q-heads (4): give --kv-heads"
    )
    for option, value, said in (
        ("--scale", "0", "--scale must be a positive number, got 0"),
        ("--head-dim-v", "0", "--head-dim-v must be a positive integer, got 0"),
        ("--kv-heads", "0", "kv_heads must be a positive integer, got 0"),
    ):
        r = tuner("tune", "sdpa", *SDPA_ARGS, option, value, cache=cache, check=False)
        assert (r.returncode, r.stderr.strip()) == (2, f"error: {said}")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("tune", "gemm", "-m", "8", "-n", "8", "-k", "8", "--source", "triton_attention"),
         "--source triton_attention serves sdpa, not gemm; the sources that serve gemm: "),
        (("tune", "sdpa", *SDPA_ARGS, "--source", "triton_gemm"),
         "--source triton_gemm serves gemm, not sdpa; the sources that serve sdpa: "),
        (("tune", "key", SDPA_KEY, "--source", "torch"),
         "--source torch serves gemm, not sdpa; the sources that serve sdpa: "),
        (("bench", "sdpa", "--quick", "--source", "triton_gemm"),
         "--source triton_gemm serves gemm, not sdpa; the sources that serve sdpa: "),
        (("bench", "gemm", "--quick", "--source", "torch_sdpa"),
         "--source torch_sdpa serves sdpa, not gemm; the sources that serve gemm: "),
        (("bench", "gemm", "--suite", "lowbit", "--quick", "--source", "triton_decode"),
         "--source triton_decode serves sdpa, not gemm; the sources that serve gemm: "),
    ],
)  # fmt: skip
def test_a_source_of_another_op_is_refused_in_one_line_and_nothing_is_written(
    tmp_path, args, named
) -> None:
    """A single-op command given a source that serves another op would tune no challenger at
    all: it is refused (exit 2) by one line naming the option, the value and the sources that
    serve the op, before any cache or output folder is made."""
    out = tmp_path / "out"
    extra = ("--out", str(out)) if args[0] == "bench" else ()
    r = tuner(*args, *extra, cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and named in r.stderr, r.stderr
    op = named.rsplit("serve ", 1)[1].rstrip(": ")
    serving = r.stderr.split(named)[1].strip().split(", ")
    assert serving == sorted(s.name for s in registry.sources(op))
    assert not (tmp_path / "c.db").exists() and not out.exists()


@pytest.mark.cpu_host
@pytest.mark.parametrize("command", ["tune", "tune-all"])
def test_sources_that_cannot_run_here_are_refused_and_nothing_is_stored(tmp_path, command):
    """``--source cublas`` on a machine without a GPU would time torch alone and store it as the
    problem's winner, which a later run then skips as tuned: refused in one line naming each
    source's reason and the sources that do run here, no cache made. With one that runs
    (Triton, interpreted), the run goes on and its table says why the other did not run."""
    cache, problems = tmp_path / "c.db", tmp_path / "p.yaml"
    problems.write_text("problems:\n  - {op: gemm, m: 4, n: 16, k: 16, dtype: f32}\n")
    args = (("tune", "gemm", "-m", "4", "-n", "16", "-k", "16", "--dtype", "f32")
            if command == "tune" else ("tune-all", "--config", str(problems)))  # fmt: skip
    r = tuner(*args, "--source", "cublas", "--source", "cutlass", cache=cache, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --source cannot run here: cublas: no GPU"), r.stderr
    assert "; cutlass: " in r.stderr and not cache.exists()
    running = r.stderr.split("the gemm sources with challengers that run here: ")[1]
    running = running.strip().split(", ")
    assert "triton_gemm" in running and "cublas" not in running
    assert "torch" not in running and "torch_sdpa" not in running  # a baseline; another op
    r = tuner(*args, "--source", "cublas", "--source", "triton_gemm", "--budget", "0.01",
              cache=cache)  # fmt: skip
    assert cache.exists()
    if command == "tune":
        assert "not run: cublas: no GPU" in r.stdout


@pytest.mark.cpu_host
@pytest.mark.parametrize(
    "sources",
    [("cublas", "cublas"), ("cublas", "torch"), ("cublas", "triton_attention")],
    ids=["twice", "beside-the-baseline", "beside-another-op"],
)
def test_a_gemm_run_whose_named_gemm_sources_cannot_run_here_is_refused(tmp_path, sources):
    """The refusal is judged per op: a source named twice counts once, torch's GEMM adds no
    challenger, and an SDPA source that runs does not let a GEMM problem be tuned with the
    baseline alone. Naming only the baseline still runs it."""
    problems = tmp_path / "p.yaml"
    problems.write_text(
        "problems:\n  - {op: gemm, m: 4, n: 16, k: 16, dtype: f32}\n"
        "  - {op: sdpa, batch: 1, q_heads: 2, kv_heads: 2, q_len: 4, kv_len: 8, head_dim: 16,"
        " dtype: f32}\n"
    )
    cache = tmp_path / "c.db"
    flags = [arg for name in sources for arg in ("--source", name)]
    r = tuner("tune-all", "--config", str(problems), *flags, cache=cache, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --source cannot run here: cublas: no GPU"), r.stderr
    assert r.stderr.count("cublas: no GPU") == 1 and not cache.exists()
    if "torch" in sources:
        assert "; torch: the baseline only;" in r.stderr
    args = ("tune", "gemm", "-m", "4", "-n", "16", "-k", "16", "--dtype", "f32", "--budget", "0.01")
    r = tuner(*args, "--source", "torch", cache=cache)
    assert "winner" in r.stdout.lower() and cache.exists()


def test_tune_prints_the_key_whole_on_one_line_and_names_a_cache_it_made(tmp_path):
    """The key is what ``tuner tune key`` and ``show`` take back: printed on its own line,
    never wrapped, however narrow the terminal. A cache the run makes is named (a mistyped
    --cache would go unseen); one that was there is not."""
    args = ("tune", "gemm", "-m", "8", "-n", "32", "-k", "32", "--dtype", "f32", "--source",
            "torch", "--budget", "0.01")  # fmt: skip
    cache = tmp_path / "new" / "c.db"
    r = tuner(*args, cache=cache, COLUMNS="60")
    key = GemmKey(m=8, n=32, k=32, dtype="f32")
    assert f"key: {key}\n" in r.stdout and len(str(key)) > 60
    assert r.stderr.endswith(f"stored in a new cache: {cache}\n")
    assert "new cache" not in tuner(*args, cache=cache).stderr


@pytest.mark.parametrize(
    ("dtype", "guess"), [("float16", "f16"), ("BF16", "bf16"), ("torch.float32", "f32")]
)
def test_a_dtype_in_another_tools_words_is_refused_with_ours(tmp_path, dtype, guess):
    r = tuner("tune", "gemm", "-m", "4", "-n", "8", "-k", "8", "--dtype", dtype,
              cache=tmp_path / "c.db", check=False)  # fmt: skip
    assert r.returncode == 2 and f"got {dtype!r} (did you mean {guess!r}?)" in r.stderr, r.stderr


def test_sources_with_nothing_for_the_key_are_refused_and_one_that_has_runs(tmp_path) -> None:
    """Sources of the right op that all have nothing for the key (plain-GEMM kernels named for an
    int4 key) would leave the baseline timed alone: refused in one line giving each one's reason
    and the sources that take the key, nothing written. With one that takes it, the run goes on
    and its table says why the other did not run."""
    cache = tmp_path / "c.db"
    int4 = ("tune", "gemm", "-m", "1", "-n", "256", "-k", "256", "--dtype", "int4-g128")
    r = tuner(*int4, "--source", "triton_gemm", "--source", "cublas", cache=cache, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --source has nothing for 1x256x256 nt bf16 int4-g128: "
                               "triton_gemm: plain GEMMs only"), r.stderr  # fmt: skip
    assert "cublas: plain GEMMs only" in r.stderr
    key = GemmKey(
        m=1, n=256, k=256, layout="nt", wdtype="int4", group=128, zeros="float", scale="group"
    )
    takers = r.stderr.split("the sources that take it: ")[1].strip().split(", ")
    assert takers == [s.name for s in registry.sources("gemm") if s.unsupported(key) is None]
    assert "triton_w4a16" in takers and not cache.exists()
    r = tuner(*int4, "--source", "triton_gemm", "--source", "triton_w4a16", cache=cache)
    assert "winner (eager): torch_lowbit" in r.stdout and cache.exists()


@pytest.mark.cpu_host
def test_the_interpreters_hint_names_the_keys_own_baseline(tmp_path):
    """The source that leaves Triton out is the key's baseline: torch_lowbit for an int4 key
    (``--source torch``, torch's plain GEMM, refuses it). With it given, no Triton candidate
    runs, and nothing is said of the interpreter."""
    int4 = ("tune", "gemm", "-m", "16", "-n", "8", "-k", "128", "--dtype", "int4-g128")
    r = tuner(*int4, cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "N=8" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "(--source torch_lowbit leaves them out)" in r.stdout
    r = tuner(*int4, "--source", "torch_lowbit", cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2 and "TRITON_INTERPRET" not in r.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("gemm", "--suite", "lowbit", "--quick", "--part", "int4-g128", "--source", "triton_fp8"),
         "triton_fp8: fp8 operands only"),
        (("gemm", "--suite", "lowbit", "--quick", "--part", "fp8-rowwise", "--source",
          "triton_w4a16"), "triton_w4a16: int4 weights only"),
        (("gemm", "--quick", "--part", "fp16", "--source", "triton_w4a16"),
         "triton_w4a16: int4 weights only"),
        (("sdpa", "--quick", "--part", "prefill", "--source", "triton_decode"),
         "triton_decode: q_len "),  # its rows' q_len: --quick shrinks them on a CPU only
    ],
)  # fmt: skip
def test_a_bench_source_with_nothing_for_any_row_is_refused_before_anything_runs(
    tmp_path, args, named
) -> None:
    """A suite given a source that takes none of its rows timed the baseline alone at 1.00x and
    said nothing: refused (exit 2) in one line naming the source, its reason and the sources
    that take the rows, before the cache or --out is made."""
    out = tmp_path / "out"
    r = tuner("bench", *args, "--out", str(out), cache=tmp_path / "c.db", check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --source has nothing for ") and r.stderr.count("\n") == 1
    assert named in r.stderr and "; the sources that take " in r.stderr, r.stderr
    assert not out.exists() and not (tmp_path / "c.db").exists()


def test_a_bench_source_that_takes_some_rows_is_let_through() -> None:
    """A source with nothing for some rows but something for others (an FP8 kernel in a run of
    both formats) runs: the rows it cannot take list it as unsupported."""
    from tuner.cli.options import check_sources_take_some
    from tuner.suites import lowbit

    formats = ["int4-g128", "fp8-rowwise"]
    keys = [key for _, key in lowbit.chosen_problems(formats, quick=True, device="cpu")]
    check_sources_take_some(["triton_fp8"], keys)
    with pytest.raises(ValueError, match=r"any of the run's 4 problems .*: triton_gemm: plain"):
        check_sources_take_some(["triton_fp8", "triton_gemm"], keys)
    # the suite tunes each row's bf16 twin too, with the same sources: a plain-GEMM source
    # that takes a twin runs (on a GPU; Triton's interpreter refuses bf16, so no CPU one does)
    twins = [lowbit.bf16_twin(key) for key in keys]
    if any(registry.get("triton_gemm").unsupported(twin) is None for twin in twins):
        check_sources_take_some(["triton_fp8", "triton_gemm"], [*keys, *twins])
    else:
        with pytest.raises(ValueError, match=r"the run's 8 problems"):
            check_sources_take_some(["triton_fp8", "triton_gemm"], [*keys, *twins])


def test_tune_all_takes_a_source_serving_any_of_its_ops(tmp_path) -> None:
    """tune-all mixes ops: a source is refused only where it serves none of the run's (its
    files' problems', or --op's), with nothing written."""
    mixed, gemm_only = tmp_path / "mixed.yaml", tmp_path / "gemm.yaml"
    gemm_line = "  - {op: gemm, m: 8, n: 16, k: 16, dtype: f32}\n"
    sdpa_line = ("  - {op: sdpa, batch: 1, q_heads: 2, kv_heads: 1, q_len: 3, kv_len: 5, "
                 "head_dim: 8, dtype: f32}\n")  # fmt: skip
    mixed.write_text(f"problems:\n{gemm_line}{sdpa_line}")
    gemm_only.write_text(f"problems:\n{gemm_line}")
    cache = tmp_path / "c.db"
    run = ("tune-all", "--dry-run", "--source", "triton_attention", "--config")
    assert "2 to tune" in tuner(*run, str(mixed), cache=cache).stdout
    r = tuner(*run, str(gemm_only), "--out", str(tmp_path / "out"), cache=cache, check=False)
    assert r.returncode == 2 and "--source triton_attention serves sdpa, not gemm" in r.stderr
    r = tuner(*run, str(mixed), "--op", "gemm", cache=cache, check=False)
    assert r.returncode == 2 and "--source triton_attention serves sdpa, not gemm" in r.stderr
    assert not cache.exists() and not (tmp_path / "out").exists()


def test_tune_all_says_what_op_left_out(tmp_path) -> None:
    """A count that shrinks between the files' lines and the run's comes with its reason."""
    from io import StringIO

    from rich.console import Console

    from tuner.cli.tune_all import Sources, add_recorded
    from tuner.offline.problem_set import ProblemSet

    problems = ProblemSet()
    problems.add(parse_key("gemm:m=16,n=64,k=64,layout=nt,dtype=bf16"), "a")
    problems.add(
        parse_key("sdpa:batch=1,q_heads=8,kv_heads=8,q_len=1,kv_len=128,head_dim=64,dtype=bf16"),
        "b",
    )
    out = StringIO()
    store, fp = Store(tmp_path / "c.db"), fingerprint()
    kept = add_recorded(problems, Sources(op="gemm"), store, fp, Console(file=out), None)
    assert [k.op for k in kept] == ["gemm"]
    assert "--op gemm: 1 of 2 problems kept" in out.getvalue()


@pytest.mark.cpu_host  # on a GPU the problem is tuned before the Ctrl-C comes
def test_ctrl_c_during_tune_says_nothing_was_stored(tmp_path):
    """A problem that takes minutes (INT4 through Triton's interpreter) shows how far it got,
    and Ctrl-C ends it with one line, no traceback, no winner; the cache the command made is
    gone again, so no later command takes it for one."""
    cache = tmp_path / "c.db"
    env = os.environ | {"TRITON_INTERPRET": "1", "TUNER_CACHE": str(cache), "COLUMNS": "200"}
    args = ("tune", "gemm", "-m", "16", "-n", "4096", "-k", "4096", "--dtype", "int4-g128")
    p = subprocess.Popen(
        [sys.executable, "-m", "tuner", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        # as a terminal's foreground job gets it: a suite started in the background (`make
        # test &`) ignores SIGINT, and its children would inherit that and never see a Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    while not cache.exists():  # the cache is made just before the run starts
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    time.sleep(3)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "TRITON_INTERPRET=1: Triton candidates run in its interpreter" in out
    assert re.search(r"interrupted after \d+ measurements?: nothing stored", err)
    assert "Traceback" not in err
    assert not list(tmp_path.glob("c.db*")), "the cache the interrupted tune made was left"


def test_info_says_which_cache_and_mode_this_process_uses(tmp_path):
    """What to check first when nothing is served: the cache file, the mode, the service."""
    env = os.environ | {
        "TUNER_CACHE": str(tmp_path / "typo.db"), "TUNER_MODE": "record", "COLUMNS": "200",
        "TUNER_TOKEN": "tnr_0123456789ab_" + "s" * 43, "TUNER_CONFIG": str(tmp_path / "none.toml"),
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "tuner", "info"], env=env, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert f"{tmp_path / 'typo.db'} (not made yet)" in out and "record" in out
    assert "tnr_0123..." in out and "s" * 43 not in out
    assert not (tmp_path / "typo.db").exists()


def info_with(tmp_path, **settings: str) -> str:
    """``tuner info``'s output with these ``TUNER_*`` variables set and no config file."""
    env = os.environ | settings | {"COLUMNS": "260", "TUNER_CONFIG": str(tmp_path / "none.toml")}
    return subprocess.run(
        [sys.executable, "-m", "tuner", "info"], env=env, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip


def test_info_marks_a_setting_word_the_dispatcher_refuses(tmp_path):
    """``TUNER_MODE=recrd`` fails the first call: info, where one looks first, says so."""
    out = info_with(tmp_path, TUNER_MODE="recrd", TUNER_BUCKETS="pow2", TUNER_STALE="no")
    assert "recrd (not one of off, lookup, record, tune: the first call fails)" in out
    assert "no (not one of use, ignore: the first call fails)" in out
    assert "pow2 (" not in out


def test_info_marks_an_on_off_word_that_is_refused(tmp_path):
    """``TUNER_TRITON_FAST_LAUNCH=nope`` is logged and its default used: info says so."""
    for text, shown in (
        ("nope", "nope (not one of 1/0, true/false, yes/no, on/off: on (the default) is used)"),
        ("OFF", "OFF"),
    ):
        out = info_with(tmp_path, TUNER_TRITON_FAST_LAUNCH=text)
        row = next(line for line in out.splitlines() if "TUNER_TRITON_FAST_LAUNCH" in line)
        assert row.split("TUNER_TRITON_FAST_LAUNCH)")[1].strip(" │|") == shown


def test_info_marks_a_number_setting_that_is_no_positive_number(tmp_path):
    """Each is refused where it is read (or its default used): info says which."""
    out = info_with(tmp_path, TUNER_SERVER_TIMEOUT="abc", TUNER_COMPILE_WORKERS="many",
                    TUNER_ARTIFACTS_MAX_BYTES="10GB", TUNER_CUTLASS_JOBS="4")  # fmt: skip
    assert (
        "abc (not a finite number of at least 0.1: tuner sync, push and artifacts refuse it; the "
        "background sync, warmup and tune-all use the default, and log it)" in out
    )
    whole = "a positive whole number"
    assert "many (not a whole number from 1 to 1024: the default is used, and logged)" in out
    assert (
        f"10GB (not {whole} of bytes (as 1000000000 or 1e9): the compiled-kernel store refuses "
        "to open)" in out
    )
    assert "4 (" not in out


def test_info_says_whether_the_config_file_applies(tmp_path):
    """A file that is not TOML is ignored whole, one with mistakes applies but for them: the
    table says which, beside the warnings."""
    cfg = tmp_path / "config.toml"
    for text, shown in (
        ("mode = record\n", "(ignored: not valid TOML"),
        ('mode = "record"\ncache = 5\n', "(1 setting left out, named above)"),
        ('mode = "record"\n', f"{cfg} │"),
    ):
        cfg.write_text(text)
        env = os.environ | {"COLUMNS": "200", "TUNER_CONFIG": str(cfg)}
        out = subprocess.run([sys.executable, "-m", "tuner", "info"], env=env,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        row = next(line for line in out.splitlines() if "config file" in line)
        assert shown in row, row


def test_export_piped_into_import(tmp_path):
    key = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    with Store(tmp_path / "a.db") as a:
        a.put_winners([Winner("cpu-test", key, "torch", {}, 2.0, 2.0)])
    exported = tuner("export", "-", cache=tmp_path / "a.db").stdout
    env = os.environ | {"TUNER_CACHE": str(tmp_path / "b.db")}
    r = subprocess.run([sys.executable, "-m", "tuner", "import", "-"], input=exported, env=env,
                       capture_output=True, text=True, check=True)  # fmt: skip
    assert "1 winner added or replaced" in r.stdout
    missing = tuner("import", str(tmp_path / "none.json"), cache=tmp_path / "b.db", check=False)
    assert missing.returncode == 2 and "none.json: cannot read: No such file" in missing.stderr


@pytest.mark.cpu_host
@pytest.mark.parametrize("args", [("gemm", "--part", "fp32"), ("sdpa", "--part", "decode")])
def test_a_whole_suite_on_a_cpu_says_as_it_starts_that_quick_is_the_cpus_run(tmp_path, args):
    """Without --quick, a suite on a host with no GPU times the models' own shapes on the CPU
    (hours for a part): a note says so as it starts, and that --quick times small shapes."""
    env = os.environ | {"COLUMNS": "300", "TRITON_INTERPRET": ""}
    argv = [sys.executable, "-m", "tuner", "bench", *args, "--out", str(tmp_path / "b")]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env) as p:  # fmt: skip
        watchdog = threading.Timer(60, p.kill)  # the suite itself would run for hours
        watchdog.start()
        try:
            said = next((line for line in p.stderr if line.startswith("note:")), None)
        finally:
            watchdog.cancel()
            p.kill()
    assert said == (
        "note: no CUDA GPU here: the suite times the models' own shapes on the CPU, slowly (a "
        "part may take hours); --quick times small shapes in their place\n"
    )


@pytest.mark.cpu_host
def test_quick_with_projections_on_a_cpu_says_they_run_full_size(tmp_path, monkeypatch):
    """``--quick --proj`` on a CPU times the models' own projections (minutes a row), not the
    small shape --quick's help promised: said as it starts, with what times small shapes; plain
    --quick (or --quick --m alone), which runs the small shape, says nothing."""
    from tuner.suites import lowbit

    ran = []
    monkeypatch.setattr(lowbit, "run", lambda rows, *a: ran.append(rows))
    lowbit_quick = ("bench", "gemm", "--suite", "lowbit", "--quick", "--part", "int4-g128",
                    "--out", str(tmp_path / "b"))  # fmt: skip
    r = CliRunner().invoke(app, [*lowbit_quick, "--proj", "down", "--m", "1"],
                           env={"COLUMNS": "300"})  # fmt: skip
    assert r.exit_code == 0, r.output
    assert [label for label, _ in ran[0]] == [
        "Llama-3-8B down M=1 int4-g128", "Qwen2.5-7B down M=1 int4-g128"
    ]  # fmt: skip
    assert r.stderr == (
        "note: no CUDA GPU here: the suite times the models' own shapes on the CPU, slowly (a "
        "part may take hours); --quick without --proj times small shapes in their place\n"
    )
    without_quick = [arg for arg in lowbit_quick if arg != "--quick"]
    r = CliRunner().invoke(app, [*without_quick, "--proj", "down", "--m", "1"],
                           env={"COLUMNS": "300"})  # fmt: skip
    assert r.stderr.endswith("; --quick without --proj times small shapes in their place\n")
    for small in ((), ("--m", "1")):
        r = CliRunner().invoke(app, [*lowbit_quick, *small], env={"COLUMNS": "300"})
        assert r.exit_code == 0 and r.stderr == "", r.output
    said = " ".join(CliRunner().invoke(app, ["bench", "gemm", "--help"], env={"COLUMNS": "300"})
                    .output.replace("│", " ").split())  # fmt: skip
    assert "--proj given, those projections at full size (minutes a row on a CPU)" in said


@pytest.mark.cpu_host
def test_inductor_asked_for_on_a_cpu_says_why_no_inductor_row_runs(tmp_path):
    """``--inductor`` on a CPU times nothing (``"inductor": []``): a note says so as the run
    starts; left to its default, nothing is said."""
    out = tmp_path / "b"
    args = ["bench", "gemm", "--quick", "--part", "fp16", "--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--inductor"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert r.stderr == ("note: --inductor: no CUDA GPU here: Inductor max-autotune is timed on "
                        "a GPU only; no Inductor row runs\n")  # fmt: skip
    assert json.loads((out / "gemm_llama_fp16.json").read_text())["inductor"] == []
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code == 0 and r.stderr == "", r.output


def test_bench_sdpa_refuses_more_compile_workers_than_the_setting_takes(tmp_path):
    """``--workers`` stands for ``$TUNER_COMPILE_WORKERS``, which takes 1 to 1024: past that the
    command is refused before it runs, rather than the compile pool using its default."""
    out = tmp_path / "b"
    r = tuner("bench", "sdpa", "--workers", "1025", "--part", "nope", "--out", str(out),
              check=False)  # fmt: skip
    assert r.returncode == 2 and "--workers" in r.stderr and "1024" in r.stderr, r.stderr
    assert not out.exists()

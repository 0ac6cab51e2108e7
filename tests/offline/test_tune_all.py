"""tune-all on the CPU path: model configs, de-duplication, resume after a real SIGKILL, failures,
timeouts, Ctrl-C, recorded misses, and the report. The runs are real ``tuner tune-all`` processes
with real worker processes; the kernels are torch's and, where the test says so, the Triton ones
through Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quiet_host import ATTEMPTS, first_judged, undisturbed

from tests.cache.full_disk import limit_in_child
from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, SdpaKey, parse_key
from tuner.measure.records import Measurement, Winner, candidate_name
from tuner.offline.journal import (
    append_journal,
    journal_path,
    kept_after_unfinished,
    kept_runs,
    order,
    pending,
    read_journal,
)
from tuner.offline.model_config import expand, load_model, parse_model
from tuner.offline.problem_list import ConfigError, load_problems
from tuner.offline.problem_set import ProblemSet
from tuner.offline.run_settings import RunSettings
from tuner.offline.tunableop import import_files
from tuner.offline.tune_all import Result, Task, _Pool, _tune_one, outranks, worker_main
from tuner.tuning.compile_pool import CompilePool
from tuner.tuning.engine import TuneOptions

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
DATA = ROOT / "tests" / "data"

TINY = """
name: Tiny
hidden_size: 64
intermediate_size: 96
num_heads: 4
num_kv_heads: 2
head_dim: 16
dtypes: [{dtype}]
m_sizes: {m_sizes}
ops: {ops}
attention:
  prefill: {{batch_sizes: [1], seq_lens: [16]}}
  decode: {{batch_sizes: [2], kv_lens: [32]}}
"""


def tiny(tmp_path: Path, name: str = "tiny.yaml", dtype="f32", m_sizes="[1, 8]", ops=None) -> Path:
    path = tmp_path / name
    ops = ops or "[qkv, o, gate_up, down, attn_prefill, attn_decode]"
    path.write_text(TINY.format(dtype=dtype, m_sizes=m_sizes, ops=ops))
    return path


def start(*args: str, cache: Path, **kw) -> subprocess.Popen:
    env = os.environ | {
        "TUNER_CACHE": str(cache), "TRITON_INTERPRET": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "tuner", "tune-all", *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )  # fmt: skip


def tune_all(*args: str, cache: Path, timeout: float = 240) -> tuple[int, str]:
    p = start(*args, cache=cache)
    out = p.communicate(timeout=timeout)[0]
    return p.returncode, out


def winner_keys(cache: Path) -> set[str]:
    try:
        with sqlite3.connect(cache) as c:
            return {k for (k,) in c.execute("select key from winners")}
    except sqlite3.OperationalError:  # not created yet
        return set()


# --- model configs -----------------------------------------------------------------------------


def test_shipped_model_configs_expand_to_their_real_shapes():
    llama = load_model(MODELS / "llama-3-8b.yaml")
    shapes = {op: llama.gemm_shape(op) for op in ("qkv", "o", "gate_up", "down")}
    assert shapes == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)
    }  # fmt: skip
    problems = expand(llama)
    gemms = [p.key for p in problems if isinstance(p.key, GemmKey)]
    assert len(gemms) == 4 * 14 and {k.m for k in gemms} == {2**i for i in range(14)}
    assert all(k.layout == "nt" and k.dtype == "bf16" and k.align == 16 for k in gemms)
    assert problems[0].label == "Llama-3-8B qkv M=1 bf16"
    attn = [p.key for p in problems if isinstance(p.key, SdpaKey)]
    assert {(k.q_heads, k.kv_heads, k.head_dim) for k in attn} == {(32, 8, 128)}
    assert {k.causal for k in attn if k.q_len == 1} == {"none"}
    assert {k.causal for k in attn if k.q_len > 1} == {"top_left"}
    mistral = {p.key for p in expand(load_model(MODELS / "mistral-7b.yaml"))}
    assert set(gemms) <= mistral  # same dimensions as Llama-3-8B: shared problems
    qwen = load_model(MODELS / "qwen2.5-7b.yaml")
    assert qwen.gemm_shape("qkv") == ((28 + 2 * 4) * 128, 3584)
    assert qwen.gemm_shape("gate_up") == (2 * 18944, 3584)
    big = load_model(MODELS / "llama-3-70b.yaml")
    assert big.gemm_shape("down") == (8192, 28672)


def test_tensor_parallel_shards_heads_and_ffn():
    base = load_model(MODELS / "llama-3-70b.yaml").model_dump()
    tp8 = parse_model({**base, "tp": 8})
    assert [tp8.gemm_shape(op) for op in ("qkv", "o", "gate_up", "down")] == [
        ((8 + 2) * 128, 8192), (8192, 1024), (7168, 8192), (8192, 3584)
    ]  # fmt: skip
    tp16 = parse_model({**base, "tp": 16})  # 8 KV heads over 16 ranks: one replicated per rank
    assert tp16.kv_heads_per_rank == 1 and tp16.gemm_shape("qkv") == ((4 + 2) * 128, 8192)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "4096"}, "hidden_size: Input should be a valid integer (got '4096')"),
        ({"num_heads": 0}, "num_heads: Input should be greater than 0"),
        ({"dtypes": ["fp8"]}, "dtypes[0]: Input should be 'f16', 'bf16', 'f32' or 'tf32'"),
        ({"ops": ["qkv", "mlp"]}, "ops[1]: Input should be 'qkv', 'o', 'gate_up', 'down'"),
        ({"layers": 32}, "layers: unknown field; allowed: ['attention', 'dtypes'"),
        ({"tp": 3}, "tp (3) must divide num_heads (32)"),
        ({"num_kv_heads": 5}, "num_kv_heads (5) must divide num_heads (32)"),
        ({"m_sizes": []}, "m_sizes is required"),
        (
            {"attention": {"prefill": {"batch_sizes": [1]}}},
            "attention.prefill.seq_lens: Field required",
        ),
        (
            {"attention": {"decode": {"batch_sizes": [1], "kv_len": [8]}}},
            "attention.decode.kv_len: unknown field (did you mean 'kv_lens'?); allowed: "
            "['batch_sizes', 'kv_lens']",
        ),
        ({"attention": None}, "attention.prefill is required when ops lists 'attn_prefill'"),
    ],
)
def test_model_config_errors_name_the_field_and_the_allowed_values(change, message):
    data = {**load_model(MODELS / "llama-3-8b.yaml").model_dump(), **change}
    with pytest.raises(ConfigError) as err:
        parse_model(data, "llama.yaml")
    assert f"llama.yaml: {message}" in str(err.value)


def test_missing_field_and_bad_yaml(tmp_path):
    data = load_model(MODELS / "llama-3-8b.yaml").model_dump()
    del data["head_dim"]
    with pytest.raises(ConfigError, match=r"m\.yaml: head_dim: Field required"):
        parse_model(data, "m.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_model(bad)


def test_a_listed_gemm_without_an_alignment_takes_the_largest_its_shape_allows(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 3, n: 5, k: 7, dtype: f32}\n"
                      "  - {op: gemm, m: 3, n: 6, k: 8, dtype: bf16, layout: tn}\n"
                      "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f16}\n")  # fmt: skip
    assert [k.align for k in load_problems(listed)] == [4, 2, 16]
    listed.write_text("problems:\n  - {op: gemm, m: 3, n: 5, k: 7, dtype: f32, align: 8}\n")
    with pytest.raises(ConfigError, match=r"align=8 is impossible.*this shape allows align 4$"):
        load_problems(listed)


def test_a_problem_list_names_every_bad_entry_at_once(tmp_path):
    listed = tmp_path / "list.yaml"
    good = "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f16}\n"
    listed.write_text("problems:\n" + good + "  - {op: gemm, m: 0, n: 8, k: 8, dtype: f16}\n"
                      + good + "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f12}\n"
                      + "  - [8, 8, 8]\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_problems(listed)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{listed}: 3 bad entries:"
    assert [line.split(": ")[1] for line in lines[1:]] == [
        "problems[1]", "problems[3]", "problems[4]"
    ]  # fmt: skip
    assert "m must be a positive integer" in lines[1] and "got 'f12'" in lines[2]
    listed.write_text("problems:\n" + "  - {op: gemm, m: 0, n: 8, k: 8}\n" * 25)
    with pytest.raises(ConfigError, match=r"25 bad entries:(\n.*problems\[\d+\].*){20}\n"
                       r"  \.\.\. and 5 more$"):  # fmt: skip
        load_problems(listed)


def test_sources_are_merged_and_deduplicated(tmp_path):
    problems = ProblemSet()
    n_llama = problems.add_model(load_model(MODELS / "llama-3-8b.yaml"))
    problems.add_model(load_model(MODELS / "mistral-7b.yaml"))
    opt = import_files([DATA / "tunableop" / "untuned_opt125m0.csv"])
    problems.add_tunableop(opt)
    problems.add_misses([{"key": str(next(iter(problems))), "count": 3}])
    bad = problems.add_misses([{"key": "gemm:m=0,n=4,k=4", "count": 1}])
    assert bad and "m must be a positive integer" in bad[0]
    # Mistral adds only what Llama-3-8B lacks: its 4096-long decode caches
    assert len(problems) == n_llama + 3 + len(opt.keys)
    first = next(iter(problems))
    assert problems.label(first) == "Llama-3-8B qkv M=1 bf16 (+2)"  # Mistral and the miss
    assert all(k.op == "gemm" for k in problems.only("gemm"))


# --- tune-all end to end -----------------------------------------------------------------------


@pytest.mark.cpu_host
def test_tune_all_small_config_on_the_cpu_path(tmp_path):
    """Models, a problem list, a TunableOp file and recorded misses in one run, with the Triton
    candidates through the interpreter; then the report on demand."""
    cache = tmp_path / "c.db"
    model = tiny(tmp_path, dtype="f16", m_sizes="[1, 16]", ops="[qkv, down, attn_decode]")
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "problems:\n  - {op: gemm, m: 16, n: 128, k: 64, layout: nt, dtype: f16}\n"  # = qkv M=16
        "  - {op: gemm, m: 16, n: 96, k: 64, layout: nt, dtype: f16}\n"
    )
    untuned = tmp_path / "tunableop_untuned0.csv"  # F.linear(x 4x64, W 32x64) and a repeat
    untuned.write_text(
        "GemmTunableOp_Half_TN,tn_32_4_64_ld_64_64_32\nGemmAndBiasTunableOp_Half_TN,tn_32_4_64_ld_64_64_32\n"
    )
    missed = "gemm:m=2,n=48,k=32,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
    fp = fingerprint()
    with Store(cache) as store:
        store.record_misses(fp.device_class, [missed], count=5)
    args = ("--model", str(model), "--config", str(listed), "--tunableop", str(untuned), "--misses")
    code, out = tune_all(*args, "--budget", "0.01", "--out", str(tmp_path / "rep"), cache=cache)
    assert code == 0, out
    # 5 model problems (qkv and down at M 1 and 16, one decode); the list adds 1 (its other
    # problem is the model's qkv M=16), TunableOp 1 (two lines, one GEMM), the misses 1
    assert "8 distinct problems" in out and "0 already tuned, 8 to tune" in out
    with Store(cache) as store:
        winners = {w.key: w for w in store.winners(fp.device_class)}
        assert store.misses(fp.device_class) == []  # tuned misses are cleared
        runs = {(m.key, m.run_id) for m in store.measurements(fp.device_class)}
    assert len(winners) == 8 and missed in winners
    assert len(runs) == 8  # one committed run per problem
    assert {w.source for w in winners.values()} >= {"torch", "torch_sdpa"}
    with Store(cache) as store:
        tried = {m.source for m in store.measurements(fp.device_class)}
    assert "triton_gemm" in tried
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["summary"]["problems"] == 8 and report["summary"]["tuned"] == 8
    assert report["summary"]["geomean_speedup"] >= 1.0  # never slower than the baseline
    assert all(r["tune_s"] > 0 and r["baseline_us"] > 0 for r in report["rows"])
    assert (tmp_path / "rep" / "speedup.png").stat().st_size > 10_000
    assert len(read_journal(journal_path(cache))) == 8


def test_winners_chosen_for_another_launch_mode_are_tuned_again_for_this_one(tmp_path):
    """A winner records the launch mode it was chosen for (none recorded: the default, eager);
    a run for the other mode tunes its problem again and says why in its plan line."""
    fp, cache = fingerprint(), tmp_path / "c.db"
    keys = [GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (2, 3)]
    with Store(cache) as store:
        store.put_winners([
            Winner(fp.device_class, str(keys[0]), "torch", {}, 1.0, 1.0, fp.version_tag),
            Winner(fp.device_class, str(keys[1]), "torch", {}, 1.0, 1.0, fp.version_tag, launch=""),
        ])  # fmt: skip
        assert pending(store, fp, keys, launch="eager") == []
        assert pending(store, fp, keys, launch="graph") == keys
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 2, n: 8, k: 8, dtype: f32}\n")
    args = ("--config", str(listed), "--source", "torch", "--budget", "0.01", "--launch", "graph")
    code, out = tune_all(*args, cache=cache)
    assert code == 0, out
    assert (
        "0 already tuned, 1 to tune (1 re-tuned: chosen for another launch mode than graph)" in out
    )
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(keys[0])).launch == "graph"
    code, out = tune_all(*args, cache=cache)
    assert "1 already tuned, 0 to tune\n" in out, out


@pytest.mark.cpu_host
def test_tune_all_tunes_a_models_low_bit_projections(tmp_path):
    """``dtypes: [int4-g128, fp8-rowwise]`` in a model config: its projections keyed and tuned
    in those formats (torch's ops as baselines, Triton's kernels through the interpreter)."""
    model = tmp_path / "lowbit.yaml"
    model.write_text(
        "name: Lowbit\nhidden_size: 256\nintermediate_size: 512\nnum_heads: 4\n"
        "num_kv_heads: 2\nhead_dim: 64\ndtypes: [int4-g128, fp8-rowwise]\nm_sizes: [1, 16]\n"
        "ops: [o, down]\n"
    )
    cache = tmp_path / "c.db"
    sources = ("--source", "triton_w4a16", "--source", "triton_fp8")  # no nvcc builds on a GPU
    code, out = tune_all("--model", str(model), "--budget", "0.01", *sources, cache=cache)
    assert code == 0, out
    assert "8 distinct problems" in out
    keys = [parse_key(k) for k in winner_keys(cache)]
    assert sorted((k.wdtype, k.m) for k in keys) == sorted(
        (w, m) for w in ("int4", "fp8_e4m3") for m in (1, 16) for _ in ("o", "down")
    )
    assert all(k.group == 128 for k in keys if k.wdtype == "int4")
    assert all(k.scale == "row" for k in keys if k.wdtype == "fp8_e4m3")


@pytest.mark.cpu_host
def test_a_problem_this_device_cannot_run_is_said_at_the_start_and_reported_unsupported(tmp_path):
    """An int4 gate_up of N = 72 (a multiple of 8, as a GPU's packing takes, not of 16, as a
    CPU's does): the run names it before tuning the rest, its report row says why, and the
    run exits 1, not having tuned everything it was asked."""
    model = tmp_path / "odd.yaml"
    model.write_text(
        "name: Odd\nhidden_size: 256\nintermediate_size: 36\nnum_heads: 4\nnum_kv_heads: 2\n"
        "head_dim: 64\ndtypes: [int4-g128]\nm_sizes: [1]\nops: [o, gate_up]\n"
    )
    cache, out = tmp_path / "c.db", tmp_path / "out"
    code, text = tune_all("--model", str(model), "--budget", "0.01", "--source", "triton_w4a16",
                          "--out", str(out), cache=cache)  # fmt: skip
    assert code == 1, text
    said = "cannot run here 1x72x256 nt bf16 int4-g128 (Odd gate_up M=1 int4-g128): N=72: torch's"
    assert said in text and text.index(said) < text.index("tuned 1x256x256"), text
    assert "problems: 2 (1 tuned, 1 unsupported)" in text
    rows = {r["key"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    odd = next(r for k, r in rows.items() if parse_key(k).n == 72)
    assert odd["status"] == "unsupported"
    assert odd["error"] == "N=72: torch's int4 packing on cpu needs a multiple of 16"
    assert [parse_key(k).n for k in winner_keys(cache)] == [256]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path):
    # 8 GEMMs large enough that each takes its whole budget: the kill lands mid-run even on a
    # busy 2-core box
    model = tiny(tmp_path, m_sizes="[1024, 2048]", ops="[qkv, o, gate_up, down]")
    args = (
        "--model",
        str(model),
        "--source",
        "torch",
        "--budget",
        "0.3",
    )  # the kill must land mid-run
    cache = tmp_path / "killed.db"
    p = start(*args, cache=cache, start_new_session=True)
    deadline = time.time() + 180
    while len(winner_keys(cache)) < 2:
        assert p.poll() is None and time.time() < deadline, p.stdout.read() if p.stdout else ""
        time.sleep(0.02)
    workers = _children(p.pid)
    os.kill(p.pid, signal.SIGKILL)  # the tune-all process itself, not its group
    p.wait()
    stored = winner_keys(cache)
    assert 2 <= len(stored) < 8
    gone = time.time() + 15
    while any(_alive(w) for w in workers) and time.time() < gone:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived the killed parent"
    time.sleep(1.0)
    after_kill = winner_keys(cache)
    assert after_kill == winner_keys(cache)  # nothing is writing any more

    code, out = tune_all(*args, cache=cache)
    assert code == 0, out
    assert f"{len(after_kill)} already tuned, {8 - len(after_kill)} to tune" in out

    clean = tmp_path / "clean.db"
    code, out = tune_all(*args, cache=clean)
    assert code == 0, out
    assert winner_keys(cache) == winner_keys(clean) and len(winner_keys(clean)) == 8
    fp = fingerprint()
    with Store(cache) as store:
        assert pending(store, fp, ProblemSet({k: [] for k in expand_keys(model)})) == []
        runs: dict[str, set[str]] = {}
        for m in store.measurements(fp.device_class):
            runs.setdefault(m.key, set()).add(m.run_id)
        winners = {w.key: w for w in store.winners(fp.device_class)}
    # the killed run lost only what was in flight: no key was stored twice or half
    assert all(len(r) == 1 for r in runs.values()) and set(runs) == set(winners)
    assert all(winners[k].run_id in runs[k] for k in winners)


def expand_keys(model: Path) -> list:
    return [p.key for p in expand(load_model(model))]


@pytest.mark.cpu_host
def test_failure_and_timeout_are_recorded_and_the_run_goes_on(tmp_path):
    cache = tmp_path / "c.db"
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "problems:\n"
        "  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n"
        "  - {op: gemm, m: 1048576, n: 1048576, k: 4, dtype: f32}\n"  # 4 TiB output: fails
        "  - {op: gemm, m: 4096, n: 4096, k: 4096, dtype: f32}\n"  # seconds of fp64 reference
        "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n"
    )
    args = ("--config", str(listed), "--source", "torch", "--budget", "0.01")
    code, out = tune_all(
        *args, "--problem-timeout", "1.5", "--out", str(tmp_path / "r"), cache=cache
    )
    assert code == 1, out  # not every problem has a winner
    rows = {r["label"]: r for r in json.loads((tmp_path / "r" / "report.json").read_text())["rows"]}
    assert rows["list.yaml[0]"]["status"] == "tuned"
    assert rows["list.yaml[1]"]["status"] == "failed"
    assert "its operands take 4096.0 GiB, more than this" in rows["list.yaml[1]"]["error"]
    assert rows["list.yaml[2]"]["status"] == "timeout"
    assert "per-problem limit of 1.5 s" in rows["list.yaml[2]"]["error"]
    assert rows["list.yaml[3]"]["status"] == "tuned"  # a fresh worker took over after the kill
    assert "2 tuned, 1 failed, 1 timeout" in out
    # on demand, without sources: every winner and failure of this device class
    env = os.environ | {"TUNER_CACHE": str(cache), "COLUMNS": "200"}
    r = subprocess.run(
        [sys.executable, "-m", "tuner", "report", "--out", str(tmp_path / "later")],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    later = json.loads((tmp_path / "later" / "report.json").read_text())
    assert sorted(row["status"] for row in later["rows"]) == ["failed", "timeout", "tuned", "tuned"]
    assert later["summary"]["geomean_speedup"] == pytest.approx(1.0)  # torch only: the baseline
    assert (tmp_path / "later" / "speedup.png").exists()
    r = subprocess.run(
        [sys.executable, "-m", "tuner", "report", "--rows", "1"], env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert "... 3 more rows (tuner report --rows N, or --out DIR for all)" in r.stdout


def four_gemms(tmp_path: Path) -> tuple[str, ...]:
    """tune-all's arguments for four small GEMMs of torch's: a run of a few seconds."""
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "problems:\n"
        + "".join(f"  - {{op: gemm, m: {m}, n: 8, k: 8, dtype: f32}}\n" for m in (1, 2, 3, 4))
    )
    return ("--config", str(listed), "--source", "torch", "--budget", "0.01")


def test_a_cache_the_disk_cannot_take_stops_the_run_and_counts_no_failure(tmp_path):
    """The disk full mid-run (here: a file-size limit on the run and its workers): the run stops
    with one line naming the cache and what to do, no traceback; what was stored stands, and the
    problems it could not store stay pending, not failed, so that runs on a full disk never use
    up their ``--retries``; once there is room the next run tunes them."""
    cache = tmp_path / "c.db"
    args = four_gemms(tmp_path)
    Store(cache).close()  # made while there is room
    room = 36 * 1024  # past the WAL index's 32 KiB, a few WAL frames: not four problems' runs
    stopped = 0
    for _ in range(3):  # more runs than --retries allows failures
        p = start(*args, cache=cache, preexec_fn=limit_in_child(room))
        out = p.communicate(timeout=240)[0]
        assert p.returncode == 1, out  # also where the run's first write was refused
        assert "Traceback" not in out and f"{cache} could not be written" in out, out
        stopped += "stopped early: cache not writable" in out
        journal = read_journal(journal_path(cache))
        assert {r["status"] for r in journal} <= {"tuned"}
        assert len(winner_keys(cache)) == len(journal) < 4
    assert stopped  # the first run at least got as far as a problem
    code, out = tune_all(*args, cache=cache)
    assert code == 0, out
    assert "not retried" not in out and len(winner_keys(cache)) == 4


def test_a_cache_the_disk_refuses_at_the_runs_first_write_stops_it_as_mid_run(tmp_path):
    """The disk full at the run's first write, its device's fingerprint, before any problem:
    the run stops as it does mid-run (status 1, the cause in one ``error: the run stopped``
    line, no traceback), not as a cache that cannot be used (status 2); nothing is journaled,
    so once there is room the next run tunes every problem, and the ``--out`` folders it made
    for its report go again. Another process keeps write-ahead frames in the cache's log (it
    holds the file open, so they are not merged), and the run may write no byte past the log's
    end."""
    cache = tmp_path / "c.db"
    args = four_gemms(tmp_path)
    out_dir = tmp_path / "runs" / "first"
    with Store(cache) as other:
        other.save_device(fingerprint())
        wal = cache.with_name(cache.name + "-wal")
        p = start(*args, "--out", str(out_dir), cache=cache,
                  preexec_fn=limit_in_child(wal.stat().st_size))  # fmt: skip
        out = p.communicate(timeout=240)[0]
    assert p.returncode == 1, out
    assert "Traceback" not in out, out
    assert not (tmp_path / "runs").exists(), "the run that did nothing left its --out folders"
    assert out.rstrip().splitlines()[-1].startswith(f"error: the run stopped: {cache} could not")
    assert read_journal(journal_path(cache)) == [] and winner_keys(cache) == set()
    code, out = tune_all(*args, cache=cache)
    assert code == 0, out
    assert "not retried" not in out and len(winner_keys(cache)) == 4


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [(signal.SIGINT, 130, "stopped early: ctrl-c"), (signal.SIGTERM, 143, "SIGTERM: no new")],
)
def test_ctrl_c_stops_cleanly_with_everything_finished_saved(tmp_path, sig, code, said):
    sizes = [1, 16, 32, 64, 128, 256]  # 24 GEMMs of >= 0.3 s each: ctrl-c lands mid-run
    n = 4 * len(sizes)
    model = tiny(tmp_path, m_sizes=str(sizes), ops="[qkv, o, gate_up, down]")
    args = (
        "--model",
        str(model),
        "--source",
        "torch",
        "--budget",
        "0.3",
    )
    cache = tmp_path / "c.db"
    p = start(*args, cache=cache, start_new_session=True)
    while not winner_keys(cache):
        assert p.poll() is None
        time.sleep(0.02)
    os.killpg(p.pid, sig)  # SIGINT: what a terminal sends to the whole foreground group
    out = p.communicate(timeout=120)[0]
    assert p.returncode == code and said in out and "Traceback" not in out
    assert ("Ctrl-C again" in out) == (sig == signal.SIGINT)  # SIGTERM aborts at once
    done = winner_keys(cache)
    assert 1 <= len(done) < n
    assert {r["key"] for r in read_journal(journal_path(cache))} == done  # all finished, all saved
    assert f"problems: {n} ({len(done)} tuned, {n - len(done)} pending)" in out


def finish_two_report_one(conn, store_path: str, keys: list[GemmKey], flag: str) -> None:
    """A tune-all worker cut short twice over: it tunes and commits both problems, but reports
    only the first; then it hangs (as a worker does that SIGTERM is about to kill)."""
    from tuner.offline.tune_all import Result
    from tuner.tuning.tune import tune

    fp = fingerprint()
    conn.send(("ready", fp.device_class))
    with Store(store_path) as store:
        for i, key in enumerate(keys):
            conn.send(("start", (key, False)))
            outcome = tune(key, options=TuneOptions(sources=["torch"], budget_s=0.01))
            for m in outcome.measurements:
                conn.send(("measurement", m.to_row()))
            store.save_run(outcome.measurements, outcome.winner)
            if i == 0:
                winner = outcome.winner.to_row()
                conn.send(("result", Result(key, "tuned", 0.1, 0, fp.device_class, winner)))
    Path(flag).touch()
    time.sleep(600)


def test_an_abort_keeps_every_problem_a_worker_committed_before_it_was_killed(tmp_path):
    """SIGTERM kills the workers at once. A result still in a killed worker's pipe, and a
    problem it committed but had no time to report, are both journaled and counted as tuned:
    a problem whose winner is stored is never reported pending."""
    from tuner.tuning.supervisor import Supervised

    keys = [GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (1, 2)]
    cache, flag = tmp_path / "c.db", tmp_path / "committed"
    pool = _Pool(cache, RunSettings(tune=TuneOptions(sources=["torch"])), [None], print)
    slot = pool.slots[0]
    slot.worker = Supervised(
        finish_two_report_one, (str(cache), keys, str(flag)), name="finish-two-report-one"
    )
    slot.worker.restart()
    deadline = time.time() + 120
    while not flag.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert flag.exists()
    pool._abort()
    assert [(r.key, r.status) for r in pool.results] == [(k, "tuned") for k in keys]
    assert [r["key"] for r in read_journal(journal_path(cache))] == [str(k) for k in keys]
    assert slot.done and slot.worker.child is None  # killed, its pipe closed


def commit_then_die(conn, store_path: str, key: GemmKey) -> None:
    """A tune-all worker that tunes and commits its problem, then dies before reporting it."""
    from tuner.tuning.tune import tune

    conn.send(("ready", fingerprint().device_class))
    conn.send(("start", (key, False)))
    outcome = tune(key, options=TuneOptions(sources=["torch"], budget_s=0.01))
    for m in outcome.measurements:
        conn.send(("measurement", m.to_row()))
    with Store(store_path) as store:
        store.save_run(outcome.measurements, outcome.winner)
    os._exit(3)


def test_a_worker_that_dies_after_committing_its_problem_leaves_it_tuned(tmp_path):
    """A worker that died between committing its run and reporting it: the problem is tuned,
    its stored winner kept (not recorded failed, nor overwritten by a lesser verdict)."""
    from tuner.tuning.supervisor import Supervised

    key = GemmKey(m=2, n=8, k=8, dtype="f32", out_dtype="f32")
    cache = tmp_path / "c.db"
    pool = _Pool(cache, RunSettings(tune=TuneOptions(sources=["torch"])), [None], print)
    slot = pool.slots[0]
    slot.worker = Supervised(commit_then_die, (str(cache), key), name="commit-then-die")
    slot.worker.restart()
    slot.child.join(timeout=120)
    pool._drain(slot)
    pool.stop.set()  # no replacement worker
    pool._on_exit(slot)
    assert [(r.key, r.status) for r in pool.results] == [(key, "tuned")]
    with Store(cache) as store:
        stored = store.winner(pool.results[0].device_class, str(key))
    assert stored is not None and stored.to_row() == pool.results[0].winner
    assert [r["status"] for r in read_journal(journal_path(cache))] == ["tuned"]


def die_at_start(conn) -> None:
    """A tune-all worker whose start fails (a broken GPU, an import that raises)."""
    sys.exit(3)


def test_a_worker_that_cannot_start_is_left_out_and_the_others_go_on(tmp_path):
    """A slot whose worker dies twice before it is ready takes no more problems; the run goes
    on with the others. Where no worker is left, the run stops and says why, its problems not
    started; no exception escapes either way."""
    from tuner.offline.tune_all import STOPPED_NO_WORKER
    from tuner.tuning.supervisor import Supervised

    keys = [GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (1, 2, 3)]
    settings = RunSettings(tune=TuneOptions(sources=["torch"], budget_s=0.01))
    notices: list[str] = []

    def emit(event) -> None:
        if event[0] == "notice":
            notices.append(event[1])

    pool = _Pool(tmp_path / "two.db", settings, [None, None], emit)
    pool.slots[1].worker = Supervised(die_at_start, (), name="die-at-start")
    summary = pool.run(keys, set())
    assert [r.status for r in summary.results] == ["tuned"] * 3
    assert {r.worker for r in summary.results} == {0} and summary.stopped == ""
    assert notices == ["worker 1 failed to start twice (exit code 3): its device takes no more "
                       "problems"]  # fmt: skip

    pool = _Pool(tmp_path / "one.db", settings, [None], emit)
    pool.slots[0].worker = Supervised(die_at_start, (), name="die-at-start")
    summary = pool.run(keys, set())
    assert summary.results == [] and summary.not_started == keys
    assert summary.stopped == STOPPED_NO_WORKER and notices[-1] == "stopping: no worker could start"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "{bad}"), "m.yaml: missing fields: intermediate_size, num_heads,"),
        ((), "nothing to tune: give --model, --config, --tunableop, --misses or --queue"),
        (("--misses", "--op", "mlp"), "--op must be 'gemm' or 'sdpa', got 'mlp'"),
        (("--queue", "5"), "--queue needs the fleet service: set TUNER_SERVER"),
    ],
)
def test_user_mistakes_get_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
    from tuner.cli import main

    bad = tmp_path / "m.yaml"
    bad.write_text("name: X\nhidden_size: 64\n")
    argv = [a.format(bad=bad) for a in args]
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.delenv("TUNER_SERVER", raising=False)
    monkeypatch.setattr(
        sys, "argv", ["tuner", "tune-all", *argv, "--cache", str(tmp_path / "c.db")]
    )
    with pytest.raises(SystemExit) as exit_:
        main.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("server", "message"),
    [(None, "--queue needs the fleet service: set TUNER_SERVER"),
     ("notaurl", "--server/TUNER_SERVER 'notaurl': expected an http:// or https:// URL")],
)  # fmt: skip
def test_a_queue_with_no_service_to_claim_from_makes_no_cache(
    tmp_path, monkeypatch, capsys, server, message
):
    """--queue with $TUNER_SERVER unset or no URL is refused (exit 2) before the cache is made
    or the device saved in it: no new cache (nor --out's folder) is left behind, as an exit 2
    touches none."""
    from tuner.cli import main

    cache, out = tmp_path / "new" / "c.db", tmp_path / "report"
    monkeypatch.delenv("TUNER_SERVER", raising=False)
    if server is not None:
        monkeypatch.setenv("TUNER_SERVER", server)
    monkeypatch.setattr(sys, "argv", ["tuner", "tune-all", "--queue", "5", "--cache", str(cache),
                                      "--out", str(out)])  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err
    assert not cache.exists() and not cache.parent.exists() and not out.exists()


def test_fleet_queue_keys_are_tuned_and_completed_on_the_service(tmp_path):
    """Misses reported by a host reach the service's queue; tune-all --queue claims them over
    real HTTP, tunes them and completes the lease; the service then serves their winners."""
    from server.live import ThreadServer

    fp = fingerprint()
    keys = [
        GemmKey(m=3, n=40, k=24, layout="nt", dtype="f32", out_dtype="f32", align=4),
        GemmKey(m=12, n=16, k=8, dtype="f32", out_dtype="f32"),
    ]
    with ThreadServer(tmp_path / "fleet.db") as srv:
        host = srv.client("host-b", "submit")
        assert host.report_misses(fp, [(str(k), 3) for k in keys]) == 2
        env = {"TUNER_SERVER": srv.url, "TUNER_TOKEN": srv.token("tuner-worker", "submit")}
        p = subprocess.run(
            [sys.executable, "-m", "tuner", "tune-all", "--queue", "10", "--source", "torch",
             "--budget", "0.02"],
            env=os.environ | env | {"TUNER_CACHE": str(tmp_path / "c.db"), "COLUMNS": "200"},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        assert "fleet queue: 2 keys leased" in p.stdout
        assert re.search(r"fleet queue: lease [0-9a-f]{32} completed: 2 done, 0 requeued, "
                         r"0 failed, \d+ measurements accepted\n", p.stdout), p.stdout  # fmt: skip
        for k in keys:
            served = host.winner(fp.device_class, str(k), fp.version_tag)
            assert served is not None and served["source"] == "torch", served
        assert {row["state"] for row in host.queue(device_class=fp.device_class)} == {"done"}
        for extra, line in (
            (
                (),
                "fleet queue: nothing leased (no queued keys for this device), nothing to complete",
            ),
            (("--dry-run",), "fleet queue: not consulted (--dry-run claims no keys"),
        ):
            p = subprocess.run(
                [sys.executable, "-m", "tuner", "tune-all", "--queue", "10", *extra],
                env=os.environ | env | {"TUNER_CACHE": str(tmp_path / "c.db"), "COLUMNS": "200"},
                capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            assert p.returncode == 0 and line in p.stdout, p.stdout + p.stderr


@pytest.mark.cpu_host
def test_a_problem_left_unfinished_stays_a_miss_and_goes_back_to_the_fleets_queue(tmp_path):
    """A queued and missed problem cut off by its limit keeps its baseline here, but the run
    did not finish it: the service gets it back in its queue, and the miss stays recorded, so
    a later --queue or --misses run tunes it whole."""
    from server.live import ThreadServer

    fp = fingerprint()
    slow = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")  # seconds in the interpreter
    cache = tmp_path / "c.db"
    with Store(cache) as store:
        store.save_device(fp)
        store.record_misses(fp.device_class, [str(slow)], count=3)
    with ThreadServer(tmp_path / "fleet.db") as srv:
        host = srv.client("host-b", "submit")
        assert host.report_misses(fp, [(str(slow), 3)]) == 1
        env = {"TUNER_SERVER": srv.url, "TUNER_TOKEN": srv.token("tuner-worker", "submit")}
        p = subprocess.run(
            [sys.executable, "-m", "tuner", "tune-all", "--queue", "10", "--misses", "--source",
             "triton_gemm", "--budget", "0.01", "--problem-timeout", "3"],
            env=os.environ | env | {"TUNER_CACHE": str(cache), "TRITON_INTERPRET": "1",
                                    "COLUMNS": "200"},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert p.returncode == 1, p.stdout + p.stderr
        assert "; its baseline kept" in p.stdout
        assert "completed: 0 done, 1 requeued, 0 failed" in p.stdout, p.stdout
        assert {row["state"] for row in host.queue(device_class=fp.device_class)} == {"queued"}
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(slow)).source == "torch"  # served meanwhile
        assert [m["key"] for m in store.misses(fp.device_class)] == [str(slow)]


@pytest.mark.cpu_host
def test_a_leased_key_that_op_left_out_is_completed_where_a_finished_run_tuned_it(tmp_path):
    """--op gemm leaves a leased attention key untuned; a finished run of before tuned it here,
    so the lease completes it as done rather than handing it back to the queue."""
    from server.live import ThreadServer
    from tuner.tuning.engine import tune

    fp = fingerprint()
    gemm = GemmKey(m=12, n=16, k=8, dtype="f32", out_dtype="f32")
    attn = SdpaKey(1, 4, 2, 8, 8, 16, dtype="f32")
    cache = tmp_path / "c.db"
    outcome = tune(attn, options=TuneOptions(sources=["torch_sdpa"], budget_s=0.01))
    with Store(cache) as store:
        store.save_device(fp)
        store.save_run(outcome.measurements, outcome.winner)
    with ThreadServer(tmp_path / "fleet.db") as srv:
        host = srv.client("host-b", "submit")
        assert host.report_misses(fp, [(str(gemm), 3), (str(attn), 3)]) == 2
        env = {"TUNER_SERVER": srv.url, "TUNER_TOKEN": srv.token("tuner-worker", "submit")}
        p = subprocess.run(
            [sys.executable, "-m", "tuner", "tune-all", "--queue", "10", "--op", "gemm",
             "--source", "torch", "--budget", "0.02"],
            env=os.environ | env | {"TUNER_CACHE": str(cache), "COLUMNS": "200"},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        assert "completed: 2 done, 0 requeued, 0 failed" in p.stdout, p.stdout
        assert {row["state"] for row in host.queue(device_class=fp.device_class)} == {"done"}


def test_a_broken_local_source_fails_before_any_fleet_key_is_leased(tmp_path):
    from server.live import ThreadServer

    fp = fingerprint()
    key = GemmKey(m=12, n=16, k=8, dtype="f32", out_dtype="f32")
    bad = tmp_path / "m.yaml"
    bad.write_text("name: X\nhidden_size: 64\n")
    with ThreadServer(tmp_path / "fleet.db") as srv:
        host = srv.client("host-b", "submit")
        host.report_misses(fp, [(str(key), 1)])
        env = {"TUNER_SERVER": srv.url, "TUNER_TOKEN": srv.token("tuner-worker", "submit")}
        p = subprocess.run(
            [sys.executable, "-m", "tuner", "tune-all", "--queue", "10", "--model", str(bad)],
            env=os.environ | env | {"TUNER_CACHE": str(tmp_path / "c.db"), "COLUMNS": "200"},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert p.returncode == 2 and "intermediate_size" in p.stderr
        assert {row["state"] for row in host.queue(device_class=fp.device_class)} == {"queued"}


def _worker_of(parent: int, cache: Path) -> int:
    """The tune-all worker among a process's children: the one that holds the cache open (not
    multiprocessing's resource tracker, nor a compile-pool process)."""
    for pid in _children(parent):
        try:
            if any(os.readlink(fd) == str(cache) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no worker process under {parent}")


@pytest.mark.cpu_host
def test_a_worker_that_dies_mid_problem_is_recorded_and_replaced(tmp_path):
    """What a segfaulting kernel does to a worker: here a real SIGKILL of the worker process."""
    cache = tmp_path / "c.db"
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "problems:\n"
        "  - {op: gemm, m: 3072, n: 3072, k: 3072, dtype: f32}\n"  # seconds: the fp64 reference
        "  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n"
        "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n"
    )
    args = ("--config", str(listed), "--source", "torch", "--budget", "0.01")
    p = start(*args, "--out", str(tmp_path / "r"), cache=cache)
    seen = ""
    while "worker 0 ready" not in seen:
        line = p.stdout.readline()
        assert line, seen
        seen += line
    time.sleep(1.0)  # the first problem is running now
    os.kill(_worker_of(p.pid, cache), signal.SIGKILL)
    out = seen + p.communicate(timeout=180)[0]
    assert p.returncode == 1, out
    rows = {r["label"]: r for r in json.loads((tmp_path / "r" / "report.json").read_text())["rows"]}
    assert rows["list.yaml[0]"]["status"] == "failed"
    assert "worker died (exit code -9)" in rows["list.yaml[0]"]["error"]
    assert rows["list.yaml[1]"]["status"] == rows["list.yaml[2]"]["status"] == "tuned"
    assert out.count("ready on") == 2  # the replacement


def test_a_fleet_service_that_refuses_the_claim_fails_in_one_line(tmp_path):
    from server.live import ThreadServer

    with ThreadServer(tmp_path / "fleet.db") as srv:
        env = {"TUNER_SERVER": srv.url, "TUNER_TOKEN": "tnr_0123456789ab_nope"}
        p = subprocess.run(
            [sys.executable, "-m", "tuner", "tune-all", "--queue", "3"],
            env=os.environ | env | {"TUNER_CACHE": str(tmp_path / "c.db")},
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.startswith(f"error: fleet service {srv.url}: HTTP 401")
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


# --- tuning that finishes ----------------------------------------------------------------------


def _rec(key: GemmKey, status: str, seconds: float) -> dict:
    return {"key": str(key), "status": status, "seconds": seconds, "device_class": "cpu-x"}


def test_earlier_failures_run_last_longest_last_and_stop_after_the_retries():
    a, b, c, d, e = (
        GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (8, 16, 24, 32, 40)
    )
    journal = [
        _rec(a, "timeout", 200.0),
        _rec(b, "failed", 3.0),
        _rec(c, "timeout", 150.0),
        _rec(c, "tuned", 20.0),  # a success clears c's failures
        _rec(e, "timeout", 90.0),
        _rec(e, "timeout", 95.0),
        _rec(e, "timeout", 99.0),
    ]
    from tuner.offline.journal import order

    got = order([a, b, c, d, e], journal, "cpu-x", retries=2)
    assert got.todo == [c, d, b, a]  # fresh ones first in their order, then b (3 s), a (200 s)
    assert got.given_up == [(e, 3)]
    assert order([a, b, c, d, e], journal, "cpu-x", retries=0).todo == [c, d]


@pytest.mark.cpu_host
def test_a_timed_out_problem_keeps_its_baseline_and_is_retried_last(tmp_path):
    """The Triton candidate of a 512^3 GEMM runs for seconds in the interpreter (a GPU-less
    host's; on a GPU it takes milliseconds): the problem is cut off after its baseline was
    timed, keeps it as its winner, and the next run tunes it again after the others, until it
    has timed out more than --retries times."""
    cache = tmp_path / "c.db"
    listed = tmp_path / "list.yaml"
    slow = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
    listed.write_text(
        "problems:\n"
        "  - {op: gemm, m: 512, n: 512, k: 512, dtype: f32}\n"
        "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n"
    )
    args = ("--config", str(listed), "--source", "triton_gemm", "--budget", "0.01",
            "--problem-timeout", "3", "--retries", "1")  # fmt: skip
    code, out = tune_all(*args, "--out", str(tmp_path / "r"), cache=cache)
    assert code == 1, out
    rows = {r["label"]: r for r in json.loads((tmp_path / "r" / "report.json").read_text())["rows"]}
    kept = rows["list.yaml[0]"]
    assert kept["status"] == "timeout" and kept["source"] == "torch", kept
    assert kept["baseline_us"] > 0 and kept["winner_us"] == kept["baseline_us"]
    assert kept["title"] == "512x512x512 nn f32 (list.yaml[0])"
    assert "timeout 512x512x512 nn f32 (list.yaml[0])" in out and "; its baseline kept" in out
    fp = fingerprint()
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(slow)).source == "torch"  # served meanwhile
    # the next run: the tuned problem is done; the timed-out one is tried once more
    code, out = tune_all(*args, cache=cache)
    assert "1 already tuned, 1 to tune (1 left unfinished by an earlier run)" in out, out
    assert "timeout 512x512x512" in out
    # and then no more: it timed out twice, more than --retries 1
    code, out = tune_all(*args, cache=cache)
    assert "not retried 512x512x512 nn f32 (list.yaml[0]): failed or timed out 2 times" in out
    assert "timeout 512x512x512" not in out


@pytest.mark.cpu_host
def test_an_idle_worker_is_handed_the_first_problem_whose_kernels_are_compiled(tmp_path):
    """A fresh worker takes the first problem at once and waits for its kernels inside, past
    the problem's time limit (its limit starts once they are compiled); after that, an idle
    worker gets the first problem that is compiled, or waits while none is."""
    keys = [GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (1, 2, 3)]
    options = TuneOptions(sources=["torch"], budget_s=0.01)
    compiler = CompilePool(keys, options, "cpu", jobs=1)  # not started: the test compiles
    started: list = []

    def emit(event):
        if event[0] == "start":
            started.append(event[1][1])

    def compiled(key):
        for event in compiler.events[str(key)]:
            event.set()

    def compile_in_this_order():
        deadline = time.time() + 60
        while not started and time.time() < deadline:
            time.sleep(0.02)
        compiled(keys[2])
        time.sleep(3.0)  # longer than the problem's time limit
        compiled(keys[0])
        while len(started) < 2 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        compiled(keys[1])

    marker = threading.Thread(target=compile_in_this_order, daemon=True)
    settings = RunSettings(tune=options, workers=1, problem_timeout_s=2.0)
    pool = _Pool(tmp_path / "c.db", settings, [None], emit, compiler)
    marker.start()
    try:
        summary = pool.run(keys, set())
    finally:
        compiler.close()
    assert started == [keys[0], keys[2], keys[1]]
    assert [r.status for r in summary.results] == ["tuned"] * 3
    assert summary.results[0].wait_s > 2.5  # waited for its kernels, and was not cut off
    assert summary.idle_s > 0.3  # then idle while keys[1] was the only one left, compiling
    assert summary.start_s is not None and 0 < summary.start_s < summary.wall_s


@pytest.mark.cpu_host
def test_problems_waiting_for_shared_kernels_get_a_first_pass_meanwhile(tmp_path):
    """While the kernels that serve every shape compile (CUTLASS's, once for the run), each
    problem's other candidates are timed and duelled (a first pass, held by the run, not
    stored); once those kernels are built, a second pass times their candidates alone."""
    from planted import SharedMemoized

    # torch's matmul of these takes many times Memoized's copy of its product: a clear win
    keys = [GemmKey(m=m, n=256, k=256, dtype="f32", out_dtype="f32") for m in (128, 129, 130)]
    options = TuneOptions(sources=["shared_memoized"], budget_s=0.01)
    compiler = CompilePool(keys, options, "cpu", jobs=1)  # not started: the test compiles
    seen: list = []

    def emit(event):
        if event[0] in ("start", "parked"):
            seen.append((event[0], keys.index(event[1][1])))

    def compile_own_jobs_then_the_shared_kernels():
        for key in keys:
            compiler.events[str(key)][0].set()
        deadline = time.time() + 60
        while sum(kind == "parked" for kind, _ in seen) < len(keys) and time.time() < deadline:
            time.sleep(0.02)
        for key in keys:
            compiler.events[str(key)][1].set()

    registry.register(SharedMemoized())  # the worker registers the run-time sources too
    cache = tmp_path / "c.db"
    pool = _Pool(cache, RunSettings(tune=options, workers=1), [None], emit, compiler)
    builder = threading.Thread(target=compile_own_jobs_then_the_shared_kernels, daemon=True)
    builder.start()
    try:
        summary = pool.run(keys, set())
    finally:
        compiler.close()
        registry.unregister("shared_memoized")
    firsts = [("start", i) for i in range(3)]
    assert seen[:6] == [e for i in range(3) for e in (firsts[i], ("parked", i))], seen
    assert seen[6:] == firsts  # the second passes, in the run's order
    assert [r.status for r in summary.results] == ["tuned"] * 3
    assert all(0 < r.first_pass_s < r.seconds for r in summary.results)  # both passes' times
    fp = fingerprint()
    with Store(cache) as store:
        for key in keys:
            measured = store.measurements(fp.device_class, str(key))
            assert sorted(m.source for m in measured) == ["shared_memoized", "torch"]
            assert len({m.run_id for m in measured}) == 1  # one problem, one run
            # the second pass duelled it (faster in its trial); the verdict is the clock's
            assert "confirmation:" in next(m.error for m in measured if m.is_baseline is False)
    journal = read_journal(journal_path(cache))
    assert len(journal) == 3 and all(rec["first_pass_s"] > 0 for rec in journal)  # a problem's


def two_passes(
    cache: Path,
    made: list[Source],
    settings: RunSettings,
    *,
    stop: int = 0,
    built: bool = True,
    retune: bool = False,
) -> tuple[Result, dict, str]:
    """Tune one small problem in two passes: its own job compiled, its shared kernels "built" the
    moment its first pass ends (unless not ``built``). ``stop``: Ctrl-C presses, made once the
    first pass has ended where nothing is built, else as the second pass starts; ``retune``: the
    problem is one the CLI hands to be tuned again (an earlier run left it unfinished). Returns its
    result, the first pass's verdict (the clock's: memoized, or torch where it lost its duel) and
    why the run stopped ("" where it finished)."""
    key = GemmKey(m=4, n=48, k=64, dtype="f32", out_dtype="f32")
    compiler = CompilePool([key], settings.tune, "cpu", jobs=1)  # not started: the test compiles
    compiler.events[str(key)][0].set()
    verdict = {}

    def emit(event):
        if event[0] == "parked":
            verdict.update(pool.parked[str(key)].outcome.winner.to_row())
            if built:
                compiler.events[str(key)][1].set()
            else:
                pool.interrupts += stop  # what the SIGINT handler does
        elif event[0] == "start" and verdict and built:  # the second pass
            pool.interrupts += stop

    for source in made:
        registry.register(source)
    pool = _Pool(cache, settings, [None], emit, compiler)
    try:
        summary = pool.run([key], {str(key)} if retune else set())
    finally:
        compiler.close()
        for source in made:
            registry.unregister(source.name)
    (result,) = summary.results
    return result, verdict, summary.stopped


@pytest.mark.cpu_host
def test_a_second_pass_cut_off_by_its_limit_keeps_the_first_pass_verdict(tmp_path):
    """Run again, into a new cache, where the host disturbed the first pass's duel
    (``first_judged``): the engine then keeps torch, by design."""
    from planted import Memoized, SlowSharedMemoized

    options = TuneOptions(sources=["memoized", "slow_shared_memoized"], budget_s=0.01)
    settings = RunSettings(tune=options, workers=1, problem_timeout_s=2.0)
    caches = iter(tmp_path / f"c{attempt}.db" for attempt in range(ATTEMPTS))

    def run() -> tuple[Path, Result, Measurement]:
        cache = next(caches)
        result, _, _ = two_passes(cache, [Memoized(), SlowSharedMemoized()], settings)
        with Store(cache) as store:
            (memoized,) = [m for m in store.measurements(fingerprint().device_class,
                           str(result.key)) if m.source == "memoized"]  # fmt: skip
        return cache, result, memoized

    cache, result, kept = first_judged(run, lambda run: undisturbed(run[2].error))
    assert result.status == "timeout" and result.winner["source"] == "memoized"
    # both passes' times, in the result and its journal line
    assert 0 < result.first_pass_s < result.seconds
    (rec,) = read_journal(journal_path(cache))
    assert rec["first_pass_s"] == result.first_pass_s and rec["seconds"] == result.seconds
    with Store(cache) as store:
        assert store.winner(fingerprint().device_class, str(result.key)).source == "memoized"
    assert "confirmation:" in kept.error and "kept" in kept.error  # the first pass's duel


@pytest.mark.cpu_host
def test_a_run_stopped_between_a_problems_passes_keeps_its_first_pass_verdict(tmp_path):
    """Ctrl-C (or the run's time limit) while the shared kernels still compile: the problems
    whose first pass ended keep its verdict, stored and served meanwhile (``partial``), and a
    later run tunes them again without counting a failure against --retries."""
    from planted import Memoized, SharedMemoized

    options = TuneOptions(sources=["memoized", "shared_memoized"], budget_s=0.01)
    settings = RunSettings(tune=options, workers=1, retries=0)
    cache = tmp_path / "c.db"
    result, verdict, stopped = two_passes(
        cache, [Memoized(), SharedMemoized()], settings, stop=1, built=False
    )
    key = result.key
    assert stopped == "ctrl-c"
    assert result.status == "partial" and result.winner == verdict
    assert result.error == "the run stopped before its second pass; the first pass's verdict kept"
    fp = fingerprint()
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(key)).to_row() == verdict  # served meanwhile
    journal = read_journal(journal_path(cache))
    assert [rec["status"] for rec in journal] == ["partial"] and journal[0]["first_pass_s"] > 0
    # the next run tunes it again, even with --retries 0: the stop was not the problem's fault
    assert kept_after_unfinished(journal, fp) == {str(key)}
    assert order([key], journal, fp.device_class, retries=0).todo == [key]
    with Store(cache) as store:
        assert pending(store, fp, [key], journal=journal) == [key]


@pytest.mark.cpu_host
def test_a_forced_retune_cut_short_never_replaces_a_finished_runs_winner(tmp_path):
    """--force re-tunes a problem a finished run tuned; stopped between its passes, the verdict
    of its first pass (which never timed the shared kernels) does not replace that winner, nor
    does the next run's, cut short again: the journal says which run's winner it is."""
    from planted import Memoized, SharedMemoized

    options = TuneOptions(sources=["memoized", "shared_memoized"], budget_s=0.01)
    cache = tmp_path / "c.db"
    made = [Memoized(), SharedMemoized()]
    finished, _, _ = two_passes(cache, made, RunSettings(tune=options, workers=1))
    assert finished.status == "tuned"
    forced = RunSettings(tune=options, workers=1, force=True)
    # the forced run, then a plain one that tunes again what the forced one left unfinished
    for settings, again in ((forced, False), (RunSettings(tune=options, workers=1), True)):
        result, verdict, _ = two_passes(cache, made, settings, stop=1, built=False, retune=again)
        assert result.status == "partial" and result.winner == finished.winner != verdict
        assert result.error.endswith("before its second pass; the earlier run's winner kept")
        with Store(cache) as store:
            held = store.winner(fingerprint().device_class, str(result.key))
        assert held.to_row() == finished.winner


def test_a_kept_verdict_replaces_only_an_unfinished_runs_winner_and_only_a_slower_one(tmp_path):
    journal = tmp_path / "journal.jsonl"
    held = Winner(device_class="gpu", key="gemm:m=1", source="memoized", params={},
                  median_us=1.0, baseline_us=2.0, versions="v1", run_id="kept")  # fmt: skip
    append_journal(journal, {"key": held.key, "device_class": "gpu", "status": "partial",
                             "run_id": "kept"})  # fmt: skip
    kept = kept_runs(read_journal(journal))
    slower, faster = (
        replace(held, run_id="new", median_us=2.0),
        replace(held, run_id="new", median_us=0.5),
    )
    assert outranks(held, slower, kept) and not outranks(held, faster, kept)
    finished = replace(held, run_id="finished", median_us=3.0)
    assert outranks(finished, faster, kept)  # a finished run's winner stays, whatever its time
    assert not outranks(replace(finished, versions="v0"), slower, kept)  # stale: replaced
    assert not outranks(replace(finished, launch="graph"), slower, kept)  # another launch mode


@pytest.mark.cpu_host
def test_a_second_pass_aborted_by_a_second_ctrl_c_keeps_the_first_pass_verdict(tmp_path):
    from planted import Memoized, SlowSharedMemoized

    options = TuneOptions(sources=["memoized", "slow_shared_memoized"], budget_s=0.01)
    cache = tmp_path / "c.db"
    made = [Memoized(), SlowSharedMemoized()]  # its second pass: slow on first sight
    result, verdict, stopped = two_passes(cache, made, RunSettings(tune=options, workers=1), stop=2)
    assert stopped == "ctrl-c"
    assert (result.status, result.winner) == ("partial", verdict)
    assert result.error == "the run aborted its second pass; the first pass's verdict kept"
    with Store(cache) as store:
        assert store.winner(fingerprint().device_class, str(result.key)).to_row() == verdict


@pytest.mark.cpu_host
def test_a_first_pass_counts_its_wait_for_its_own_kernels_in_its_time(tmp_path):
    """A worker's first problem is handed out while its own job compiles: the worker waits for
    it, then runs a first pass (the shared kernels still compiling). That wait counts as the
    engine's own does: in the problem's time and its first pass's, as compiling."""
    from planted import SharedMemoized

    key = GemmKey(m=128, n=256, k=256, dtype="f32", out_dtype="f32")
    options = TuneOptions(sources=["shared_memoized"], budget_s=0.01)
    compiler = CompilePool([key], options, "cpu", jobs=1)  # not started: the test compiles
    own, shared = compiler.events[str(key)]
    started, parked = threading.Event(), threading.Event()
    wait_s = 3.0

    def emit(event):
        if event[0] == "start":
            started.set()
        elif event[0] == "parked":
            parked.set()

    def compile_own_job_then_the_shared_kernels():
        if started.wait(60):
            time.sleep(wait_s)
        own.set()
        parked.wait(60)
        shared.set()

    registry.register(SharedMemoized())
    cache = tmp_path / "c.db"
    pool = _Pool(cache, RunSettings(tune=options, workers=1), [None], emit, compiler)
    builder = threading.Thread(target=compile_own_job_then_the_shared_kernels, daemon=True)
    builder.start()
    try:
        summary = pool.run([key], set())
    finally:
        compiler.close()
        registry.unregister("shared_memoized")
    (r,) = summary.results
    assert r.status == "tuned" and r.first_pass_s is not None, r
    assert wait_s <= r.wait_s <= r.first_pass_s < r.seconds, r
    assert sum(r.phases.values()) == pytest.approx(r.seconds, rel=0.05), r
    assert r.phases["compile"] >= wait_s


class Deadly(GemmKey):
    """A key whose unpickling ends the process (exit code 9): a worker killed right after it
    took its task, before it said "start"."""

    __slots__ = ()

    def __reduce__(self):
        return (os._exit, (9,))


@pytest.mark.cpu_host
@pytest.mark.parametrize("first", [True, False], ids=["first-pass", "whole"])
def test_a_worker_killed_before_it_announced_its_problem_fails_it_and_the_run_ends(tmp_path, first):
    """The run knows what it handed each worker: a worker that dies before it announced its
    task (a first pass, the run waiting for it to come back, or a whole problem) fails that
    problem as any whose worker died, and the run ends."""
    key = Deadly(m=4, n=8, k=8, dtype="f32", out_dtype="f32")
    options = TuneOptions(sources=["torch"], budget_s=0.01)
    compiler = CompilePool([key], options, "cpu", jobs=1)  # not started: the test compiles
    own, shared = compiler.events[str(key)]
    own.set()
    if not first:
        shared.set()
    pool = _Pool(tmp_path / "c.db", RunSettings(tune=options, workers=1), [None], print, compiler)
    watchdog = threading.Timer(60, pool.stop.set)  # a run that would wait forever
    watchdog.start()
    try:
        summary = pool.run([key], set())
    finally:
        watchdog.cancel()
        compiler.close()
    assert [r.status for r in summary.results] == ["failed"], summary
    assert "worker died (exit code 9) before it started this problem" in summary.results[0].error
    assert not pool.stop.is_set() and summary.not_started == []


def test_a_replacement_worker_is_handed_a_problem_while_its_kernels_compile(tmp_path):
    """A worker that replaces a dead one is fresh, as the run's first ones are: it takes the
    first problem while nothing is compiled and waits for its kernels inside, instead of idling."""
    keys = [GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32") for m in (1, 2)]
    options = TuneOptions(sources=["torch"], budget_s=0.01)
    compiler = CompilePool(keys, options, "cpu", jobs=1)  # not started: nothing compiles
    settings = RunSettings(tune=options, workers=1)
    pool = _Pool(tmp_path / "c.db", settings, [None], print, compiler)
    pool.backlog, pool.rank = list(keys), {str(k): i for i, k in enumerate(keys)}
    slot = pool.slots[0]
    try:
        assert pool._pick(slot.fresh) == (0, True)
        slot.fresh = False  # it started a problem, then died
        assert pool._pick(slot.fresh) is None
        pool._replace(slot)
        assert slot.fresh and pool._pick(slot.fresh) == (0, True)
    finally:
        pool._kill_all()
        compiler.close()


def ready_then_die_once(conn, flag: str, *args) -> None:
    """A tune-all worker that says "ready" and dies idle the first time it starts (``flag``
    absent), as one the OOM killer takes between problems; a worker like any other after."""
    if not os.path.exists(flag):
        Path(flag).touch()
        conn.send(("ready", fingerprint().device_class))
        os._exit(5)
    worker_main(conn, *args)


def test_a_problem_handed_to_a_worker_already_dead_goes_to_its_replacement(tmp_path):
    """A worker that died idle never got the problem the run then sends it: the problem is not
    failed for that death, the worker's replacement tunes it."""
    from tuner.tuning.supervisor import Supervised

    key = GemmKey(m=2, n=8, k=8, dtype="f32", out_dtype="f32")
    settings = RunSettings(tune=TuneOptions(sources=["torch"], budget_s=0.01), workers=1)
    pool = _Pool(tmp_path / "c.db", settings, [None], print)
    slot = pool.slots[0]
    args = (str(tmp_path / "died"), *slot.worker.args)
    slot.worker = Supervised(ready_then_die_once, args, name="dies-idle")
    pool.backlog, pool.rank, pool.started = [key], {str(key): 0}, time.perf_counter()
    slot.worker.restart()
    pool._on_message(slot, slot.child.conn.recv())  # "ready"
    slot.child.join(timeout=60)  # dead before the run hands it anything
    watchdog = threading.Timer(120, pool.stop.set)
    watchdog.start()
    try:
        while not all(s.done for s in pool.slots):
            pool._step(pool.started)
    finally:
        watchdog.cancel()
        pool._kill_all()
    assert [(r.key, r.status) for r in pool.results] == [(key, "tuned")], pool.results
    assert not pool.stop.is_set()


@pytest.mark.cpu_host
@pytest.mark.parametrize(
    ("shared", "said"),
    [
        ("SharedRaises", "second pass: RuntimeError: shared_raises cannot tell"),
        ("SharedKills", "worker died (exit code -9) while tuning this problem"),
    ],
)
def test_a_second_pass_that_crashes_keeps_the_first_pass_verdict(tmp_path, shared, said):
    """A second pass that raises, or whose worker dies, fails the problem as a timeout cuts it:
    the first pass's verdict is stored and served, the error says what happened, a later run
    tunes it again."""
    import planted

    from tuner.offline import report

    made = [planted.Memoized(), getattr(planted, shared)()]
    options = TuneOptions(sources=[s.name for s in made], budget_s=0.01)
    cache = tmp_path / "c.db"
    result, verdict, _ = two_passes(cache, made, RunSettings(tune=options, workers=1))
    key = result.key
    assert result.status == "failed" and result.winner == verdict, result
    assert said in result.error and "the first pass's verdict kept" in result.error
    assert 0 < result.first_pass_s < result.seconds
    (rec,) = read_journal(journal_path(cache))
    assert (rec["status"], rec["error"]) == ("failed", result.error)
    assert rec["run_id"] == result.winner["run_id"]
    fp = fingerprint()
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(key)).to_row() == verdict
        (row,) = report.build(store, fp, journal=[rec]).rows
    assert (row.status, row.candidate, row.error) == ("failed", verdict["candidate"], result.error)


@pytest.mark.cpu_host
def test_a_problems_limit_holds_over_both_its_passes(tmp_path):
    """Each pass takes about 4 s, within the problem's 6 s limit: the second gets what the first
    left, is cut off before its build ends, and the first pass's verdict stands."""
    from planted import Memoized, SharedSlowToBuild, SlowToBuild

    options = TuneOptions(sources=["memoized", "slow_to_build", "shared_slow_to_build"],
                          budget_s=0.01)  # fmt: skip
    settings = RunSettings(tune=options, workers=1, problem_timeout_s=6.0)
    made = [Memoized(), SlowToBuild(), SharedSlowToBuild()]
    r, verdict, _ = two_passes(tmp_path / "c.db", made, settings)
    assert r.status == "timeout" and r.winner == verdict, r
    assert "limit of 6 s over its two passes" in r.error, r.error
    assert r.first_pass_s >= SlowToBuild.build_s
    assert r.seconds - r.first_pass_s < SlowToBuild.build_s  # cut before its build ended


def test_a_first_pass_that_used_up_its_problems_limit_gets_no_second(tmp_path):
    """No time left for a second pass: the first pass's verdict stands, recorded as a timeout
    (as a second pass cut off leaves it; a later run tunes the problem again)."""
    from planted import Memoized, SharedMemoized

    key = GemmKey(m=4, n=48, k=64, dtype="f32", out_dtype="f32")
    options = TuneOptions(sources=["memoized", "shared_memoized"], budget_s=0.01)
    settings = RunSettings(tune=options, problem_timeout_s=5.0)
    cache, fp, events = tmp_path / "c.db", fingerprint(), []
    made = [Memoized(), SharedMemoized()]
    for source in made:
        registry.register(source)
    try:
        with Store(cache) as store:
            first = _tune_one(Task(key, retune=False, first=True), store, fp, settings, 0,
                              lambda m: None, None)  # fmt: skip
    finally:
        for source in made:
            registry.unregister(source.name)
    pool = _Pool(cache, settings, [None], events.append)
    pool.rank = {str(key): 0}
    slot = pool.slots[0]
    slot.device_class, slot.started = fp.device_class, time.perf_counter() - 6.0  # 6 s ago
    pool._park(slot, first)
    (r,) = pool.results
    assert r.status == "timeout" and r.winner == first.winner, r
    assert (
        "its first pass used up the per-problem limit of 5 s" in r.error
        and r.first_pass_s == first.seconds
    )
    assert pool.backlog == [] and not pool.parked and [e[0] for e in events] == ["result"]
    with Store(cache) as store:
        assert store.winner(fp.device_class, str(key)).to_row() == first.winner


class Delayed(Source):
    """Two challengers that differ only in a host delay: the slower one listed first."""

    name, op = "delayed", "gemm"

    def candidates(self, key, device):
        return [{"delay_ms": 5}, {"delay_ms": 0}]

    def build(self, key, params):
        delay = params["delay_ms"] / 1e3

        def run(a, b, out=None):
            time.sleep(delay)
            return torch.matmul(a, b, out=out)

        return run


def test_a_forced_retune_times_what_was_fastest_in_the_cache_first(tmp_path):
    """``--force`` re-tunes with the cache's earlier times (here both challengers' probes, both
    cut): the faster one, listed second, goes first the second time."""
    key = GemmKey(m=8, n=16, k=32, dtype="f32", out_dtype="f32")
    settings = RunSettings(tune=TuneOptions(budget_s=0.005, sources=["delayed"]), force=True)
    fp = fingerprint()
    registry.register(Delayed())
    try:
        with Store(tmp_path / "c.db") as store:
            orders = []
            for _ in range(2):
                seen: list[str] = []
                _tune_one(Task(key, retune=False), store, fp, settings, 0,
                          lambda m, seen=seen: seen.append(m.candidate), None)  # fmt: skip
                orders.append([c for c in seen if c.startswith("delayed")])
    finally:
        registry.unregister("delayed")
    slow, fast = (candidate_name("delayed", {"delay_ms": d}) for d in (5, 0))
    assert orders == [[slow, fast], [fast, slow]]


def test_a_problem_that_cannot_be_tuned_here_is_a_failed_result(tmp_path, monkeypatch):
    """A problem past this device's memory fails before anything is allocated or tuned; one
    whose tuning raises (the baseline failed, the inputs cannot be made) fails with the error."""
    import tuner.tuning.tune as tuning

    def broken(key, **kwargs):
        raise RuntimeError(f"the baseline failed on {key}")

    monkeypatch.setattr(tuning, "tune", broken)
    settings = RunSettings(tune=TuneOptions(budget_s=0.005, sources=["torch"]))
    huge = GemmKey(m=1 << 20, n=1 << 20, k=4, dtype="f32", out_dtype="f32")  # a 4 TiB output
    small = GemmKey(m=8, n=16, k=32, dtype="f32", out_dtype="f32")
    with Store(tmp_path / "c.db") as store:
        results = [_tune_one(Task(key, retune=False), store, fingerprint(), settings, i,
                             lambda m: None, None) for i, key in enumerate((huge, small))]  # fmt: skip
    assert [r.status for r in results] == ["failed", "failed"]
    assert results[0].error.startswith("its operands take 4096.0 GiB, more than this")
    assert results[1].error == f"RuntimeError: the baseline failed on {small}"


def test_a_forced_dry_run_says_how_many_are_tuned_already(tmp_path, monkeypatch, capsys):
    """--force tunes every problem again; the plan still counts the ones tuned already instead of
    reading "0 already tuned" for a cache that holds them."""
    from tuner.cli import main
    from tuner.tuning.tune import tune

    cache, listed = tmp_path / "c.db", tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: f32}\n"
                      "  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n")  # fmt: skip
    outcome = tune(load_problems(listed)[0], options=TuneOptions(budget_s=0.01, sources=["torch"]))
    with Store(cache) as store:
        store.save_device(fingerprint())
        store.save_run(outcome.measurements, outcome.winner)
    monkeypatch.setenv("COLUMNS", "300")
    for force, plan in (([], "1 already tuned, 1 to tune"),
                        (["--force"], "1 already tuned (--force: tuned again), 2 to tune")):  # fmt: skip
        argv = ["tuner", "tune-all", "-c", str(listed), "--cache", str(cache), "--dry-run", *force]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit_:
            main.main()
        assert exit_.value.code == 0
        assert (
            f"2 distinct problems on {fingerprint().device_class}: {plan}\n"
            in capsys.readouterr().out
        )


def test_a_journal_that_cannot_be_read_is_named_before_anything_is_done(
    tmp_path, monkeypatch, capsys
):
    """Without its journal a run would tune again what is done and retry what gave up: a
    journal in the way (here a folder of its name) is refused up front, naming it, and nothing
    of the run is done."""
    from tuner.cli import main

    cache = tmp_path / "c.db"
    journal_path(cache).mkdir()
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n")
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(
        sys, "argv", ["tuner", "tune-all", "-c", str(listed), "--cache", str(cache)]
    )
    with pytest.raises(SystemExit) as exit_:
        main.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"the tune-all journal {journal_path(cache)} cannot be read (Is a directory)" in err
    assert not winner_keys(cache)


def test_a_journal_that_cannot_be_written_is_said_once_and_the_run_goes_on(
    tmp_path, monkeypatch, capsys
):
    """The cache holds what the run tunes; only the report's times and failures of this run
    are lost with the journal's lines, and the run says so once."""
    from tests.cache.read_only import read_only
    from tuner.cli import main

    cache = tmp_path / "c.db"
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 8, n: 8, k: 8, dtype: f32}\n"
                      "  - {op: gemm, m: 8, n: 16, k: 8, dtype: f32}\n")  # fmt: skip
    journal_path(cache).touch()
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(sys, "argv", ["tuner", "tune-all", "-c", str(listed), "--cache", str(cache),
                                      "--workers", "1"])  # fmt: skip
    with read_only(journal_path(cache)), pytest.raises(SystemExit) as exit_:
        main.main()
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    assert len(winner_keys(cache)) == 2
    said = (out.out + out.err).count(f"journal {journal_path(cache)} not written")
    assert said == 1, out


def test_a_journal_line_cut_short_costs_only_itself(tmp_path):
    """A line cut mid-write (SIGKILL; the disk full, which raises) is ended before the next
    record, so the next record reads whole; the cut one is skipped."""
    from tests.cache.full_disk import file_size_limit

    journal = tmp_path / "j.jsonl"
    append_journal(journal, {"key": "a", "status": "tuned"})
    with journal.open("a") as f:
        f.write('{"key": "torn", "sta')  # a SIGKILL mid-line
    append_journal(journal, {"key": "b", "status": "tuned"})
    with file_size_limit(journal.stat().st_size + 10), pytest.raises(OSError, match="bytes"):
        append_journal(journal, {"key": "cut by the disk", "status": "tuned"})
    append_journal(journal, {"key": "c", "status": "tuned"})
    assert [r["key"] for r in read_journal(journal)] == ["a", "b", "c"]


@pytest.mark.parametrize("line", ["[1, 2]", "null", '{"key": 5, "status": "tuned"}', '{"at": 1}'])
def test_a_journal_line_that_is_no_record_is_named(tmp_path, line):
    """A line edited by hand into JSON that is no record failed the report and the next run
    with a traceback ('list' object has no attribute 'get'); it is named, with its line."""
    journal = tmp_path / "j.jsonl"
    append_journal(journal, {"key": "a", "status": "tuned"})
    with journal.open("a") as f:
        f.write(line + "\n")
    with pytest.raises(ValueError, match=f"{journal}: line 2 is no record of a problem"):
        read_journal(journal)

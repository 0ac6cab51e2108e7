"""The run-wide compile pool: every problem's job once, in the run's order, tile-pruned, in
processes of its own (tuner.tuning.compile_pool)."""

from __future__ import annotations

import json
import os

from tests.tuning.compile_log_source import CompileLog, SharedLog
from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.tuning import compile_pool
from tuner.tuning.compile_pool import CompilePool
from tuner.tuning.engine import TuneOptions
from tuner.tuning.isolation import runtime_sources


def test_the_pool_gets_every_problem_once_in_order_and_prunes_tiles(tmp_path, monkeypatch):
    log = tmp_path / "compiled.jsonl"
    monkeypatch.setenv("TUNER_TEST_COMPILE_LOG", str(log))
    registry.register(CompileLog())
    keys = [GemmKey(m=m, n=256, k=64, dtype="f32", out_dtype="f32") for m in (1, 512, 1, 64)]
    pool = CompilePool(
        keys, TuneOptions(sources=["compile_log"]), "cpu", jobs=1, sources=runtime_sources()
    )
    try:
        pool.start()
        for key in keys:
            compile_pool.wait(pool.events, key, timeout_s=120)
        results = [pool.result(k) for k in keys[:2] + keys[3:]]
    finally:
        pool.close()
        registry.unregister("compile_log")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["key"] for line in lines] == [str(k) for k in (keys[0], keys[1], keys[3])]
    assert lines[0]["tiles"] == [[16, 64], [64, 64]]  # M=1: the 128x256 tile is not compiled
    assert lines[1]["tiles"] == [[16, 64], [64, 64], [128, 256]]
    assert [r.compiled for r in results] == [2, 3, 3]
    assert [r.pruned for r in results] == [{"tile": 1}, {}, {}]
    assert not any(r.errors for r in results)


def test_kernels_shared_by_all_shapes_are_compiled_once_for_the_whole_run(tmp_path, monkeypatch):
    log = tmp_path / "compiled.jsonl"
    monkeypatch.setenv("TUNER_TEST_COMPILE_LOG", str(log))
    registry.register(CompileLog())
    registry.register(SharedLog())
    keys = [GemmKey(m=m, n=256, k=64, dtype="f32", out_dtype="f32") for m in (1, 512, 1, 64)]
    options = TuneOptions(sources=["compile_log", "shared_log"])
    pool = CompilePool(keys, options, "cpu", jobs=1, sources=runtime_sources())
    try:
        pool.start()
        for key in keys:
            compile_pool.wait(pool.events, key, timeout_s=120)
        ready = [pool.ready(k) for k in keys]
        pool.futures[compile_pool.SHARED].result(timeout=120)  # it ends after its last event
        shared = pool.result(compile_pool.SHARED)
        results = [pool.result(k) for k in keys[:2] + keys[3:]]
    finally:
        pool.close()
        registry.unregister("compile_log")
        registry.unregister("shared_log")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    runs = [line["run"] for line in lines if "run" in line]
    assert runs == [  # one call, every distinct problem in the run's order, tile-pruned
        [[str(keys[0]), [[16, 64], [64, 64]]], [str(keys[1]), [[16, 64], [64, 64], [128, 256]]],
         [str(keys[3]), [[16, 64], [64, 64], [128, 256]]]]
    ]  # fmt: skip
    per_problem = [line["key"] for line in lines if "key" in line]
    assert per_problem == [str(k) for k in (keys[0], keys[1], keys[3])]  # compile_log only
    assert ready == [True] * 4
    assert shared is not None and shared.compiled == 8 and not shared.errors
    assert [r.compiled for r in results] == [4, 6, 6]  # both sources' candidates, per problem
    assert [r.pruned for r in results] == [{"tile": 2}, {}, {}]


def test_a_run_whose_sources_share_no_kernels_has_no_shared_job_to_wait_for():
    """--source compile_log (none that shares kernels, though one is registered): every problem's
    shared kernels are ready from the start, so none gets a first pass while nothing compiles."""
    registry.register(SharedLog())
    keys = [GemmKey(m=m, n=256, k=64, dtype="f32", out_dtype="f32") for m in (1, 64)]
    options = TuneOptions(sources=["compile_log"])
    pool = CompilePool(keys, options, "cpu", jobs=1, sources=runtime_sources())
    try:
        pool.start()
        assert all(pool.events[str(k)][1].is_set() for k in keys)  # at once, not once a job ran
        assert compile_pool.SHARED not in pool.futures and pool.result(compile_pool.SHARED) is None
    finally:
        pool.close()
        registry.unregister("shared_log")


def test_waiting_for_a_key_without_a_job_returns_at_once():
    assert compile_pool.wait({}, GemmKey(m=8, n=8, k=8)) < 1.0


def test_compiling_runs_at_a_lower_cpu_priority_than_timing():
    key = GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32")
    pool = CompilePool([key], TuneOptions(sources=["torch"]), "cpu", jobs=1)
    try:
        niceness = [ex.submit(os.getpriority, os.PRIO_PROCESS, 0) for ex in pool.executors]
        found = [f.result(timeout=120) for f in niceness]
    finally:
        pool.close()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert found == [min(19, own + compile_pool.COMPILE_NICENESS)] * 2


def test_compiling_leaves_the_first_physical_core_to_timing():
    key = GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32")
    pool = CompilePool([key], TuneOptions(sources=["torch"]), "cpu", jobs=1)
    try:
        futures = [ex.submit(os.sched_getaffinity, 0) for ex in pool.executors]
        found = [f.result(timeout=120) for f in futures]
    finally:
        pool.close()
    own = os.sched_getaffinity(0)
    assert found == [compile_pool.compile_cpus(own) or own] * 2


def test_compile_cpus_spare_one_whole_core_where_there_are_enough():
    def siblings(cpu: int) -> set[int]:  # 8 cores of two hyperthreads: cpu c and c + 8
        return {cpu % 8, cpu % 8 + 8}

    assert compile_pool.compile_cpus(set(range(16)), siblings) == set(range(16)) - {0, 8}
    assert compile_pool.compile_cpus({4, 5, 6, 7, 12}, siblings) == {5, 6, 7}
    assert compile_pool.compile_cpus({0, 1, 8}, siblings) is None  # too few to spare one
    assert compile_pool.compile_cpus({0, 8, 1, 9}, lambda c: {0, 8, 1, 9}) is None  # one core
    assert 0 in compile_pool.thread_siblings(0)
    assert compile_pool.thread_siblings(10_000) == {10_000}  # no such CPU: itself

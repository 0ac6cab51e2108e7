"""Crash isolation: candidates that kill or poison their worker are recorded and the run goes on."""

from __future__ import annotations

import os
import re

import pytest
from crashing_source import CrashingGemm
from planted import PlantedGemm

from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.measure.records import candidate_name
from tuner.tuning.engine import PHASES, TuneOptions
from tuner.tuning.isolation import WorkerPool
from tuner.tuning.tune import tune

KEY = GemmKey(m=16, n=24, k=32, dtype="f32", out_dtype="f32")


@pytest.fixture
def crashing():
    registry.register(CrashingGemm())
    yield
    registry.unregister("crash_test")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_crashing_candidates_are_failed_and_the_run_goes_on(crashing):
    pool = WorkerPool(candidate_timeout_s=4)
    lines: list[str] = []
    seen: list = []  # what the caller saw of each measurement as it was made
    try:
        outcome = pool.tune(
            KEY,
            TuneOptions(
                budget_s=0.01, cut_factor=1e9, late_cut=1e9, sources=["crash_test"], launch="graph"
            ),  # on a CPU timed eagerly, and recorded as asked
            device="cpu",
            progress=lines.append,
            on_result=seen.append,
        )
        by_mode = {(m.params.get("mode"), m.params.get("tag")): m for m in outcome.measurements}
        pids = {
            tag: int(re.search(r"pid=(\d+)", by_mode["pid", tag].error).group(1))
            for tag in (1, 2, 3, 4)
        }
        exited, segv = by_mode["exit", None], by_mode["segv", None]
        cuda_error, hang = by_mode["cuda_error", None], by_mode["hang", None]
        assert exited.status == "failed" and "exit code 7" in exited.error
        assert f"worker process {pids[1]} died" in exited.error
        assert segv.status == "failed" and "SIGSEGV" in segv.error
        assert cuda_error.status == "failed" and "illegal memory access" in cuda_error.error
        assert hang.status == "timeout" and f"worker {pids[4]} killed" in hang.error
        assert by_mode["ok", None].status == "ok"  # measured by the fifth worker, after all that
        # each crash really ended its worker; the candidates after it ran in a new one
        assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()
        assert not any(alive(p) for p in pids.values())
        assert pool.started[:4] == [pids[1], pids[2], pids[3], pids[4]] and len(pool.started) == 5
        # the parent knows every candidate exactly once, and the baseline still decides
        assert len(outcome.measurements) == len({m.candidate for m in outcome.measurements}) == 10
        assert outcome.baseline.status == "ok" and outcome.winner.key == str(KEY)
        assert len({m.run_id for m in outcome.measurements} | {outcome.winner.run_id}) == 1
        assert {m.launch for m in outcome.measurements} == {"graph"}  # the crashed ones' too
        # as the caller saw them, whichever worker made them (a tune-all run tells a problem
        # it committed by its measurements' run id)
        assert seen and {m.run_id for m in seen} == {outcome.winner.run_id}
        assert any("broke the CUDA context" in line for line in lines)
    finally:
        pool.close()
    assert not alive(pool.started[-1])


def test_the_worker_is_reused_across_problems_and_tune_can_isolate(crashing, monkeypatch):
    pool = WorkerPool()
    monkeypatch.setattr("tuner.tuning.isolation._POOL", pool)
    try:
        options = TuneOptions(budget_s=0.01, sources=["torch"], isolate=True)
        first = tune(KEY, options=options, device="cpu")
        second = tune(
            GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32"), options=options, device="cpu"
        )
        assert first.winner.source == second.winner.source == "torch"
        assert len(pool.started) == 1 and alive(pool.started[0])
        # the worker's time by phase comes back with its outcome, as in-process
        assert first.phases and set(first.phases) <= set(PHASES), first.phases
    finally:
        pool.close()


def test_an_isolated_worker_times_earlier_fast_challengers_first(monkeypatch):
    registry.register(PlantedGemm())
    pool = WorkerPool()
    monkeypatch.setattr("tuner.tuning.isolation._POOL", pool)
    names = [candidate_name("planted", p) for p in PlantedGemm().candidates(KEY, "cpu")]
    try:
        outcome = tune(
            KEY, options=TuneOptions(budget_s=0.01, sources=["planted"], isolate=True),
            device="cpu", earlier={names[-1]: 1.0},
        )  # fmt: skip
    finally:
        pool.close()
        registry.unregister("planted")
    challengers = [m.candidate for m in outcome.measurements if m.source == "planted"]
    assert challengers == [names[-1], *names[:-1]]

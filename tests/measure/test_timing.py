"""``timing.measure``'s cut-offs, on the host clock (no GPU): a candidate slower than a cut-off
stops early, with the numbers of the calls it ran; and the other timers' rules."""

from __future__ import annotations

import collections
import itertools
import time

import pytest
import torch

from tuner.measure import timing


def sleeper(seconds: float):
    return lambda i: time.sleep(seconds)


def test_a_probe_slower_than_the_cutoff_stops_after_the_probe():
    t = timing.measure(sleeper(0.002), device="cpu", budget_s=0.2, cutoff_us=500.0)
    assert t.cut and t.reps == 3 and t.median_us > 1500


def test_a_candidate_past_the_probe_but_slower_than_the_late_cutoff_stops_after_late_reps():
    t = timing.measure(
        sleeper(0.001), device="cpu", budget_s=0.5, cutoff_us=1e6, late_cutoff_us=500.0
    )
    assert t.cut and t.reps == timing.LATE_REPS and t.median_us > 900


def test_a_candidate_within_both_cutoffs_is_timed_in_full():
    t = timing.measure(
        sleeper(0.001), device="cpu", budget_s=0.2, cutoff_us=1e6, late_cutoff_us=1e6
    )
    assert not t.cut and t.reps > 2 * timing.LATE_REPS


def test_the_late_cutoff_waits_for_a_budget_of_twice_its_calls():
    """Too few calls in the budget to stop after LATE_REPS of them: all are timed."""
    t = timing.measure(
        sleeper(0.001), device="cpu", budget_s=0.04, cutoff_us=1e6, late_cutoff_us=500.0
    )
    assert not t.cut and t.reps < 2 * timing.LATE_REPS


def test_graph_calls_spread_the_replay_launch_and_cover_every_input_set():
    assert timing.graph_calls(5.0) == timing.GRAPH_CALLS  # short calls: as many as allowed
    assert timing.graph_calls(3000.0) == 1  # a long call needs no company
    assert timing.graph_calls(3000.0, sets=3) == 3  # ... but each input set once per replay
    assert timing.graph_calls(100.0) == 3
    assert timing.graph_calls(5.0, sets=32) == 32  # small sets, many: every one of them


def test_two_runners_side_by_side_alternate_their_order():
    assert [timing.round_order("ab", r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert timing.round_order("", 3) == []


@pytest.mark.parametrize("n", range(1, 9))
def test_a_cycle_of_rounds_balances_each_runners_position_and_predecessor(n: int):
    """A runner timed right after a heavy one starts at a lower clock: over a cycle every
    runner follows every other equally often, and sits in every place equally often."""
    rows = [timing.round_order(range(n), r) for r in range(timing.order_cycle(n))]
    assert all(sorted(row) == list(range(n)) for row in rows)
    places = collections.Counter((x, i) for row in rows for i, x in enumerate(row))
    follows = collections.Counter((a, b) for row in rows for a, b in itertools.pairwise(row))
    assert len(set(places.values())) == 1 and len(places) == n * n
    assert len(set(follows.values())) <= 1 and len(follows) == n * (n - 1)
    assert rows[1] == rows[0][::-1]  # every other round the one before reversed


@pytest.mark.parametrize("n", [3, 4, 5])
def test_the_order_repeats_every_cycle_warmup_rounds_before_zero_included(n: int):
    cycle = timing.order_cycle(n)
    for r in range(-2 * cycle, cycle):
        assert timing.round_order(range(n), r) == timing.round_order(range(n), r + cycle)


def test_queued_is_only_a_gpu_clock():
    """Off the GPU nothing can be queued: the samples are the host's clock as always."""
    t = timing.measure(lambda i: time.sleep(0.001), device="cpu", max_reps=5, queued=True)
    assert t.median_us >= 900


def test_sustained_time_reads_the_pace_a_long_run_settles_at():
    """A call that slows once it has run for a while (a GPU lowering its clock at its power
    limit) reads fast over a short measurement and at its settled pace over a sustained one."""
    first_call: list[float] = []

    def call(i: int) -> None:
        now = time.perf_counter()
        if not first_call:
            first_call.append(now)
        time.sleep(100e-6 if now - first_call[0] < 0.03 else 400e-6)

    short = timing.measure(call, device="cpu", budget_s=0.005)
    first_call.clear()
    settled = timing.sustained_time(call, device="cpu", seconds=0.3)
    assert short.median_us < 300 < settled.median_us
    assert settled.reps > timing.SUSTAINED_BATCH and settled.p10_us <= settled.median_us


def test_eager_time_takes_a_sustained_stretch_only_when_asked():
    """``eager_time`` is ``measure_sets`` (its options, a budget of calls) unless given a
    sustained stretch, which runs calls back to back for that long however few the budget."""
    calls: list[int] = []

    def runner(x: int) -> None:
        calls.append(x)
        time.sleep(200e-6)

    sets = [(0,), (1,)]
    short = timing.eager_time(runner, sets, device="cpu", max_reps=5)
    assert short.reps == 5 and set(calls) == {0, 1}
    calls.clear()
    start = time.perf_counter()
    long = timing.eager_time(runner, sets, device="cpu", sustained_s=0.1, max_reps=5)
    assert time.perf_counter() - start >= 0.1
    assert long.reps > 5 and set(calls) == {0, 1}


def test_a_sustained_stretch_runs_each_input_set_once_before_the_clock():
    """A runner's first call on an operand may convert it (set-up, not a call): a sustained
    stretch warms every set first, as ``measure_sets`` does."""
    seen: set[int] = set()

    def runner(x: int) -> None:
        if x not in seen:  # a conversion made once per operand
            seen.add(x)
            time.sleep(5e-3)

    sets = [(i,) for i in range(8)]  # a quarter of the first batch's 32 calls
    t = timing.eager_time(runner, sets, device="cpu", sustained_s=0.01)
    assert t.reps >= timing.SUSTAINED_BATCH and t.p90_us < 1000


def test_p10_and_p90_stand_as_far_from_their_ends_for_any_count():
    for n in range(2, 40):
        xs = [float(i) for i in range(n)]
        t = timing._cut(xs)
        assert t.p10_us - xs[0] == pytest.approx(xs[-1] - t.p90_us), n
    assert timing._cut([1.0, 2, 3, 4, 5, 6]).p10_us == 1.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_suites_graph_reading_runs_every_input_set_each_replay():
    """The suites' graph columns rotate over every input set, however many: a set left out of
    the graph would be one fewer in L2's way, and the reading too kind."""
    sets = [(torch.full((4,), float(i), device="cuda"),) for i in range(timing.GRAPH_CALLS + 9)]
    seen, one = torch.zeros(len(sets), device="cuda"), torch.ones(1, device="cuda")

    def runner(x: torch.Tensor) -> None:  # counts its calls on each set, on the GPU
        seen.index_add_(0, x[:1].long(), one)

    timing.graph_time_over(runner, sets)
    assert bool((seen > 0).all()), seen


def test_a_rotation_of_small_sets_passes_twice_a_hopper_l2(monkeypatch: pytest.MonkeyPatch):
    """Sets of 1 MiB on a GPU with a 50 MiB L2: enough of them that each call's operands were
    evicted since its last turn; big sets need few, and the CPU keeps a handful."""
    monkeypatch.setattr(timing, "cache_bytes", lambda device: 50 * 2**20)
    assert timing.rotation_sets(2**20, "cuda") * 2**20 > 2 * 50 * 2**20
    assert timing.rotation_sets(64 * 2**20, "cuda") == 3  # 2 x L2 in two, and one more
    assert timing.rotation_sets(1024, "cuda") == timing.MAX_SETS
    assert timing.rotation_sets(1024, "cpu") == timing.CPU_MAX_SETS
    assert timing.rotation_sets(16 * 2**30, "cuda") == 1  # past the memory bound: one set


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_rotation_of_1_mib_sets_passes_twice_this_gpus_l2():
    assert timing.rotation_sets(2**20, "cuda") * 2**20 > 2 * timing.cache_bytes("cuda")

"""Honest timing of one runner: every benchmark and the engine time through here, so that every
figure they report follows the same rules.

- GPU time from CUDA events around each call, after a warm-up; the host clock on the CPU.
- Inputs rotate over several buffer sets whose total exceeds twice the L2 cache, so nothing is
  served from cache that a real workload would read from memory.
- Repetitions fill a time budget (within [min_reps, max_reps]); the result is the median with the
  10th/90th percentiles as spread. A call of ``STEADY_US`` or more is GPU-bound and steady:
  ``STEADY_REPS`` samples place its median within noise, and more would only spend the budget.
- A probe of a few calls first: a candidate far slower than the best so far is cut early; one
  that passes is cut after its first ``LATE_REPS`` timed calls if their median is already slower
  than a tighter cut-off, since a few dozen calls place a median within a few percent.
- The host time per eager call is measured too: for tiny problems the launch, not the kernel,
  is what the caller waits for.
- ``sustained_time``: a compute-bound call's time over a stretch of calls back to back, at the
  clock the GPU keeps at its power limit (the tuner's duels of GPU-bound calls use it).
- ``graph_duel``: GPU time alone, from calls captured in a CUDA graph and replayed (what a caller
  that runs its step as a graph sees; event times of small eager calls are host-bound), each
  call after a fence whose own time is subtracted, several runners read side by side in rounds
  (one after the other, the first met a clock still settling). ``graph_time(fn)`` is the duel of
  ``fn`` alone.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

CPU_L2_BYTES = 32 * 2**20  # a generous last-level cache guess; CPU rotation matters less
# input sets a GPU rotation holds at most: sets of 1 MiB (a small GEMM's operands) still rotate
# over twice a Hopper L2 (50 MiB); smaller ones read too little for the cache to weigh much
MAX_SETS = 128
CPU_MAX_SETS = 4
WARMUP = 3  # untimed calls before the clock starts (measure_sets: at least one per input set)
STEADY_US = 100.0  # calls this long are GPU-bound: launch jitter is a small share of them
STEADY_REPS = 20  # samples enough for such a call's median
LATE_REPS = 30  # timed calls before the late cut-off is applied
HOLD_US_PER_CALL = 50.0  # GPU held per queued call: several times a graph launch's host cost
HOLD_CYCLES_PER_US = 2000  # at least the SM clock in MHz: a held GPU spins no shorter than asked
HOST_CALLS = 20  # eager calls per host reading at most: a launch's jitter spread, still cheap


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    reps: int
    host_us: float
    cut: bool = False

    @property
    def spread(self) -> float:
        """(p90 - p10) / median."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us else 0.0


def cache_bytes(device: str) -> int:
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", 50 * 2**20))
    return CPU_L2_BYTES


def rotation_sets(bytes_per_set: int, device: str, *, max_total: int = 8 * 2**30) -> int:
    """How many input sets make the rotation at least twice the cache (bounded by memory and by
    ``MAX_SETS``)."""
    want = math.ceil(2 * cache_bytes(device) / max(bytes_per_set, 1)) + 1
    fit = max(1, max_total // max(bytes_per_set, 1))
    cap = MAX_SETS if device == "cuda" else CPU_MAX_SETS
    return max(1, min(want, cap, fit))


def on_sets(runner: Callable[..., Any], sets: Sequence[tuple[Any, ...]]) -> Callable[[int], Any]:
    """``fn(i)`` for ``measure`` and ``graph_time``: ``runner`` on input set ``i``, round robin."""
    n = len(sets)
    return lambda i: runner(*sets[i % n])


def measure_sets(
    runner: Callable[..., Any], sets: Sequence[tuple[Any, ...]], **options: Any
) -> Timing:
    """``measure`` of ``runner`` round robin over ``sets``, each set run once before the clock
    starts: a runner's first call on an operand may convert it (a layout made once per tensor,
    then memoised), which is set-up, not a call."""
    return measure(on_sets(runner, sets), warmup=max(WARMUP, len(sets)), **options)


def eager_time(
    runner: Callable[..., Any],
    sets: Sequence[tuple[Any, ...]],
    *,
    device: str,
    sustained_s: float = 0.0,
    **options: Any,
) -> Timing:
    """``runner``'s eager time round robin over ``sets``: over a stretch of ``sustained_s``
    seconds of calls back to back where that is positive (``sustained_time``), else
    ``measure_sets`` with ``options``."""
    if sustained_s > 0:
        for inputs in sets:  # set-up, as in ``measure_sets``: a first call may convert operands
            runner(*inputs)
        return sustained_time(on_sets(runner, sets), device=device, seconds=sustained_s)
    return measure_sets(runner, sets, device=device, **options)


def round_order(items: Sequence[T], round_: int) -> list[T]:
    """The order of round ``round_`` of runners timed side by side. A GPU that heats over a
    round of long compute-bound calls lowers its clock, and a runner timed right after a heavy
    one starts at a lower clock: a fixed order would favour the runners timed first, and a
    shuffled one, unless balanced, some runners' neighbours. So the rounds follow a Williams
    design: over ``order_cycle(len(items))`` rounds each runner is timed in every position,
    and right after every other runner, equally often (within rounds: a round's first runner
    follows the last of the round before); every other round is the one before reversed (two
    runners alternate). The order repeats every cycle, for negative rounds too."""
    items = list(items)
    n = len(items)
    if n == 0:
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...: each difference mod n once between neighbours
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    shift = (round_ // 2) % (order_cycle(n) // 2)
    row = [items[(x + shift) % n] for x in first]
    return row if round_ % 2 == 0 else row[::-1]


def order_cycle(n: int) -> int:
    """Rounds after which ``round_order`` of ``n`` runners has balanced every position and
    every runner's predecessor: n for an even n (the rows' reverses are rows), else 2n."""
    return max(2, n if n % 2 == 0 else 2 * n)


def _percentile(sorted_xs: list[float], q: float) -> float:
    """The ``q`` quantile, linear between the two nearest samples: p10 and p90 stand as far
    from their ends as each other for any count."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (pos - lo) * (sorted_xs[hi] - sorted_xs[lo])


class _Clock:
    """Per-call durations in microseconds: CUDA events on the GPU, perf_counter on the CPU.

    ``queued``: a spin kernel holds the GPU while the host queues the timed calls, so that each
    sample is GPU time alone. A call quicker on the GPU than its launch on the host (a graph of
    tiny kernels, the graph timer's fence) would otherwise be charged the host's gaps, and a
    loaded host (a compile pool at work) would inflate it further."""

    def __init__(self, device: str, queued: bool = False) -> None:
        self.cuda = device == "cuda"
        self.queued = queued and self.cuda

    def run(self, fn: Callable[[int], Any], start: int, n: int) -> list[float]:
        if not self.cuda:
            out = []
            for i in range(start, start + n):
                t0 = time.perf_counter()
                fn(i)
                out.append((time.perf_counter() - t0) * 1e6)
            return out
        begin = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        stream = torch.cuda.current_stream()  # looked up once: per record it costs microseconds
        if self.queued:
            torch.cuda._sleep(int(n * HOLD_US_PER_CALL * HOLD_CYCLES_PER_US))
        for j in range(n):
            begin[j].record(stream)
            fn(start + j)
            end[j].record(stream)
        torch.cuda.synchronize()
        return [b.elapsed_time(e) * 1e3 for b, e in zip(begin, end, strict=True)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def host_time_us(fn: Callable[[int], Any], n: int, clock: _Clock) -> float:
    """Wall time per call when the caller launches eagerly, without waiting for the GPU."""
    clock.sync()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    elapsed = time.perf_counter() - t0
    clock.sync()
    return elapsed / n * 1e6


def host_reading(fn: Callable[[int], Any], device: str, calls: int = HOST_CALLS) -> float:
    """A fresh reading of the host time per eager call of ``fn(i)``, taken as ``measure`` takes
    it, for a reading a disturbance may have inflated: it can only add time, never take it
    away. On the CPU, where a call is synchronous, it is the median of the calls' times: there
    host and call time are one reading, so only a baseline with a GPU's shape (a test's) makes
    a CPU challenger's host time decide a verdict."""
    clock = _Clock(device)
    if clock.cuda:
        return host_time_us(fn, calls, clock)
    return statistics.median(clock.run(fn, 0, calls))


def measure(
    fn: Callable[[int], Any],
    *,
    device: str,
    budget_s: float = 0.2,
    warmup: int = WARMUP,
    probe: int = 3,
    min_reps: int = 5,
    max_reps: int = 500,
    cutoff_us: float | None = None,
    late_cutoff_us: float | None = None,
    queued: bool = False,
) -> Timing:
    """Time ``fn(i)`` (which runs the candidate on input set ``i``) per the rules above.

    ``cutoff_us``: after the probe, stop if its median exceeds this (the caller passes a multiple
    of the best median so far); the Timing then has ``cut=True`` and only the probe's numbers.
    ``late_cutoff_us`` (tighter): the same after the first ``LATE_REPS`` timed calls, where
    the budget allows at least twice as many. ``queued``: samples are GPU time alone (see
    ``_Clock``), not what an eager caller waits for.
    """
    clock = _Clock(device, queued)
    for i in range(warmup):
        fn(i)
    clock.sync()
    samples = clock.run(fn, warmup, probe)
    est = statistics.median(samples)
    if cutoff_us is not None and est > cutoff_us:
        return _cut(samples)
    reps = int(min(max_reps, max(min_reps, budget_s * 1e6 / max(est, 1.0))))
    if clock.cuda and est >= STEADY_US:
        reps = min(reps, max(min_reps, STEADY_REPS))
    samples = []
    if late_cutoff_us is not None and reps >= 2 * LATE_REPS:
        samples = clock.run(fn, warmup + probe, LATE_REPS)
        if statistics.median(samples) > late_cutoff_us:
            return _cut(samples)
    samples += clock.run(fn, warmup + probe + len(samples), reps - len(samples))
    s = sorted(samples)
    median = statistics.median(s)
    host = (
        host_time_us(fn, min(reps, HOST_CALLS), clock) if clock.cuda else median
    )  # CPU work is synchronous
    return Timing(median, _percentile(s, 0.1), _percentile(s, 0.9), len(s), host)


SUSTAINED_BATCH = 32  # calls between two syncs of ``sustained_time``: the GPU never waits long


def sustained_time(fn: Callable[[int], Any], *, device: str, seconds: float) -> Timing:
    """``fn(i)``'s time per call over ``seconds`` of calls back to back: what a compute-bound
    call costs once the GPU has drawn its power limit for a while and lowered its clock, as it
    does in a model's long run of such calls. ``measure`` times such a call over a few ms, at
    whatever clock the moment gives, and two kernels that differ there can be equal at the
    limit. The spread is over the calls; the host time is read after them."""
    clock = _Clock(device)
    samples: list[float] = []
    start = time.perf_counter()
    while not samples or time.perf_counter() - start < seconds:
        samples += clock.run(fn, len(samples), SUSTAINED_BATCH)
    s = sorted(samples)
    median = statistics.median(s)
    host = host_time_us(fn, HOST_CALLS, clock) if clock.cuda else median
    return Timing(median, _percentile(s, 0.1), _percentile(s, 0.9), len(s), host)


def _cut(samples: list[float]) -> Timing:
    """A candidate stopped at a cut-off: the median and spread of the calls it ran."""
    s = sorted(samples)
    median = statistics.median(s)
    return Timing(median, _percentile(s, 0.1), _percentile(s, 0.9), len(s), median, cut=True)


def copy_bandwidth_gbs(device: str, nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read plus written: the memory ceiling."""
    if device != "cuda":
        nbytes = 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = measure(lambda i: dst.copy_(src), device=device, budget_s=0.3, max_reps=50)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


GRAPH_CALLS = 16  # calls per captured graph: the replay's own launch cost is spread over them
GRAPH_REPLAY_US = 300.0  # GPU time per replay that makes its own launch cost a small share


def graph_calls(call_us: float, sets: int = 1) -> int:
    """Calls per captured graph for a call of about ``call_us``: enough to spread the replay's
    launch cost (at most ``GRAPH_CALLS``; a long call needs few, and each replay of many long
    calls only spends time), and at least one per input set, so that replays rotate over all
    of them and nothing is served from L2 that a real step reads from memory (many sets are
    small ones, whose calls are short: ``rotation_sets``)."""
    spread = math.ceil(GRAPH_REPLAY_US / max(call_us, 1e-3))
    return max(1, min(GRAPH_CALLS, spread), sets)


def graph_time(
    fn: Callable[[int], Any], calls: int = GRAPH_CALLS, budget_s: float = 0.03, fenced: bool = True
) -> Timing:
    """GPU time per call of ``fn(i)`` (``i`` picks the input set) with the host launch cost
    removed: ``calls`` calls captured in one CUDA graph, replayed. Warmed up first on the
    capturing stream (workspaces are per stream). Raises what the capture raises: a runner that
    cannot be captured cannot serve a caller that runs its step as a graph.

    ``fenced`` (the default): ``graph_duel`` of ``fn`` alone, so that one fence, taken one way,
    stands before every call the tuner and the benchmarks time: its Timing has no host time (0)
    and ``DUEL_ROUNDS`` x 2-8 samples. Unfenced, the calls run back to back, and the Timing's host
    time is a replay's launch cost a call."""
    if fenced:
        return graph_duel([fn], calls, budget_s)[0]
    graph = _captured(fn, calls)
    t = measure(
        lambda i: graph.replay(), device="cuda", budget_s=budget_s, max_reps=30, queued=True
    )
    return Timing(t.median_us / calls, t.p10_us / calls, t.p90_us / calls, t.reps,
                  t.host_us / calls)  # fmt: skip


def graph_time_over(
    runner: Callable[..., Any], sets: Sequence[tuple[Any, ...]], budget_s: float = 0.03
) -> Timing:
    """``graph_time`` of ``runner`` round robin over ``sets`` (``on_sets``), each set at least
    once a replay: ``graph_calls`` for a call of unknown length, taken as short."""
    return graph_time(on_sets(runner, sets), graph_calls(0.0, len(sets)), budget_s)


def _captured(fn: Callable[[int], Any], calls: int) -> torch.cuda.CUDAGraph:
    """``fn(0) .. fn(calls - 1)`` captured in one CUDA graph, after the same calls warmed up on
    the capturing stream (workspaces are per stream)."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            fn(i)
    return graph


DUEL_ROUNDS = 4  # rounds of a graph duel: enough to put each runner early and late twice
DUEL_REPS = (2, 8)  # replays of each graph a round, at least and at most


def graph_duel(
    fns: Sequence[Callable[[int], Any]], calls: int = GRAPH_CALLS, budget_s: float = 0.03
) -> list[Timing]:
    """GPU time per call of each of ``fns`` (see ``graph_time``), their replays taken side by
    side: ``DUEL_ROUNDS`` rounds in ``round_order``, each replaying every graph a few times,
    within about ``budget_s`` a runner. Timed one after the other, two compute-bound runners
    read at different clocks where the GPU's clock still moves (it settles at its power limit
    over a fraction of a second), and the one timed while it was lower looks slower.

    Each call follows a fence: a one-element torch kernel launched without programmatic
    dependent launch (PDL). A PDL kernel's launch then overlaps the end of a foreign kernel, as
    in a model's step; back to back it would also hide behind its own previous call. The
    fence's own replays, read each round, are subtracted at their quickest round: a disturbance
    can only lengthen a reading, and a lengthened fence would flatter the runners. The Timings
    carry no host time (0). Raises what a capture raises."""
    flag = torch.zeros(1, device="cuda")

    def fence(i: int) -> None:
        flag.add_(1)

    def fenced(fn: Callable[[int], Any]) -> Callable[[int], Any]:
        return lambda i: (fence(i), fn(i))

    graphs = [_captured(fenced(fn), calls) for fn in fns]
    fences = _captured(fence, calls)
    clock = _Clock("cuda", queued=True)
    probe = [statistics.median(clock.run(lambda i, g=g: g.replay(), 0, 3)) for g in graphs]
    low, high = DUEL_REPS
    reps = max(low, min(high, int(budget_s * 1e6 / DUEL_ROUNDS / max(max(probe), 1.0))))
    samples: list[list[float]] = [[] for _ in graphs]
    fence_us = math.inf
    for r in range(DUEL_ROUNDS):
        for i in round_order(range(len(graphs)), r):
            samples[i] += clock.run(lambda _, g=graphs[i]: g.replay(), 0, reps)
        fence_us = min(fence_us, statistics.median(clock.run(lambda _: fences.replay(), 0, reps)))
    out = []
    for xs in samples:
        s = sorted(x - fence_us for x in xs)
        out.append(Timing(max(0.0, statistics.median(s)) / calls,
                          max(0.0, _percentile(s, 0.1)) / calls,
                          max(0.0, _percentile(s, 0.9)) / calls, len(s), 0.0))  # fmt: skip
    return out


_SIDE = threading.local()  # per thread: {device index: its side stream}


def side_stream() -> torch.cuda.Stream:
    """This thread's side stream on the current device, for captures and first calls. One a
    thread, not a fresh one a call: a library runner keeps a workspace for each stream it meets,
    for the process's life (a captured graph may replay on it), and torch's pool hands out 32
    streams; nor one for all threads: another thread's launch would join a capture."""
    streams = getattr(_SIDE, "streams", None)
    if streams is None:
        streams = _SIDE.streams = {}
    index = torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(index)
    return streams[index]

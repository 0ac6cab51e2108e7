"""On the GPU: tune bf16 and fp32 (TF32 off and on) GEMMs with torch and Triton, then dispatch."""

from __future__ import annotations

import math
import time

import pytest
import torch
from planted import PlantedGemm

from tuner.cache import Store
from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.measure import timing
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.warmup import warmup
from tuner.tuning.engine import TuneOptions, tune
from tuner.tuning.verdict import at_power_limit, heavy_rate

pytestmark = pytest.mark.gpu

CASES = [
    ("bf16", False, (256, 512, 1024)),
    ("bf16", False, (1, 4096, 4096)),
    ("f32", False, (512, 512, 512)),
    ("f32", True, (512, 512, 512)),
]


@pytest.mark.parametrize(("dtype", "tf32", "mnk"), CASES)
def test_tune_store_dispatch(tmp_path, dtype, tf32, mnk):
    m, n, k = mnk
    key = GemmKey(m=m, n=n, k=k, dtype=dtype, out_dtype=dtype, compute="tf32" if tf32 else "f32")
    outcome = tune(
        key, options=TuneOptions(budget_s=0.02, sources=["triton_gemm"], max_candidates=8)
    )
    triton = [x for x in outcome.measurements if x.source == "triton_gemm"]
    assert triton and any(x.status in ("ok", "cut") for x in triton), [x.error for x in triton]
    assert outcome.winner.speedup >= 1.0
    store = Store(tmp_path / "c.db")
    store.save_run(outcome.measurements, outcome.winner)

    d = Dispatcher(tmp_path / "c.db", mode="lookup")
    warmup(progress=False, dispatcher=d, fetch=False)  # compiled winners load before the first call
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(k, n, device="cuda", dtype=dt)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        c = d.matmul(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    ref = a.double() @ b.double()
    assert ((c.double() - ref).norm() / ref.norm()).item() < {
        "bf16": 2e-2,
        "f32": 5e-3 if tf32 else 1e-4,
    }[dtype]
    assert d.choices[str(key)] == outcome.winner.candidate


def test_numerics_check_rejects_a_wrong_candidate_on_the_gpu():
    registry.register(PlantedGemm())
    try:
        outcome = tune(
            GemmKey(m=128, n=256, k=512), options=TuneOptions(budget_s=0.02, sources=["planted"])
        )
    finally:
        registry.unregister("planted")
    got = {x.params.get("bug"): x for x in outcome.measurements if x.source == "planted"}
    assert got["drops_last_k"].status == "rejected"
    assert got["nan"].status == "rejected"
    assert outcome.winner.source != "planted"


def test_graph_time_subtracts_its_fence():
    """The fence before each captured call is not charged to the call: a call that launches
    nothing costs ~0, one that launches a kernel costs more than that."""
    x = torch.zeros(1 << 26, device="cuda")  # past L2: the kernel's time stands above the noise
    nothing = timing.graph_time(lambda i: None)
    one_kernel = timing.graph_time(lambda i: x.add_(1))
    assert 0.0 <= nothing.median_us < one_kernel.median_us
    assert timing.graph_time(lambda i: x.add_(1), fenced=False).median_us > 0


def test_a_graph_duel_reads_each_runner_as_it_reads_alone_and_a_twin_alike():
    """Side by side, the fence is still not charged (a call that launches nothing costs ~0), a
    kernel reads what ``graph_time`` (its duel alone) reads for it, and two copies of one
    compute-bound GEMM read alike: neither is favoured by when it was read."""
    x = torch.zeros(1 << 26, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    nothing, one_kernel = timing.graph_duel([lambda i: None, lambda i: x.add_(1)], calls=4)
    assert 0.0 <= nothing.median_us < 0.5 < one_kernel.median_us, (nothing, one_kernel)
    alone = timing.graph_time(lambda i: x.add_(1), calls=4)
    assert abs(one_kernel.median_us - alone.median_us) < 0.2 * alone.median_us, (one_kernel, alone)
    first, second = timing.graph_duel([lambda i: a @ a, lambda i: a @ a], calls=4)
    assert abs(first.median_us - second.median_us) < 0.03 * first.median_us, (first, second)


def test_queued_samples_are_gpu_time_however_slow_the_host():
    """A call whose host side outlasts its kernel is charged the host's time when each sample is
    taken as it comes, and only its kernel's when the calls are queued behind a held GPU (how
    graph replays are timed)."""
    x = torch.zeros(1, device="cuda")

    def slow_host(i: int) -> None:
        until = time.perf_counter() + 30e-6
        while time.perf_counter() < until:
            pass
        x.add_(1)

    # a hundred calls: their launches and events fit the launch queue while the GPU is held
    as_it_comes = timing.measure(slow_host, device="cuda", max_reps=100)
    queued = timing.measure(slow_host, device="cuda", max_reps=100, queued=True)
    assert as_it_comes.median_us >= 25.0
    assert queued.median_us < as_it_comes.median_us / 2


def test_a_steady_gpu_bound_call_is_timed_with_few_samples():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    long_call = timing.measure(lambda i: a @ a, device="cuda", budget_s=1.0)
    assert long_call.median_us >= timing.STEADY_US
    assert long_call.reps == timing.STEADY_REPS  # the budget alone would allow thousands
    x = torch.zeros(1, device="cuda")
    short_call = timing.measure(lambda i: x.add_(1), device="cuda", budget_s=0.05)
    assert short_call.reps > timing.STEADY_REPS


def test_duels_of_compute_bound_gemms_are_timed_over_sustained_stretches():
    """A bf16 GEMM of 4096^3 is GPU-bound (well over ``timing.STEADY_US``): its duels run each
    runner over stretches of calls back to back, at the clock the power limit leaves, and the
    verdict says so. Ties are dueled on the GPU, and a noise share of 10% makes ties of
    cuBLASLt's first heuristic algorithms, which run within a few percent of torch's kernel
    (the same kernel on some GPUs, another on others). A host slack past any launch keeps a tie
    that reads slower and costs more host time a call in the duel (eager: it would not repay
    that launch cost, and this test is about the duel's timing, not launch costs)."""
    key = GemmKey(m=4096, n=4096, k=4096, dtype="bf16", out_dtype="bf16")
    options = TuneOptions(
        budget_s=0.02, sources=["cublaslt"], max_candidates=4, min_noise=0.1, host_slack_us=1e3
    )
    outcome = tune(key, options=options)
    dueled = [x for x in outcome.measurements if "confirmation" in (x.error or "")]
    assert dueled, [(x.candidate, x.status, x.median_us, x.error) for x in outcome.measurements]
    assert all("s stretches (GPU-bound or heavy calls)" in x.error for x in dueled)


def test_a_large_gemm_holds_the_power_limit_and_decode_or_host_bound_ones_do_not():
    """``heavy_rate`` is a share of this GPU's own bf16 matmul peak. A 2048 x 4096 x 4096 bf16
    GEMM (under ``timing.STEADY_US`` on a Hopper GPU) is GPU-bound and multiplies past it; a
    decode GEMM of 16 rows, bound by reading its weight, stays far under it; and a small GEMM
    behind a slow launch is host-bound, its GPU idle between calls."""
    rate = heavy_rate("cuda")
    assert 0 < rate < math.inf
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def readings(fn) -> tuple[float, float]:  # eager and GPU time, us a call
        eager = timing.measure(fn, device="cuda", budget_s=0.05)
        return max(eager.median_us, eager.host_us), timing.graph_time(fn).median_us

    for m, held in ((2048, True), (16, False)):
        a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        eager_us, gpu_us = readings(lambda i, a=a: a @ b)
        flops = 2.0 * m * 4096 * 4096
        assert at_power_limit(flops, [eager_us], [gpu_us], rate) == held, (m, eager_us, gpu_us)
        assert (flops / gpu_us >= rate) == held, (m, gpu_us)  # the rate decides, not the launch
    small = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)

    def slow_launch(i: int) -> torch.Tensor:
        time.sleep(100e-6)  # host work before the launch, as a heavy Python wrapper's
        return small @ w

    eager_us, gpu_us = readings(slow_launch)
    assert gpu_us < eager_us * 0.5, (eager_us, gpu_us)
    any_rate = 0.0  # every call counts as heavy here: only its launch decides
    assert not at_power_limit(2.0 * 256 * 1024 * 1024, [eager_us], [gpu_us], any_rate)

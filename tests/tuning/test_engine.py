"""The tuning engine on the CPU path: torch baseline, interpreted Triton, and planted bad candidates."""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import pytest
import torch
from planted import PlantedGemm
from quiet_host import first_judged, quiet, undisturbed

from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.keys import GemmKey, SdpaKey
from tuner.measure import timing
from tuner.measure.records import LAUNCHES, Measurement, candidate_name
from tuner.tuning.engine import PHASES, TuneOptions, TuneOutcome, cut_off, earlier_times, tune
from tuner.tuning.verdict import (
    duels,
    effective_us,
    pair_noise,
    timed_baseline,
)

KEY = GemmKey(m=48, n=40, k=72, dtype="f32", out_dtype="f32")


@pytest.fixture
def planted():
    registry.register(PlantedGemm())
    yield
    registry.unregister("planted")


def tuned_with(source: Source, launch: str = "eager", **options) -> TuneOutcome:
    """``KEY`` tuned with ``source`` registered for the run, against the baseline alone."""
    registry.register(source)
    try:
        return tune(KEY, options=TuneOptions(sources=[source.name], launch=launch, **options))
    finally:
        registry.unregister(source.name)


def tuned_uncut(
    key: GemmKey, sources: list[Source], min_noise: float = 0.02, **hooks
) -> TuneOutcome:
    """``key`` tuned with ``sources`` registered for the run and cut-offs that cannot cut: the
    rule under test is the duels', not this host's speed."""
    for source in sources:
        registry.register(source)
    try:
        options = TuneOptions(budget_s=0.02, sources=[s.name for s in sources], cut_factor=1e9,
                              late_cut=1e9, min_noise=min_noise, prune=False)  # fmt: skip
        return tune(key, options=options, **hooks)
    finally:
        for source in sources:
            registry.unregister(source.name)


def by_params(outcome):
    return {m.params.get("bug", m.source): m for m in outcome.measurements}


def test_wrong_nan_and_broken_candidates_are_recorded_never_chosen(planted):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.02, sources=["planted"]))
    got = by_params(outcome)
    assert got["drops_last_k"].status == "rejected" and got["drops_last_k"].max_rel_err > 0.01
    assert got["nan"].status == "rejected" and "relative error nan" in got["nan"].error
    assert got["build_error"].status == "failed" and "static_assert" in got["build_error"].error
    assert got["raises"].status == "failed" and "illegal memory access" in got["raises"].error
    assert got["slow"].status == "cut"  # 20 ms against a ~10 us baseline: cut after the probe
    assert got["slow"].host_us is None  # its host time was never read
    assert got["torch"].status == "ok" and got["torch"].is_baseline
    assert outcome.winner.source == "torch"


def test_interpreted_triton_candidate_is_checked_and_timed():
    outcome = tune(
        GemmKey(m=40, n=24, k=56, dtype="f16", out_dtype="f16"),
        options=TuneOptions(budget_s=0.02, cut_factor=1e9, late_cut=1e9),
    )
    triton = [m for m in outcome.measurements if m.source == "triton_gemm"]
    assert triton and all(m.status == "ok" for m in triton)
    assert triton[0].max_rel_err < 5e-3 and triton[0].median_us > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter: CPU hosts only")
def test_bf16_triton_is_unsupported_in_the_interpreter_with_a_reason():
    outcome = tune(GemmKey(m=16, n=16, k=16), options=TuneOptions(budget_s=0.01))
    triton = next(m for m in outcome.measurements if m.source == "triton_gemm")
    assert triton.status == "unsupported" and "interpreter" in triton.error


def test_sdpa_baseline_tunes_on_cpu():
    key = SdpaKey(
        batch=1,
        q_heads=4,
        kv_heads=2,
        q_len=7,
        kv_len=13,
        head_dim=16,
        causal="bottom_right",
        dtype="f32",
    )
    outcome = tune(key, options=TuneOptions(budget_s=0.01))
    assert outcome.baseline.max_rel_err < 1e-4
    assert outcome.winner.baseline_us > 0


@pytest.fixture
def memoized():
    from planted import Memoized

    registry.register(Memoized())
    yield Memoized
    registry.unregister("memoized")


def test_a_truly_faster_challenger_wins_and_is_confirmed(memoized):
    """torch's few-us CPU GEMM has a long tail in every take (a wide half spread), but
    no usual reading of the memoized product reaches torch's quickest: the margin its win must
    clear is the floor, not that tail. Taken again where the host disturbed the duel
    (``first_judged``): torch's readings of so short a GEMM can jump between two levels."""
    outcome = first_judged(
        lambda: tune(KEY, options=TuneOptions(budget_s=0.02, sources=["memoized"])),
        lambda outcome: undisturbed(by_params(outcome)["memoized"].error),
    )
    assert outcome.winner.source == "memoized" and outcome.winner.speedup > 1.5
    assert "kept" in by_params(outcome)["memoized"].error


def test_a_baselines_long_tail_does_not_tie_a_challenger_far_under_it(memoized):
    """torch's trial here is a take with a long tail (p90 three times its median): the memoized
    product's readings all lie under torch's quickest, so it duels at the floor's margin, not
    that tail's. That tail still ties them, so its win must show twice: a baseline's trial
    slowed throughout (a compile beside all of it) lifts its p10 too. On a loaded host the
    baseline's second take may read far off its trial, which the engine keeps torch for
    (disturbed, nothing of this test): taken again (``first_judged``)."""

    def run() -> tuple[Measurement, TuneOutcome]:
        timed = timed_baseline(
            tune(KEY, options=TuneOptions(budget_s=0.02, sources=[]), device="cpu").measurements
        )
        base = dataclasses.replace(timed, p10_us=timed.median_us * 0.97, p90_us=timed.median_us * 3)
        outcome = tune(
            KEY, options=TuneOptions(budget_s=0.02, sources=["memoized"]), device="cpu",
            prior=[base],
        )  # fmt: skip
        return base, outcome

    base, outcome = first_judged(
        run, lambda run: "disturbed" not in by_params(run[1])["memoized"].error
    )
    challenger = by_params(outcome)["memoized"]
    assert pair_noise(base, challenger, 0.02, "eager") == 0.02
    assert outcome.winner.source == "memoized", challenger.error
    assert "a tie in its trial, so taken again" in challenger.error
    assert "ahead again" in challenger.error and "kept" in challenger.error


def test_a_challenger_faster_in_its_trial_but_not_duelled_says_why(memoized):
    """Off the GPU a tie within the noise meets no duel; its note says so, with the margin."""
    base = Measurement(
        device_class="d", key=str(KEY), source="torch", params={}, status="ok", is_baseline=True,
        median_us=100.0, p10_us=95.0, p90_us=105.0, host_us=100.0,
    )  # fmt: skip
    tie = dataclasses.replace(
        base, source="memoized", is_baseline=False, median_us=98.0, p10_us=97.0, p90_us=99.0,
        host_us=98.0,
    )  # fmt: skip
    options = TuneOptions(budget_s=0.02, sources=["memoized"])
    outcome = tune(KEY, options=options, device="cpu", prior=[base, tie])
    assert outcome.winner.source == "torch"
    assert by_params(outcome)["memoized"].error == (
        "trial 98.00 vs baseline 100.00 us, within the noise (margin 5.0%): a tie, not duelled"
    )


def test_a_lucky_measurement_does_not_survive_the_confirmation(memoized):
    """A challenger fast in its trial and slow after never wins. On a loaded host its trial may
    not read it ahead by more than the noise, and then no confirmation is taken (no note, and
    nothing of what this test is about): taken again (``first_judged``) where none was."""

    def slow_down_after_its_trial(m):
        if m.source == "memoized":
            memoized.slow = True  # it measured fast; from now on it is slow

    def run() -> TuneOutcome:
        memoized.slow = False
        outcome = tune(
            KEY,
            options=TuneOptions(budget_s=0.02, sources=["memoized"]),
            on_result=slow_down_after_its_trial,
        )
        assert outcome.winner.source == "torch"
        return outcome

    outcome = first_judged(run, lambda outcome: bool(by_params(outcome)["memoized"].error))
    error = by_params(outcome)["memoized"].error
    # taken again, then judged as read; on a loaded host the baseline's rounds may be far off
    # its trial too, and a duel disturbed twice keeps the baseline just the same
    assert "far over its trial" in error or "disturbed twice: far off a trial's time" in error
    # the loss names what it failed: slow as read, or the duel disturbed
    assert re.search(r"lost: (disturbed|no faster beyond the margin)", error), error


@pytest.mark.cpu_host
def test_a_challenger_read_far_over_its_trial_still_wins_where_it_stays_faster(
    monkeypatch, one_thread
):
    """A challenger that measured 100 us a call in its trial reads 400 us in its duel (its
    host path slowed by what ran between its calls, as a Triton launcher's does beside torch's
    calls), twice: its duel is disturbed, but only on its own side, which cannot make its win.
    Against torch's ~ms 512^3 GEMM it stays far faster, so it wins as read. On a loaded host
    torch's duel may read far off its trial too, which the engine keeps torch for (disturbed
    twice, nothing of this test): taken again (``first_judged``)."""
    from planted import Busy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    class SlowerInItsDuel(Busy):
        name = "slower_in_its_duel"

    def slow_down_after_its_trial(m):
        if m.source == SlowerInItsDuel.name:
            SlowerInItsDuel.busy_s = 400e-6

    def run() -> TuneOutcome:
        SlowerInItsDuel.busy_s = 100e-6
        key = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
        return tuned_uncut(key, [SlowerInItsDuel()], on_result=slow_down_after_its_trial)

    outcome = first_judged(
        run, lambda outcome: "disturbed" not in by_params(outcome)[SlowerInItsDuel.name].error
    )
    error = by_params(outcome)[SlowerInItsDuel.name].error
    assert outcome.winner.source == SlowerInItsDuel.name, error
    assert "far over its trial" in error and "kept" in error


@pytest.mark.cpu_host
def test_a_winner_confirmed_slower_than_a_runner_ups_trial_meets_the_runner_up(
    monkeypatch, one_thread
):
    """Both beat torch's 512^3 GEMM on the CPU by far; the first ranked first on its trial, then
    its confirmation reads it slower than the second's trial: the second duels too and wins.
    Each duel weighs its runner against its own reading of torch, which drifts on a shared CPU
    host while a busy wait does not: the second's trial also reads it slower than it is, so that
    its win is wider than that drift. Taken again where the engine reports the host noisy
    (``first_judged``)."""
    from planted import Busy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    def run() -> TuneOutcome:
        class First(Busy):
            name, busy_s = "first", 100e-6

        class Second(Busy):
            name, busy_s = "second", 115e-6

        def change_after_its_trial(m):
            if m.source == "first":
                First.busy_s = 140e-6  # slower, though not beyond a disturbed spread
            if m.source == "second":
                Second.busy_s = 80e-6

        key = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
        return tuned_uncut(key, [First(), Second()], on_result=change_after_its_trial)

    outcome = first_judged(run, quiet)
    first = by_params(outcome)["first"]
    assert outcome.winner.source == "second", [
        (m.candidate, m.median_us, m.error) for m in outcome.measurements
    ]
    assert "kept" in first.error and "then second confirmed faster" in first.error


@pytest.mark.cpu_host
def test_a_disturbed_timing_is_taken_again(one_thread):
    from planted import Disturbed

    # a budget of hundreds of its calls: the disturbed ones are a fifth of the first timing;
    # cut-offs that cannot cut: it is torch's twin, and its retake must stand on any host
    outcome = tuned_with(Disturbed(), budget_s=0.02, cut_factor=1e9, late_cut=1e9)
    timed = by_params(outcome)["disturbed"]
    assert timed.status == "ok", timed.error
    assert timed.p90_us < Disturbed.wait_s * 1e6 / 2  # the retake's, not the disturbed one's


def test_the_numerics_check_covers_a_later_call_not_only_the_first():
    from planted import RightOnce

    outcome = tuned_with(RightOnce(), budget_s=0.01)
    assert by_params(outcome)["right_once"].status == "rejected"


HAS_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_confirmation_times_both_in_a_cuda_graph(memoized):
    """A host-bound win is confirmed eagerly and in a CUDA graph; a duel the host disturbed
    (its rounds scattered: the memoized call is all host time) is taken again."""
    for launch in ("eager", "graph"):
        # cut-offs that cannot cut: the rule under test is the duel's, not this host's speed
        options = TuneOptions(
            budget_s=0.02, cut_factor=1e9, late_cut=1e9, sources=["memoized"], launch=launch
        )
        outcome = first_judged(lambda options=options: tune(KEY, options=options), quiet)
        errors = {m.candidate: m.error for m in outcome.measurements}
        assert outcome.winner.source == "memoized", (launch, errors)
        assert "in a CUDA graph" in by_params(outcome)["memoized"].error


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_a_tie_goes_to_the_duel_and_a_twin_of_the_baseline_does_not_win():
    from planted import Twin

    outcome = tuned_with(Twin(), budget_s=0.02)
    twin = by_params(outcome)["twin"]
    assert outcome.winner.source == "torch", twin.error
    if twin in duels(outcome.measurements, TuneOptions(), "cuda"):
        assert "in a CUDA graph" in twin.error and "lost" in twin.error  # it met the baseline


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_graph_launch_ranks_candidates_by_gpu_time():
    """A challenger slow eagerly (host work) but fastest on the GPU: an eager caller keeps the
    baseline, a caller that replays graphs gets the challenger."""
    from planted import HostHeavy

    winners = {launch: tuned_with(HostHeavy(), launch, budget_s=0.02) for launch in LAUNCHES}
    assert winners["eager"].winner.source == "torch"
    graph = winners["graph"]
    assert graph.winner.source == "hostheavy", {m.candidate: m.error for m in graph.measurements}
    assert by_params(graph)["hostheavy"].median_us < by_params(graph)["torch"].median_us


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_a_challenger_that_cannot_be_captured_loses():
    from planted import Uncapturable

    Uncapturable.slow = False
    # cut-offs that cannot cut: the challenger must reach the duel on any host
    outcome = tuned_with(Uncapturable(), budget_s=0.02, cut_factor=1e9, late_cut=1e9)
    assert outcome.winner.source == "torch"
    assert "cannot be captured in a CUDA graph" in by_params(outcome)["uncapturable"].error
    assert torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_an_eager_win_slower_on_the_gpu_loses_and_says_so(monkeypatch):
    """torch's tiny f32 GEMM is host-bound eagerly (its launch outlasts its few-us kernel); a
    challenger quick to launch whose kernel spins between the two (their geometric mean) is
    faster eagerly and slower on the GPU: served, it would make every graph-replayed step
    slower, so it loses, and its note says so. The spin is set from this GPU's own readings."""
    from planted import GpuBusy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)
    a = torch.randn(KEY.m, KEY.k, device="cuda")
    b = torch.randn(KEY.k, KEY.n, device="cuda")
    gpu_us = timing.graph_time(lambda i: torch.matmul(a, b)).median_us
    eager_us = timed_baseline(
        tune(KEY, options=TuneOptions(budget_s=0.02, sources=[])).measurements
    ).median_us
    if eager_us < 2.5 * gpu_us:
        pytest.skip(
            f"torch's GEMM not host-bound here ({eager_us:.1f} us eager, {gpu_us:.1f} on the GPU)"
        )
    spin_us = (gpu_us * eager_us) ** 0.5
    us_per_cycle = timing.graph_time(lambda i: torch.cuda._sleep(10_000)).median_us / 10_000

    class QuickLaunch(GpuBusy):
        name, busy_s, gpu_cycles = "quick_launch", 0.0, round(spin_us / us_per_cycle)

    outcome = tuned_uncut(KEY, [QuickLaunch()])
    got = by_params(outcome)
    chal, base = got["quick_launch"], got["torch"]
    assert chal.median_us < base.median_us * 0.9, ("faster eagerly in its trial", chal, base)
    assert outcome.winner.source == "torch", chal.error
    assert re.search(r"lost: [^(]*slower on the GPU \(margin", chal.error), chal.error


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_of_two_challengers_tied_by_their_launches_the_faster_on_the_gpu_serves(monkeypatch):
    """Both beat torch's ~0.3 ms f32 GEMM by far behind ~80 us of host work and one spin-kernel
    launch a call; one spins the GPU ~25 us a call, the other a few cycles. The idle one's trial
    ran beside a disturbance (10 us more host work a call), so the busy one ranks first and keeps
    its win over torch; the idle one tied it (within 25% noise), duels it, ties it eagerly (its
    launch 10 us shorter by then: inside the noise, and no eager loss for a host's jitter to
    make of it) and wins on the GPU. The trial sits 10 us from either edge of the tie: a host's
    jitter moves neither the ranking nor the tie. A host busy beside the test (another pytest compiling) can
    read the busy one's trial launch far slower than its 80 us, which ranks it second: up to
    three tunes, the first whose trials ranked them as planted (by ``effective_us``, as the
    duels' order has it: a call's event time may pass its host time) judged."""
    from planted import GpuBusy, Memoized

    monkeypatch.setattr(Memoized, "slow", False)

    class Quick(GpuBusy):
        name, gpu_cycles = "quick_gpu", 1

    class Slow(GpuBusy):
        name, busy_s = "slow_gpu", 80e-6

    def quieter_after_its_trial(m):
        if m.source == "quick_gpu":
            Quick.busy_s = 70e-6

    key = GemmKey(m=1024, n=1024, k=8192, dtype="f32", out_dtype="f32")
    for _ in range(3):
        Quick.busy_s = 90e-6  # its trial, beside a disturbance
        outcome = tuned_uncut(
            key, [Quick(), Slow()], min_noise=0.25, on_result=quieter_after_its_trial
        )
        got = by_params(outcome)
        errors = {name: (m.median_us, m.host_us, m.error) for name, m in got.items()}
        slow, quick = (
            effective_us(got[n], outcome.winner.launch) for n in ("slow_gpu", "quick_gpu")
        )
        if slow < quick:
            break
    assert slow < quick, ("ranked as planted", errors)
    assert outcome.winner.source == "quick_gpu", errors
    assert outcome.winner.median_us < outcome.winner.baseline_us / 2
    assert "kept" in got["slow_gpu"].error, errors  # ranked first, it met torch first
    assert "quick_gpu, whose trial tied it, won their duel" in got["slow_gpu"].error, errors
    assert "vs slow_gpu" in got["quick_gpu"].error, errors


class Compiling(Source):
    """Logs its precompile and build calls; one name can fail its precompile."""

    op = "gemm"
    events: ClassVar[list[tuple[str, str, object]]] = []

    def __init__(self, name: str, *, broken: bool = False) -> None:
        self.name, self.broken = name, broken

    def candidates(self, key, device):
        return [{"tile": 1}, {"tile": 2}]

    def precompile(self, key, shortlist):
        Compiling.events.append(("precompile", self.name, shortlist))
        if self.broken:
            raise RuntimeError("compiler crashed")

    def build(self, key, params):
        Compiling.events.append(("build", self.name, params))
        return lambda a, b, out=None: torch.matmul(a, b, out=out)


def test_every_source_precompiles_its_shortlist_before_any_timing():
    Compiling.events = []
    sources = [Compiling("compiling_a"), Compiling("compiling_b", broken=True)]
    for src in sources:
        registry.register(src)
    try:
        outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=[s.name for s in sources]))
    finally:
        for src in sources:
            registry.unregister(src.name)
    kinds = [kind for kind, _, _ in Compiling.events]
    assert kinds[:2] == ["precompile", "precompile"] and "precompile" not in kinds[2:]
    shortlist = [{"tile": 1}, {"tile": 2}]
    assert {(name, str(p)) for _, name, p in Compiling.events[:2]} == {
        ("compiling_a", str(shortlist)), ("compiling_b", str(shortlist))
    }  # fmt: skip
    # a failed precompile leaves each candidate to its own build, which works here
    statuses = {m.candidate: m.status for m in outcome.measurements if m.source == "compiling_b"}
    assert len(statuses) == 2 and set(statuses.values()) <= {"ok", "cut"}


def test_a_resumed_run_precompiles_only_what_is_left():
    Compiling.events = []
    src = Compiling("compiling_a")
    registry.register(src)
    try:
        first = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["compiling_a"]))
        done = [m for m in first.measurements if m.params == {"tile": 1}]
        Compiling.events = []
        tune(KEY, options=TuneOptions(budget_s=0.005, sources=["compiling_a"]), prior=done)
    finally:
        registry.unregister("compiling_a")
    assert Compiling.events[0] == ("precompile", "compiling_a", [{"tile": 2}])


@pytest.mark.parametrize("launch", ["eager", "graph"])
def test_the_winner_and_measurements_record_the_launch_mode(launch):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=[], launch=launch))
    assert outcome.winner.launch == launch
    assert {m.launch for m in outcome.measurements} == {launch}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"launch": "warp"}, "launch must be one of ['eager', 'graph'], got 'warp'"),
        ({"cut_factor": 0.5}, "cut_factor must be >= 1, got 0.5"),
        ({"budget_s": -1.0}, "budget_s must be >= 0, got -1.0"),
        ({"confirm_rounds": -1}, "confirm_rounds must be >= 0, got -1"),
    ],
)
def test_bad_options_name_the_field_the_value_and_what_is_allowed(fields, message):
    with pytest.raises(ValueError) as e:
        TuneOptions(**fields)
    assert str(e.value) == message


def test_the_engine_runs_in_process_only():
    with pytest.raises(ValueError, match=r"through tuner\.tuning\.tune"):
        tune(KEY, options=TuneOptions(isolate=True))


def test_the_cut_is_tighter_where_the_best_is_a_steady_gpu_bound_call():
    options = TuneOptions(cut_factor=1.5, steady_cut=1.1)
    assert cut_off(None, "cuda", options) is None  # nothing timed yet: nothing to cut against
    assert cut_off(1000.0, "cuda", options) == pytest.approx(1100.0)
    assert cut_off(10.0, "cuda", options) == pytest.approx(15.0)  # launch-bound: noisy probes
    assert cut_off(1000.0, "cpu", options) == pytest.approx(1500.0)
    with pytest.raises(ValueError, match="steady_cut must be >= 1"):
        TuneOptions(steady_cut=0.9)
    with pytest.raises(ValueError, match="late_cut must be >= 1"):
        TuneOptions(late_cut=0.9)


def test_challengers_timed_in_an_earlier_run_go_first_fastest_first(planted):
    """A warm re-tune times what was fastest last time first, so the cut-off is tight at once."""
    first = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]))
    earlier = earlier_times(first.measurements, "eager")
    timed = {m.candidate for m in first.measurements if m.status == "ok" or m.median_us}
    assert set(earlier) == timed and all(t > 0 for t in earlier.values())
    assert any(m.status == "cut" for m in first.measurements if m.candidate in earlier)
    assert earlier_times(first.measurements, "graph") == {}  # other launch modes say nothing

    names = [m.candidate for m in first.measurements if not m.is_baseline and m.params]
    hinted = {names[-1]: 1.0, names[-2]: 2.0}  # the plan's last two, in reverse
    order = []
    tune(
        KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]), earlier=hinted,
        on_start=lambda source, params: order.append(candidate_name(source.name, params)),
    )  # fmt: skip
    challengers = [n for n in order if n in names]
    assert challengers[:2] == [names[-1], names[-2]]
    assert challengers[2:] == [n for n in names if n not in hinted]


def test_a_problems_tuning_time_is_split_into_its_phases(planted):
    outcome = tune(KEY, options=TuneOptions(budget_s=0.005, sources=["planted"]))
    assert list(outcome.phases) == list(PHASES)
    assert all(t >= 0 for t in outcome.phases.values())
    assert sum(outcome.phases.values()) == pytest.approx(outcome.seconds)
    assert outcome.phases["compile"] >= outcome.compile_s


def test_a_runners_first_call_on_each_input_set_is_set_up_not_timing(monkeypatch):
    """A runner's first call on an operand may convert it (a weight layout made once per
    tensor): the warm-up covers every input set, however short the warm-up itself, so no
    timed call includes a conversion (else the probe's calls would, and it would be cut)."""
    from planted import ConvertsOnFirstSight, Memoized

    from tuner.measure import samples

    monkeypatch.setattr(timing, "WARMUP", 1)
    monkeypatch.setattr(Memoized, "slow", False)
    assert len(samples.input_sets(KEY, "cpu", 0)) >= 4  # the probe's 3 calls: all first sights
    # cut-offs far above this host's noise and far below a conversion (tens of ms): a probe
    # that converted is still cut, one slowed by a busy box is not
    outcome = tuned_with(ConvertsOnFirstSight(), budget_s=0.005, cut_factor=100, late_cut=100)
    timed = by_params(outcome)["converts_on_first_sight"]
    assert timed.status == "ok", timed.error
    assert timed.median_us < ConvertsOnFirstSight.first_sight_s * 1e6 / 10


def test_a_failed_baseline_ends_the_tuning_before_any_challenger_is_compiled():
    """Nothing could be judged against it: no challenger's compile or timing is spent (here the
    baseline crashed a worker earlier, and the run resumes from that record)."""
    [base] = tune(KEY, options=TuneOptions(budget_s=0.005, sources=[])).measurements
    crashed = dataclasses.replace(base, status="failed", median_us=None, error="worker died")
    Compiling.events = []
    registry.register(Compiling("compiling_a"))
    try:
        with pytest.raises(RuntimeError, match=r"the baseline failed on .*: worker died"):
            tune(KEY, options=TuneOptions(budget_s=0.005, sources=["compiling_a"]), prior=[crashed])
    finally:
        registry.unregister("compiling_a")
    assert Compiling.events == []

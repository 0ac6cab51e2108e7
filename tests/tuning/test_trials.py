"""How the duels that confirm a win are run in turn (``tuner.tuning.trials.confirmed``): with
scripted duel outcomes on the CPU, and with twins of the baseline at the GPU's power limit."""

from __future__ import annotations

import pytest
import torch
from planted import BrokenInDuel, Level, Twin
from quiet_host import first_judged, undisturbed

from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.measure.records import Measurement, Winner
from tuner.tuning.engine import tune
from tuner.tuning.options import TuneOptions
from tuner.tuning.trials import SUSTAINED_TRIES, Trial, confirmed, reconfirmed
from tuner.tuning.verdict import tied_in_trial

KEY = GemmKey(m=64, n=64, k=64, dtype="f32", out_dtype="f32")


def timed(name: str, us: float, baseline: bool = False) -> Measurement:
    return Measurement(
        device_class="d", key=str(KEY), source=name, params={}, status="ok",
        is_baseline=baseline, median_us=us, p10_us=us, p90_us=us, host_us=0.0,
    )  # fmt: skip


class ScriptedDuels(Trial):
    """A trial whose duels end as scripted: (kept, sustained) by challenger."""

    def __init__(self, outcomes: dict[str, tuple[bool, bool]]) -> None:
        self.key, self.device, self.stretched = KEY, "cpu", {}
        self.outcomes, self.dueled = outcomes, []

    def confirm(self, base, challenger, options, base_name="baseline"):
        kept, sustained = self.outcomes[challenger.candidate]
        self.stretched[base.candidate, challenger.candidate] = sustained
        self.dueled.append(challenger.candidate)
        chosen = challenger if kept else base
        return chosen, base.median_us, chosen.median_us


def run(outcomes: dict[str, tuple[bool, bool]]) -> tuple[str, list[str]]:
    """The chosen candidate and the challengers dueled, in order (fastest first)."""
    trial = ScriptedDuels(outcomes)
    base = timed("torch", 100.0, baseline=True)
    order = [timed(name, 80.0 + i) for i, name in enumerate(outcomes)]
    chosen, _, _ = confirmed(trial, base, order, TuneOptions(confirm_tries=4))
    return chosen.candidate, trial.dueled


def test_two_duels_lost_at_the_power_limit_keep_the_baseline_without_more():
    lost_at_limit = (False, True)
    assert SUSTAINED_TRIES == 2
    chosen, dueled = run({"a": lost_at_limit, "b": lost_at_limit, "c": (True, True)})
    assert (chosen, dueled) == ("torch", ["a", "b"])


def test_a_second_try_at_the_power_limit_may_still_win():
    chosen, dueled = run({"a": (False, True), "b": (True, True), "c": (True, True)})
    assert (chosen, dueled) == ("b", ["a", "b"])


def test_only_duels_at_the_power_limit_count_against_the_tries():
    quick_loss, lost_at_limit = (False, False), (False, True)
    chosen, dueled = run({"a": quick_loss, "b": lost_at_limit, "c": quick_loss, "d": lost_at_limit})
    assert (chosen, dueled) == ("torch", ["a", "b", "c", "d"])
    assert run({"a": quick_loss, "b": quick_loss, "c": quick_loss, "d": (True, False)})[0] == "d"


def settled_on(name: str, us: float, base_us: float = 100.0) -> Winner:
    """A first pass's verdict: ``name`` at ``us`` against the baseline's ``base_us``."""
    return Winner(
        device_class="d", key=str(KEY), source=name, params={}, median_us=us, baseline_us=base_us,
    )  # fmt: skip


def test_a_second_pass_goes_on_from_the_duels_its_first_pass_lost_at_the_power_limit():
    """Its first pass lost one duel at the power limit, to a challenger one pass would have
    duelled first: one more loss there keeps the baseline, as in one pass over every
    candidate."""
    trial = ScriptedDuels({"x": (False, True), "y": (True, True)})
    base, lost = timed("torch", 100.0, baseline=True), timed("w", 79.0)
    trial.stretched = {(base.candidate, lost.candidate): True}  # as engine.tune hands it on
    new = [timed("x", 80.0), timed("y", 81.0)]
    chosen, _, _ = reconfirmed(
        trial, base, settled_on("torch", 100.0), [base, lost, *new], new, TuneOptions()
    )
    assert (chosen.candidate, trial.dueled) == ("torch", ["x"])


def test_a_second_pass_duels_a_new_contender_one_pass_would_have_duelled_first():
    """Its first pass lost two duels at the power limit, to challengers that one pass would
    have duelled only after a faster new one: that one duels, and wins, as in one pass."""
    trial = ScriptedDuels({"n": (True, False)})
    base = timed("torch", 100.0, baseline=True)
    a, b, n = timed("a", 80.0), timed("b", 81.0), timed("n", 70.0)
    trial.stretched = {(base.candidate, a.candidate): True, (base.candidate, b.candidate): True}
    chosen, _, _ = reconfirmed(
        trial, base, settled_on("torch", 100.0), [base, a, b, n], [n], TuneOptions()
    )
    assert (chosen.candidate, trial.dueled) == ("n", ["n"])
    # one pass over the same candidates, with the same duels' outcomes
    once = ScriptedDuels({"n": (True, False), "a": (False, True), "b": (False, True)})
    assert confirmed(once, base, [n, a, b], TuneOptions())[0] is n and once.dueled == ["n"]


def test_a_second_pass_duels_a_new_one_whose_trial_beats_the_kept_ones_confirmed_time():
    """The first pass kept k, whose duel read it slower than its trial; a new challenger slower
    than k's trial but faster than its confirmed time is the one one pass would have duelled
    next (``runner_up``): it duels k."""
    trial = ScriptedDuels({"n": (True, False)})
    base, kept, n = timed("torch", 100.0, baseline=True), timed("k", 60.0), timed("n", 65.0)
    trial.stretched = {(base.candidate, kept.candidate): False}
    chosen, _, _ = reconfirmed(
        trial, base, settled_on("k", 75.0), [base, kept, n], [n], TuneOptions()
    )
    assert (chosen.candidate, trial.dueled) == ("n", ["n"])
    assert "then n, whose trial beat its confirmed time, won their duel" in kept.error


def test_a_second_pass_without_duels_serves_one_pass_verdict():
    """``confirm_rounds`` 0: no duel, in either pass; the fastest trial serves."""
    trial = ScriptedDuels({})
    base, kept, n = timed("torch", 100.0, baseline=True), timed("k", 60.0), timed("n", 50.0)
    options = TuneOptions(confirm_rounds=0)
    chosen, base_us, chosen_us = reconfirmed(
        trial, base, settled_on("k", 60.0), [base, kept, n], [n], options
    )
    assert (chosen, base_us, chosen_us, trial.dueled) == (n, 100.0, 50.0, [])


class Twins(Twin):
    """Three copies of the baseline's kernel: every duel of theirs is a tie that keeps it."""

    name = "twins"

    def candidates(self, key, device):
        return [{"copy": i} for i in range(3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_twins_of_a_heavy_baseline_duel_at_the_power_limit_at_most_twice():
    """A 4096^3 bf16 GEMM draws the GPU to its power limit: its duels are sustained. A 30%
    noise makes every twin a tie that goes to a duel, and a duel it cannot win (a twin whose
    trial ran after the clock fell to the power limit reads slower than the baseline's did
    before: at 10% such a twin need not tie, and would not duel). A host slack of 100%: a twin's
    host time (a Python call, above torch's) read high once would keep it out of the duel by the
    launch rule, which is not what this tests."""
    registry.register(Twins())
    try:
        options = TuneOptions(sources=["twins"], min_noise=0.3, host_slack=1.0, prune=False,
                              cut_factor=1e9, late_cut=1e9)  # fmt: skip
        outcome = tune(GemmKey(m=4096, n=4096, k=4096), options=options)
    finally:
        registry.unregister("twins")
    notes = {m.candidate: m.error or "" for m in outcome.measurements if m.source == "twins"}
    dueled = [name for name, note in notes.items() if "confirmation: " in note]
    assert outcome.winner.source == "torch", notes
    assert len(dueled) == SUSTAINED_TRIES, notes
    assert all("stretches" in notes[name] and "lost" in notes[name] for name in dueled), notes


def test_a_tie_in_its_trial_that_wins_one_eager_take_must_win_a_second(monkeypatch, one_thread):
    """A challenger level with torch's 256^3 GEMM in its trial, far ahead in its duel's first
    take (a lucky stretch), level again in the take after: its trial was a tie, so one take
    does not make it the winner. The duel run by a real trial on the CPU (whose engine duels
    no ties: on a GPU it does). Level is torch's own matmul, so that it stays level however
    loaded the host; taken again (``first_judged``) where the host disturbed the duel, or where
    the engine took the first take again (already level by then: no tie to take a second time)."""
    from tuner.candidates.base import Params, Source

    key = GemmKey(m=256, n=256, k=256, dtype="f32", out_dtype="f32")
    options = TuneOptions(budget_s=0.02, min_noise=0.25)

    def record(source: Source, params: Params, status: str, **fields) -> Measurement:
        return Measurement(
            device_class="cpu", key=str(key), source=source.name, params=params, status=status,
            is_baseline=source.is_baseline(params), launch="eager", **fields,
        )  # fmt: skip

    real_rounds = Trial.rounds

    def level_after_one_take(self, *args, **kwargs):
        readings = real_rounds(self, *args, **kwargs)
        Level.ahead = False
        return readings

    monkeypatch.setattr(Trial, "rounds", level_after_one_take)

    def run() -> tuple[Measurement, Measurement, Measurement]:
        Level.ahead = False  # its trial: torch's matmul, level with torch
        trial = Trial.for_key(key, "cpu", options.seed, record)
        base = trial.run(registry.get("torch"), {}, None, options)
        level = trial.run(Level(), {}, None, options, base=base)
        Level.ahead = True  # its duel's first take: far ahead
        chosen, _, _ = trial.confirm(base, level, options)
        return base, level, chosen

    def judged(run: tuple[Measurement, Measurement, Measurement]) -> bool:
        base, level, _ = run
        return (
            tied_in_trial((base.median_us, level.median_us), 0.25)
            and undisturbed(level.error)
            and "a tie in its trial" in level.error
        )

    base, level, chosen = first_judged(run, judged)
    assert tied_in_trial((base.median_us, level.median_us), 0.25), (base, level)
    assert chosen is base, level.error
    assert "a tie in its trial, so taken again" in level.error, level.error
    assert "not ahead" in level.error, level.error
    assert "lost: not ahead in the second take (margin" in level.error, level.error


def test_a_challenger_whose_duel_raises_loses_it_and_the_problem_keeps_its_measurements():
    """Faster in its trial, then raising in its duel: the baseline serves, the challenger's
    measurement says why it lost, and nothing the problem measured is lost."""
    source = BrokenInDuel()
    registry.register(source)

    def break_after_its_trial(m: Measurement) -> None:
        if m.source == source.name and m.status == "ok":
            BrokenInDuel.broken = True

    try:
        options = TuneOptions(budget_s=0.02, sources=[source.name], prune=False)
        outcome = tune(KEY, options=options, on_result=break_after_its_trial)
    finally:
        registry.unregister(source.name)
        BrokenInDuel.broken = False
    assert outcome.winner.source == "torch"
    [challenger] = [m for m in outcome.measurements if m.source == source.name]
    assert challenger.status == "ok" and "duel: RuntimeError: CUDA error" in challenger.error

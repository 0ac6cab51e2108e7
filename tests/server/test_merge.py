"""The merge policy on plain records: median of medians, one voice per submitter, confirmation."""

from __future__ import annotations

import pytest

from server.merge import Sample, aggregate, decide, effective_us, propose

BASE, FAST, ODD = "torch", 'triton_gemm:{"bm":64}', 'triton_gemm:{"bm":128}'


def s(cand: str, sub: str, us: float, noise: float = 0.02) -> Sample:
    return Sample(cand, cand.partition(":")[0], "{}", cand == BASE, sub, us, noise)


def test_median_of_medians_gives_each_submitter_one_voice():
    # host a: 100 us three times; host b: 110 once; a flood of 50 fakes from host p counts once
    samples = [s(BASE, "a", 100), s(BASE, "a", 99), s(BASE, "a", 101), s(BASE, "b", 110)]
    samples += [s(BASE, "p", 1.0) for _ in range(50)]
    agg = aggregate(samples)[BASE]
    assert agg.voices == {"a": 100, "b": 110, "p": 1.0}
    assert agg.us == 100  # the median of the three voices, not of the 54 samples
    assert agg.count == 54 and agg.submitters == 3
    assert agg.spread == pytest.approx((110 - 1) / 100)


def test_effective_time_counts_host_launch_overhead():
    assert effective_us(5.0, 8.0) == 8.0
    assert effective_us(5.0, None) == 5.0


def test_baseline_keeps_the_win_within_noise():
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 99.5)])
    assert propose(aggs, min_noise=0.01).candidate == BASE
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 90)])
    assert propose(aggs, min_noise=0.01).candidate == FAST


def test_one_token_with_a_stretched_spread_cannot_widen_the_margin():
    """A token that sends one baseline row with p10 far below and p90 far above its median
    would, with the noise taken over rows, make any challenger's win look like noise."""
    honest = [s(BASE, "a", 10.0), s(FAST, "a", 8.5)]
    rogue = s(BASE, "b", 10.0, noise=1e11)
    assert propose(aggregate([*honest, rogue]), min_noise=0.01).candidate == FAST
    assert aggregate([*honest, rogue])[BASE].noise == 0.02


def test_small_improvement_is_served_at_once():
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 90)])
    d = decide(aggs, served=None)
    assert (d.action, d.proposal.candidate) == ("serve", FAST)


def test_large_change_from_one_submitter_is_held():
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 20)])
    d = decide(aggs, served=None)
    assert d.action == "pending" and d.supporters == ("a",)
    assert "needs a second submitter" in d.reason


def test_second_submitter_confirms_a_large_change():
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 20), s(BASE, "b", 98), s(FAST, "b", 22)])
    d = decide(aggs, served=BASE)
    assert d.action == "serve" and d.supporters == ("a", "b")


def test_admin_token_confirms_alone():
    aggs = aggregate([s(BASE, "root", 100), s(FAST, "root", 20)])
    assert decide(aggs, served=None, admins=frozenset({"root"})).action == "serve"
    # an admin elsewhere in the fleet does not vouch for someone else's numbers
    assert decide(aggs, served=None, admins=frozenset({"other"})).action == "pending"


def test_a_poisoner_cannot_make_the_winner_look_slow():
    # served FAST (confirmed by a and b); p claims FAST takes 100x longer on its machine
    honest = [s(BASE, h, 100) for h in "ab"] + [s(FAST, h, 20) for h in "ab"]
    poison = [s(BASE, "p", 100), s(FAST, "p", 2000)]
    d = decide(aggregate(honest + poison), served=FAST)
    assert d.action == "keep"  # median of (20, 20, 2000) is still 20
    # with only one honest host the median moves, but the change is held for confirmation
    one = [s(BASE, "a", 100), s(FAST, "a", 20), *poison]
    d = decide(aggregate(one), served=FAST)
    assert d.action == "pending" and d.proposal.candidate == BASE and d.supporters == ("p",)


def test_no_baseline_no_winner():
    d = decide(aggregate([s(FAST, "a", 20)]), served=None)
    assert d.action == "keep" and d.proposal is None


def test_served_winner_still_best_is_kept():
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 20), s(ODD, "a", 21)])
    assert decide(aggs, served=FAST).action == "keep"
    # a close challenger overtaking the served winner is a small change: served at once
    aggs = aggregate([s(BASE, "a", 100), s(FAST, "a", 20), s(ODD, "a", 19)])
    d = decide(aggs, served=FAST)
    assert (d.action, d.proposal.candidate) == ("serve", ODD)

"""Merge policy: many hosts' measurements of one problem -> the one winner every host is served.

Pure functions over plain records, so the policy can be read and tested without a database.

- Each submitter (token) gets one voice per candidate: the median of its own medians (its
  latest 32 results, see ``server.results.RECENT``). The
  fleet's figure for a candidate is the median of those voices ("median of medians"), so one
  host that submits a thousand times or one absurd number cannot move it alone.
- The proposal is the fastest candidate, except that the baseline keeps the win unless the
  challenger beats it by more than the noise (the engine's rule, applied to fleet figures).
- A proposal that differs from what is served (or, for a new problem, from the baseline) by more
  than ``confirm_margin`` needs *two* submitters whose own results show it faster, or one admin
  token. Until then it is pending and the old winner stays served.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MIN_US = 1e-6  # a picosecond: no kernel is timed faster, and a ratio of two times stays finite


@dataclass(frozen=True)
class Sample:
    """One ok measurement, reduced to what the merge needs."""

    candidate: str
    source: str
    params: str  # canonical JSON
    is_baseline: bool
    submitter: str
    us: float  # what the caller waits for (see ``effective_us``)
    noise: float  # the measurement's own (p90 - p10) / median
    run_id: str = ""
    launch: str = "eager"


@dataclass
class Aggregate:
    """The fleet's figure for one candidate of one problem."""

    candidate: str
    source: str
    params: str
    is_baseline: bool
    us: float
    spread: float
    noise: float
    count: int
    voices: dict[str, float] = field(default_factory=dict)  # submitter -> its median
    run_id: str = ""
    launch: str = "eager"  # the launch mode of its latest result

    @property
    def submitters(self) -> int:
        return len(self.voices)

    def to_row(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate, "source": self.source, "params": self.params,
            "is_baseline": int(self.is_baseline), "us": self.us, "spread": self.spread,
            "noise": self.noise, "count": self.count, "submitters": self.submitters,
        }  # fmt: skip


@dataclass(frozen=True)
class Decision:
    """What to do with a problem after a submission.

    ``action``: ``serve`` (make ``proposal`` the served winner), ``pending`` (keep the served
    winner, remember the proposal) or ``keep`` (the served winner stays; nothing pending).
    """

    action: str
    proposal: Aggregate | None
    reference: Aggregate | None
    margin: float = 0.0
    supporters: tuple[str, ...] = ()
    reason: str = ""


def effective_us(median_us: float, host_us: float | None) -> float:
    """An eager caller waits for the GPU time or the host launch time, whichever is larger."""
    return max(median_us, host_us) if host_us else median_us


def aggregate(samples: Iterable[Sample]) -> dict[str, Aggregate]:
    """candidate -> Aggregate (median over submitters of each submitter's median time; the noise
    likewise, the lower middle one where the count is even: one token's wide spread, a row's
    p10 to p90 stretched, cannot widen the margin a challenger must win by)."""
    by_candidate: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_candidate[s.candidate].append(s)
    out: dict[str, Aggregate] = {}
    for cand, group in by_candidate.items():
        per_submitter: dict[str, list[float]] = defaultdict(list)
        noises: dict[str, list[float]] = defaultdict(list)
        for s in group:
            per_submitter[s.submitter].append(s.us)
            noises[s.submitter].append(s.noise)
        voices = {sub: statistics.median(v) for sub, v in per_submitter.items()}
        us = statistics.median(voices.values())
        first = group[-1]
        out[cand] = Aggregate(
            candidate=cand, source=first.source, params=first.params,
            is_baseline=first.is_baseline, us=us,
            spread=(max(voices.values()) - min(voices.values())) / us if us > 0 else 0.0,
            noise=statistics.median_low([statistics.median(v) for v in noises.values()]),
            count=len(group),
            voices=voices, run_id=first.run_id, launch=first.launch,
        )  # fmt: skip
    return out


def propose(aggs: dict[str, Aggregate], min_noise: float) -> Aggregate | None:
    """The fastest candidate, unless it beats the baseline by no more than the noise."""
    if not aggs:
        return None
    best = min(aggs.values(), key=lambda a: (a.us, a.candidate))
    base = next((a for a in aggs.values() if a.is_baseline), None)
    if base is None or best is base:
        return best
    margin = max(min_noise, base.noise / 2, best.noise / 2)
    return best if best.us < base.us * (1 - margin) else base


def supporters(aggs: dict[str, Aggregate], proposal: str, reference: str) -> tuple[str, ...]:
    """Submitters whose *own* medians show ``proposal`` faster than ``reference``."""
    mine, theirs = aggs[proposal].voices, aggs[reference].voices if reference in aggs else {}
    return tuple(sorted(s for s, us in mine.items() if s in theirs and us < theirs[s]))


def decide(
    aggs: dict[str, Aggregate],
    served: str | None,
    *,
    admins: frozenset[str] = frozenset(),
    confirm_margin: float = 0.25,
    min_noise: float = 0.01,
) -> Decision:
    """Apply the policy. ``served``: the candidate served now (None: nothing yet);
    ``admins``: submitters holding an admin token (one of them suffices to confirm)."""
    base = next((a for a in aggs.values() if a.is_baseline), None)
    if base is None:
        return Decision("keep", None, None, reason="no baseline measured: nothing to compare with")
    proposal = propose(aggs, min_noise)
    assert proposal is not None
    reference = aggs.get(served) if served else base
    if reference is None:  # served candidate has no measurement under these versions any more
        reference = base
    if served == proposal.candidate:
        return Decision("keep", proposal, reference, reason="the served winner is still the best")
    if proposal is reference:  # new problem whose best is the baseline
        return Decision("serve", proposal, reference, reason="the baseline is the best")
    # either direction counts: making the winner look slow is as much an attack as fast
    ratio = reference.us / proposal.us if proposal.us > 0 else float("inf")
    margin = max(ratio, 1 / ratio) - 1 if ratio > 0 else float("inf")
    backers = supporters(aggs, proposal.candidate, reference.candidate)
    if margin <= confirm_margin:
        return Decision("serve", proposal, reference, margin, backers, "small change")
    if len(backers) >= 2:
        return Decision(
            "serve", proposal, reference, margin, backers, "confirmed by two submitters"
        )
    if admins.intersection(backers):
        return Decision(
            "serve", proposal, reference, margin, backers, "confirmed by an admin token"
        )
    return Decision(
        "pending", proposal, reference, margin, backers,
        f"a {margin:.0%} change from {reference.candidate} needs a second submitter or an admin token",
    )  # fmt: skip

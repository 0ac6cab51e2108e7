"""Measurements in, served winners out.

``ingest`` stores a batch (idempotent by ``uid``) and re-merges every problem it touched, inside
the caller's write transaction, so that a winner, its sequence number and the queue never
disagree. Every change of a served winner takes the next value of one counter: a host that has
seen everything up to sequence ``n`` asks for ``since=n`` and misses nothing, whatever the clocks
say, because numbers are handed out under SQLite's write lock, in commit order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from server import merge
from server.store import WINNER_COLUMNS, FleetStore, Group
from tuner.measure.records import Measurement


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    served: list[str] = field(default_factory=list)  # keys whose served winner changed
    pending: list[str] = field(default_factory=list)  # keys with a change awaiting confirmation
    refused: list[str] = field(default_factory=list)  # why a measurement was not stored


@dataclass(frozen=True)
class Policy:
    confirm_margin: float = 0.25
    min_noise: float = 0.01


def ingest(
    store: FleetStore,
    measurements: Iterable[Measurement],
    submitter: str,
    *,
    admins: frozenset[str],
    policy: Policy,
) -> IngestOutcome:
    """Store measurements and re-merge the problems that got new ok results (open transaction).
    An ok result whose ``is_baseline`` disagrees with its candidate's first ok result is not
    stored, and ``refused`` says why: the merge would lose what to compare with. The rest of the
    batch is stored, so one such result cannot stop a host's pushes, which resend a refused
    batch."""
    now = time.time()
    out = IngestOutcome()
    touched: set[Group] = set()
    for i, m in enumerate(measurements):
        group = (m.device_class, m.versions, m.key)
        if m.status == "ok" and store.baseline_flag(group, m.candidate) not in (
            None,
            m.is_baseline,
        ):
            out.refused.append(
                f"measurements.{i}.is_baseline={str(m.is_baseline).lower()}: candidate "
                f"{m.candidate!r} of {m.key!r} was submitted with is_baseline="
                f"{str(not m.is_baseline).lower()} before; the baseline is one candidate, always"
            )
            continue
        if store.add_measurement({**m.to_row(), "submitter": submitter, "received_at": now}):
            out.accepted += 1
            if m.status == "ok":
                touched.add(group)
        else:
            out.duplicates += 1
    for group in sorted(touched):
        action = remerge(store, group, admins=admins, policy=policy)
        if action == "serve":
            out.served.append(group[2])
        elif action == "pending":
            out.pending.append(group[2])
    return out


RECENT = 32  # a token's voice: the median of its latest results per candidate


def _samples(store: FleetStore, group: Group) -> list[merge.Sample]:
    """The ok results the merge weighs: each token's latest ``RECENT`` per candidate, so a
    re-merge costs the same however long a key's history grows, and old runs age out."""
    return [
        merge.Sample(
            candidate=cand,
            source=src,
            params=params,
            is_baseline=bool(base),
            submitter=sub,
            us=merge.effective_us(med, host),
            run_id=run_id or "",
            noise=(p90 - p10) / med if p10 is not None and p90 is not None else 0.0,
            launch=launch,
        )
        for cand, src, params, base, sub, med, p10, p90, host, run_id, launch in store.recent_ok(
            group, RECENT
        )
    ]


def _aggregates(store: FleetStore, group: Group) -> dict[str, merge.Aggregate]:
    aggs = merge.aggregate(_samples(store, group))
    for cand, n in store.ok_counts(group).items():
        aggs[cand].count = n  # every ok result counts, also those older than the window
    return aggs


def remerge(store: FleetStore, group: Group, *, admins: frozenset[str], policy: Policy) -> str:
    """Recompute one problem's aggregates and apply the merge policy. Returns the action."""
    aggs = _aggregates(store, group)
    store.put_results(group, [a.to_row() for a in aggs.values()], time.time())
    served = store.served_candidate(group)
    d = merge.decide(
        aggs, served, admins=admins,
        confirm_margin=policy.confirm_margin, min_noise=policy.min_noise,
    )  # fmt: skip
    if d.action == "serve":
        assert d.proposal is not None
        serve(store, group, d.proposal, aggs)
    elif d.action == "pending":
        assert d.proposal is not None and d.reference is not None
        store.put_pending(
            group,
            {"candidate": d.proposal.candidate, "source": d.proposal.source,
             "params": d.proposal.params, "us": d.proposal.us,
             "served_candidate": d.reference.candidate, "served_us": d.reference.us,
             "margin": d.margin, "supporters": d.supporters},
        )  # fmt: skip
    else:
        store.clear_pending(group)
        base_us = _baseline_us(aggs)
        # same winner, fresher figures; no new seq (nothing to refresh against without a
        # baseline: a store written before baseline conflicts were refused may hold one so)
        if served is not None and served in aggs and base_us is not None:
            w = aggs[served]
            store.refresh_winner(group, w.us, base_us, w.submitters)
    return d.action


def _baseline_us(aggs: dict[str, merge.Aggregate]) -> float | None:
    return next((a.us for a in aggs.values() if a.is_baseline), None)


def serve(
    store: FleetStore, group: Group, winner: merge.Aggregate, aggs: dict[str, merge.Aggregate]
) -> int:
    """Make ``winner`` the served winner of ``group`` under a new sequence number (``aggs``
    hold a baseline: ``merge.decide`` serves nothing without one)."""
    base = _baseline_us(aggs)
    assert base is not None
    return store.serve(
        group,
        {"candidate": winner.candidate, "source": winner.source, "params": winner.params,
         "median_us": winner.us, "baseline_us": base,
         "speedup": base / winner.us if winner.us else 1.0, "run_id": winner.run_id,
         "submitters": winner.submitters, "updated_at": time.time(), "launch": winner.launch},
    )  # fmt: skip


def confirm_pending(store: FleetStore, group: Group) -> str | None:
    """Admin override: serve the pending proposal of ``group``. Returns its candidate, or None
    where nothing is pending or no baseline was measured to compare it with."""
    candidate = store.pending_candidate(group)
    aggs = _aggregates(store, group)
    if candidate is None or _baseline_us(aggs) is None:  # nothing to serve, or to compare with
        return None
    serve(store, group, aggs[candidate], aggs)
    return candidate


# --- reads -------------------------------------------------------------------------------------


def winner(store: FleetStore, device_class: str, key: str, versions: str | None) -> dict | None:
    """The served winner; without ``versions``, the one of the most recently served versions.

    Both forms are index lookups (primary key, or (device_class, key)): this is the hot read.
    """
    rows = store.winners_of(device_class, key, versions)
    return max(rows, key=lambda r: r["seq"]) if rows else None


FEED_COLUMNS = list(WINNER_COLUMNS)
_SEQ = FEED_COLUMNS.index("seq")


def feed(
    store: FleetStore, device_class: str, versions: str | None, since: int, limit: int
) -> tuple[list[tuple], bool, int]:
    """Winners changed after sequence ``since``, oldest first, as rows of ``FEED_COLUMNS``
    (params as their JSON text); whether more follow; and the cursor to ask from next. Rows,
    not objects: large pages are encoded, sent and decoded without repeating every field name.

    Rows JSON cannot carry are left out (``server.servable``). The cursor is the last row sent,
    where a host's pull keeps its position beside that row's mark; a page of rows all left out
    moves it past them, else a host would ask for them again forever."""
    rows = store.feed(device_class, versions, since, limit + 1)
    page = rows[:limit]
    kept = store.servable(page)
    cursor = (kept or page)[-1][_SEQ] if page else since
    return kept, len(rows) > limit, cursor

"""Measurements in, served winners out.

``ingest`` stores a batch (idempotent by ``uid``) and re-merges every problem it touched, inside
the caller's write transaction, so that a winner, its sequence number and the queue never
disagree. Every change of a served winner takes the next value of one counter: a host that has
seen everything up to sequence ``n`` asks for ``since=n`` and misses nothing, whatever the clocks
say, because numbers are handed out under SQLite's write lock, in commit order.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from server import merge
from tuner.cache import Store
from tuner.measure.records import Measurement

MEASUREMENT_COLS = (
    "uid", "submitter", "device_class", "versions", "key", "op", "candidate", "source", "params",
    "is_baseline", "status", "median_us", "p10_us", "p90_us", "reps", "host_us", "max_rel_err",
    "error", "host", "run_id", "created_at", "received_at",
)  # fmt: skip
_INSERT = (
    f"insert or ignore into srv_measurements({', '.join(MEASUREMENT_COLS)}) "
    f"values ({', '.join('?' * len(MEASUREMENT_COLS))})"
)
WINNER_COLS = (
    "device_class, versions, key, op, candidate, source, params, median_us, baseline_us, "
    "speedup, run_id, submitters, seq, updated_at"
)

Group = tuple[str, str, str]  # device class, versions, key


@dataclass
class IngestOutcome:
    accepted: int = 0
    duplicates: int = 0
    served: list[str] = field(default_factory=list)  # keys whose served winner changed
    pending: list[str] = field(default_factory=list)  # keys with a change awaiting confirmation


@dataclass(frozen=True)
class Policy:
    confirm_margin: float = 0.25
    min_noise: float = 0.01


def ingest(
    c: sqlite3.Connection,
    measurements: Iterable[Measurement],
    submitter: str,
    *,
    admins: frozenset[str],
    policy: Policy,
) -> IngestOutcome:
    """Store measurements and re-merge the problems that got new ok results (open transaction)."""
    now = time.time()
    out = IngestOutcome()
    touched: set[Group] = set()
    for m in measurements:
        row = {**m.to_row(), "submitter": submitter, "received_at": now}
        if c.execute(_INSERT, [row[k] for k in MEASUREMENT_COLS]).rowcount:
            out.accepted += 1
            if m.status == "ok":
                touched.add((m.device_class, m.versions, m.key))
        else:
            out.duplicates += 1
    for group in sorted(touched):
        action = remerge(c, group, admins=admins, policy=policy)
        if action == "serve":
            out.served.append(group[2])
        elif action == "pending":
            out.pending.append(group[2])
    return out


RECENT = 32  # a token's voice: the median of its latest results per candidate
_OK = "device_class = ? and versions = ? and key = ? and status = 'ok' and median_us > 0"


def _samples(c: sqlite3.Connection, group: Group) -> list[merge.Sample]:
    """The ok results the merge weighs: each token's latest ``RECENT`` per candidate, so a
    re-merge costs the same however long a key's history grows, and old runs age out."""
    rows = c.execute(
        "select candidate, source, params, is_baseline, submitter, median_us, p10_us, p90_us, "
        "host_us, run_id from (select *, row_number() over (partition by submitter, candidate "
        f"order by id desc) as recent from srv_measurements where {_OK}) "
        "where recent <= ? order by id",
        (*group, RECENT),
    )
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
        )
        for cand, src, params, base, sub, med, p10, p90, host, run_id in rows
    ]


def _aggregates(c: sqlite3.Connection, group: Group) -> dict[str, merge.Aggregate]:
    aggs = merge.aggregate(_samples(c, group))
    for cand, n in c.execute(
        f"select candidate, count(*) from srv_measurements where {_OK} group by candidate", group
    ):
        aggs[cand].count = n  # every ok result counts, also those older than the window
    return aggs


def remerge(c: sqlite3.Connection, group: Group, *, admins: frozenset[str], policy: Policy) -> str:
    """Recompute one problem's aggregates and apply the merge policy. Returns the action."""
    now = time.time()
    aggs = _aggregates(c, group)
    c.executemany(
        "insert or replace into srv_results(device_class, versions, key, candidate, source, "
        "params, is_baseline, us, spread, noise, count, submitters, updated_at) "
        f"values ({', '.join('?' * 13)})",
        [(*group, *a.to_row().values(), now) for a in aggs.values()],
    )
    row = c.execute(
        "select candidate from srv_winners where device_class = ? and versions = ? and key = ?",
        group,
    ).fetchone()
    served = row[0] if row else None
    d = merge.decide(
        aggs, served, admins=admins,
        confirm_margin=policy.confirm_margin, min_noise=policy.min_noise,
    )  # fmt: skip
    if d.action == "serve":
        serve(c, group, d.proposal, aggs)
    elif d.action == "pending":
        assert d.proposal is not None and d.reference is not None
        c.execute(
            "insert or replace into srv_pending(device_class, versions, key, candidate, source, "
            "params, us, served_candidate, served_us, margin, supporters, updated_at) "
            "values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*group, d.proposal.candidate, d.proposal.source, d.proposal.params, d.proposal.us,
             d.reference.candidate, d.reference.us, d.margin, json.dumps(d.supporters), now),
        )  # fmt: skip
    else:
        _clear_pending(c, group)
        if served is not None and served in aggs:  # same winner, fresher figures; no new seq
            base = _baseline_us(aggs)
            w = aggs[served]
            c.execute(
                "update srv_winners set median_us = ?, baseline_us = ?, speedup = ?, "
                "submitters = ? where device_class = ? and versions = ? and key = ?",
                (w.us, base, base / w.us if w.us else 1.0, w.submitters, *group),
            )
    return d.action


def _baseline_us(aggs: dict[str, merge.Aggregate]) -> float:
    return next(a.us for a in aggs.values() if a.is_baseline)


def _clear_pending(c: sqlite3.Connection, group: Group) -> None:
    c.execute("delete from srv_pending where device_class = ? and versions = ? and key = ?", group)


def serve(
    c: sqlite3.Connection, group: Group, winner: merge.Aggregate, aggs: dict[str, merge.Aggregate]
) -> int:
    """Make ``winner`` the served winner of ``group`` under a new sequence number."""
    (seq,) = c.execute(
        "update srv_counters set value = value + 1 where name = 'winner_seq' returning value"
    ).fetchone()
    base = _baseline_us(aggs)
    c.execute(
        f"insert or replace into srv_winners({WINNER_COLS}) "
        "values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (*group, group[2].partition(":")[0], winner.candidate, winner.source, winner.params,
         winner.us, base, base / winner.us if winner.us else 1.0, winner.run_id,
         winner.submitters, seq, time.time()),
    )  # fmt: skip
    _clear_pending(c, group)
    c.execute(
        "update srv_queue set state = 'done', updated_at = ? "  # lease_id kept: release() reports it
        "where device_class = ? and versions = ? and key = ?",
        (time.time(), *group),
    )
    return seq


def confirm_pending(c: sqlite3.Connection, group: Group) -> str | None:
    """Admin override: serve the pending proposal of ``group``. Returns its candidate or None."""
    row = c.execute(
        "select candidate from srv_pending where device_class = ? and versions = ? and key = ?",
        group,
    ).fetchone()
    if row is None:
        return None
    aggs = _aggregates(c, group)
    serve(c, group, aggs[row[0]], aggs)
    return row[0]


# --- reads -------------------------------------------------------------------------------------


def winner_row(row: sqlite3.Row | dict[str, Any]) -> dict[str, Any]:
    """A served winner as the API sends it (params as an object)."""
    out = dict(row)
    out["params"] = json.loads(out["params"])
    return out


def _query(store: Store, sql: str, args: Iterable[Any]) -> list[dict[str, Any]]:
    cur = store.db.conn.execute(sql, list(args))  # raw sqlite3: the hot reads go through here
    cols = [d[0] for d in cur.description]
    return [winner_row(dict(zip(cols, r, strict=True))) for r in cur]


def winner(store: Store, device_class: str, key: str, versions: str | None) -> dict | None:
    """The served winner; without ``versions``, the one of the most recently served versions.

    Both forms are index lookups (primary key, or (device_class, key)): this is the hot read.
    """
    where = "device_class = ? and key = ?" + (" and versions = ?" if versions is not None else "")
    args = [device_class, key] + ([versions] if versions is not None else [])
    rows = _query(store, f"select {WINNER_COLS} from srv_winners where {where}", args)
    return max(rows, key=lambda r: r["seq"]) if rows else None


def lookup(store: Store, device_class: str, versions: str, keys: list[str]) -> list[dict]:
    found: list[dict] = []
    for i in range(0, len(keys), 500):  # SQLite's bound-parameter limit
        chunk = keys[i : i + 500]
        found += _query(
            store,
            f"select {WINNER_COLS} from srv_winners where device_class = ? and versions = ? "
            f"and key in ({', '.join('?' * len(chunk))})",
            [device_class, versions, *chunk],
        )
    return found


FEED_COLUMNS = [c.strip() for c in WINNER_COLS.split(",")]


def feed(
    store: Store, device_class: str, versions: str | None, since: int, limit: int
) -> tuple[list[tuple], bool]:
    """Winners changed after sequence ``since``, oldest first, as rows of ``FEED_COLUMNS``
    (params as their JSON text); and whether more follow. Rows, not objects: a page of 10k
    winners is encoded, sent and decoded several times faster without repeated field names."""
    where = "device_class = ? and seq > ?" + (" and versions = ?" if versions is not None else "")
    args = [device_class, since] + ([versions] if versions is not None else [])
    rows = store.db.conn.execute(
        f"select {WINNER_COLS} from srv_winners where {where} order by seq limit ?",
        [*args, limit + 1],
    ).fetchall()
    return rows[:limit], len(rows) > limit


def pending(store: Store, device_class: str | None, limit: int) -> list[dict[str, Any]]:
    where = " where device_class = ?" if device_class else ""
    rows = store.db.query(
        f"select * from srv_pending{where} order by updated_at desc limit ?",
        [device_class, limit] if device_class else [limit],
    )
    return [
        {**r, "params": json.loads(r["params"]), "supporters": json.loads(r["supporters"])}
        for r in rows
    ]

"""Misses and the tuning queue built from them.

A miss (a key some host met without a winner) is counted per (device class, versions, key) and,
unless that problem already has a served winner, queued. Workers of the same device class and
versions claim the most-missed keys under a lease; a lease that runs out (dead worker) puts its
keys back, counting an attempt, and a key that used up ``max_attempts`` is marked failed rather
than handed out forever. A key is done as soon as a winner is served for it, whoever tuned it.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tuner.cache import Store


class LeaseError(LookupError):
    """A completion that names a lease this service cannot accept (unknown, not yours, done)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Lease:
    lease_id: str | None
    keys: list[str]
    expires_at: float | None
    expired_returned: int = 0  # keys this claim found under dead leases and put back


@dataclass
class Release:
    lease_expired: bool
    done: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def record_misses(
    c: sqlite3.Connection, device_class: str, versions: str, misses: list[tuple[str, int]]
) -> int:
    """Count misses and queue the unserved keys (open transaction). Returns newly queued keys."""
    now = time.time()
    c.executemany(
        "insert into srv_misses(device_class, versions, key, op, count, first_seen, last_seen) "
        "values (?, ?, ?, ?, ?, ?, ?) on conflict(device_class, versions, key) do update set "
        "count = count + excluded.count, last_seen = excluded.last_seen",
        [(device_class, versions, k, k.partition(":")[0], n, now, now) for k, n in misses],
    )
    queued = 0
    for key, n in misses:
        served = c.execute(
            "select 1 from srv_winners where device_class = ? and versions = ? and key = ?",
            (device_class, versions, key),
        ).fetchone()
        if served:
            continue
        inserted = c.execute(
            "insert into srv_queue(device_class, versions, key, op, state, misses, attempts, "
            "enqueued_at, updated_at) values (?, ?, ?, ?, 'queued', ?, 0, ?, ?) "
            "on conflict(device_class, versions, key) do nothing",
            (device_class, versions, key, key.partition(":")[0], n, now, now),
        ).rowcount
        queued += inserted
        if not inserted:
            c.execute(
                "update srv_queue set misses = misses + ?, updated_at = ? "
                "where device_class = ? and versions = ? and key = ?",
                (n, now, device_class, versions, key),
            )
    return queued


def expire_leases(c: sqlite3.Connection, max_attempts: int, now: float | None = None) -> int:
    """Return the keys of run-out leases to the queue (or fail them). Returns how many."""
    now = time.time() if now is None else now
    c.execute(
        "update srv_queue set attempts = attempts + 1, lease_id = null, lease_expires = null, "
        "updated_at = ?, state = case when attempts + 1 >= ? then 'failed' else 'queued' end "
        "where state = 'leased' and lease_expires <= ?",
        (now, max_attempts, now),
    )
    return c.execute("select changes()").fetchone()[0]


def claim(
    c: sqlite3.Connection,
    device_class: str,
    versions: str,
    *,
    worker: str,
    submitter: str,
    max_keys: int,
    lease_s: float,
    max_attempts: int,
) -> Lease:
    """Lease up to ``max_keys`` queued keys, most-missed first (open transaction)."""
    now = time.time()
    returned = expire_leases(c, max_attempts, now)
    keys = [
        r[0]
        for r in c.execute(
            "select key from srv_queue where device_class = ? and versions = ? and state = 'queued' "
            "order by misses desc, enqueued_at, key limit ?",
            (device_class, versions, max_keys),
        )
    ]
    if not keys:
        return Lease(None, [], None, returned)
    lease_id, expires = uuid.uuid4().hex, now + lease_s
    c.executemany(
        "update srv_queue set state = 'leased', lease_id = ?, lease_expires = ?, updated_at = ? "
        "where device_class = ? and versions = ? and key = ?",
        [(lease_id, expires, now, device_class, versions, k) for k in keys],
    )
    c.execute(
        "insert into srv_leases(id, worker, submitter, device_class, versions, keys, created_at, "
        "expires_at) values (?, ?, ?, ?, ?, ?, ?, ?)",
        (lease_id, worker, submitter, device_class, versions, len(keys), now, expires),
    )
    return Lease(lease_id, keys, expires, returned)


def check_lease(c: sqlite3.Connection, lease_id: str, submitter: str) -> dict[str, Any]:
    row = c.execute(
        "select id, submitter, completed_at, expires_at from srv_leases where id = ?", (lease_id,)
    ).fetchone()
    if row is None:
        raise LeaseError(404, f"unknown lease_id {lease_id!r}")
    if row[1] != submitter:
        raise LeaseError(403, f"lease {lease_id!r} was claimed with another token")
    if row[2] is not None:
        raise LeaseError(409, f"lease {lease_id!r} was already completed")
    return {"id": row[0], "expires_at": row[3]}


def release(c: sqlite3.Connection, lease_id: str, max_attempts: int) -> Release:
    """End a lease after its results were ingested: keys with a served winner are done (the
    merge marked them), the rest go back to the queue with one more attempt counted."""
    now = time.time()
    (expires,) = c.execute("select expires_at from srv_leases where id = ?", (lease_id,)).fetchone()
    out = Release(lease_expired=expires <= now)
    for key, state, attempts in c.execute(
        "select key, state, attempts from srv_queue where lease_id = ?", (lease_id,)
    ).fetchall():
        if state == "done":
            out.done.append(key)
            continue
        failed = attempts + 1 >= max_attempts
        (out.failed if failed else out.requeued).append(key)
        c.execute(
            "update srv_queue set state = ?, attempts = attempts + 1, lease_id = null, "
            "lease_expires = null, updated_at = ? where lease_id = ? and key = ?",
            ("failed" if failed else "queued", now, lease_id, key),
        )
    c.execute("update srv_leases set completed_at = ? where id = ?", (now, lease_id))
    return out


def queue_rows(
    store: Store, device_class: str | None, versions: str | None, state: str | None, limit: int
) -> list[dict[str, Any]]:
    """Queue entries as a reader sees them: a run-out lease already shows as queued."""
    now = time.time()
    shown = "case when state = 'leased' and lease_expires <= ? then 'queued' else state end"
    where, args = [], []
    for expr, val in (("device_class = ?", device_class), ("versions = ?", versions)):
        if val is not None:
            where.append(expr)
            args.append(val)
    if state is not None:
        where.append(f"{shown} = ?")
        args += [now, state]
    sql = (
        f"select device_class, versions, key, op, {shown} as state, misses, attempts, "
        "lease_expires, enqueued_at, updated_at from srv_queue"
        + (" where " + " and ".join(where) if where else "")
        + " order by misses desc, enqueued_at, key limit ?"
    )
    return list(store.db.query(sql, [now, *args, limit]))


def queue_counts(store: Store) -> dict[str, int]:
    return dict(store.db.conn.execute("select state, count(*) from srv_queue group by state"))


def miss_rows(store: Store, device_class: str | None, limit: int) -> list[dict[str, Any]]:
    where = " where device_class = ?" if device_class else ""
    return list(
        store.db.query(
            f"select * from srv_misses{where} order by count desc, key limit ?",
            [device_class, limit] if device_class else [limit],
        )
    )

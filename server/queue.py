"""Misses and the tuning queue built from them.

A miss (a key some host met without a winner) is counted per (device class, versions, key) and,
unless that problem already has a served winner, queued. Workers of the same device class and
versions claim the most-missed keys under a lease; a lease that runs out (dead worker) puts its
keys back, counting an attempt, and a key that used up ``max_attempts`` is marked failed rather
than handed out forever. A key is done as soon as a winner is served for it, whoever tuned it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.store import FleetStore


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
    store: FleetStore, device_class: str, versions: str, misses: list[tuple[str, int]]
) -> int:
    """Count misses and queue the unserved keys (open transaction). Returns newly queued keys."""
    store.count_misses(device_class, versions, misses)
    return sum(store.enqueue((device_class, versions, key), n) for key, n in misses)


def claim(
    store: FleetStore,
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
    returned = store.expire_leases(max_attempts, now)
    keys = store.queued_keys(device_class, versions, max_keys)
    if not keys:
        return Lease(None, [], None, returned)
    lease_id, expires = uuid.uuid4().hex, now + lease_s
    store.lease(
        {"id": lease_id, "worker": worker, "submitter": submitter, "device_class": device_class,
         "versions": versions, "created_at": now, "expires_at": expires},
        keys,
    )  # fmt: skip
    return Lease(lease_id, keys, expires, returned)


def check_lease(store: FleetStore, lease_id: str, submitter: str) -> dict[str, Any]:
    row = store.lease_row(lease_id)
    if row is None:
        raise LeaseError(404, f"unknown lease_id {lease_id!r}")
    if row["submitter"] != submitter:
        raise LeaseError(403, f"lease {lease_id!r} was claimed with another token")
    if row["completed_at"] is not None:
        raise LeaseError(409, f"lease {lease_id!r} was already completed")
    return {"id": row["id"], "expires_at": row["expires_at"]}


def release(store: FleetStore, lease_id: str, max_attempts: int) -> Release:
    """End a lease after its results were ingested: keys with a served winner are done (the
    merge marked them), the rest go back to the queue with one more attempt counted."""
    now = time.time()
    lease = store.lease_row(lease_id)
    assert lease is not None  # check_lease ran first, in the same transaction
    out = Release(lease_expired=lease["expires_at"] <= now)
    for key, state, attempts in store.lease_entries(lease_id):
        if state == "done":
            out.done.append(key)
            continue
        failed = attempts + 1 >= max_attempts
        (out.failed if failed else out.requeued).append(key)
        store.return_key(lease_id, key, "failed" if failed else "queued", now)
    store.complete_lease(lease_id, now)
    return out

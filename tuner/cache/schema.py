"""Schema of the results store, and the migrations between its versions.

``MIGRATIONS[i]`` takes a database at version ``i`` to ``i + 1``; version 0 is an empty file.
Add a function at the end to change the schema; never edit an old one.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils

APP_ID = "tuner"


def _v1(db: sqlite_utils.Database) -> None:
    db["meta"].create({"name": str, "value": str}, pk="name")
    db["devices"].create(
        {"device_class": str, "fingerprint": str, "first_seen": float, "last_seen": float},
        pk="device_class",
    )
    db["measurements"].create(
        {
            "id": int,
            "uid": str,  # globally unique: makes export/import and fleet pushes idempotent
            "device_class": str,
            "key": str,
            "op": str,
            "candidate": str,
            "source": str,
            "params": str,  # JSON
            "is_baseline": int,
            "status": str,  # ok | rejected | failed | cut | timeout
            "median_us": float,
            "p10_us": float,
            "p90_us": float,
            "reps": int,
            "host_us": float,  # host time per eager call: the floor when launches, not kernels, bound
            "max_rel_err": float,
            "error": str,
            "versions": str,
            "host": str,
            "run_id": str,
            "created_at": float,
        },
        pk="id",
        not_null={"uid", "device_class", "key", "candidate", "status"},
    )
    db["measurements"].create_index(["uid"], unique=True)
    db["measurements"].create_index(["device_class", "key"])
    db["winners"].create(
        {
            "device_class": str,
            "key": str,
            "op": str,
            "candidate": str,
            "source": str,
            "params": str,
            "median_us": float,
            "baseline_us": float,
            "speedup": float,
            "versions": str,
            "run_id": str,
            "updated_at": float,
        },
        pk=("device_class", "key"),
    )
    db["winners"].create_index(["updated_at"])
    db["misses"].create(
        {
            "device_class": str,
            "key": str,
            "op": str,
            "count": int,
            "first_seen": float,
            "last_seen": float,
        },
        pk=("device_class", "key"),
    )


def _v2(db: sqlite_utils.Database) -> None:
    """Fleet service tables (``srv_*``, used by ``server/``) and the client's sync bookkeeping.

    A server file and a host cache share one schema; each side leaves the other's tables empty.
    """
    db["srv_tokens"].create(
        {
            "id": str,  # public part of the token, shown by ``tuner token list``
            "name": str,
            "secret_hash": str,  # sha256 of the secret part; the secret itself is never stored
            "scopes": str,  # comma separated: read, submit, admin
            "created_at": float,
            "revoked_at": float,  # null while the token is valid
        },
        pk="id",
        not_null={"name", "secret_hash", "scopes"},
    )
    db["srv_measurements"].create(
        {
            "id": int,
            "uid": str,  # the submitting host's Measurement.uid: re-sends are ignored
            "submitter": str,  # token id: one token = one voice in the merge
            "device_class": str,
            "versions": str,
            "key": str,
            "op": str,
            "candidate": str,
            "source": str,
            "params": str,
            "is_baseline": int,
            "status": str,
            "median_us": float,
            "p10_us": float,
            "p90_us": float,
            "reps": int,
            "host_us": float,
            "max_rel_err": float,
            "error": str,
            "host": str,
            "run_id": str,
            "created_at": float,
            "received_at": float,
        },
        pk="id",
        not_null={"uid", "submitter", "device_class", "versions", "key", "candidate", "status"},
    )
    db["srv_measurements"].create_index(["uid"], unique=True)
    db["srv_measurements"].create_index(["device_class", "versions", "key"])
    db["srv_results"].create(  # aggregate per (device class, versions, key, candidate)
        {
            "device_class": str,
            "versions": str,
            "key": str,
            "candidate": str,
            "source": str,
            "params": str,
            "is_baseline": int,
            "us": float,  # median over submitters of each submitter's median
            "spread": float,  # (max - min) / us over the submitters' medians
            "noise": float,  # median of the measurements' own (p90 - p10) / median
            "count": int,  # ok measurements
            "submitters": int,
            "updated_at": float,
        },
        pk=("device_class", "versions", "key", "candidate"),
    )
    db["srv_winners"].create(  # served (confirmed) winners; seq is the sync cursor
        {
            "device_class": str,
            "versions": str,
            "key": str,
            "op": str,
            "candidate": str,
            "source": str,
            "params": str,
            "median_us": float,
            "baseline_us": float,
            "speedup": float,
            "run_id": str,
            "submitters": int,
            "seq": int,
            "updated_at": float,
        },
        pk=("device_class", "versions", "key"),
    )
    db["srv_winners"].create_index(["device_class", "versions", "seq"])
    db["srv_winners"].create_index(["device_class", "seq"])
    db["srv_winners"].create_index(["device_class", "key"])  # lookups without versions
    db["srv_pending"].create(  # a large change waiting for a second submitter or an admin
        {
            "device_class": str,
            "versions": str,
            "key": str,
            "candidate": str,
            "source": str,
            "params": str,
            "us": float,
            "served_candidate": str,
            "served_us": float,
            "margin": float,
            "supporters": str,  # JSON list of token ids whose own results back the change
            "updated_at": float,
        },
        pk=("device_class", "versions", "key"),
    )
    db["srv_misses"].create(
        {
            "device_class": str,
            "versions": str,
            "key": str,
            "op": str,
            "count": int,
            "first_seen": float,
            "last_seen": float,
        },
        pk=("device_class", "versions", "key"),
    )
    db["srv_queue"].create(
        {
            "device_class": str,
            "versions": str,
            "key": str,
            "op": str,
            "state": str,  # queued | leased | done | failed
            "misses": int,
            "attempts": int,
            "lease_id": str,
            "lease_expires": float,
            "enqueued_at": float,
            "updated_at": float,
        },
        pk=("device_class", "versions", "key"),
    )
    db["srv_queue"].create_index(["device_class", "versions", "state"])
    db["srv_queue"].create_index(["lease_id"])
    db["srv_leases"].create(
        {
            "id": str,
            "worker": str,
            "submitter": str,
            "device_class": str,
            "versions": str,
            "keys": int,
            "created_at": float,
            "expires_at": float,
            "completed_at": float,
        },
        pk="id",
    )
    db["srv_counters"].create({"name": str, "value": int}, pk="name")
    db["srv_counters"].insert({"name": "winner_seq", "value": 0})
    # host side: where incremental pulls/pushes stopped, and how much of each miss was reported
    db["sync_state"].create({"name": str, "value": int, "updated_at": float}, pk="name")
    db["reported_misses"].create(
        {"device_class": str, "key": str, "reported": int}, pk=("device_class", "key")
    )


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1, _v2]
SCHEMA_VERSION = len(MIGRATIONS)

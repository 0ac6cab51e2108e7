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


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_v1]
SCHEMA_VERSION = len(MIGRATIONS)

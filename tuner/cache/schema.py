"""Schema of the local results cache, and the migrations between its versions.

Only what a host keeps: devices, measurements, winners, misses, and the bookkeeping of its fleet
syncs. The fleet service's tables live in ``server.schema``. Files written before the two were
split carry their version in a ``meta`` table and the service's empty ``srv_*`` tables;
``legacy_version`` reads them and the last migration drops what no longer belongs here.
"""

from __future__ import annotations

from pathlib import Path

import sqlite_utils

from tuner.cache.sqlite import Schema, StoreError, register
from tuner.core.keys import spelt_now

LEGACY_APP = "tuner"  # meta.app of files from before application ids
HOST_TABLES = ("measurements", "winners", "misses", "sync_state", "reported_misses")
SERVICE_TABLES = (
    "srv_tokens", "srv_measurements", "srv_results", "srv_winners", "srv_pending",
    "srv_misses", "srv_queue", "srv_leases", "srv_counters",
)  # fmt: skip


def create_devices(db: sqlite_utils.Database) -> None:
    """The fingerprints seen per device class (both kinds of file keep them)."""
    db["devices"].create(
        {"device_class": str, "fingerprint": str, "first_seen": float, "last_seen": float},
        pk="device_class",
    )


def _v1(db: sqlite_utils.Database) -> None:
    create_devices(db)
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
    """The client's sync bookkeeping: where incremental pulls/pushes stopped, and how much of
    each miss was reported."""
    db["sync_state"].create({"name": str, "value": int, "updated_at": float}, pk="name")
    db["reported_misses"].create(
        {"device_class": str, "key": str, "reported": int}, pk=("device_class", "key")
    )


def _v3(db: sqlite_utils.Database) -> None:
    """The launch mode (eager or graph) of measurements and winners; the service's tables and
    the ``meta`` table leave files that carried them."""
    for table in ("measurements", "winners"):
        db[table].add_column("launch", str, not_null_default="eager")
    for table in (*SERVICE_TABLES, "meta"):
        db[table].drop(ignore=True)


def _v4(db: sqlite_utils.Database) -> None:
    """What a sync position stands at, as the service names it (a pulled winner, a pushed
    measurement's uid): a host asks the service for it to tell one restored from an older
    backup, which has lost it."""
    db["sync_state"].add_column("mark", str)


def _v5(db: sqlite_utils.Database) -> None:
    """How much of each miss count was reported, per fleet service (``service``: the scope
    its sync positions are kept under, ``FleetClient.sync_scope``), so that the reports
    forgotten when one service is found restored are that service's alone.

    Schema 4's rows are dropped, not given a service: they do not say which one got the count
    (a host syncing with two reported each count to whichever it pushed to first), and
    ``sync_state`` names only services that stored a position, so a row kept under one would
    tell the host a service had a count it never got, which would then never reach it. With
    none kept, every count is reported in full once more to each service: one that held it
    counts it twice, which only moves its key up the tuning queue."""
    db["reported_misses"].drop()
    db["reported_misses"].create(
        {"service": str, "device_class": str, "key": str, "reported": int},
        pk=("service", "device_class", "key"),
        # a process of the previous release still open on the file writes no service: refused,
        # where rows without one (never equal in a primary key) would pile up and match its
        # unscoped reads twice
        not_null={"service", "device_class", "key", "reported"},
    )


def respelt_sdpa_keys(db: sqlite_utils.Database, tables: tuple[str, ...]) -> list[tuple[str, str]]:
    """The SDPA keys stored in ``tables`` that this release spells another way (the default
    scale written as ``head_dim ** -0.5``), as (stored, this release's) pairs; a key no release
    could parse stays as it is."""
    renamed = {}
    for table in tables:
        for (key,) in db.conn.execute(f"select distinct key from {table} where key like 'sdpa:%'"):
            if (canonical := spelt_now(key)) != key:
                renamed[key] = canonical
    return sorted(renamed.items())


def _v6(db: sqlite_utils.Database) -> None:
    """SDPA keys whose scale is 1 / sqrt(head_dim) written another way (``head_dim ** -0.5``,
    as models pass it, rounds one bit away) are the default scale's key, as a call with either
    now makes: their rows join the default's. Per problem the newer winner stays, miss counts
    and their reports add up."""
    c = db.conn
    for old, new in respelt_sdpa_keys(db, ("measurements", "winners", "misses", "reported_misses")):
        c.execute("update measurements set key = ? where key = ?", (new, old))
        # a problem holding a winner under both keys keeps the newer
        c.execute(
            "delete from winners where key = ? and exists (select 1 from winners w where "
            "w.key = ? and w.device_class = winners.device_class and w.updated_at >= "
            "winners.updated_at)",
            (old, new),
        )
        c.execute(
            "delete from winners where key = ? and exists (select 1 from winners w where "
            "w.key = ? and w.device_class = winners.device_class)",
            (new, old),
        )
        c.execute("update winners set key = ? where key = ?", (new, old))
        c.execute(
            "insert into misses(device_class, key, op, count, first_seen, last_seen) "
            "select device_class, ?, op, count, first_seen, last_seen from misses where key = ? "
            "on conflict(device_class, key) do update set count = count + excluded.count, "
            "first_seen = min(first_seen, excluded.first_seen), "
            "last_seen = max(last_seen, excluded.last_seen)",
            (new, old),
        )
        c.execute(
            "insert into reported_misses(service, device_class, key, reported) "
            "select service, device_class, ?, reported from reported_misses where key = ? "
            "on conflict(service, device_class, key) do update set "
            "reported = reported + excluded.reported",
            (new, old),
        )
        for table in ("misses", "reported_misses"):
            c.execute(f"delete from {table} where key = ?", (old,))


def legacy_meta(db: sqlite_utils.Database, path: Path) -> int:
    """The schema version in the ``meta`` table of a file from before application ids."""
    tables = set(db.table_names())
    if "meta" not in tables:
        raise StoreError(
            f"{path} is a SQLite database of another application (tables: {sorted(tables)[:5]})"
        )
    meta = dict(db.conn.execute("select name, value from meta").fetchall())
    if meta.get("app") != LEGACY_APP:
        raise StoreError(
            f"{path} is a SQLite database of another application (meta.app={meta.get('app')!r})"
        )
    version = meta.get("schema_version", 0)
    try:
        return int(version)
    except (TypeError, ValueError):
        raise StoreError(
            f"{path} is corrupt: its meta.schema_version is {version!r}, not a whole number"
        ) from None


def filled(db: sqlite_utils.Database, tables: tuple[str, ...]) -> list[str]:
    """Those of ``tables`` that exist and hold rows."""
    present = set(db.table_names())
    return [t for t in tables if t in present and db.conn.execute(f"select 1 from {t}").fetchone()]


def _legacy_version(db: sqlite_utils.Database, path: Path) -> int:
    version = legacy_meta(db, path)
    if held := filled(db, tuple(t for t in SERVICE_TABLES if t != "srv_counters")):
        raise StoreError(
            f"{path} is a tuner fleet database (its {', '.join(held)} hold rows), not a tuner "
            "cache; open it with 'tuner serve --db'"
        )
    return version


CACHE = register(
    Schema(
        kind="tuner cache",
        application_id=0x544E5243,  # "TNRC"
        migrations=(_v1, _v2, _v3, _v4, _v5, _v6),
        legacy_version=_legacy_version,
        # v4 adds only sync_state.mark, v5 only reported_misses' service and v6 renames
        # keys: no read of winners needs any of them
        readable_from=3,
    )
)

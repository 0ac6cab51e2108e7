"""Schema of the fleet service's database, and the migrations between its versions.

The service keeps tokens, every host's measurements, the merged results, the served winners with
their sequence numbers, pending changes, misses and the tuning queue (``srv_*`` tables), plus the
fingerprints of the device classes it has seen, and the compiled-kernel artifacts published by
builders (spec -> served hash, every builder's build of a spec; the blobs themselves are files in
``server.blobs``), and the service's identity (a random id made with the file, so that a host
can tell a rebuilt service at the same URL from the one it synced with; a backup keeps it, so a
restored one is told by its sequence numbers falling behind the host's positions), and every
serving of a winner under its sequence number (``srv_served``, kept when a later one replaces
it), which tells a restored one that has since passed a host's position again: it lacks the
serving that host pulled last, or holds another under that number. A host's
cache has its own schema (``tuner.cache.schema``); both are checked and migrated by ``tuner.cache.sqlite``. Files from
before the two were split (one shared schema, version 2 in a ``meta`` table) open as version 1
and lose the host's empty tables in the next migration.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import sqlite_utils

from tuner.cache.schema import (
    HOST_TABLES,
    create_devices,
    filled,
    legacy_meta,
    respelt_sdpa_keys,
)
from tuner.cache.sqlite import FLEET_APPLICATION_ID, Schema, StoreError, register

SHARED_SCHEMA_VERSION = 2  # meta.schema_version of a file that held both sides' tables


def _v1(db: sqlite_utils.Database) -> None:
    create_devices(db)
    db["srv_tokens"].create(
        {
            "id": str,  # public part of the token, shown by ``tuner token list``
            "name": str,
            "secret_hash": str,  # sha256 of the secret part; the secret itself is never stored
            "scopes": str,  # comma separated: read, submit, build, admin
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


def _v2(db: sqlite_utils.Database) -> None:
    """The launch mode (eager or graph) of measurements and served winners; the host's tables
    and the ``meta`` table leave files that carried them."""
    for table in ("srv_measurements", "srv_winners"):
        db[table].add_column("launch", str, not_null_default="eager")
    for table in (*HOST_TABLES, "meta"):
        db[table].drop(ignore=True)


def _v3(db: sqlite_utils.Database) -> None:
    """Compiled-kernel artifacts: the served build of each spec, and every builder's build."""
    db["srv_artifacts"].create(  # the build served for a spec: the first one published
        {
            "seq": int,  # order of publication: the cursor of the artifact listing
            "spec_id": str,  # sha256 of the spec's canonical JSON
            "spec": str,
            "source": str,
            "arch": str,
            "hash": str,
            "size": int,
            "builder": str,  # token id of the publisher
            "created_at": float,
        },
        pk="seq",
        not_null={"spec_id", "spec", "source", "arch", "hash", "size", "builder", "created_at"},
    )
    db["srv_artifacts"].create_index(["spec_id"], unique=True)
    db["srv_artifacts"].create_index(["arch", "seq"])
    db["srv_artifact_builds"].create(  # every (spec, hash) each builder published
        {
            "spec_id": str,
            "hash": str,
            "builder": str,
            "size": int,
            "first_seen": float,
            "last_seen": float,
        },
        pk=("spec_id", "hash", "builder"),
        not_null={"size", "first_seen", "last_seen"},
    )
    db["srv_artifact_builds"].create_index(["hash"])


def _v4(db: sqlite_utils.Database) -> None:
    """The service's identity: one row, made once with the file (kept by backups of it)."""
    db["srv_service"].create({"id": str, "created_at": float}, pk="id", not_null={"created_at"})
    db["srv_service"].insert({"id": uuid.uuid4().hex, "created_at": time.time()})


def _v5(db: sqlite_utils.Database) -> None:
    """Every serving of a winner under its sequence number, kept after a later one replaces it:
    a host asks what was served under the number it pulled last (``store.served_at``), which a
    service restored from an older backup has lost, or holds as another serving. Sequence
    numbers before this migration were not kept: the winners served now are logged under
    theirs, and ``served_log_from`` (the counter now) says from which number on the log is whole
    (a restored file migrated later says its own, older one)."""
    db["srv_served"].create(
        {"seq": int, "device_class": str, "versions": str, "key": str, "updated_at": float},
        pk="seq",
        not_null={"device_class", "versions", "key", "updated_at"},
    )
    db.conn.execute(
        "insert into srv_served(seq, device_class, versions, key, updated_at) "
        "select seq, device_class, versions, key, updated_at from srv_winners"
    )
    db.conn.execute(
        "insert into srv_counters(name, value) select 'served_log_from', value from "
        "srv_counters where name = 'winner_seq'"
    )


_SAME_PROBLEM = "t.device_class = {t}.device_class and t.versions = {t}.versions"


def _v6(db: sqlite_utils.Database) -> None:
    """SDPA keys of the default scale written another way (``head_dim ** -0.5``; the cache's
    schema 6) take the default's key, the only one hosts of this release send and look up.
    Measurements join it. Of two served winners of one problem the newer stays, under its own
    sequence number: a host that pulled it has its position, and its cache has moved the key
    already (``srv_served``, the log of what was served, keeps the spelling hosts were sent).
    Miss counts add up. A queue entry, pending change or aggregate under both keys keeps the
    default's (the next submission re-merges the problem from its measurements); one under the
    other key alone is moved."""
    tables = ("srv_measurements", "srv_results", "srv_winners", "srv_pending", "srv_misses",
              "srv_queue")  # fmt: skip
    c = db.conn

    def exists(table: str, extra: str = "") -> str:
        """Whether ``table`` holds a row of the same problem under the other key (``?``)."""
        same = _SAME_PROBLEM.format(t=table)
        return f"exists (select 1 from {table} t where t.key = ? and {same}{extra})"

    for old, new in respelt_sdpa_keys(db, tables):
        c.execute("update srv_measurements set key = ? where key = ?", (new, old))
        newer = " and t.updated_at >= srv_winners.updated_at"
        c.execute(f"delete from srv_winners where key = ? and {exists('srv_winners', newer)}",
                  (old, new))  # fmt: skip
        c.execute(f"delete from srv_winners where key = ? and {exists('srv_winners')}", (new, old))
        c.execute(
            "insert into srv_misses(device_class, versions, key, op, count, first_seen, "
            "last_seen) select device_class, versions, ?, op, count, first_seen, last_seen "
            "from srv_misses where key = ? on conflict(device_class, versions, key) do update "
            "set count = count + excluded.count, first_seen = min(first_seen, "
            "excluded.first_seen), last_seen = max(last_seen, excluded.last_seen)",
            (new, old),
        )
        c.execute("delete from srv_misses where key = ?", (old,))
        c.execute(
            "update srv_queue set misses = misses + (select t.misses from srv_queue t where "
            f"t.key = ? and {_SAME_PROBLEM.format(t='srv_queue')}) "
            f"where key = ? and {exists('srv_queue')}",
            (old, new, old),
        )
        for table, extra in (("srv_queue", ""), ("srv_pending", ""),
                             ("srv_results", " and t.candidate = srv_results.candidate")):  # fmt: skip
            c.execute(f"delete from {table} where key = ? and {exists(table, extra)}", (old, new))
        for table in ("srv_winners", "srv_queue", "srv_pending", "srv_results"):
            c.execute(f"update {table} set key = ? where key = ?", (new, old))


def _legacy_version(db: sqlite_utils.Database, path: Path) -> int:
    version = legacy_meta(db, path)
    if version != SHARED_SCHEMA_VERSION or "srv_tokens" not in db.table_names():
        raise StoreError(f"{path} is a tuner cache (schema {version}), not a tuner fleet database")
    if held := filled(db, HOST_TABLES):
        raise StoreError(
            f"{path} is a tuner cache (its {', '.join(held)} hold rows), not a tuner fleet "
            "database; give 'tuner serve --db' a file of its own"
        )
    return 1


FLEET = register(
    Schema(
        kind="tuner fleet database",
        application_id=FLEET_APPLICATION_ID,
        migrations=(_v1, _v2, _v3, _v4, _v5, _v6),
        legacy_version=_legacy_version,
        elsewhere="name another fleet database (--db / $TUNER_SERVER_DB)",
    )
)

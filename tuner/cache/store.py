"""The local results cache: measurements, winners, devices, recorded misses and sync positions.

Every read and write of a host's cache file goes through ``Store``: the SQL lives here and
callers (dispatcher, engine, fleet client, CLI) deal in records. Opening, checking and migrating
the file, and the one-transaction-per-write rule, come from ``tuner.cache.sqlite``; one
``Store`` wraps one connection, so open one per thread.

    store = Store(default_path())
    store.save_run(measurements, winner)
    store.winner("cuda-nvidia-h200-sm90-132sm-140gib", "gemm:m=1,...")
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from tuner.cache import export_check
from tuner.cache.schema import CACHE
from tuner.cache.sqlite import SqliteFile, StoreError
from tuner.core.device import Fingerprint
from tuner.core.keys import key_op
from tuner.measure.records import Measurement, Winner

_W = TypeVar("_W", Winner, dict[str, Any])
Stamp = tuple[str, str, float, str, str]  # a winner's device class, key, updated_at, versions
# and candidate

EXPORT_FORMAT = "tuner-results"
# The schema version an export names: the last one that changed a table an export holds
# (devices, measurements, winners), so that an export imports into every release that reads
# those tables alike (schemas 4 and 5 changed only the sync bookkeeping). Bump it with such a
# change.
EXPORTED_VERSION = 3
EXPORTED_TABLES = ("devices", "measurements", "winners")
_SET_POSITION = (
    "insert or replace into sync_state(name, value, mark, updated_at) values (?, ?, ?, ?)"
)

__all__ = ["EXPORT_FORMAT", "ExportError", "Store", "StoreError", "cache_file", "default_path"]


def cache_file(named: str | Path) -> Path:
    """A cache path as a user wrote it (``--cache``, ``$TUNER_CACHE``, the config file's
    ``cache``), ``~`` expanded: every way in must name the same file, or the command line writes
    ``./~/x.db`` while the library reads ``$HOME/x.db``."""
    return Path(named).expanduser()


def default_path() -> Path:
    """``$TUNER_CACHE``, else ``$XDG_CACHE_HOME/tuner/tuner.db``, else ``~/.cache/tuner/tuner.db``."""
    if env := os.environ.get("TUNER_CACHE"):
        return cache_file(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuner" / "tuner.db"


def _winner_stamp(w: Winner) -> Stamp:
    return w.device_class, w.key, w.updated_at, w.versions, w.candidate


def _row_stamp(row: dict[str, Any]) -> Stamp:
    return row["device_class"], row["key"], row["updated_at"], row["versions"], row["candidate"]


def _stored_stamps(
    c: sqlite3.Connection, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], tuple[float, str, str]]:
    """(``updated_at``, ``versions``, ``candidate``) of the cache's winner for each of ``keys``
    that has one, one primary-key lookup each: a feed page costs the same however many winners
    the cache holds."""
    stored: dict[tuple[str, str], tuple[float, str, str]] = {}
    for pair in keys:
        row = c.execute(
            "select updated_at, versions, candidate from winners where device_class = ? and key = ?",
            pair,
        ).fetchone()
        if row is not None:
            stored[pair] = (row[0], row[1], row[2])
    return stored


class ExportError(StoreError):
    """The data given to ``Store.import_`` is not an export it can take; the cache is as it was."""


class CheckedExport(NamedTuple):
    """An export's records, checked whole: what ``Store.import_`` writes."""

    measurements: list[Measurement]
    winners: list[Winner]
    devices: list[tuple[str, str, float, float]]  # device class, fingerprint JSON, first, last


def checked_export(data: Any) -> CheckedExport:
    """The records of a ``tuner export`` JSON; ExportError naming the first record and field
    it refuses. Needs no cache: a file refused here leaves none made."""
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise ExportError(f"not a tuner export: expected an object with format={EXPORT_FORMAT!r}")
    version = data.get("schema_version", 0)
    if not isinstance(version, int):
        raise ExportError(f"malformed export: schema_version must be an integer, got {version!r}")
    if version > CACHE.version:
        raise ExportError(
            f"export has schema version {version}: this tuner reads exports of schema versions "
            f"up to {CACHE.version} (it writes version {EXPORTED_VERSION}); a newer tuner imports it"
        )
    try:
        return CheckedExport(
            export_check.records(data, "measurements", Measurement, also_required=("uid",)),
            export_check.records(data, "winners", Winner),
            [
                (device_class, json.dumps(fingerprint), first_seen, last_seen)
                for device_class, fingerprint, first_seen, last_seen in export_check.devices(data)
            ],
        )
    except ValueError as e:
        raise ExportError(f"malformed export: {e}") from None
    except (TypeError, KeyError) as e:
        raise ExportError(f"malformed export: {e!r}") from None


class DeviceFile(SqliteFile):
    """A file with a ``devices`` table: the fingerprint last seen per device class."""

    def save_device(self, fp: Fingerprint) -> None:
        with self.transaction() as c:
            self.record_device(c, fp)

    @staticmethod
    def record_device(c: sqlite3.Connection, fp: Fingerprint) -> None:
        """``save_device``'s write in a transaction the caller holds: stored with the rest of
        it, or not at all."""
        now = time.time()
        c.execute(
            "insert into devices(device_class, fingerprint, first_seen, last_seen) values (?, ?, ?, ?) "
            "on conflict(device_class) do update set fingerprint=excluded.fingerprint, last_seen=excluded.last_seen",
            (fp.device_class, json.dumps(fp.to_dict(), sort_keys=True), now, now),
        )

    def devices(self) -> list[dict[str, Any]]:
        return [
            {**r, "fingerprint": json.loads(r["fingerprint"])}
            for r in self.db.query("select * from devices")
        ]

    def fingerprint(self, device_class: str) -> Fingerprint | None:
        """The fingerprint last seen of ``device_class``; None where it is unknown or unreadable
        (written by a release whose fingerprint had other fields)."""
        row = self.db.conn.execute(
            "select fingerprint from devices where device_class = ?", (device_class,)
        ).fetchone()
        if row is None:
            return None
        fields = {k: v for k, v in json.loads(row[0]).items() if k != "device_class"}
        try:
            return Fingerprint(**fields)
        except TypeError:
            return None

    def known_device(self, device_class: str) -> bool:
        row = self.db.conn.execute(
            "select 1 from devices where device_class = ?", (device_class,)
        ).fetchone()
        return row is not None

    def device_classes(self, limit: int = 20) -> list[str]:
        """The device classes seen, most recent first."""
        rows = self.db.conn.execute(
            "select device_class from devices order by last_seen desc limit ?", (limit,)
        )
        return [r[0] for r in rows]


class Store(DeviceFile):
    """One connection to a host's cache file (created and migrated on open)."""

    schema = CACHE

    # --- writes --------------------------------------------------------------------------------

    def save_run(self, measurements: Iterable[Measurement], winner: Winner | None = None) -> None:
        """Store a tuning run's measurements and its winner atomically."""
        with self.transaction() as c:
            self._insert_measurements(c, measurements)
            if winner is not None:
                self._upsert_winners(c, [winner])

    def save_run_unless_held(
        self,
        measurements: Iterable[Measurement],
        winner: Winner,
        held_stays: Callable[[Winner], bool],
    ) -> Winner | None:
        """Store a run's measurements, and its winner unless the winner already stored for its
        key is to stay (``held_stays`` says, given it). The test and the write are one
        transaction, so no other writer comes between them. Returns the winner that stayed,
        or None where ``winner`` was stored."""
        with self.transaction() as c:
            self._insert_measurements(c, measurements)
            held = self.winner(winner.device_class, winner.key)
            if held is not None and held_stays(held):
                return held
            self._upsert_winners(c, [winner])
            return None

    def _insert_measurements(
        self, c: sqlite3.Connection, measurements: Iterable[Measurement]
    ) -> int:
        rows = [m.to_row() for m in measurements]
        if not rows:
            return 0
        cols = list(rows[0])
        sql = f"insert or ignore into measurements({', '.join(cols)}) values ({', '.join('?' * len(cols))})"
        before = c.total_changes
        c.executemany(sql, [[r[k] for k in cols] for r in rows])
        return c.total_changes - before

    def _upsert_winners(self, c: sqlite3.Connection, winners: Iterable[Winner]) -> int:
        return self._upsert_winner_rows(c, [w.to_row() for w in winners])

    def _upsert_winner_rows(self, c: sqlite3.Connection, rows: list[dict[str, Any]]) -> int:
        if not rows:
            return 0
        cols = list(rows[0])
        updates = ", ".join(f"{k}=excluded.{k}" for k in cols if k not in ("device_class", "key"))
        sql = (
            f"insert into winners({', '.join(cols)}) values ({', '.join('?' * len(cols))}) "
            f"on conflict(device_class, key) do update set {updates}"
        )
        c.executemany(sql, [[r[k] for k in cols] for r in rows])
        return len(rows)

    def put_winners(self, winners: Iterable[Winner]) -> int:
        with self.transaction() as c:
            return self._upsert_winners(c, winners)

    def put_winner_rows(self, rows: list[dict[str, Any]]) -> int:
        """Winners already in row form (``Winner.to_row()``'s keys, params as JSON text), e.g. a
        fleet feed page: bulk loads skip building and re-serialising Winner objects. As in
        ``import_``, a winner older than the cache's for its key is left out, except that one the
        cache holds under other versions than this host's gives way whatever its date (the feed's
        winners were served for these versions). Returns how many were stored."""
        with self.transaction() as c:
            newer, _ = self._newer_winners(c, rows, _row_stamp, for_these_versions=True)
            return self._upsert_winner_rows(c, newer)

    def record_misses(self, device_class: str, keys: Iterable[str], count: int = 1) -> None:
        now = time.time()
        with self.transaction() as c:
            c.executemany(
                "insert into misses(device_class, key, op, count, first_seen, last_seen) values (?, ?, ?, ?, ?, ?) "
                "on conflict(device_class, key) do update set count = count + excluded.count, last_seen = excluded.last_seen",
                [(device_class, k, key_op(k), count, now, now) for k in keys],
            )

    def clear_misses(self, device_class: str, keys: Iterable[str]) -> None:
        with self.transaction() as c:
            c.executemany(
                "delete from misses where device_class = ? and key = ?",
                [(device_class, k) for k in keys],
            )

    # --- reads ---------------------------------------------------------------------------------

    def holds_nothing(self) -> bool:
        """No row in any table: made, and nothing stored in it yet."""
        return not any(self.db[t].count for t in self.db.table_names())

    def winner(self, device_class: str, key: str) -> Winner | None:
        rows = list(
            self.db.query(
                "select * from winners where device_class = ? and key = ?", [device_class, key]
            )
        )
        return Winner.from_row(rows[0]) if rows else None

    def winners(
        self,
        device_class: str | None = None,
        *,
        op: str | None = None,
        source: str | None = None,
        limit: int | None = None,
    ) -> list[Winner]:
        where, args = self._filters(device_class=device_class, op=op, source=source)
        sql = "select * from winners" + (" where " + " and ".join(where) if where else "")
        sql += " order by updated_at, device_class, key"
        if limit is not None:
            sql += f" limit {int(limit)}"
        with self.reading():
            return [Winner.from_row(r) for r in self.db.query(sql, args)]

    def measurements(
        self, device_class: str | None = None, key: str | None = None
    ) -> list[Measurement]:
        where, args = self._filters(device_class=device_class, key=key)
        sql = (
            "select * from measurements"
            + (" where " + " and ".join(where) if where else "")
            + " order by id"
        )
        return [Measurement.from_row(r) for r in self.db.query(sql, args)]

    def misses(self, device_class: str | None = None) -> list[dict[str, Any]]:
        where, args = self._filters(device_class=device_class)
        sql = (
            "select * from misses"
            + (" where " + " and ".join(where) if where else "")
            + " order by count desc, key"
        )
        return list(self.db.query(sql, args))

    def measurements_after(self, last_id: int, limit: int) -> list[tuple[int, Measurement]]:
        """(row id, measurement) of the first ``limit`` measurements after row ``last_id``: the
        order in which a host pushes its results, resumable from the last id sent."""
        rows = self.db.query(
            "select * from measurements where id > ? order by id limit ?", [last_id, limit]
        )
        return [(r["id"], Measurement.from_row(r)) for r in rows]

    def unreported_misses(self, device_class: str, *, service: str) -> list[tuple[str, int, int]]:
        """(key, count not yet reported to ``service``, count now) for this device class's
        recorded misses; ``service`` is the fleet service's sync scope."""
        scoped = "r.service = ? and "
        args: tuple[str, ...] = (service, device_class)
        if "service" not in self.db["reported_misses"].columns_dict:
            scoped, args = "", (device_class,)  # a read-only file of schema 3 or 4, read as it is
        out = []
        for key, count, reported in self.db.conn.execute(
            "select m.key, m.count, coalesce(r.reported, 0) from misses m left join "
            f"reported_misses r on {scoped}r.device_class = m.device_class and r.key = m.key "
            "where m.device_class = ?",
            args,
        ):
            delta = count - reported if count >= reported else count  # cleared and seen again
            if delta > 0:
                out.append((key, delta, count))
        return out

    def mark_reported(
        self, device_class: str, counts: Iterable[tuple[str, int]], *, service: str
    ) -> None:
        """Remember how much of each key's miss count was reported to the fleet ``service``."""
        with self.transaction() as c:
            c.executemany(
                "insert or replace into reported_misses(service, device_class, key, reported) "
                "values (?, ?, ?, ?)",
                [(service, device_class, k, n) for k, n in counts],
            )

    def forget_reported_misses(self, service: str) -> None:
        """Forget how much of each miss count was reported to ``service``, so that the next
        report to it sends every count in full (it lost the reports); the reports to other
        services stand."""
        with self.transaction() as c:
            c.execute("delete from reported_misses where service = ?", (service,))

    def position(self, name: str) -> int:
        """Where the sync called ``name`` stopped (a feed cursor, a measurement id); 0 if never."""
        row = self.db.conn.execute(
            "select value from sync_state where name = ?", (name,)
        ).fetchone()
        return int(row[0]) if row else 0

    def mark(self, name: str) -> str | None:
        """What the sync called ``name`` stopped at, as the service names it (None: not known)."""
        try:
            row = self.db.conn.execute(
                "select mark from sync_state where name = ?", (name,)
            ).fetchone()
        except sqlite3.OperationalError:  # a read-only file of schema 3, read as it is
            return None
        return row[0] if row else None

    def set_position(self, name: str, value: int, mark: str | None = None) -> None:
        with self.transaction() as c:
            c.execute(_SET_POSITION, (name, value, mark, time.time()))

    def adopt_positions(self, scope: str, marker: str) -> int:
        """Move to ``scope`` the positions and miss reports kept under any scope that ends with
        ``marker`` (the same service under another name: an older release kept them under the
        URL it was reached by, then ``#<service id>``). Where two names meet, the further
        position and the larger report stay. Returns how many moved (read first: a sync with
        nothing to move writes nothing)."""
        old_names = self.db.conn.execute(
            "select 1 from sync_state where instr(name, ?) > 0", (marker,)
        ).fetchone()
        scoped = "service" in self.db["reported_misses"].columns_dict  # (a read-only old file)
        old_reports = (
            scoped
            and self.db.conn.execute(
                "select 1 from reported_misses where service != ? and substr(service, -?) = ?",
                (scope, len(marker), marker),
            ).fetchone()
        )
        if not (old_names or old_reports):
            return 0
        with self.transaction() as c:
            moved: dict[str, tuple[int, str | None]] = {}
            for name, value, mark in c.execute(
                "select name, value, mark from sync_state"
            ).fetchall():
                kind, _, rest = name.partition(":")
                at = rest.find(marker)
                end = at + len(marker)
                if at < 0 or rest[:end] == scope or (end < len(rest) and rest[end] != ":"):
                    continue
                new = f"{kind}:{scope}{rest[end:]}"
                c.execute("delete from sync_state where name = ?", (name,))
                best = moved.get(new) or (self.position(new), self.mark(new))
                moved[new] = max(best, (int(value), mark), key=lambda p: p[0])
            c.executemany(
                _SET_POSITION, [(n, value, mark, time.time()) for n, (value, mark) in moved.items()]
            )
            old = [r for (r,) in c.execute("select distinct service from reported_misses")
                   if r != scope and r.endswith(marker)]  # fmt: skip
            for service in old:
                c.execute(
                    "insert into reported_misses(service, device_class, key, reported) select ?, "
                    "device_class, key, reported from reported_misses where service = ? "
                    "on conflict(service, device_class, key) do update set "
                    "reported = max(reported, excluded.reported)",
                    (scope, service),
                )
                c.execute("delete from reported_misses where service = ?", (service,))
        return len(moved) + len(old)

    def reset_positions(self, scope: str) -> list[str]:
        """Set to 0, with no mark, every position kept under ``scope``: those named
        ``<kind>:<scope>`` or ``<kind>:<scope>:<more>`` (a fleet service's pull, push and
        artifact positions), so that the next sync with it starts from the beginning. Returns
        the names reset."""
        with self.transaction() as c:
            names = [
                name
                for (name,) in c.execute("select name from sync_state")
                if (rest := name.partition(":")[2]) == scope or rest.startswith(f"{scope}:")
            ]
            c.executemany(
                "update sync_state set value = 0, mark = null, updated_at = ? where name = ?",
                [(time.time(), name) for name in names],
            )
        return names

    @staticmethod
    def _filters(**equal: str | None) -> tuple[list[str], list[Any]]:
        where = [f"{col} = ?" for col, v in equal.items() if v is not None]
        args: list[Any] = [v for v in equal.values() if v is not None]
        return where, args

    # --- export / import -----------------------------------------------------------------------

    def export(self, device_class: str | None = None) -> dict[str, Any]:
        """Everything (or one device class) as a JSON-ready dict; ``import_`` takes it back."""
        return {
            "format": EXPORT_FORMAT,
            "schema_version": EXPORTED_VERSION,
            "devices": [d for d in self.devices() if device_class in (None, d["device_class"])],
            "measurements": [m.to_row() for m in self.measurements(device_class)],
            "winners": [w.to_row() for w in self.winners(device_class)],
        }

    def import_(self, data: Any) -> dict[str, int]:
        """Merge an export (``checked_export``'s, or the JSON data for it to check) into this
        store. Idempotent; all or nothing; a winner older than the cache's for its key is left
        out. Returns what changed: measurements and devices added, winners added or replaced,
        and winners left out as older."""
        export = data if isinstance(data, CheckedExport) else checked_export(data)
        measurements, winners, devices = export
        with self.transaction() as c:
            before = c.total_changes
            c.executemany(
                "insert or ignore into devices(device_class, fingerprint, first_seen, last_seen) values (?, ?, ?, ?)",
                devices,
            )
            new_devices = c.total_changes - before
            added = self._insert_measurements(c, measurements)
            newer, older = self._newer_winners(c, winners, _winner_stamp, for_these_versions=False)
            self._upsert_winners(c, newer)
        return {
            "measurements": added, "winners": len(newer), "older_winners": older,
            "devices": new_devices,
        }  # fmt: skip

    @staticmethod
    def _newer_winners(
        c: sqlite3.Connection,
        winners: list[_W],
        stamp: Callable[[_W], Stamp],
        *,
        for_these_versions: bool,
    ) -> tuple[list[_W], int]:
        """The incoming winners (``Winner`` objects or rows, ``stamp`` giving each one's
        device class, key, ``updated_at``, versions and candidate) to store, and how many were
        older than the cache's and are left alone. An old export or a fleet feed must not undo
        a re-tune made since, so per key the winner updated last is kept (the batch's own
        duplicates included); one as old as the cache's, or the same candidate stamped earlier
        (the one a fleet feed brought before), is the same winner again and counts as neither.
        ``for_these_versions``: the winners were served for this host's versions (a fleet
        feed), so one the cache holds under other versions is stale and gives way whatever
        its date."""
        latest: dict[tuple[str, str], tuple[float, str, str, _W]] = {}
        for w in winners:
            device_class, key, updated_at, versions, candidate = stamp(w)
            seen = latest.get((device_class, key))
            if seen is None or updated_at > seen[0]:
                latest[(device_class, key)] = (updated_at, versions, candidate, w)
        stored = _stored_stamps(c, latest)

        def replaces(k: tuple[str, str], at: float, versions: str) -> bool:
            if k not in stored:
                return True
            stored_at, stored_versions, _ = stored[k]
            return at > stored_at or (for_these_versions and versions != stored_versions)

        newer = [w for k, (at, v, _, w) in latest.items() if replaces(k, at, v)]
        older = sum(
            1
            for k, (at, v, candidate, _) in latest.items()
            if not replaces(k, at, v) and at < stored[k][0] and candidate != stored[k][2]
        )
        return newer, older

"""The SQLite results store: measurements, winners, devices and recorded misses.

One ``Store`` wraps one connection; SQLite connections belong to their thread, so open one per
thread (the server opens one per request). The file is in WAL mode and every write is a single
``BEGIN IMMEDIATE`` transaction, so several processes can tune into the same file at once and no
result is lost. A file that is not a tuner store (corrupt, foreign, or from a newer tuner) raises
``StoreError`` and is never written to.

    store = Store(default_path())
    store.save_run(measurements, winner)
    store.winner("cuda-nvidia-h200-sm90-132sm-140gib", "gemm:m=1,...")
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlite_utils

from tuner.cache.schema import APP_ID, MIGRATIONS, SCHEMA_VERSION
from tuner.core.device import Fingerprint
from tuner.measure.records import Measurement, Winner

SQLITE_MAGIC = b"SQLite format 3\x00"
EXPORT_FORMAT = "tuner-results"


class StoreError(Exception):
    """The cache file cannot be used as it is; the message says why and what to do."""


def default_path() -> Path:
    """``$TUNER_CACHE``, else ``$XDG_CACHE_HOME/tuner/tuner.db``, else ``~/.cache/tuner/tuner.db``."""
    if env := os.environ.get("TUNER_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuner" / "tuner.db"


def _check_file(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        raise StoreError(
            f"{path} is not a SQLite database (corrupt or another kind of file); refusing to touch it"
        )


# Closing *any* file descriptor on a SQLite file drops every POSIX lock this process holds on it
# (sqlite.org/howtocorrupt.html, 2.2); another process closing its last connection may then
# delete the WAL under this process's open connections. So the header check, which opens the
# file with plain ``open()``, only runs while no Store of this process has the file open.
_OPEN_FILES: collections.Counter[str] = collections.Counter()
_OPEN_LOCK = threading.Lock()


def _check_imported(measurements: list[Measurement], winners: list[Winner]) -> None:
    """ValueError for a record that would break later readers: a key that does not parse (``show``
    and ``report`` parse every key) or a time that is not a number."""
    from tuner.core.keys import parse_key  # imports torch: only here, not for every Store

    def number(name: str, x: Any, optional: bool) -> None:
        if (x is None and optional) or (isinstance(x, (int, float)) and not isinstance(x, bool)):
            return
        raise ValueError(f"{name} must be a number, got {x!r}")

    for m in measurements:
        parse_key(m.key)
        for name in ("median_us", "p10_us", "p90_us", "host_us", "max_rel_err"):
            number(name, getattr(m, name), True)
    for w in winners:
        parse_key(w.key)
        number("median_us", w.median_us, False)
        number("baseline_us", w.baseline_us, False)


class Store:
    def __init__(self, path: str | Path, *, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self._file: str | None = None
        if str(path) != ":memory:":
            if self.path.is_dir():
                raise StoreError(f"{path} is a directory, not a cache file")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"{path}: cannot create its directory: {e.strerror}") from None
            self._file = os.path.realpath(self.path)
        with _OPEN_LOCK:
            if self._file is not None and not _OPEN_FILES[self._file]:
                try:
                    _check_file(self.path)
                except OSError as e:
                    raise StoreError(f"{path} cannot be read: {e.strerror}") from None
            try:
                conn = sqlite3.connect(
                    str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False
                )
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.DatabaseError as e:
                raise StoreError(f"{path} cannot be opened as a tuner cache: {e}") from None
            if self._file is not None:
                _OPEN_FILES[self._file] += 1
        self.db = sqlite_utils.Database(conn)
        try:
            self._migrate()
        except StoreError:
            self.close()
            raise

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        self.db.conn.close()
        if self._file is not None:
            with _OPEN_LOCK:
                _OPEN_FILES[self._file] -= 1
                if _OPEN_FILES[self._file] <= 0:
                    del _OPEN_FILES[self._file]
            self._file = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that takes the write lock up front (no upgrade deadlocks)."""
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _schema_version(self) -> int:
        tables = set(self.db.table_names())
        if not tables:
            return 0
        if "meta" not in tables:
            raise StoreError(
                f"{self.path} is a SQLite database of another application (tables: {sorted(tables)[:5]})"
            )
        meta = {r["name"]: r["value"] for r in self.db.query("select name, value from meta")}
        if meta.get("app") != APP_ID:
            raise StoreError(
                f"{self.path} is a SQLite database of another application (meta.app={meta.get('app')!r})"
            )
        return int(meta.get("schema_version", 0))

    def _migrate(self) -> None:
        """Bring the schema up to date. A current file is only read: opening a store for reading
        never waits for, or blocks, a process that is writing."""
        try:
            if self._check_version() == SCHEMA_VERSION:
                return
            with self.transaction():
                version = self._check_version()  # again, under the write lock
                for step in MIGRATIONS[version:]:
                    step(self.db)
                if version < SCHEMA_VERSION:
                    self._put_meta(app=APP_ID, schema_version=str(SCHEMA_VERSION))
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.path} is corrupt or not a tuner cache: {e}") from None

    def _check_version(self) -> int:
        version = self._schema_version()
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this tuner's {SCHEMA_VERSION}; upgrade tuner"
            )
        return version

    def _put_meta(self, **values: str) -> None:
        self.db.conn.executemany(
            "insert or replace into meta(name, value) values (?, ?)", list(values.items())
        )

    # --- writes --------------------------------------------------------------------------------

    def save_device(self, fp: Fingerprint) -> None:
        now = time.time()
        with self.transaction() as c:
            c.execute(
                "insert into devices(device_class, fingerprint, first_seen, last_seen) values (?, ?, ?, ?) "
                "on conflict(device_class) do update set fingerprint=excluded.fingerprint, last_seen=excluded.last_seen",
                (fp.device_class, json.dumps(fp.to_dict(), sort_keys=True), now, now),
            )

    def save_run(self, measurements: Iterable[Measurement], winner: Winner | None = None) -> None:
        """Store a tuning run's measurements and its winner atomically."""
        with self.transaction() as c:
            self._insert_measurements(c, measurements)
            if winner is not None:
                self._upsert_winners(c, [winner])

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
        fleet feed page: bulk loads skip building and re-serialising Winner objects."""
        with self.transaction() as c:
            return self._upsert_winner_rows(c, rows)

    def record_misses(self, device_class: str, keys: Iterable[str], count: int = 1) -> None:
        now = time.time()
        with self.transaction() as c:
            c.executemany(
                "insert into misses(device_class, key, op, count, first_seen, last_seen) values (?, ?, ?, ?, ?, ?) "
                "on conflict(device_class, key) do update set count = count + excluded.count, last_seen = excluded.last_seen",
                [(device_class, k, k.partition(":")[0], count, now, now) for k in keys],
            )

    def clear_misses(self, device_class: str, keys: Iterable[str]) -> None:
        with self.transaction() as c:
            c.executemany(
                "delete from misses where device_class = ? and key = ?",
                [(device_class, k) for k in keys],
            )

    # --- reads ---------------------------------------------------------------------------------

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
        contains: str | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[Winner]:
        where, args = self._filters(
            device_class=device_class, op=op, source=source, contains=contains
        )
        if since is not None:
            where.append("updated_at > ?")
            args.append(since)
        sql = "select * from winners" + (" where " + " and ".join(where) if where else "")
        sql += " order by updated_at, device_class, key"
        if limit is not None:
            sql += f" limit {int(limit)}"
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

    def devices(self) -> list[dict[str, Any]]:
        return [
            {**r, "fingerprint": json.loads(r["fingerprint"])}
            for r in self.db.query("select * from devices")
        ]

    @staticmethod
    def _filters(contains: str | None = None, **equal: str | None) -> tuple[list[str], list[Any]]:
        where = [f"{col} = ?" for col, v in equal.items() if v is not None]
        args: list[Any] = [v for v in equal.values() if v is not None]
        if contains:  # a plain substring: LIKE would take '_' and '%' in keys as wildcards
            where.append("instr(key, ?) > 0")
            args.append(contains)
        return where, args

    # --- export / import -----------------------------------------------------------------------

    def export(self, device_class: str | None = None) -> dict[str, Any]:
        """Everything (or one device class) as a JSON-ready dict; ``import_`` takes it back."""
        return {
            "format": EXPORT_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "devices": [d for d in self.devices() if device_class in (None, d["device_class"])],
            "measurements": [m.to_row() for m in self.measurements(device_class)],
            "winners": [w.to_row() for w in self.winners(device_class)],
        }

    def import_(self, data: Any) -> dict[str, int]:
        """Merge an export into this store. Idempotent; all or nothing. Returns counts added."""
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise StoreError(
                f"not a tuner export: expected an object with format={EXPORT_FORMAT!r}"
            )
        version = data.get("schema_version", 0)
        if not isinstance(version, int):
            raise StoreError(
                f"malformed export: schema_version must be an integer, got {version!r}"
            )
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"export has schema version {version}, newer than this tuner's {SCHEMA_VERSION}"
            )
        try:
            measurements = [Measurement.from_row(r) for r in data.get("measurements", [])]
            winners = [Winner.from_row(r) for r in data.get("winners", [])]
            devices = [
                (d["device_class"], json.dumps(d["fingerprint"]), d["first_seen"], d["last_seen"])
                for d in data.get("devices", [])
            ]
            _check_imported(measurements, winners)
        except (TypeError, KeyError, ValueError) as e:
            raise StoreError(f"malformed export: {e!r}") from None
        with self.transaction() as c:
            c.executemany(
                "insert or ignore into devices(device_class, fingerprint, first_seen, last_seen) values (?, ?, ?, ?)",
                devices,
            )
            added = self._insert_measurements(c, measurements)
            self._upsert_winners(c, winners)
        return {"measurements": added, "winners": len(winners), "devices": len(devices)}

"""A SQLite file that one kind of program owns: open, check, migrate, transact.

The local cache (``tuner.cache.Store``) and the fleet service's database (``server.store``)
share this base and nothing else: each declares a ``Schema`` (its ``application_id``, its
migrations) and gets the same guarantees. The file is in WAL mode and every write is a single
``BEGIN IMMEDIATE`` transaction, so several processes can write into one file and no result is
lost. A file of another kind (foreign, corrupt, or from a newer tuner) raises ``StoreError``
before anything is written to it; a current file is only read on open, so opening never waits
for, or blocks, a writer. Migrations run in one transaction: all of them or none.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

import sqlite_utils

from tuner.core.fork_safe import ForkSafeLock

log = logging.getLogger(__name__)

SQLITE_MAGIC = b"SQLite format 3\x00"
Migration = Callable[[sqlite_utils.Database], None]


class _KeepNothing(Exception):
    """Raised inside ``transaction`` to roll it back."""


class StoreError(Exception):
    """The file cannot be used as it is; the message says why and what to do."""


class BusyError(StoreError):
    """Another process's lock outlasted the wait: nothing was written, and the same write may
    succeed once that process is done."""


class ReadOnlyError(StoreError):
    """The file can be read but not written (its mode, an immutable flag, a read-only mount): a
    reader may go on using it, a writer cannot."""


class WriteFailedError(ReadOnlyError):
    """A write the file system refused (the disk full, a file-size limit, an I/O error): the
    write was rolled back whole and what was stored before stands, so a reader may go on using
    the file, as a read-only one; a writer cannot, until space is made."""


def is_corrupt(e: sqlite3.DatabaseError) -> bool:
    """Whether SQLite found the file damaged (a page it cannot read, an index that disagrees
    with its table: the extended codes too), not merely busy."""
    return getattr(e, "sqlite_errorname", "").startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


def is_busy(e: sqlite3.DatabaseError) -> bool:
    """Whether SQLite refused because another connection holds a lock (SQLITE_BUSY and its
    extended codes): the same statement may succeed once it lets go."""
    return getattr(e, "sqlite_errorname", "").startswith("SQLITE_BUSY")


def is_write_failure(e: sqlite3.DatabaseError) -> bool:
    """Whether SQLite could not write for want of room or a failing write (SQLITE_FULL: the
    disk or a file-size limit; SQLITE_IOERR and its extended codes), not a damaged file."""
    return getattr(e, "sqlite_errorname", "").startswith(("SQLITE_FULL", "SQLITE_IOERR"))


def is_read_only(e: sqlite3.DatabaseError) -> bool:
    """Whether SQLite refused a write because the file cannot be written (SQLITE_READONLY and
    its extended codes), not because it is damaged or busy."""
    return getattr(e, "sqlite_errorname", "").startswith("SQLITE_READONLY")


@dataclass(frozen=True)
class Schema:
    """What a kind of file holds. ``migrations[i]`` takes version ``i`` to ``i + 1`` (0 is an
    empty file); add one at the end to change the schema, never edit an old one.

    ``legacy_version`` reads the version of a file written before application ids were set
    (``application_id`` 0 with tables), or raises ``StoreError`` when such a file is not of
    this kind. ``readable_from``: the oldest version whose files this code reads as they are
    where it cannot migrate them (a read-only file, e.g. one baked into an image by an older
    release); None: the current version only."""

    kind: str  # names the file in messages: "tuner cache", "tuner fleet database"
    application_id: int
    migrations: Sequence[Migration]
    legacy_version: Callable[[sqlite_utils.Database, Path], int]
    readable_from: int | None = None
    # the advice of a message about a file that cannot be written: where to name another
    elsewhere: str = "name another cache (--cache / $TUNER_CACHE)"

    @property
    def version(self) -> int:
        return len(self.migrations)


FLEET_APPLICATION_ID = 0x544E5246  # "TNRF": the fleet service's database (``server.schema``)
# application_id -> kind, for naming a file of another tuner kind (the fleet's is named here too:
# a host's commands never import the service's schema)
KINDS: dict[int, str] = {FLEET_APPLICATION_ID: "tuner fleet database"}


def register(schema: Schema) -> Schema:
    KINDS[schema.application_id] = schema.kind
    return schema


# Closing *any* file descriptor on a SQLite file drops every POSIX lock this process holds on it
# (sqlite.org/howtocorrupt.html, 2.2); another process closing its last connection may then
# delete the WAL under this process's open connections. So the header check, which opens the
# file with plain ``open()``, only runs while no connection of this process has the file open.
_OPEN_FILES: collections.Counter[str] = collections.Counter()
_OPEN_LOCK = ForkSafeLock()
_VERIFIED: set[str] = set()  # files this process has quick-checked (``SqliteFile.verify``)


def unmade(path: Path) -> bool:
    """No database at ``path`` yet: no file, or an empty one (``touch``, a failed copy), which
    SQLite would make a new database of."""
    return not path.exists() or (path.is_file() and path.stat().st_size == 0)


def _check_header(path: Path) -> None:
    if unmade(path):
        return
    with path.open("rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head != SQLITE_MAGIC:
        raise StoreError(
            f"{path} is not a SQLite database (corrupt or another kind of file); refusing to touch it"
        )


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK)


def _read_only_uri(path: Path) -> str:
    """How to open a file in a folder this process cannot write (a read-only mount, a cache
    baked into an image), where SQLite cannot make the index it keeps beside a WAL file. Where a
    write-ahead log lies beside it (a writer that can write there has it open, or it was left
    unmerged when the folder was frozen): read-only, which reads the log's rows and keeps in step
    with that writer through its index. Where none does, no writer has the file open: as
    immutable (an immutable file's reader would skip a log's rows)."""
    query = "mode=ro" if Path(f"{path}-wal").exists() else "immutable=1"
    return f"{path.resolve().as_uri()}?{query}"


class SqliteFile:
    """One connection to one file of ``schema``'s kind; open one per thread."""

    schema: ClassVar[Schema]

    def __init__(self, path: str | Path, *, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self._file: str | None = None
        self._as_it_is = False  # read-only at an older version the schema reads: no writes
        self._timeout_s = timeout_s
        if str(path) != ":memory:":
            if self.path.is_dir():
                raise StoreError(
                    f"{path} is a directory, not a cache file (a {self.schema.kind} was expected)"
                )
            if self.path.exists() and not self.path.is_file():
                raise StoreError(
                    f"{path} is not a regular file (a device, a pipe, a socket): a "
                    f"{self.schema.kind} is one"
                )
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"{path}: cannot create its directory: {e.strerror}") from None
            self._file = os.path.realpath(self.path)
        with _OPEN_LOCK:
            if self._file is not None and not _OPEN_FILES[self._file]:
                try:
                    _check_header(self.path)
                except OSError as e:
                    raise StoreError(f"{path} cannot be read: {e.strerror}") from None
            conn = self._connect()
            if self._file is not None:
                _OPEN_FILES[self._file] += 1
        self.db = sqlite_utils.Database(conn)
        try:
            self._open()
        except BaseException:  # a StoreError, or anything unforeseen: no connection left open
            self.close()
            raise

    def _connect(self) -> sqlite3.Connection:
        """A new connection to the file, read-only where its folder cannot be written; a
        StoreError where SQLite cannot open it."""
        target, uri = str(self.path), False
        if self._file is not None and self.path.exists() and not _writable(self.path.parent):
            target, uri = _read_only_uri(self.path), True
        try:
            conn = sqlite3.connect(
                target, timeout=self._timeout_s, isolation_level=None, check_same_thread=False,
                uri=uri,
            )  # fmt: skip
            conn.execute("PRAGMA synchronous=NORMAL")  # a setting of this connection only
        except sqlite3.DatabaseError as e:
            if is_write_failure(e):
                raise self.unusable(e) from None
            raise StoreError(
                f"{self.path} cannot be opened as a {self.schema.kind}: {e}{self._why_not(e)}"
            ) from None
        return conn

    def close(self) -> None:
        self.db.conn.close()
        if self._file is not None:
            with _OPEN_LOCK:
                _OPEN_FILES[self._file] -= 1
                if _OPEN_FILES[self._file] <= 0:
                    del _OPEN_FILES[self._file]
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify(self) -> None:
        """StoreError unless SQLite's quick check finds every page whole. The header check on
        open cannot see a page damaged inside the file, so this runs before a process first
        writes to it (once a process: the check reads the whole file): a damaged file is
        refused, not written to."""
        try:
            found = [row[0] for row in self.db.conn.execute("PRAGMA quick_check(1)")]
        except sqlite3.DatabaseError as e:
            if not is_corrupt(e):  # the check could not read the file: not proof of damage
                raise self.unusable(e) from None
            found = [str(e)]
        if found != ["ok"]:
            raise self.corrupt(" ".join(found[0].replace("***", "").split()))
        if self._file is not None:
            with _OPEN_LOCK:
                _VERIFIED.add(self._file)

    def _verified(self) -> bool:
        return self._file is None or self._file in _VERIFIED

    def corrupt(self, why: object) -> StoreError:
        return StoreError(
            f"{self.path} is corrupt ({why}); refusing to use it: restore it from a backup, "
            f"or move it aside to start a new {self.schema.kind}"
        )

    def unusable(self, e: sqlite3.DatabaseError) -> StoreError:
        """A file that SQLite could not read or set up for an I/O reason (the disk full, a
        file-size limit, a device that is no regular file), not found damaged: said as such,
        so that no one restores a sound file from a backup."""
        if is_read_only(e):
            return self.read_only()
        if is_write_failure(e):
            return self.write_failed(e)
        if is_busy(e):
            return BusyError(
                f"{self.path} is locked by another process ({e}): try again once it is done"
            )
        return StoreError(
            f"{self.path} cannot be used now ({e}), which is no sign of damage; check the "
            f"file system of {self.path.resolve().parent}"
        )

    def read_only(self) -> ReadOnlyError:
        folder = self.path.resolve().parent
        what = "the file" if _writable(folder) else f"its folder {folder}"
        if what == "the file" and os.access(self.path, os.W_OK):
            # the file is writable but a file SQLite keeps beside it is not (left read-only by
            # a reader of the file while it was read-only, or another user's)
            side = [
                name
                for name in (f"{self.path}-wal", f"{self.path}-shm")
                if os.path.exists(name) and not os.access(name, os.W_OK)
            ]
            if side:
                them = "it" if len(side) == 1 else "them"
                return ReadOnlyError(
                    f"{self.path} cannot be written: {' and '.join(side)} beside it "
                    f"{'is' if len(side) == 1 else 'are'} read-only (left by a reader while the "
                    f"cache was read-only, or another user's); make {them} writable (a -shm "
                    "file may also be removed while no process has the cache open; never the "
                    "-wal file: it may hold stored results), or "
                    f"{self.schema.elsewhere}"
                )
        return ReadOnlyError(
            f"{self.path} is read-only: nothing can be stored in it; make {what} writable, "
            f"or {self.schema.elsewhere}"
        )

    def write_failed(self, e: sqlite3.DatabaseError) -> WriteFailedError:
        folder = self.path.resolve().parent
        if getattr(e, "sqlite_errorname", "").startswith("SQLITE_FULL"):
            what = f"make room on the file system of {folder}"
        else:  # an I/O error: a file-size limit (EFBIG) reads as one too, or a failing device
            what = f"check the file system of {folder} (its space, the file-size limit, the device)"
        return WriteFailedError(
            f"{self.path} could not be written ({e}): the write was rolled back, what was stored "
            f"before stands; {what}, or {self.schema.elsewhere}"
        )

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Reads that meet a damaged page raise ``StoreError`` (the file's ``corrupt``), as a
        write does: the file opened fine, and only a query that reaches the page finds it."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if is_corrupt(e):
                raise self.corrupt(e) from None
            raise

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that takes the write lock up front (no upgrade deadlocks).
        A file read as it is (read-only at an older version) refuses it as read-only: its
        tables are not those the writes name."""
        if self._as_it_is:
            raise self.read_only()
        if not self._verified():
            self.verify()
        conn = self.db.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                self._roll_back()
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.DatabaseError:
                self._roll_back()  # a commit that failed may leave its transaction open
                raise
        except sqlite3.DatabaseError as e:
            raise self._write_error(e) from None

    def check_writable(self) -> None:
        """Refuse, as a write would, a file that cannot be written (read-only, locked, its
        disk full), by a write that is rolled back: a long command asks before it starts and
        stores nothing, so a new file it made still holds nothing if the command fails."""
        with contextlib.suppress(_KeepNothing), self.transaction() as conn:
            # a write of what is there: SQLite takes it as one, and a read-only file refuses it
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            conn.execute(f"PRAGMA user_version={int(version)}")
            raise _KeepNothing

    def _roll_back(self) -> None:
        """End the open transaction, if SQLite left one, keeping nothing of it. A ROLLBACK that
        SQLite aborts too (interrupted, out of memory) would leave the connection inside its
        transaction, holding the write lock every other writer waits on, and refusing its own
        next write as nested: the connection is then opened again, which ends the transaction.
        Either way the first error is the one told."""
        conn = self.db.conn
        if not conn.in_transaction:
            return
        with contextlib.suppress(sqlite3.DatabaseError):
            conn.execute("ROLLBACK")
        if conn.in_transaction:
            self.reconnect()

    def reconnect(self) -> None:
        """Close the connection to a file and open a new one (an in-memory database would be
        lost with it: it is left as it is). A failed open is not told here: the caller's error
        is the one to tell, and the next use of the closed connection tells its own."""
        if self._file is None:
            return
        self.db.conn.close()
        with contextlib.suppress(StoreError):
            self.db = sqlite_utils.Database(self._connect())

    def _write_error(self, e: sqlite3.DatabaseError) -> sqlite3.DatabaseError | StoreError:
        """What a write's ``e`` tells its caller: a damaged file, one that cannot be written
        (read-only: the file, its folder, or the ``-wal`` and ``-shm`` files beside it), a
        write the file system refused (disk full), or one another process's lock outlasted
        (a StoreError its callers tell, not a raw ``database is locked``); any other error as
        it is."""
        if is_corrupt(e):
            return self.corrupt(e)
        if is_busy(e):
            return self.unusable(e)
        if is_read_only(e):
            return self.read_only()
        if is_write_failure(e):
            return self.write_failed(e)
        return e

    def schema_version(self) -> int:
        """The file's schema version; StoreError if it is not a file of this kind."""
        conn = self.db.conn
        (app_id,) = conn.execute("PRAGMA application_id").fetchone()
        if app_id == self.schema.application_id:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        elif app_id in KINDS:
            raise StoreError(f"{self.path} is a {KINDS[app_id]}, not a {self.schema.kind}")
        elif app_id:
            raise StoreError(
                f"{self.path} is a SQLite database of another application "
                f"(application_id={app_id:#x}); refusing to touch it"
            )
        elif not self.db.table_names():
            version = 0
        else:
            version = self.schema.legacy_version(self.db, self.path)
        if version > self.schema.version:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this tuner's "
                f"{self.schema.version}; upgrade tuner"
            )
        return version

    def _open(self) -> None:
        """Check the file, then bring its schema up to date in one transaction (or, read-only
        and at a version the schema reads as it is, leave it as it is)."""
        try:
            version = self._read_version()
            if version == self.schema.version:
                return
            try:
                self._migrate()
            except ReadOnlyError as e:
                readable = self.schema.readable_from
                # a full disk is no read-only file: read as it is, it would be refused every
                # write as one, even once room is made
                if isinstance(e, WriteFailedError) or readable is None or version < readable:
                    raise
                log.warning(
                    "%s is read-only at schema version %d: read as it is (not migrated to %d)",
                    self.path, version, self.schema.version,
                )  # fmt: skip
                self._as_it_is = True
        except sqlite3.DatabaseError as e:
            if "unable to open" in str(e):
                raise StoreError(f"{self.path} cannot be opened: {e}{self._why_not(e)}") from None
            if is_write_failure(e) or is_read_only(e) or is_busy(e):
                raise self.unusable(e) from None
            raise StoreError(f"{self.path} is corrupt or not a {self.schema.kind}: {e}") from None

    def _read_version(self) -> int:
        """``schema_version`` read in one snapshot. Read statement by statement, a new file that
        another connection initialises meanwhile would show the first read its
        ``application_id`` as 0 (not yet committed) and the next its tables (committed since),
        and be refused as another application's file."""
        conn = self.db.conn
        conn.execute("BEGIN")
        try:
            return self.schema_version()
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    def _migrate(self) -> None:
        self._wal()
        with self.transaction() as c:
            version = self.schema_version()  # again, under the write lock
            for step in self.schema.migrations[version:]:
                step(self.db)
            c.execute(f"PRAGMA application_id={int(self.schema.application_id)}")
            c.execute(f"PRAGMA user_version={int(self.schema.version)}")

    def _wal(self) -> None:
        """Put the file in WAL mode. Switching a file to WAL takes an exclusive lock without
        waiting for it (SQLite calls no busy handler there), so while another connection reads
        the new file (in its rollback mode, before the switch) the switch fails as "database is
        locked" at once: it is retried until that reader lets go, or the connection's timeout."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                self.db.conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.DatabaseError as e:
                if is_read_only(e):
                    raise self.read_only() from None
                if not is_busy(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(0.005)

    def _why_not(self, e: sqlite3.DatabaseError) -> str:
        """What a bare "unable to open database file" leaves out, when it is so."""
        folder = self.path.resolve().parent
        if "unable to open" in str(e) and not _writable(folder):
            return f" ({folder} is not writable, so no new file can be made there)"
        return ""

"""The service's database: one ``FleetStore`` (one SQLite connection) per thread.

SQLite connections belong to their thread; FastAPI runs sync endpoints on a thread pool, so each
pool thread opens its own connection on first use and keeps it (opening one per request would
run the migration check, a write transaction, on every request).

A database file removed or replaced while the service runs leaves its open connections on the
old file: what they write is lost at the next start, and a pool thread's first connection would
open (or make) whatever file is at the path now. ``MovedDatabaseMiddleware`` answers every
request that may touch the database 503 from then on, and ``/v1/ready`` says why, so that the
hosts keep their results and a monitor sees it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.store import FleetStore

# what answers without the database (a moved one's service still says that it is up, and why
# it is not ready)
NO_DATABASE = ("/v1/health", "/v1/ready", "/docs", "/openapi.json")
log = logging.getLogger("tuner.server")


class FleetDB:
    def __init__(self, path: Path, *, lock_wait_s: float = 30.0) -> None:
        self.path = Path(path)
        self.lock_wait_s = lock_wait_s  # for another process's lock, before a request gets 503
        self._local = threading.local()
        self._all: list[FleetStore] = []
        self._lock = threading.Lock()
        # create / migrate once, up front, and read every page once: a bad file (its header, or
        # a page damaged inside it) fails at startup, not on the requests that meet it
        with FleetStore(self.path) as first:
            first.verify()
            # and write once: a file that cannot be written (its mode, a read-only mount) would
            # say ready, then answer every write of every host with a 500
            with first.transaction() as c:
                c.execute("update srv_service set id = id")
        self._identity = _identity(self.path)
        self._told = False  # the log says it once

    def moved(self) -> str:
        """Why the file at ``path`` is no longer the one the service opened, or ""."""
        found = _identity(self.path)
        if found == self._identity:
            return ""
        what = "removed" if found is None else "replaced by another file"
        why = (
            f"the database {self.path} was {what} while the service ran: what it stored since "
            "is lost at the next start; restart the service (on a restored file, if any)"
        )
        if not self._told:
            self._told = True
            log.error("%s; answering 503 to every request that may touch it until then", why)
        return why

    def store(self) -> FleetStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = FleetStore(self.path, timeout_s=self.lock_wait_s)
            self._local.store = store
            with self._lock:
                self._all.append(store)
        return store

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class MovedDatabaseMiddleware:
    """503 for every request that may touch the database once ``db.moved()``."""

    def __init__(self, app: ASGIApp, db: FleetDB) -> None:
        self.app, self.db = app, db

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in NO_DATABASE
            and (why := self.db.moved())
        ):
            await JSONResponse({"detail": why}, 503)(scope, receive, send)
            return
        await self.app(scope, receive, send)

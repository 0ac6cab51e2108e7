"""The service's database: one ``FleetStore`` (one SQLite connection) per thread.

SQLite connections belong to their thread; FastAPI runs sync endpoints on a thread pool, so each
pool thread opens its own connection on first use and keeps it (opening one per request would
run the migration check, a write transaction, on every request).
"""

from __future__ import annotations

import threading
from pathlib import Path

from server.store import FleetStore


class FleetDB:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._all: list[FleetStore] = []
        self._lock = threading.Lock()
        # create / migrate once, up front, and read every page once: a bad file (its header, or
        # a page damaged inside it) fails at startup, not on the requests that meet it
        with FleetStore(self.path) as first:
            first.verify()

    def store(self) -> FleetStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = FleetStore(self.path, timeout_s=30.0)
            self._local.store = store
            with self._lock:
                self._all.append(store)
        return store

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()

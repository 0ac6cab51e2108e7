"""Run the service on a free loopback port: in a thread, or as a ``tuner serve`` subprocess.

Tests and benchmarks use these to talk to a real uvicorn over real TCP, not an in-process shim.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from server import tokens
from server.app import create_app
from server.config import Settings
from server.store import FleetStore
from tuner.fleet.client import FleetClient


def wait_until(check: Callable[[], object], timeout_s: float = 30.0) -> object:
    """Poll ``check`` until it returns something truthy, and return that; AssertionError after
    ``timeout_s`` (for tests and benchmarks waiting on background work)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


def _wait_healthy(
    url: str, timeout_s: float, alive: Any = lambda: True, path: str = "/v1/health"
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the service at {url} exited during startup")
        try:
            if httpx.get(url + path, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the service at {url} did not come up within {timeout_s} s")


class _Tokens:
    db: Path
    url: str

    def token(self, name: str, *scopes: str) -> str:
        """A new bearer token, written straight into the service's database."""
        with FleetStore(self.db) as store:
            return tokens.create(store, name, list(scopes))[1]

    def client(self, name: str, *scopes: str, **kwargs: Any) -> FleetClient:
        """A client holding a new token of its own (one token per simulated host)."""
        return FleetClient(self.url, self.token(name, *scopes) if scopes else None, **kwargs)


class AppThread:
    """Any ASGI app under uvicorn in a daemon thread, on a socket bound before start (no port
    race); ``port=0`` picks a free one. Ready once ``health_path`` answers 200."""

    def __init__(self, app: Any, port: int = 0, health_path: str = "/v1/health") -> None:
        self.app, self.health_path = app, health_path
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Any:
        self.thread.start()
        _wait_healthy(self.url, 30, self.thread.is_alive, self.health_path)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class ThreadServer(AppThread, _Tokens):
    """The fleet service in a thread of this process."""

    def __init__(self, db: Path, port: int = 0, **settings: Any) -> None:
        self.db = Path(db)
        super().__init__(create_app(Settings(db=db, **settings)), port)


def backup(db: Path, to: Path) -> None:
    """An online backup of a (possibly live) service database, with SQLite's backup API."""
    with contextlib.closing(sqlite3.connect(db)) as src, contextlib.closing(sqlite3.connect(to)) as dst:  # fmt: skip
        src.backup(dst)


def restore(db: Path, saved: Path) -> None:
    """Replace a stopped service's database (its WAL files too) by the backup ``saved``, as an
    operator restoring an older backup would; its artifact blobs are left as they are."""
    for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        f.unlink(missing_ok=True)
    shutil.copy(saved, db)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SubprocessServer(_Tokens):
    """``tuner serve`` as a child process (a separate interpreter, as in production)."""

    def __init__(self, db: Path, *args: str, log: Path | None = None) -> None:
        self.db, self.args, self.log = Path(db), args, log
        self.proc: subprocess.Popen | None = None
        self._log_file: Any = None
        self.url = ""

    def __enter__(self) -> SubprocessServer:
        self._log_file = self.log.open("ab") if self.log else None
        for _ in range(5):  # a port picked free can be taken before the child binds it
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            out = self._log_file or subprocess.DEVNULL
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tuner", "serve", "--db", str(self.db),
                 "--port", str(port), "--log-level", "warning", *self.args],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ},
            )  # fmt: skip
            try:
                _wait_healthy(self.url, 60, lambda: self.proc.poll() is None)
                return self
            except RuntimeError:
                continue
        raise RuntimeError("could not start tuner serve on a free port")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()

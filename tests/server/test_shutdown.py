"""A stop past ``--shutdown-timeout`` cuts the requests in flight: each is logged as one line
and answered truthfully (503 where nothing of it was stored), never with a traceback, and the
database stays whole (real ``tuner serve`` on loopback, SIGTERM, real SQLite file)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from server import shutdown
from server.blobs import default_dir
from server.live import SubprocessServer, wait_until
from tuner.core.device import fingerprint
from tuner.fleet.client import wire
from tuner.measure.records import Measurement

pytestmark = pytest.mark.timeout(120)
FP = fingerprint()
CHUNK = 64 * 1024
SPEC = {"source": "triton_gemm", "config": {"bm": 64}, "arch": "sm_90", "toolchain": {}}


class Stopped:
    """A service started with a short shutdown timeout, stopped by SIGTERM mid-request."""

    def __init__(self, root: Path) -> None:
        self.db, self.log = root / "fleet.db", root / "serve.log"
        self.srv = SubprocessServer(self.db, "--shutdown-timeout", "0.5", log=self.log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self) -> None:
        assert self.srv.proc is not None
        self.srv.proc.send_signal(signal.SIGTERM)

    def exited_cleanly(self) -> bool:
        """uvicorn re-raises the SIGTERM it handled once it has stopped (a supervisor sees
        the process end by that signal); older releases exit 0."""
        assert self.srv.proc is not None
        return self.srv.proc.wait(30) in (0, -signal.SIGTERM)

    def rows(self, sql: str) -> list[tuple]:
        with contextlib.closing(sqlite3.connect(self.db)) as con:
            assert con.execute("pragma integrity_check").fetchall() == [("ok",)]
            return con.execute(sql).fetchall()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Stopped]:
    stopped = Stopped(tmp_path)
    with stopped.srv:
        yield stopped


def in_thread(send: callable) -> tuple[threading.Thread, list]:
    """``send()`` in a thread; its response (or the exception it raised) lands in the list."""
    got: list = []

    def run() -> None:
        try:
            got.append(send())
        except httpx.HTTPError as e:
            got.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def cut_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "cut by the stop" in line]


def test_a_slow_upload_cut_by_the_stop_gets_503_and_one_log_line(service: Stopped) -> None:
    data = bytes(range(256)) * (CHUNK // 16)  # 1 MiB, sent a chunk every 0.2 s: ~3 s
    digest = hashlib.sha256(data).hexdigest()
    token = service.srv.token("builder", "build")
    blobs = default_dir(service.db)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]
            time.sleep(0.2)

    thread, got = in_thread(lambda: httpx.put(
        f"{service.srv.url}/v1/artifacts/blobs/{digest}", content=chunks(), timeout=30,
        headers={"Authorization": f"Bearer {token}", "Tuner-Artifact-Spec": json.dumps(SPEC),
                 "Content-Length": str(len(data))},
    ))  # fmt: skip
    wait_until(lambda: list(blobs.glob(".*.tmp")), 10)  # the upload is being received
    service.terminate()
    thread.join(30)
    assert service.exited_cleanly()
    (r,) = got
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 503 and "stopping" in r.json()["detail"], r.text
    log = service.text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    (line,) = cut_lines(log)
    assert re.search(rf"PUT /v1/artifacts/blobs/{digest} after \d+\.\d\d s; answered 503", line)
    assert list(blobs.iterdir()) == []  # the partial upload is gone, nothing stored
    assert service.rows("select count(*) from srv_artifact_builds") == [(0,)]


def test_a_write_in_flight_when_cut_is_rolled_back_whole(service: Stopped) -> None:
    """Another writer (a backup, ``tuner token create``) holds the write lock, so the
    submission is inside its transaction when the stop cuts it: it stores nothing, and says so."""
    token = service.srv.token("host", "submit")
    body = {"device": FP.to_dict(), "measurements": [wire(Measurement(
        FP.device_class, f"gemm:m={m},n=8,k=8,dtype=f32,out_dtype=f32", "torch", {}, "ok",
        is_baseline=True, median_us=10.0, p10_us=9.9, p90_us=10.1, reps=5,
        versions=FP.version_tag,
    )) for m in range(1, 51)]}  # fmt: skip
    holder = sqlite3.connect(service.db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    thread, got = in_thread(lambda: httpx.post(
        service.srv.url + "/v1/measurements", json=body, timeout=30,
        headers={"Authorization": f"Bearer {token}"},
    ))  # fmt: skip
    time.sleep(1.0)  # the request reaches its transaction and waits there for the lock
    service.terminate()
    wait_until(lambda: "timeout graceful shutdown exceeded" in service.text(), 10)
    holder.execute("ROLLBACK")  # the cut request gets the lock now, inside the grace
    holder.close()
    thread.join(30)
    assert service.exited_cleanly()
    (r,) = got
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 503 and "nothing of this request was stored" in r.json()["detail"]
    log = service.text()
    assert "Traceback" not in log, log
    (line,) = cut_lines(log)
    assert "POST /v1/measurements" in line and "answered 503" in line
    assert service.rows("select count(*) from srv_measurements") == [(0,)]
    assert service.rows("select count(*) from devices") == [(0,)]


def cut_answer(work: Callable[[shutdown.Ledger], None]) -> tuple[int, str]:
    """What ``StopMiddleware`` answers a request cut by the stop right after ``work(ledger)``."""
    sent: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        work(shutdown.ledger())
        raise asyncio.CancelledError

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    middleware = shutdown.StopMiddleware(app, shutdown.Stops())
    scope = {"type": "http", "method": "POST", "path": "/v1/misses"}
    asyncio.run(middleware(scope, receive, send))
    start, body = sent
    return start["status"], json.loads(body["body"])["detail"]


def test_a_request_cut_after_it_stored_gets_500_not_503() -> None:
    """Sent again, a miss report already stored would be counted twice: not 'send it again'."""

    def stored(book: shutdown.Ledger) -> None:
        with book.transaction():
            pass

    assert cut_answer(lambda book: None) == (503, shutdown.STOPPING)
    assert cut_answer(stored) == (500, shutdown.STORED)


def test_a_transaction_still_running_past_the_grace_gets_500_and_cannot_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutdown, "WRITE_GRACE_S", 0.05)
    release, books, refused = threading.Event(), [], []

    def writer(book: shutdown.Ledger) -> None:
        try:
            with book.transaction():  # as FleetStore.transaction runs one
                release.wait(10)
                book.raise_if_cut()  # its last step before COMMIT
        except shutdown.Cut as e:
            refused.append(e)

    def start_writing(book: shutdown.Ledger) -> None:
        books.append(book)
        threading.Thread(target=writer, args=(book,)).start()
        wait_until(lambda: book.writing, 10)

    assert cut_answer(start_writing) == (500, shutdown.UNSETTLED)
    release.set()
    (book,) = books
    wait_until(lambda: not book.writing, 10)
    assert len(refused) == 1 and not book.stored  # it rolls back
    with pytest.raises(shutdown.Cut), book.transaction():  # and no new one begins
        pass


def test_a_slow_download_cut_by_the_stop_gets_one_log_line(service: Stopped) -> None:
    """The file stream is still winding down when the shutdown begins: the shutdown waits for
    it, so its line is written before the event loop closes."""
    data = hashlib.sha256(b"seed").digest() * (32 * 1024 * 1024 // 32)  # 32 MiB
    digest = hashlib.sha256(data).hexdigest()
    builder, reader = service.srv.token("builder", "build"), service.srv.token("host", "read")
    r = httpx.put(
        f"{service.srv.url}/v1/artifacts/blobs/{digest}", content=data, timeout=60,
        headers={"Authorization": f"Bearer {builder}", "Tuner-Artifact-Spec": json.dumps(SPEC)},
    )  # fmt: skip
    assert r.status_code in (200, 201), r.text
    received: list[int] = []

    def download() -> int:
        with httpx.stream("GET", f"{service.srv.url}/v1/artifacts/blobs/{digest}", timeout=30,
                          headers={"Authorization": f"Bearer {reader}"}) as r:  # fmt: skip
            for chunk in r.iter_bytes(CHUNK):
                received.append(len(chunk))
                time.sleep(0.05)
        return sum(received)

    thread, got = in_thread(download)
    wait_until(lambda: received, 10)  # the answer has started
    service.terminate()
    thread.join(60)
    assert service.exited_cleanly()
    (r,) = got
    assert isinstance(r, httpx.RemoteProtocolError), r  # the client sees the answer cut short
    log = service.text()
    assert "Traceback" not in log, log
    (line,) = cut_lines(log)
    assert f"GET /v1/artifacts/blobs/{digest}" in line and "closed mid-answer" in line

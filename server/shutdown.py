"""Requests a stop cuts: one log line each and an answer that tells the truth, never a traceback.

Past ``--shutdown-timeout`` uvicorn cancels every request still running. Left alone, the
``CancelledError`` runs out through the app: uvicorn logs it with a traceback and answers 500.
``StopMiddleware`` catches it instead and answers by what the request stored (its ``Ledger``,
which every ``FleetStore`` transaction of the request reports to):

- nothing: 503 ("the service is stopping"), which a client may safely send again (the fleet
  client sends a miss report or a queue claim again only on 503 or 429);
- a transaction still running: it is given ``WRITE_GRACE_S`` to end. Once its request is cut,
  a transaction commits only if it had passed its last check before the cut; any other rolls
  back whole, and no new one begins. Then 503 if nothing was stored, else 500 saying the
  request's writes were stored but its answer is lost (not 503: sent again, a miss report
  would be counted twice); 500 too where one is still running past the grace, saying each
  write is stored whole or not at all.

A response already started cannot be changed: its connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tuner.server")

WRITE_GRACE_S = 5.0  # how long a cut request's running transaction may take to end
STOPPING = "the service is stopping: nothing of this request was stored; send it again later"
STORED = (
    "the service stopped while answering: this request's writes were stored (each whole), "
    "but its answer is lost"
)
UNSETTLED = (
    "the service stopped while storing this request: each of its writes is stored whole or not "
    "at all, and its answer is lost"
)


class Cut(Exception):
    """A transaction of a request the stop cut, refused before it could store anything."""


@dataclass
class Ledger:
    """What one request's transactions did, read by the thread that answers a cut request
    while the request's worker thread may still be writing (hence the lock)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    cut: bool = False
    writing: int = 0
    stored: bool = False

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Around one transaction: refused if the request is cut already; ``stored`` once it
        commits."""
        with self.lock:
            if self.cut:
                raise Cut("the request was cut by the service's stop")
            self.writing += 1
        committed = False
        try:
            yield
            committed = True
        finally:
            with self.lock:
                self.writing -= 1
                self.stored |= committed

    def raise_if_cut(self) -> None:
        """The last step before COMMIT: a transaction of a request the stop has cut rolls back."""
        with self.lock:
            if self.cut:
                raise Cut("the request was cut by the service's stop: rolled back")

    def cut_now(self) -> int:
        """Mark the request cut; how many of its transactions are still running."""
        with self.lock:
            self.cut = True
            return self.writing


_LEDGER: ContextVar[Ledger | None] = ContextVar("tuner_request_ledger", default=None)


def ledger() -> Ledger:
    """This request's ledger (worker threads see their request's); outside a request (a CLI
    command) a fresh one, never cut."""
    return _LEDGER.get() or Ledger()


class Stops:
    """The requests in flight, each kept from its start: the app's shutdown waits for them
    (``WRITE_GRACE_S`` and a second at most: uvicorn has let each end or cut it by then) before
    it closes the database under their transactions, and before the event loop closes under a
    cut one still winding down (a download's file stream), whose log line would be lost."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()

    async def drain(self) -> None:
        if self.running:
            await asyncio.wait(self.running, timeout=WRITE_GRACE_S + 1)


class StopMiddleware:
    """Gives each request a ``Ledger`` and answers the requests a stop cuts (see the module)."""

    def __init__(self, app: ASGIApp, stops: Stops) -> None:
        self.app, self.stops = app, stops

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, answered, book = time.monotonic(), False, Ledger()
        _LEDGER.set(book)  # the request's own task: its context is its own

        async def tracked(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.current_task()
        assert task is not None
        self.stops.running.add(task)
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            outcome = await self._answer(book, answered, scope, receive, send)
            log.warning("cut by the stop: %s %s after %.2f s; %s", scope["method"],
                        scope["path"], time.monotonic() - started, outcome)  # fmt: skip
        finally:
            self.stops.running.discard(task)

    async def _answer(
        self, book: Ledger, answered: bool, scope: Scope, receive: Receive, send: Send
    ) -> str:
        """Answer a cut request; what was done, for the log line."""
        if book.cut_now():
            await _settled(book)
        if answered:
            return "connection closed mid-answer"
        status, detail = _verdict(book)
        try:
            await JSONResponse({"detail": detail}, status)(scope, receive, send)
        except asyncio.CancelledError:  # cancelled again: the event loop is closing
            return "connection closed unanswered"
        return f"answered {status}: {detail}"


def _verdict(book: Ledger) -> tuple[int, str]:
    """The status and detail that tell a cut request's client what became of it."""
    if book.writing:
        return 500, UNSETTLED
    return (500, STORED) if book.stored else (503, STOPPING)


async def _settled(book: Ledger) -> None:
    """Wait up to ``WRITE_GRACE_S`` for the request's running transactions to end."""
    deadline = time.monotonic() + WRITE_GRACE_S
    with contextlib.suppress(asyncio.CancelledError):
        while book.writing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

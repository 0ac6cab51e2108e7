"""Errors the service has no answer for: a 500 without internals, the traceback logged once.

Not an exception handler for ``Exception``: Starlette calls that one from its outermost
middleware, which raises the error again once the answer is sent, so that uvicorn logged it a
second time ("Exception in ASGI application"). This middleware answers and does not raise.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tuner.server")


class UnexpectedErrorMiddleware:
    """Answers an error raised inside it with a 500 and logs it with its traceback. An error
    raised after the answer began is raised on: only uvicorn can end that answer, and it logs
    the error (once: here it is not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            answer = JSONResponse({"detail": "internal error; see the service log"}, 500)
            await answer(scope, receive, send)

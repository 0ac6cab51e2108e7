"""Request-size limit: a body over the limit gets 413 before anything parses it."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        {"detail": f"request body too large: at most {limit} bytes; send smaller batches"}, 413
    )


class BodyLimitMiddleware:
    """Checks Content-Length up front, and counts chunked bodies as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not length.isdigit():
            bad = JSONResponse({"detail": f"Content-Length must be a number, got {length!r}"}, 400)
            await bad(scope, receive, send)
            return
        if length is not None and int(length) > self.max_bytes:
            await too_large(self.max_bytes)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)

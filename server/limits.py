"""Request-size limit: a body over the limit gets 413 before anything parses it."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(
        {"detail": f"request body too large: at most {limit} bytes; send smaller batches"}, 413
    )


class BodyLimitMiddleware:
    """Checks Content-Length up front; reads a chunked body up to the limit before the app."""

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
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            await self._buffered(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A body without Content-Length (chunked) is read here, up to the limit, then replayed:
        once the app has started reading it is too late to answer 413 cleanly."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(self.max_bytes)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

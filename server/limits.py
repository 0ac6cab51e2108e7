"""Request-size limit: a body over the limit gets 413 before anything parses it.

Streamed uploads (artifact blobs) have a limit of their own: a declared Content-Length over it
gets 413 here, and a chunked body is passed on unread, for the route to count as it streams.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large(limit: int, advice: str) -> JSONResponse:
    return JSONResponse({"detail": f"request body too large: at most {limit} bytes; {advice}"}, 413)


BATCH_ADVICE = "send smaller batches"
ARTIFACT_ADVICE = "the service's max_artifact_bytes limits one artifact"


class BodyLimitMiddleware:
    """Checks Content-Length up front; reads a chunked body up to the limit before the app."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, streamed: tuple[str, int] | None = None
    ) -> None:
        """``streamed``: (path prefix, limit) of the routes that read their body as a stream."""
        self.app, self.max_bytes, self.streamed = app, max_bytes, streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not length.isdigit():
            bad = JSONResponse({"detail": f"Content-Length must be a number, got {length!r}"}, 400)
            await bad(scope, receive, send)
            return
        streamed = self.streamed is not None and scope["path"].startswith(self.streamed[0])
        limit, advice = (
            (self.streamed[1], ARTIFACT_ADVICE) if streamed else (self.max_bytes, BATCH_ADVICE)
        )
        if length is not None and int(length) > limit:
            await too_large(limit, advice)(scope, receive, send)
            return
        if length is None and not streamed and scope["method"] in ("POST", "PUT", "PATCH"):
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
                await too_large(self.max_bytes, BATCH_ADVICE)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

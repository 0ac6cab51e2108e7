"""Bearer-token checks as FastAPI dependencies: ``Depends(require("submit"))``.

No token: 401 (reads pass when the service runs with open reads; writes never do, whatever
scope they need: open reads must not let anyone fill the queue). A malformed, unknown or
revoked token: 401, even on an open read, so a broken client configuration is noticed. A valid
token without the scope: 403 naming what it has and what is needed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server import tokens
from server.tokens import Token

bearer = HTTPBearer(auto_error=False, description="tnr_<id>_<secret>, from `tuner token create`")
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(request: Request) -> str | None:
    """The credentials of an ``Authorization: Bearer ...`` header (as HTTPBearer reads it)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def authorize(request: Request, scope: str, *, write: bool = False) -> Token | None:
    """The request's token if it has ``scope``; None for an open read (never for a ``write``,
    even one any token may make); else 401/403."""
    state = request.app.state
    presented = bearer_token(request)
    if presented is None:
        if scope == "read" and not write and state.settings.open_reads:
            return None
        sent = request.headers.get("authorization")
        how = (" (the Authorization header must read 'Bearer tnr_...', got "
               f"{_scheme(sent)})" if sent else "")  # fmt: skip
        raise HTTPException(
            401, f"this needs a bearer token with scope {scope!r}{how}", headers=CHALLENGE
        )
    # a primary-key lookup: cheap enough to run on the event loop's own connection
    token = tokens.verify(state.db.store(), presented)
    if token is None:  # which id was presented (its public part), never the secret
        raise HTTPException(401, tokens.invalid(presented), headers=CHALLENGE)
    if token.revoked_at is not None:
        raise HTTPException(401, f"token {token.id} ({token.name}) is revoked", headers=CHALLENGE)
    if not token.allows(scope):
        raise HTTPException(
            403,
            f"token {token.id} ({token.name}) has scopes {list(token.scopes)}; this needs {scope!r}",
        )
    return token


def _scheme(header: str) -> str:
    """What an Authorization header that is not a bearer token starts with (no credentials)."""
    first, space, _ = header.strip().partition(" ")
    if first.lower() == "bearer":  # an empty variable after it (curl -H "...: Bearer $TOKEN")
        return "'Bearer' with no token after it"
    return f"a {first!r} scheme" if space else "a bare value (no 'Bearer ')"


def require(scope: str, *, write: bool = False) -> Callable[..., Awaitable[Token | None]]:
    """A dependency that lets a request through with a token of ``scope`` (or, unless it is a
    ``write``, open reads)."""

    async def check(
        request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)
    ) -> Token | None:  # ``bearer`` only declares the scheme in the OpenAPI spec
        return authorize(request, scope, write=write)

    return check

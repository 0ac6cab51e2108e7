"""Bearer tokens: ``tnr_<id>_<secret>``, scopes read < submit < build < admin, stored hashed.

``build`` sits above ``submit``: a published artifact is executable code that every host of the
fleet will run, so a token that may only report measurements cannot publish one, while a builder
also submits the results of what it built.

The id is public (listed, used as the submitter's identity in the merge); only a SHA-256 of the
secret is stored. The secret is 256 random bits, so a fast hash is enough: there is nothing to
brute-force, unlike a password. Revoking sets ``revoked_at``; the row stays so that the
measurements it submitted keep an owner.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from server.store import FleetStore
from tuner.core.guesses import did_you_mean

SCOPES = ("read", "submit", "build", "admin")  # each includes the ones before it
PREFIX = "tnr"
_ID_RE = re.compile(r"^[0-9a-f]{12}$")


class TokenError(ValueError):
    """A token request that cannot be honoured (bad scope, unknown id)."""


@dataclass(frozen=True)
class Token:
    id: str
    name: str
    scopes: tuple[str, ...]
    created_at: float
    revoked_at: float | None = None

    @property
    def level(self) -> int:
        return max(SCOPES.index(s) for s in self.scopes)

    def allows(self, scope: str) -> bool:
        return self.revoked_at is None and self.level >= SCOPES.index(scope)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _row_to_token(row: dict) -> Token:
    return Token(
        row["id"],
        row["name"],
        tuple(row["scopes"].split(",")),
        row["created_at"],
        row["revoked_at"],
    )


def check_scopes(scopes: list[str]) -> tuple[str, ...]:
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        guess = did_you_mean(bad[0], SCOPES) if bad else ""
        raise TokenError(f"scope must be one or more of {list(SCOPES)}, got {scopes!r}{guess}")
    return tuple(dict.fromkeys(scopes))


def check_request(name: str, scopes: list[str]) -> tuple[str, ...]:
    """The scopes of a token asked for as ``name`` with ``scopes``; TokenError naming what is
    wrong, before any database is opened (a typo must not make one)."""
    if not name or len(name) > 100:
        raise TokenError(f"name must be 1..100 characters, got {name!r}")
    return check_scopes(scopes)


def create(store: FleetStore, name: str, scopes: list[str]) -> tuple[Token, str]:
    """A new token; returns it and the full secret string, which is shown once and never stored."""
    scope_t = check_request(name, scopes)
    token_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    now = time.time()
    store.add_token(token_id, name, _hash(secret), ",".join(scope_t), now)
    return Token(token_id, name, scope_t, now), f"{PREFIX}_{token_id}_{secret}"


def list_tokens(store: FleetStore) -> list[Token]:
    return [_row_to_token(r) for r in store.tokens()]


def revoke(store: FleetStore, token_id: str) -> Token:
    """Revoke the token of id ``token_id``, or of the whole token string (``tnr_<id>_<secret>``,
    as an operator may paste it: its id is taken, and the secret never printed back)."""
    prefix, given_id, _ = _parts(token_id)
    if prefix == PREFIX and given_id:
        token_id = given_id
    revoked = store.revoke_token(token_id, time.time())
    row = store.token(token_id)
    if row is None:
        raise TokenError(f"no token with id {token_id!r}; see 'tuner token list'")
    if not revoked:
        raise TokenError(f"token {token_id!r} was already revoked")
    return _row_to_token(row)


def _parts(presented: str) -> tuple[str, str, str]:
    """``tnr_<id>_<secret>`` as (prefix, id, secret); parts missing come back empty."""
    prefix, _, rest = presented.partition("_")
    token_id, _, secret = rest.partition("_")
    return prefix, token_id, secret


def invalid(presented: str) -> str:
    """Why ``verify`` refused a presented string, for a 401 and its log line (never the
    secret): the form it lacks, or the id it names."""
    prefix, token_id, secret = _parts(presented)
    if prefix != PREFIX or not _ID_RE.match(token_id) or not secret:
        return f"invalid token: not of the form {PREFIX}_<id>_<secret>"
    return f"invalid token {token_id!r}: unknown id or wrong secret"


def verify(store: FleetStore, presented: str) -> Token | None:
    """The token named by a presented string, or None if malformed, unknown or wrong secret."""
    prefix, token_id, secret = _parts(presented)
    if prefix != PREFIX or not _ID_RE.match(token_id) or not secret:
        return None
    row = store.token_for_check(token_id)
    if row is None or not hmac.compare_digest(row[5], _hash(secret)):
        return None
    return Token(row[0], row[1], tuple(row[2].split(",")), row[3], row[4])


def admin_ids(store: FleetStore) -> frozenset[str]:
    """Ids of valid admin tokens: their results confirm a large change on their own."""
    return frozenset(i for i, scopes in store.valid_token_scopes() if "admin" in scopes.split(","))

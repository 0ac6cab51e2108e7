"""The /v1 routes. Sync handlers run on FastAPI's thread pool, each thread on its own connection."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from server import queue, results, shutdown, tokens
from server.auth import authorize, require
from server.models import (
    DEVICE_CLASS_RE,
    MAX_FEED_PAGE,
    UID_RE,
    ClaimIn,
    ClaimOut,
    CompleteIn,
    CompleteOut,
    ConfirmOut,
    DeviceClass,
    ErrorOut,
    FeedOut,
    GroupIn,
    KeyStr,
    LookupIn,
    LookupOut,
    MeasurementRef,
    MissEntry,
    MissesIn,
    MissesOut,
    PendingEntry,
    QueueEntry,
    ServedOut,
    SubmitIn,
    SubmitOut,
    TokenOut,
    ValidationOut,
    Versions,
    WinnerOut,
)
from server.store import FleetStore
from server.tokens import Token

ERRORS: dict[int | str, dict] = {
    status: {"model": ErrorOut, "description": text}
    for status, text in (
        (400, "malformed request"),
        (401, "missing, malformed, invalid or revoked bearer token"),
        (403, "the token lacks the scope this needs"),
        (404, "unknown device class, key, lease or nothing pending"),
        (409, "the lease was already completed"),
        (413, "request body too large"),
        (415, "a body sent without a JSON Content-Type"),
        (503, shutdown.STOPPING),
    )
}
log = logging.getLogger("tuner.server")
router = APIRouter(prefix="/v1", responses=ERRORS)

DeviceClassPath = Annotated[str, Path(pattern=DEVICE_CLASS_RE, description="e.g. cpu-x86-64-2c")]
VersionsQuery = Annotated[
    str | None, Query(max_length=2000, description="only winners measured under these versions")
]
DeviceClassQuery = Annotated[str | None, Query(pattern=DEVICE_CLASS_RE)]
Limit = Annotated[int, Query(ge=1, le=10000)]
Reader = Annotated[Token | None, Depends(require("read"))]
# a write any valid token may make: needs one even when reads are open
Reporter = Annotated[Token, Depends(require("read", write=True))]
Submitter = Annotated[Token, Depends(require("submit"))]
Admin = Annotated[Token, Depends(require("admin"))]


def _store(request: Request) -> FleetStore:
    return request.app.state.db.store()


def _known(store: FleetStore, device_class: str) -> None:
    if not store.known_device(device_class):
        known = store.device_classes()
        raise HTTPException(
            404,
            f"unknown device class {device_class!r}: no host of that class has reported here"
            + (f"; known: {known}" if known else ""),
        )


# --- reads -------------------------------------------------------------------------------------


@router.get("/device-classes", response_model=list[str])
def list_device_classes(request: Request, _: Reader) -> list[str]:
    """Device classes this service has heard from, most recent first."""
    return _store(request).device_classes(limit=10000)


_DEVICE_CLASS, _KEY, _VERSIONS = (TypeAdapter(t) for t in (DeviceClass, KeyStr, Versions))
WINNER_PARAMS = {
    "security": [{"HTTPBearer": []}],
    "parameters": [
        {"name": "device_class", "in": "path", "required": True,
         "schema": {"type": "string", "pattern": DEVICE_CLASS_RE}},
        {"name": "key", "in": "query", "required": True, "description": "key string",
         "schema": {"type": "string", "minLength": 5, "maxLength": 600}},
        {"name": "versions", "in": "query", "required": False,
         "description": "only the winner measured under these versions",
         "schema": {"type": "string", "maxLength": 2000}},
    ],
}  # fmt: skip


def _valid(adapter: TypeAdapter, value: object, loc: tuple[str, str]) -> Any:
    """Validate one request value with the same types the declared routes use (same 422s)."""
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": loc} for err in e.errors()]) from None


@router.get(
    "/winners/{device_class}",
    response_model=WinnerOut,
    openapi_extra=WINNER_PARAMS,
    responses={
        422: {"model": ValidationOut, "description": "invalid device class, key or versions"}
    },
)
async def get_winner(request: Request) -> JSONResponse:
    """The winner served for one key (without `versions`: the most recently served ones').

    The hot read, written lean on purpose: parameters are checked here with the API's own types
    instead of through FastAPI's dependency machinery (which cost more than the rest of the
    request), the index lookup runs on the event loop's own connection (a thread-pool hop
    costs more than the query), a canonical key skips re-parsing, and our own row is not
    re-validated."""
    authorize(request, "read")
    device_class = _valid(_DEVICE_CLASS, request.path_params["device_class"], ("path", "device_class"))  # fmt: skip
    key = request.query_params.get("key")
    versions = request.query_params.get("versions")
    if versions is not None:
        _valid(_VERSIONS, versions, ("query", "versions"))
    store = _store(request)
    found = None
    if key is not None and 5 <= len(key) <= 600:
        found = results.winner(store, device_class, key, versions)  # stored keys are canonical
    if key is None:
        missing = {"type": "missing", "loc": ("query", "key"), "msg": "Field required"}
        raise RequestValidationError([missing])
    if found is None:
        canonical = _valid(_KEY, key, ("query", "key"))  # 422 for an invalid key
        if canonical != key:
            found = results.winner(store, device_class, canonical, versions)
    if found is None:
        _known(store, device_class)
        raise HTTPException(404, f"no winner for {key!r} on {device_class!r}"
                            + _other_versions(store, device_class, canonical, versions))  # fmt: skip
    return JSONResponse(found)


def _other_versions(store: FleetStore, device_class: str, key: str, versions: str | None) -> str:
    """The versions a key is served under where a read named others: a '+' sent unencoded in
    the query (``2.13.0+cpu``) arrives as a space, and only the versions side by side show it."""
    if versions is None:
        return ""
    served = sorted(w["versions"] for w in store.winners_of(device_class, key, None))
    more = f" and {len(served) - 3} more" if len(served) > 3 else ""
    return f" under versions {versions!r}" + (
        f"; served under {served[:3]}{more}" if served else ""
    )


@router.post("/winners/{device_class}/lookup", response_model=LookupOut)
def lookup(request: Request, device_class: DeviceClassPath, body: LookupIn, _: Reader) -> dict:
    """Winners for a batch of keys; keys without one are listed in `missing`."""
    store = _store(request)
    _known(store, device_class)
    found = store.lookup(device_class, body.versions, list(dict.fromkeys(body.keys)))
    have = {w["key"] for w in found}
    return {"winners": found, "missing": [k for k in body.keys if k not in have]}


@router.get("/winners/{device_class}/feed", response_model=FeedOut)
def feed(
    request: Request, device_class: DeviceClassPath, _: Reader, versions: VersionsQuery = None,
    since: Annotated[int, Query(ge=0, le=2**62, description="last `cursor` seen; 0: all")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_FEED_PAGE)] = 5000,
) -> JSONResponse:  # fmt: skip
    """Served winners changed after sequence number `since`, oldest first (incremental sync)."""
    store = _store(request)
    _known(store, device_class)
    rows, more, cursor = results.feed(store, device_class, versions, since, limit)
    body = {"device_class": device_class, "versions": versions, "since": since,
            "cursor": cursor, "more": more, "last": store.winner_seq(),
            "columns": results.FEED_COLUMNS, "rows": rows}  # fmt: skip
    return JSONResponse(body)  # our own rows: no need to re-validate 20k of them


@router.get("/winners/{device_class}/served", response_model=ServedOut)
def served_at(
    request: Request, device_class: DeviceClassPath, _: Reader,
    seq: Annotated[int, Query(ge=1, le=2**62, description="a feed sequence number")],
) -> dict:  # fmt: skip
    """What was served under sequence number `seq` (key, versions, date), kept after later
    servings replace it: a host asks for the last one it pulled to tell a service restored from
    an older backup (which lost it, or has since served another under that number). An unknown
    device class is no 404 here: a restored service may not know it yet."""
    return _store(request).served_at(device_class, seq)


@router.get("/measurements", response_model=list[MeasurementRef])
def find_measurements(
    request: Request, _: Reader,
    uid: Annotated[str, Query(pattern=UID_RE, description="the submitting host's uid")],
) -> list[dict]:  # fmt: skip
    """The measurement stored under `uid`, if any: a host asks for the last one it pushed to
    tell a service restored from an older backup (which lost it) and push to it again."""
    return _store(request).measurement_refs(uid)


@router.get("/misses", response_model=list[MissEntry])
def list_misses(
    request: Request, _: Reader, device_class: DeviceClassQuery = None, limit: Limit = 100
) -> list[dict]:
    """Most-missed keys."""
    return _store(request).misses(device_class, limit)


@router.get("/queue", response_model=list[QueueEntry])
def list_queue(
    request: Request, _: Reader, device_class: DeviceClassQuery = None,
    versions: VersionsQuery = None,
    state: Annotated[str | None, Query(pattern="^(queued|leased|done|failed)$")] = None,
    limit: Limit = 100,
) -> list[dict]:  # fmt: skip
    """The tuning queue, most-missed first."""
    return _store(request).queue(device_class, versions, state, limit)


@router.get("/pending", response_model=list[PendingEntry])
def list_pending(
    request: Request, _: Reader, device_class: DeviceClassQuery = None, limit: Limit = 100
) -> list[dict]:
    """Large winner changes held until a second submitter or an admin confirms them."""
    return _store(request).pending(device_class, limit)


# --- writes ------------------------------------------------------------------------------------


def _ingest(
    request: Request, store: FleetStore, body: SubmitIn, token: Token
) -> results.IngestOutcome:
    state = request.app.state
    out = results.ingest(
        store, [m.to_measurement() for m in body.measurements], token.id,
        admins=tokens.admin_ids(store), policy=state.policy,
    )  # fmt: skip
    for why in out.refused:
        log.warning("refused a measurement from token %s: %s", token.id, why)
    m = state.metrics
    m.measurements.labels("accepted").inc(out.accepted)
    m.measurements.labels("duplicate").inc(out.duplicates)
    m.winner_changes.inc(len(out.served))
    m.pending.inc(len(out.pending))
    return out


@router.get("/token", response_model=TokenOut)
def token_info(token: Reporter) -> TokenOut:
    """The token this request presents: what it may do, before a host has anything to send
    with it (a token is needed even where reads are open)."""
    allows = [s for s in tokens.SCOPES if token.allows(s)]
    return TokenOut(id=token.id, name=token.name, scopes=list(token.scopes), allows=allows)


@router.post("/measurements", response_model=SubmitOut)
def submit(request: Request, body: SubmitIn, token: Submitter) -> dict:
    """A batch of measurements (a tuning run's full results). Re-sending is harmless."""
    store = _store(request)
    with store.transaction() as c:
        store.record_device(c, body.device.fingerprint())
        return asdict(_ingest(request, store, body, token))


@router.post("/misses", response_model=MissesOut)
def report_misses(request: Request, body: MissesIn, _: Reporter) -> dict:
    """Keys a host met without a winner, with counts. Any valid token may report: a count
    only steers the queue, it cannot change what is served."""
    store = _store(request)
    fp = body.device.fingerprint()
    merged: dict[str, int] = {}
    for miss in body.misses:
        merged[miss.key] = merged.get(miss.key, 0) + miss.count
    with store.transaction() as c:
        store.record_device(c, fp)
        queued = queue.record_misses(store, fp.device_class, body.versions, list(merged.items()))
    request.app.state.metrics.misses.inc(sum(merged.values()))
    return {"recorded": len(merged), "queued": queued}


@router.post("/queue/claim", response_model=ClaimOut)
def claim(request: Request, body: ClaimIn, token: Submitter) -> dict:
    """Lease up to `max_keys` queued keys of the worker's device class and versions."""
    state = request.app.state
    store = _store(request)
    with store.transaction():
        lease = queue.claim(
            store, body.device.fingerprint().device_class, body.versions, worker=body.worker,
            submitter=token.id, max_keys=body.max_keys, lease_s=body.lease_s,
            max_attempts=state.settings.max_attempts,
        )  # fmt: skip
    state.metrics.leases.labels("expired_keys").inc(lease.expired_returned)
    if lease.lease_id:
        state.metrics.leases.labels("claimed").inc()
    return asdict(lease)


@router.post("/queue/complete", response_model=CompleteOut)
def complete(request: Request, body: CompleteIn, token: Submitter) -> dict:
    """Results for a lease. Keys that got a served winner are done; the others are queued again."""
    store = _store(request)
    try:
        with store.transaction() as c:
            queue.check_lease(store, body.lease_id, token.id)
            store.record_device(c, body.device.fingerprint())
            out = _ingest(request, store, body, token)
            rel = queue.release(store, body.lease_id, request.app.state.settings.max_attempts)
    except queue.LeaseError as e:
        raise HTTPException(e.status, str(e)) from None
    request.app.state.metrics.leases.labels("completed").inc()
    return asdict(out) | asdict(rel)


@router.post("/pending/confirm", response_model=ConfirmOut)
def confirm(request: Request, body: GroupIn, _: Admin) -> dict:
    """Admin override: serve a pending change now."""
    store = _store(request)
    with store.transaction():
        cand = results.confirm_pending(store, (body.device_class, body.versions, body.key))
    if cand is None:
        raise HTTPException(
            404,
            f"nothing pending (or no baseline measured) for {body.key!r} on {body.device_class!r}",
        )
    request.app.state.metrics.winner_changes.inc()
    return {"key": body.key, "candidate": cand}

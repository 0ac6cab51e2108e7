"""The FastAPI application: ``create_app(Settings(db=...))``, served by ``tuner serve``.

Besides the /v1 routes: ``/v1/health`` (the process answers), ``/v1/ready`` (the database
answers at the expected schema), ``/metrics`` (Prometheus), ``/docs`` and ``/openapi.json``.
User mistakes get 4xx with a one-line ``detail`` (422s also carry a readable ``message``);
anything else is logged once and answered 500 without internals (``server.unexpected``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException

from server import artifacts
from server.api import router
from server.blobs import BlobDir, default_dir
from server.config import Settings
from server.db import FleetDB, MovedDatabaseMiddleware
from server.limits import BodyLimitMiddleware
from server.metrics import Metrics, MetricsMiddleware
from server.results import Policy
from server.schema import FLEET
from server.shutdown import StopMiddleware, Stops
from server.unexpected import UnexpectedErrorMiddleware
from tuner.cache import BusyError, ReadOnlyError, StoreError, WriteFailedError
from tuner.measure.records import clipped
from tuner.version import __version__

log = logging.getLogger("tuner.server")
LOGGED_PATH = 200  # a refused request's path, in characters at most, in the log
BUSY_RETRY_S = 5  # Retry-After of a request refused because another process held the lock


def _summary(errors: list[dict]) -> str:
    """'body.measurements.0.status: Input should be ...' for the first errors."""
    parts = [
        ".".join(str(p) for p in e.get("loc", ())) + ": " + str(e.get("msg", "")) for e in errors
    ]
    extra = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + extra


def _short_input(error: dict[str, Any]) -> dict[str, Any]:
    """Echo at most a short repr of the offending input: it may be a 5,000-item list or a NaN
    (which JSON cannot carry), and ``ctx`` may hold exception objects. A body that is not JSON
    says where and why it could not be read (its parsed ``input`` is an empty stand-in)."""
    out = {k: v for k, v in error.items() if k in ("type", "loc", "msg")}
    loc = error.get("loc", ())
    if error.get("type") == "json_invalid" and loc[:1] == ("body",):
        at = loc[-1]
        out["msg"] = (
            f"the body is not valid JSON at character {at}: {error.get('ctx', {}).get('error', '')}"
        )
        return out
    if "input" in error:
        text = repr(error["input"])
        out["input"] = text if len(text) <= 200 else text[:200] + "..."
    return out


def _not_json(request: Request) -> str | None:
    """Why a POST or PUT body that failed validation is refused as not JSON (415), if it is:
    its Content-Type says another format. A compiled kernel's upload is bytes, not JSON."""
    sent = request.headers.get("content-type", "")
    if request.method not in ("POST", "PUT") or "json" in sent:
        return None
    if request.url.path.startswith(artifacts.BLOBS):
        return None
    if sent:
        return f"Content-Type must be application/json, got {sent!r}"
    return (
        "Content-Type must be application/json (none sent: curl -H "
        "'Content-Type: application/json' ...)"
    )


def _unparsed(exc: HTTPException) -> str | None:
    """Why a JSON body could not be parsed, where FastAPI's 400 says only that it could not: its
    cause is no JSON syntax error (those are 422s that say where) but a body nested deeper than
    Python's parser goes, bytes that are no UTF-8, or an integer too long for Python to read."""
    if exc.status_code != 400:
        return None
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "JSON nested too deeply: the body's arrays and objects lie too many levels deep"
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 text, as JSON is: {cause}"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (
            f"a number in the body has more than {sys.get_int_max_str_digits()} digits, more "
            "than Python reads"
        )
    return None


def open_storage(settings: Settings) -> tuple[BlobDir, FleetDB]:
    """The artifacts folder, then the database: a folder that cannot be made leaves no new
    database behind, and a database refused (another kind of file) leaves no new folder."""
    root = settings.artifacts_dir or default_dir(settings.db)
    made = not root.exists()
    blobs = BlobDir(root)
    try:
        return blobs, FleetDB(settings.db, lock_wait_s=settings.lock_wait_s)
    except StoreError:
        if made:
            with contextlib.suppress(OSError):
                root.rmdir()
        raise


def create_app(settings: Settings) -> FastAPI:
    blobs, db = open_storage(settings)
    service_id = db.store().service_id()
    metrics = Metrics()
    stops = Stops()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await stops.drain()  # requests in flight (a stop cut them) settle and log first
        db.close()

    app = FastAPI(
        title="tuner fleet service",
        version=__version__,
        description="Tuned GEMM/SDPA winners shared by every host of a GPU class.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics
    app.state.policy = Policy(settings.confirm_margin, settings.min_noise)
    app.state.blobs = blobs

    def scrape() -> Iterator[GaugeMetricFamily]:
        store = db.store()
        depth = GaugeMetricFamily("tuner_queue_keys", "tuning queue entries", labels=["state"])
        for state, n in store.queue_counts().items():
            depth.add_metric([state], n)
        yield depth
        yield GaugeMetricFamily(
            "tuner_served_winners", "served winners", value=store.served_count()
        )
        yield GaugeMetricFamily(
            "tuner_artifact_conflicting_specs",
            "artifact specs published with more than one build (see /v1/artifacts/conflicts)",
            value=store.conflicting_specs(),
        )

    metrics.add_collector(scrape)

    def refusal(request: Request, status: int, why: object) -> None:
        """One line in the service's log for each refused request (a 404 is an answer: none)."""
        client = request.client.host if request.client else "?"
        path = clipped(request.url.path, LOGGED_PATH)  # anyone may send a path of any length
        log.warning("refused %s %s from %s: %d %s", request.method, path, client, status, why)

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException) -> Response:
        if why := _unparsed(exc):
            exc = HTTPException(400, why)
        if exc.status_code != 404:
            refusal(request, exc.status_code, exc.detail)
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if why := _not_json(request):
            refusal(request, 415, why)
            return JSONResponse({"detail": why, "message": why}, 415)
        errors = [_short_input(e) for e in exc.errors()]
        refusal(request, 422, _summary(errors))
        return JSONResponse({"detail": jsonable_encoder(errors), "message": _summary(errors)}, 422)

    @app.exception_handler(ReadOnlyError)
    async def write_refused(request: Request, exc: ReadOnlyError) -> JSONResponse:
        """The database refused a write, which was rolled back whole: the request may be sent
        again (503) once the operator made room (a full disk) or made the file writable again
        (a read-only remount, which a pool thread's new connection meets as a read-only file)."""
        log.error("%s %s: %s", request.method, request.url.path, exc)
        why = (
            "its disk refused the write"
            if isinstance(exc, WriteFailedError)
            else "its database is read-only"
        )
        return JSONResponse({"detail": f"the service cannot store it now ({why}; nothing was "
                                       "stored): send it again later"}, 503)  # fmt: skip

    @app.exception_handler(BusyError)
    async def busy(request: Request, exc: BusyError) -> JSONResponse:
        """Another process (a backup, an operator's sqlite3 shell) held the database's lock past
        the wait; the write was rolled back whole, so the request may be sent again."""
        log.error("%s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(
            {"detail": "the service's database is locked by another process (nothing was "
                       "stored): send it again later"},
            503, headers={"Retry-After": str(BUSY_RETRY_S)},
        )  # fmt: skip

    @app.get("/v1/health", tags=["ops"])
    async def health() -> dict[str, str]:
        """The process is up (no database access), and which service it is: a host keys its
        sync positions by this id, so a service rebuilt at the same URL is synced from the start."""
        return {"status": "ok", "service_id": service_id}

    @app.get("/v1/ready", tags=["ops"], responses={503: {"description": "not ready"}})
    def ready() -> JSONResponse:
        """The database opens, is still the file at its path, and has this service's schema."""
        if why := db.moved():
            return JSONResponse({"status": "not ready", "detail": why}, 503)
        try:
            version = db.store().schema_version()
        except Exception as e:
            return JSONResponse({"status": "not ready", "detail": str(e)}, 503)
        if version != FLEET.version:
            return JSONResponse(
                {"status": "not ready", "detail": f"schema {version}, want {FLEET.version}"}, 503
            )
        return JSONResponse({"status": "ready", "schema_version": version})

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def prometheus() -> Response:
        """Prometheus exposition format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(router)
    app.include_router(artifacts.router)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        streamed=(artifacts.BLOBS, settings.max_artifact_bytes),
    )
    app.add_middleware(MovedDatabaseMiddleware, db=db)
    app.add_middleware(StopMiddleware, stops=stops)  # inside the metrics: they count its answers
    app.add_middleware(
        MetricsMiddleware, metrics=metrics, paths=lambda: list(app.openapi()["paths"])
    )
    app.add_middleware(UnexpectedErrorMiddleware)  # outermost: it answers for all the others
    return app

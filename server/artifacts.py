"""The /v1/artifacts routes: compiled kernels published by builders, fetched by every host.

An artifact is executable code every host of the fleet will run, so publishing needs a token of
scope ``build``; reading needs ``read`` like the winners. A publish streams the bytes (the spec
rides in the ``Tuner-Artifact-Spec`` header, so the body is nothing but the artifact) and
declares their sha256 in the path; the service re-hashes them and stores nothing on a mismatch.
The first build of a spec is the one served; a different build of it, from any builder, is
recorded and reported (``/v1/artifacts/conflicts``, ``tuner_artifact_*`` in ``/metrics``),
never served in its place.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from server.api import ERRORS, Limit, Reader, _store
from server.auth import require
from server.blobs import BlobError
from server.models import (
    MAX_ARTIFACT_PAGE,
    MAX_SPEC_CHARS,
    SHA256_RE,
    ArtifactFeedOut,
    ArtifactLookupIn,
    ArtifactLookupOut,
    ArtifactSpecIn,
    ConflictOut,
    ErrorOut,
    PublishOut,
)
from server.tokens import Token
from tuner.cache.artifacts import ArtifactError

PREFIX = "/v1/artifacts"
BLOBS = PREFIX + "/blobs/"  # the streamed routes (see server.limits)
router = APIRouter(prefix=PREFIX, tags=["artifacts"], responses=ERRORS)

Builder = Annotated[Token, Depends(require("build"))]
HashPath = Annotated[str, Path(pattern=SHA256_RE, description="sha256 of the artifact's bytes")]
SpecHeader = Annotated[
    str,
    Header(
        max_length=MAX_SPEC_CHARS,
        description="the artifact's spec as JSON: source, config, arch, toolchain",
    ),
]
_SPEC = TypeAdapter(ArtifactSpecIn)
_LOC = ("header", "tuner-artifact-spec")


def _parse_spec(text: str) -> dict[str, str]:
    """The header's spec as the store records it (spec_id, spec, source, arch); 422 if bad."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": _LOC, "msg": f"not JSON: {why}", "input": text[:200]}]
        ) from None
    try:
        spec = _SPEC.validate_python(data).to_spec()
    except ValidationError as e:
        errors = [{**err, "loc": _LOC + err["loc"]} for err in e.errors()]
        raise RequestValidationError(errors) from None
    except ArtifactError as e:
        raise RequestValidationError(
            [{"type": "value_error", "loc": _LOC, "msg": str(e), "input": text[:200]}]
        ) from None
    return {"spec_id": spec.id, "spec": spec.to_json(), "source": spec.source, "arch": spec.arch}


@router.put(
    "/blobs/{digest}",
    response_model=PublishOut,
    responses={507: {"model": ErrorOut, "description": "the artifacts folder cannot take it"}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)  # fmt: skip
async def publish(
    request: Request, digest: HashPath, token: Builder, tuner_artifact_spec: SpecHeader
) -> dict[str, Any]:
    """Publish one artifact: the body is its bytes, `digest` their sha256 (checked here)."""
    spec = _parse_spec(tuner_artifact_spec)
    state = request.app.state
    try:
        size = await state.blobs.receive(
            request.stream(), digest, state.settings.max_artifact_bytes
        )
    except BlobError as e:
        raise HTTPException(e.status, str(e)) from None
    outcome = await run_in_threadpool(
        lambda: _store(request).add_build(spec, digest, size, token.id)
    )
    state.metrics.artifacts.labels(outcome).inc()
    return {"spec_id": spec["spec_id"], "hash": digest, "size": size, "outcome": outcome}


@router.get(
    "/blobs/{digest}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download(request: Request, digest: HashPath, _: Reader) -> FileResponse:
    """An artifact's bytes, streamed; clients check them against `digest` before use."""
    blobs = request.app.state.blobs
    if not blobs.has(digest):
        raise HTTPException(404, f"no artifact with sha256 {digest}")
    return FileResponse(blobs.path(digest), media_type="application/octet-stream")


@router.post("/lookup", response_model=ArtifactLookupOut)
def lookup(request: Request, body: ArtifactLookupIn, _: Reader) -> dict[str, Any]:
    """The served build of each spec id; ids without one are listed in `missing`."""
    found = _store(request).served_artifacts(list(dict.fromkeys(body.spec_ids)))
    have = {a["spec_id"] for a in found}
    return {"artifacts": found, "missing": [s for s in body.spec_ids if s not in have]}


@router.get("", response_model=ArtifactFeedOut)
def listing(
    request: Request, _: Reader,
    arch: Annotated[list[str], Query(max_length=32, description="only these archs")] = [],  # noqa: B006
    since: Annotated[int, Query(ge=0, le=2**62, description="last `cursor` seen; 0: all")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_ARTIFACT_PAGE)] = 1000,
) -> dict[str, Any]:  # fmt: skip
    """Served builds published after `since`, oldest first (for hosts that sync everything)."""
    store = _store(request)
    rows = store.artifact_feed(arch, since, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    cursor = rows[-1]["seq"] if rows else since
    last = store.artifact_seq()
    return {"since": since, "cursor": cursor, "more": more, "last": last, "artifacts": rows}


@router.get("/conflicts", response_model=list[ConflictOut])
def conflicts(request: Request, _: Reader, limit: Limit = 100) -> list[dict[str, Any]]:
    """Specs published with more than one build: the served hash and every builder's build."""
    return _store(request).artifact_conflicts(limit)

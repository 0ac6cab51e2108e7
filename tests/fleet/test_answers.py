"""A fleet service answering garbage: valid JSON of another shape, from a real HTTP server on
loopback. The client refuses it naming the URL, the endpoint, the field and what it should be
(not a bare KeyError or AttributeError), and an impossible sync position
(``last: -5``, a cursor that goes back) leaves the host's positions as they were."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from server import models
from server.live import AppThread, wait_until
from tuner.cache import Store
from tuner.cache.artifacts import ArtifactStore
from tuner.core.device import fingerprint
from tuner.fleet import answers
from tuner.fleet.artifact_sync import sync_artifacts
from tuner.fleet.background import BackgroundSync
from tuner.fleet.client import FleetClient, FleetError
from tuner.fleet.sync import pull
from tuner.measure.records import Winner

pytestmark = pytest.mark.timeout(120)
FP = fingerprint()
FEED = f"/v1/winners/{FP.device_class}/feed"
LISTING = "/v1/artifacts"
QUEUE = "/v1/queue"
WINNER = f"/v1/winners/{FP.device_class}"
SCOPE = "service-s1"
PULL = f"pull:{SCOPE}:{FP.device_class}:{FP.version_tag}"
ARCHS = ["sm90"]
ARTIFACTS = f"artifacts:{SCOPE}:sm90"
COLUMNS = list(Winner.columns())
ROW = ["cpu-x", "gemm:m=8,n=8,k=8", "torch", "{}", 5.0, 5.0, "v", "r", 1.0, "eager", "gemm",
       "torch", 1.0]  # fmt: skip


class Scripted:
    """A service whose health names it ``s1`` and that answers each path in ``answers`` with
    that JSON (changed between calls by the test): a real uvicorn on loopback."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok", "service_id": "s1"})

        async def answer(request: Request) -> JSONResponse:
            return JSONResponse(self.answers[request.url.path])

        paths = [FEED, LISTING, QUEUE, WINNER]
        routes = [Route("/v1/health", health), *(Route(p, answer) for p in paths)]
        self.app = Starlette(routes=routes)


@pytest.fixture
def service() -> Iterator[tuple[Scripted, FleetClient]]:
    scripted = Scripted()
    with AppThread(scripted.app) as srv, FleetClient(srv.url, retries=0) as client:
        yield scripted, client


def page(cursor: int, last: int, **more: Any) -> dict[str, Any]:
    return {"since": 0, "cursor": cursor, "more": False, "last": last, **more}


def positions(store: Store) -> dict[str, int]:
    return dict(store.db.conn.execute("select name, value from sync_state").fetchall())


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ([], "the answer: should be a JSON object, got []"),
        (page(0, 0, columns=COLUMNS), "rows: Field required"),
        (page(1, 1, columns=COLUMNS, rows=[ROW[:-1]]), "rows[0] has 12 values for the 13 columns"),
        (
            page(1, 1, columns=COLUMNS, rows=[[8, *ROW[1:]]]),
            "rows[0].device_class: Input should be a valid string, got 8",
        ),
        (
            page(1, 1, columns=COLUMNS, rows=[[*ROW[:3], "not json", *ROW[4:]]]),
            "rows[0].params: should be the JSON text of an object, got 'not json'",
        ),
        (
            page("x", 1, columns=COLUMNS, rows=[]),
            "cursor: Input should be a valid integer, got 'x'",
        ),
    ],
)
def test_a_feed_of_another_shape_is_refused_naming_the_url_endpoint_and_field(
    service: tuple[Scripted, FleetClient], tmp_path: Path, answer: Any, said: str
) -> None:
    scripted, client = service
    scripted.answers[FEED] = answer
    with Store(tmp_path / "host.db") as store:
        with pytest.raises(FleetError) as refused:
            pull(client, store, FP)
        assert store.winners() == [] and positions(store) == {}
    assert str(refused.value) == f"{client.server}{FEED}: not an answer of a tuner service: {said}"


def test_the_background_sync_logs_a_garbage_answer_by_url_endpoint_and_field(
    service: tuple[Scripted, FleetClient], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scripted, client = service
    scripted.answers[FEED] = {"rows": []}
    sync = BackgroundSync(client, tmp_path / "host.db", push=False, fingerprints=lambda: [FP])
    with caplog.at_level(logging.WARNING, logger="tuner.fleet.background"):
        sync.start()
        try:
            wait_until(lambda: sync.failures)
        finally:
            sync.stop()
    assert (
        f"fleet sync with {client.server} failed: FleetError: {client.server}{FEED}: not an "
        "answer of a tuner service: cursor: Field required (and 2 more)"
    ) in caplog.text


QUEUED = {"device_class": "cpu-x", "versions": "v", "key": "gemm:m=8,n=8,k=8", "op": "gemm",
          "state": "queued", "misses": 3, "attempts": 0, "lease_expires": None,
          "enqueued_at": 1.0, "updated_at": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "call", "answer", "said"),
    [
        (QUEUE, lambda c: c.queue(), {"key": "k"},
         "the answer: should be a JSON array, got {'key': 'k'}"),
        (QUEUE, lambda c: c.queue(), [{**QUEUED, "misses": "3"}],
         "the answer[0].misses: Input should be a valid integer, got '3'"),
        (QUEUE, lambda c: c.queue(), [{**QUEUED, "misses": 3.0}],
         "the answer[0].misses: Input should be a valid integer, got 3.0"),
        (WINNER, lambda c: c.winner(FP.device_class, "k"), {"seq": "7", "updated_at": 1.0},
         "seq: Input should be a valid integer, got '7'"),
    ],
)  # fmt: skip
def test_an_answer_is_taken_as_sent_not_converted(
    service: tuple[Scripted, FleetClient], path: str, call: Any, answer: Any, said: str
) -> None:
    """A number sent as text or as a fraction is another service's answer, refused naming
    the field: converted, it would be believed."""
    scripted, client = service
    scripted.answers[path] = answer
    with pytest.raises(FleetError) as refused:
        call(client)
    assert str(refused.value) == f"{client.server}{path}: not an answer of a tuner service: {said}"


def test_a_sound_queue_answer_comes_back_whole(service: tuple[Scripted, FleetClient]) -> None:
    scripted, client = service
    scripted.answers[QUEUE] = [QUEUED, {**QUEUED, "key": "k2", "extra": "a later release's"}]
    assert client.queue() == scripted.answers[QUEUE]


def sync_feed(client: FleetClient, store: Store, tmp_path: Path) -> None:
    pull(client, store, FP)


def sync_listing(client: FleetClient, store: Store, tmp_path: Path) -> None:
    with ArtifactStore(tmp_path / "kernels") as kernels:
        sync_artifacts(client, kernels, store, ARCHS)


@pytest.mark.parametrize(
    ("path", "sync", "name", "items"),
    [(FEED, sync_feed, PULL, {"columns": COLUMNS, "rows": []}),
     (LISTING, sync_listing, ARTIFACTS, {"artifacts": []})],
)  # fmt: skip
@pytest.mark.parametrize(
    ("cursor", "last", "said"),
    [
        (7, -5, "last: Input should be greater than or equal to 0, got -5"),
        (-1, 7, "cursor: Input should be greater than or equal to 0, got -1"),
        (3, 7, "cursor 3 (more: False) for since=7: a page's cursor never goes back"),
        (9, 3, "cursor 9 past last=3: a page ends at a sequence number the service has given"),
        (2**63, 2**63, "cursor: Input should be less than 9223372036854775808"),
    ],
)
def test_an_impossible_sync_position_is_refused_and_the_hosts_positions_stay(
    service: tuple[Scripted, FleetClient], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    path: str, sync: Any, name: str, items: dict[str, Any], cursor: int, last: int, said: str,
) -> None:  # fmt: skip
    """A sequence number below 0 or past SQLite's integers, a cursor behind the position asked
    from, or one moved on past the service's last number is no restore of the service from an
    older backup (after which the host starts over): no service sends it.
    The host's positions with it stay, so its next sync with a sound service resumes there."""
    scripted, client = service
    with Store(tmp_path / "host.db") as store:
        store.set_position(name, 7)
        before = positions(store)
        scripted.answers[path] = page(cursor, last, **items)
        with pytest.raises(FleetError, match=re.escape(f"{client.server}{path}: ")) as refused:
            sync(client, store, tmp_path)
        assert said in str(refused.value)
        assert positions(store) == before
        assert "restored" not in caplog.text


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (answers.Token, models.TokenOut),
        (answers.ServedWinner, models.WinnerOut),
        (answers.Lookup, models.LookupOut),
        (answers.Serving, models.Serving),
        (answers.Served, models.ServedOut),
        (answers.Feed, models.FeedOut),
        (answers.Submitted, models.SubmitOut),
        (answers.Completed, models.CompleteOut),
        (answers.Queued, models.MissesOut),
        (answers.QueueEntry, models.QueueEntry),
        (answers.Claimed, models.ClaimOut),
        (answers.MeasurementRef, models.MeasurementRef),
        (answers.Artifact, models.ArtifactOut),
        (answers.ArtifactLookup, models.ArtifactLookupOut),
        (answers.ArtifactListing, models.ArtifactFeedOut),
        (answers.Published, models.PublishOut),
        (answers.Build, models.BuildOut),
        (answers.Conflict, models.ConflictOut),
    ],
)
def test_what_the_client_reads_of_an_answer_is_what_the_service_sends(
    ours: type[BaseModel], theirs: type[BaseModel]
) -> None:
    assert set(ours.model_fields) <= set(theirs.model_fields)


def test_a_feed_row_is_checked_in_every_column_the_host_stores() -> None:
    assert list(answers.FeedWinner.model_fields) == COLUMNS

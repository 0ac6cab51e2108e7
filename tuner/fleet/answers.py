"""What the fleet client reads of the service's answers, checked before it is read.

Whatever answers at the service's URL (a broken service, one of another release, a proxy) may
send valid JSON of another shape: a list where an object is due, a field missing or of another
type, a sequence number below 0 or past the feed's end. Read raw, such an answer fails deep in
a sync as a bare ``KeyError``, or is believed (a position the host then keeps); checked here,
the client refuses it, naming the URL, the endpoint, the field and what it should be.

The models mirror the service's answer models (``server.models``, which the host never imports)
in what the client reads: a field a later release adds passes through, one an older release
lacks is optional where the client does without it (``last``). tests/fleet/test_answers.py
holds them to the service's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

# a sequence number or a feed's cursor: 0 is the start; SQLite's integers end at 2^63
SeqNo = Annotated[int, Field(ge=0, lt=2**63)]


class Answer(BaseModel):
    """An answer's fields the client reads; the others (a later release's) pass through.
    Strict: a number sent as text (or a whole number as a fraction) is another service's, not
    one to convert and believe."""

    model_config = ConfigDict(extra="allow", strict=True)


class Health(Answer):
    service_id: str | None = None  # None: a service too old to name itself


class Token(Answer):
    id: str
    name: str
    scopes: list[str]
    allows: list[str]


class ServedWinner(Answer):
    seq: SeqNo
    updated_at: float


class Lookup(Answer):
    winners: list[ServedWinner]
    missing: list[str]


class Serving(Answer):
    key: str
    versions: str
    updated_at: float


class Served(Answer):
    served: Serving | None
    log_from: SeqNo


class Page(Answer):
    """A page of a feed: where the next one starts, and the latest sequence number. Validated
    with the ``since`` it was asked from in its context: a cursor that goes back, or stays
    where it was with more to come, would hand the host a position it has passed, or a loop."""

    cursor: SeqNo
    more: bool
    last: SeqNo | None = None  # None: a service too old to say

    @model_validator(mode="after")
    def _moves_on(self, info: ValidationInfo) -> Page:
        since = (info.context or {}).get("since", 0)
        if self.cursor < since or (self.more and self.cursor == since):
            raise ValueError(
                f"cursor {self.cursor} (more: {self.more}) for since={since}: a page's cursor "
                "never goes back, and moves on where more follow"
            )
        # a page that moved on ends at a number the service has given; one that did not
        # echoes since, which may lie past the last of a service restored from a backup
        if self.last is not None and since < self.cursor and self.last < self.cursor:
            raise ValueError(
                f"cursor {self.cursor} past last={self.last}: a page ends at a sequence number "
                "the service has given"
            )
        return self


class FeedWinner(BaseModel):
    """A feed row, by its columns, in what the host stores of it (the local winners table's
    columns, ``Winner.columns()``), each of that column's type: strict, so that a number sent
    as text is not stored as text."""

    model_config = ConfigDict(strict=True)

    device_class: str
    key: str
    source: str
    params: str  # JSON text of an object: checked by _rows_are_winners
    median_us: float
    baseline_us: float
    versions: str
    run_id: str | None
    updated_at: float
    launch: str
    op: str
    candidate: str
    speedup: float


_FEED_WINNERS = TypeAdapter(list[FeedWinner])


class Feed(Page):
    columns: list[str]
    rows: list[list[Any]]

    @model_validator(mode="after")
    def _rows_are_winners(self) -> Feed:
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(
                    f"rows[{i}] has {len(row)} values for the {len(self.columns)} columns"
                )
        if not _of_their_types(self.columns, self.rows):
            try:  # to name what is wrong
                _FEED_WINNERS.validate_python(
                    [dict(zip(self.columns, r, strict=True)) for r in self.rows]
                )
            except ValidationError as e:
                raise ValueError(what_is_wrong(e, "rows")) from None
        at = self.columns.index("params")
        for i, row in enumerate(self.rows):
            if not _json_object(row[at]):
                raise ValueError(
                    f"rows[{i}].params: should be the JSON text of an object, got "
                    f"{_clipped(row[at])}"
                )
        return self


def _json_object(text: str) -> bool:
    """Whether ``text`` is the JSON of an object (a winner's params: stored as sent, then read by
    every dispatch of its problem)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _of_their_types(columns: list[str], rows: list[list[Any]]) -> bool:
    """Whether every value of ``rows`` the host reads is of its column's type in
    ``FeedWinner``, as strict validation would find: the common case, checked without building
    a model a row (a full sync pulls every winner of the fleet). Other columns pass."""
    fields = FeedWinner.model_fields
    if any(f not in columns for f in fields):
        return False
    read = [(i, _KINDS.get(fields[c].annotation)) for i, c in enumerate(columns) if c in fields]
    if any(kind is None for _, kind in read):  # a column of a type not listed: pydantic's
        return False
    return all(all(type(row[i]) in kind for i, kind in read) for row in rows)


_KINDS: dict[Any, tuple[type, ...]] = {
    str: (str,),
    float: (float, int),
    str | None: (str, type(None)),
}


class Submitted(Answer):
    accepted: int
    duplicates: int
    served: list[str] = []
    pending: list[str] = []
    refused: list[str] = []


class Completed(Submitted):
    lease_expired: bool
    done: list[str]
    requeued: list[str]
    failed: list[str]


class Queued(Answer):
    queued: int


class QueueEntry(Answer):
    """A key of the tuning queue, returned to the caller whole (``FleetClient.queue``)."""

    device_class: str
    versions: str
    key: str
    op: str
    state: str
    misses: int
    attempts: int
    lease_expires: float | None
    enqueued_at: float
    updated_at: float


class QueueListing(RootModel[list[QueueEntry]]):
    pass


class Claimed(Answer):
    lease_id: str | None
    keys: list[str]
    expires_at: float | None


class MeasurementRef(Answer):
    uid: str


class Found(RootModel[list[MeasurementRef]]):
    pass


class Artifact(Answer):
    spec_id: str
    spec: str
    hash: str
    size: Annotated[int, Field(ge=0)]


class ArtifactLookup(Answer):
    artifacts: list[Artifact]
    missing: list[str]


class ArtifactListing(Page):
    artifacts: list[Artifact]


class Published(Answer):
    outcome: str


class Build(Answer):
    hash: str
    builder: str


class Conflict(Answer):
    spec_id: str
    spec: str
    served: str
    builds: list[Build]


class Conflicts(RootModel[list[Conflict]]):
    pass


def what_is_wrong(e: ValidationError, root: str = "") -> str:
    """The first thing ``e`` found wrong with an answer (or its part ``root``), in one clause:
    where in it, what it should be, and what came instead."""
    first = e.errors()[0]
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    if first["type"] == "value_error" and not first["loc"]:  # a check of the whole: said there
        return first["msg"].removeprefix("Value error, ") + more
    where = root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
    where = where.removeprefix(".")
    where = f"the answer{where}" if not where or where[0] == "[" else where
    if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        why = "should be a JSON object"
    elif first["type"] == "list_type":
        why = "should be a JSON array"
    else:
        why = first["msg"].removeprefix("Value error, ")
    got = "" if first["type"] == "missing" else f", got {_clipped(first['input'])}"
    return f"{where}: {why}{got}{more}"


def _clipped(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."

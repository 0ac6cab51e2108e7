"""Request and response bodies of the /v1 API (pydantic), with the limits that bound a request.

Every field is checked where it enters, so a mistake comes back as a 422 naming the field, the
value and what is allowed, and nothing malformed reaches the database. Keys are parsed with
``tuner.core.keys.parse_key`` and stored in their canonical string form.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, model_validator

from server.merge import MIN_US
from server.servable import utf8_unsafe
from tuner.cache.artifacts import ArtifactSpec
from tuner.core.device import Fingerprint
from tuner.core.keys import parse_key
from tuner.measure.records import LAUNCHES, STATUSES, Measurement

MAX_BATCH = 5000  # measurements or misses per request
MAX_KEYS = 1000  # keys per batch lookup or claim
MAX_FEED_PAGE = 20000
MAX_PARAMS_CHARS = 4000
DEVICE_CLASS_RE = r"^(cuda|cpu)-[a-z0-9][a-z0-9-]{0,199}$"
LAST = (
    "the service's latest sequence number: a `since` beyond it was handed out by a later state "
    "of this database (it was restored from an older backup), so sync from 0 again"
)


def canonical_key(text: str) -> str:
    try:
        return str(parse_key(text))
    except (ValueError, ArithmeticError, TypeError) as e:  # some invalid keys divide by zero
        raise ValueError(f"invalid key {text[:200]!r}: {e}") from None


def _small_params(params: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """Params small and JSON: a NaN or an Infinity (which Python's parser takes, and which it
    makes of a number beyond a float's range, such as 1e999) was stored and served as text no
    JSON reader takes, and the read of that winner failed with a 500; so did a lone surrogate,
    which the answer's UTF-8 cannot carry."""
    try:
        text = json.dumps(params, sort_keys=True, allow_nan=False)
    except ValueError:
        raise ValueError(
            "not JSON-serialisable: NaN, Infinity and numbers beyond a float's range (1e999 "
            "reads as Infinity) are no numbers in JSON"
        ) from None
    if len(text) > MAX_PARAMS_CHARS:
        raise ValueError(
            f"params must be at most {MAX_PARAMS_CHARS} characters of JSON, got {len(text)}"
        )
    if utf8_unsafe(params, text):
        raise ValueError(
            "a string holds a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry"
        )
    return params


KeyStr = Annotated[str, Field(min_length=5, max_length=600), AfterValidator(canonical_key)]
DeviceClass = Annotated[str, Field(pattern=DEVICE_CLASS_RE, examples=["cpu-x86-64-2c"])]
UID_RE = r"^[A-Za-z0-9_-]{8,64}$"
Uid = Annotated[str, Field(pattern=UID_RE)]  # a host's Measurement.uid
Versions = Annotated[
    str, Field(max_length=2000, examples=["torch=2.13.0;triton=3.9.0;tuner=0.1.0"])
]


def _timed(us: float) -> float:
    """0 (not timed) or at least ``MIN_US``: a time of 5e-324 divides the baseline's into an
    infinite speedup, which JSON cannot carry, and every read of the served winner (the feed
    page of every host of the class) would fail on it."""
    if 0 < us < MIN_US:
        raise ValueError(f"a time must be 0 or at least {MIN_US} us, got {us!r}")
    return us


Micros = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False), AfterValidator(_timed)]
Seconds = Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=4000)]
Name = Annotated[str, Field(min_length=1, max_length=200)]


class ErrorOut(BaseModel):
    detail: str


class TokenOut(BaseModel):
    id: str = Field(description="the token's public id")
    name: str
    scopes: list[str] = Field(description="as granted")
    allows: list[str] = Field(description="every scope it may use (each includes the previous)")


class ValidationOut(BaseModel):
    detail: list[dict[str, Any]] = Field(description="pydantic's errors: loc, msg, type, input")
    message: str = Field(description="the first errors as one readable line")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceIn(Strict):
    """A host's fingerprint (``tuner.core.device.fingerprint().to_dict()``)."""

    kind: Literal["cuda", "cpu"]
    name: Name
    compute_capability: Annotated[str, Field(pattern=r"^(\d{1,2}\.\d{1,2})?$")] = ""
    sm_count: Annotated[int, Field(ge=1, le=1_000_000)]
    memory_gib: Annotated[int, Field(ge=0, le=1_000_000)]
    l2_bytes: Annotated[int, Field(ge=0, le=2**40)] = 0
    versions: Annotated[dict[Name, Name], Field(max_length=64)] = {}
    device_class: DeviceClass | None = None  # optional; must match what the fields give

    @model_validator(mode="after")
    def _class_matches(self) -> DeviceIn:
        computed = self.fingerprint().device_class
        if not re.match(DEVICE_CLASS_RE, computed):
            raise ValueError(f"name {self.name!r} gives no usable device class ({computed!r})")
        if self.device_class is not None and self.device_class != computed:
            raise ValueError(
                f"device_class {self.device_class!r} does not match the fingerprint's {computed!r}"
            )
        return self

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(
            kind=self.kind, name=self.name, compute_capability=self.compute_capability,
            sm_count=self.sm_count, memory_gib=self.memory_gib, l2_bytes=self.l2_bytes,
            versions=dict(self.versions),
        )  # fmt: skip


class MeasurementIn(Strict):
    """One candidate's result, as ``tuner.measure.records.Measurement`` holds it."""

    device_class: DeviceClass
    key: KeyStr
    source: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    params: Annotated[dict[str, JsonValue], AfterValidator(_small_params)] = {}
    status: Literal[STATUSES]  # type: ignore[valid-type]
    is_baseline: bool = False
    median_us: Micros | None = None
    p10_us: Micros | None = None
    p90_us: Micros | None = None
    reps: Annotated[int, Field(ge=0, le=10**9)] = 0
    host_us: Micros | None = None
    max_rel_err: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    error: Text = ""
    versions: Versions = ""
    host: Annotated[str, Field(max_length=255)] = ""
    run_id: Annotated[str, Field(max_length=64)] = ""
    created_at: Seconds = 0.0
    uid: Uid
    launch: Literal[LAUNCHES] = "eager"  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _ok_is_timed(self) -> MeasurementIn:
        if self.status == "ok" and not self.median_us:
            raise ValueError("status 'ok' needs a positive median_us")
        # quantiles of one set of calls: a spread out of order would only widen the noise the
        # merge grants the baseline
        order = [(n, v) for n in ("p10_us", "median_us", "p90_us")
                 if (v := getattr(self, n)) is not None]  # fmt: skip
        for (low, a), (high, b) in itertools.pairwise(order):
            if a > b:
                raise ValueError(f"{low} ({a!r}) must not exceed {high} ({b!r})")
        return self

    def to_measurement(self) -> Measurement:
        return Measurement(**self.model_dump())


def _same_class(device: DeviceIn, measurements: list[MeasurementIn]) -> None:
    dc = device.fingerprint().device_class
    for i, m in enumerate(measurements):
        if m.device_class != dc:
            raise ValueError(
                f"measurements[{i}].device_class {m.device_class!r} does not match the device's {dc!r}"
            )


class SubmitIn(Strict):
    device: DeviceIn
    measurements: Annotated[list[MeasurementIn], Field(max_length=MAX_BATCH)]

    @model_validator(mode="after")
    def _consistent(self) -> SubmitIn:
        _same_class(self.device, self.measurements)
        return self


class SubmitOut(BaseModel):
    accepted: int
    duplicates: int
    served: list[str] = Field(description="keys whose served winner changed")
    pending: list[str] = Field(description="keys with a large change awaiting confirmation")
    refused: list[str] = Field(
        default_factory=list, description="why a measurement was not stored (the rest were)"
    )


class MissIn(Strict):
    key: KeyStr
    count: Annotated[int, Field(ge=1, le=10**9)] = 1


class MissesIn(Strict):
    device: DeviceIn
    versions: Versions
    misses: Annotated[list[MissIn], Field(min_length=1, max_length=MAX_BATCH)]


class MissesOut(BaseModel):
    recorded: int
    queued: int = Field(description="keys newly added to the tuning queue")


class WinnerOut(BaseModel):
    device_class: str
    versions: str
    key: str
    op: str
    candidate: str
    source: str
    params: dict[str, Any]
    median_us: float
    baseline_us: float
    speedup: float
    run_id: str | None
    submitters: int
    seq: int = Field(description="position in the feed: pass the largest seen as `since`")
    updated_at: float
    launch: str = Field(description="the launch mode it was chosen for: eager or graph")


class LookupIn(Strict):
    versions: Versions
    keys: Annotated[list[KeyStr], Field(min_length=1, max_length=MAX_KEYS)]


class LookupOut(BaseModel):
    winners: list[WinnerOut]
    missing: list[str]


class FeedOut(BaseModel):
    device_class: str
    versions: str | None
    since: int
    cursor: int = Field(description="pass as `since` next time")
    more: bool = Field(description="true: call again with `since=cursor` right away")
    last: int = Field(description=LAST)
    columns: list[str] = Field(description="names of the row fields (WinnerOut's fields)")
    rows: list[list[Any]] = Field(description="one row per winner; `params` as JSON text")


class Serving(BaseModel):
    key: str
    versions: str
    updated_at: float


class ServedOut(BaseModel):
    """What was served under one sequence number: a host checks the one it pulled last."""

    seq: int
    served: Serving | None = Field(description="null: nothing of this class under `seq`")
    log_from: int = Field(
        description="the log is whole above this number; at or below it, null proves nothing"
    )


class ClaimIn(Strict):
    device: DeviceIn
    versions: Versions
    worker: Name
    max_keys: Annotated[int, Field(ge=1, le=MAX_KEYS)] = 10
    lease_s: Annotated[float, Field(ge=1, le=86400, allow_inf_nan=False)] = 900.0


class ClaimOut(BaseModel):
    lease_id: str | None = Field(description="null when nothing is queued for this device")
    keys: list[str]
    expires_at: float | None
    expired_returned: int = Field(description="keys of run-out leases this claim put back")


class CompleteIn(SubmitIn):
    lease_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class CompleteOut(SubmitOut):
    lease_expired: bool
    done: list[str]
    requeued: list[str]
    failed: list[str]


class GroupIn(Strict):
    device_class: DeviceClass
    versions: Versions
    key: KeyStr


class ConfirmOut(BaseModel):
    key: str
    candidate: str


class MeasurementRef(BaseModel):
    """A stored measurement, as much as a host needs to know the service still holds it."""

    uid: str
    device_class: str
    key: str
    received_at: float


class QueueEntry(BaseModel):
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


class MissEntry(BaseModel):
    device_class: str
    versions: str
    key: str
    op: str
    count: int
    first_seen: float
    last_seen: float


class PendingEntry(BaseModel):
    device_class: str
    versions: str
    key: str
    candidate: str
    source: str
    params: dict[str, Any]
    us: float
    served_candidate: str = Field(
        description="what hosts run for the key until the change is confirmed: the served "
        "winner, or for a key with none yet its baseline (the hosts' own default, which "
        "/v1/winners does not list)"
    )
    served_us: float = Field(description="served_candidate's time in the group's measurements")
    margin: float
    supporters: list[str]
    updated_at: float


# --- compiled-kernel artifacts -----------------------------------------------------------------

MAX_SPEC_CHARS = 8000  # an artifact spec's JSON (sent in the Tuner-Artifact-Spec header)
MAX_ARTIFACT_PAGE = 5000
SHA256_RE = r"^[0-9a-f]{64}$"
Sha256 = Annotated[str, Field(pattern=SHA256_RE, examples=["0" * 64])]
SpecName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:+-]{1,100}$")]


class ArtifactSpecIn(Strict):
    """What identifies a compiled kernel (``tuner.cache.artifacts.ArtifactSpec``)."""

    source: SpecName
    config: Annotated[dict[str, JsonValue], AfterValidator(_small_params)]
    arch: SpecName
    toolchain: Annotated[dict[Name, Name], Field(max_length=32)] = {}

    def to_spec(self) -> ArtifactSpec:
        return ArtifactSpec(self.source, self.config, self.arch, self.toolchain)


class PublishOut(BaseModel):
    spec_id: str = Field(description="sha256 of the spec's canonical JSON")
    hash: str
    size: int
    outcome: Literal["new", "same", "conflict", "known conflict"] = Field(
        description="new: now served; same: the served build again; conflict: a different "
        "build of a served spec (recorded and reported, not served)"
    )


class ArtifactLookupIn(Strict):
    spec_ids: Annotated[list[Sha256], Field(min_length=1, max_length=MAX_KEYS)]


class ArtifactOut(BaseModel):
    seq: int = Field(description="position in the listing: pass the largest seen as `since`")
    spec_id: str
    spec: str = Field(description="the spec as canonical JSON")
    hash: str
    size: int
    builder: str = Field(description="id of the token that published it")
    created_at: float


class ArtifactLookupOut(BaseModel):
    artifacts: list[ArtifactOut]
    missing: list[str]


class ArtifactFeedOut(BaseModel):
    since: int
    cursor: int = Field(description="pass as `since` next time")
    more: bool = Field(description="true: call again with `since=cursor` right away")
    last: int = Field(description=LAST)
    artifacts: list[ArtifactOut]


class BuildOut(BaseModel):
    hash: str
    builder: str
    size: int
    first_seen: float
    last_seen: float


class ConflictOut(BaseModel):
    spec_id: str
    spec: str
    served: str = Field(description="the hash served: the first build published")
    builds: list[BuildOut]

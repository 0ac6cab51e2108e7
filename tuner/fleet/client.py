"""Client of the fleet service: pull this device class's winners, push results, report misses,
and publish / fetch compiled-kernel artifacts.

    client = FleetClient("http://tuner.internal:8000", token="tnr_...")
    pull(client, store, fingerprint())        # incremental: only what changed since last time
    push(client, store, fingerprint())        # new local measurements and miss counts
    push_artifacts(client, artifacts)         # this host's builds (needs a ``build`` token)
    fetch_artifacts(client, artifacts, specs) # served builds, each checked against its hash

Settings: ``TUNER_SERVER`` (base URL), ``TUNER_TOKEN``, ``TUNER_SYNC_INTERVAL`` (seconds).
Every request has a bounded timeout and is retried with exponential backoff on connection
errors, timeouts, 429 and 502/503/504; a miss report or a queue claim, which the service counts
or leases, only where it surely was not acted upon (no connection made, 429 or 503). Other 4xx
raise ``FleetError`` with the service's message at once, except that measurements a 422 names by
index are counted as refused and the rest of their batch sent again. The dispatcher never waits
for the service: ``attach`` runs the sync in a daemon thread with its own SQLite connection and
calls ``Dispatcher.reload()`` when new winners arrive.

Sync positions live in the local cache (``sync_state``): pulls resume from the last feed sequence
number, pushes from the last pushed measurement id, and miss reports send only the counts not yet
reported to that service (``reported_misses``), so an outage never loses or double-counts
anything (a process killed between marking a batch and sending it loses that batch's counts,
which only order the tuning queue).
Positions are kept per service, by the id its health names, whatever URL reaches it: a
service rebuilt at the same URL is pulled from and pushed to from the start. One restored from
an older backup keeps its id. A position is kept with its mark, what stands at it as the service
names it: the last winner pulled, the uid of the last measurement pushed. Before a pull the
service is asked what it served under that position (it keeps every serving by number; of a
service too old to, that winner as served now), before a push for that measurement (one small
request each); one it has lost, or another serving under that number, gives the restore away, as
does a position beyond the latest sequence number it names (``last`` in the feed and the
artifact listing). All of its positions then start over, and every miss count is reported to it
again in full; what was reported to other services stands.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tuner.cache import Store
from tuner.cache.artifacts import (
    ArtifactError,
    ArtifactSpec,
    ArtifactStore,
    Conflict,
    sha256,
    shared_store,
)
from tuner.core.device import Fingerprint
from tuner.core.keys import spelt_now
from tuner.measure.records import Measurement, Winner
from tuner.version import __version__

log = logging.getLogger(__name__)

BATCH = 5000  # the service's per-request limit for measurements and misses
BATCH_SPECS = 1000  # the service's per-request limit for artifact lookups
RETRY_STATUS = (429, 502, 503, 504)
# what says a request was not acted upon: a request that counts (misses) or hands out (a
# lease) is sent again only then; after a reply lost to a timeout or a proxy, a retry would
# count it twice or lease the keys again
NOT_RECEIVED_STATUS = (429, 503)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class FleetError(Exception):
    """The service refused a request (4xx, with its message) or stayed unreachable."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail  # the answer's ``detail`` (a 422's errors: loc, msg, ...), if JSON


@dataclass(frozen=True)
class Lease:
    lease_id: str | None
    keys: list[str]
    expires_at: float | None


TIMEOUT_S = 10.0  # seconds to wait for each answer, unless the caller says otherwise
SYNC_INTERVAL_S = 60.0  # default seconds between background syncs
MIN_SYNC_INTERVAL_S = 1.0  # of $TUNER_SYNC_INTERVAL: less would hammer the service (0: no wait)
MAX_SYNC_INTERVAL_S = (
    7 * 24 * 3600.0
)  # a week; longer is a typo, and past threading.TIMEOUT_MAX kills the thread


def _check_server(server: str) -> None:
    """A ValueError naming the setting, the value and what is wrong with it, for a server URL
    httpx would refuse only later, with a traceback (``http://[::1``, ``http://host:abc``), or
    take and fail to connect to (port 99999, no host)."""
    where = f"--server/TUNER_SERVER {server!r}"
    if not server.startswith(("http://", "https://")):
        raise ValueError(f"{where}: expected an http:// or https:// URL")
    try:
        url = httpx.URL(server)
    except httpx.InvalidURL as e:
        raise ValueError(f"{where}: not a valid URL: {e}") from None
    if not url.host:
        raise ValueError(f"{where}: no host name")
    if url.port is not None and not 0 < url.port < 65536:
        raise ValueError(f"{where}: port {url.port} is not in 1-65535")
    if url.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"{where}: give the service's base URL, without /v1 (the client adds "
                         "the API's paths)")  # fmt: skip


def _clean_token(token: str | None) -> str | None:
    """``token`` without surrounding whitespace (a secret file's trailing newline, which h11
    refuses in a header: it read as "service unreachable"); a ValueError naming the setting,
    never the token, for a character no header may carry (a non-ASCII one failed deep in
    httpx with an ascii codec error)."""
    token = token.strip() if token else None
    if token and token[:7].lower() == "bearer ":  # the header's word, copied with the token
        token = token[7:].strip()
    for i, c in enumerate(token or ""):
        if not " " <= c <= "~":
            raise ValueError(
                f"--token/TUNER_TOKEN: character {i + 1} of the token is not printable ASCII "
                f"(U+{ord(c):04X}); an HTTP header cannot carry it"
            )
    return token or None


class FleetClient:
    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        timeout_s: float = TIMEOUT_S,
        retries: int = 3,
        backoff_s: float = 0.25,
    ) -> None:
        server = server.strip()  # a setting's stray space would name another service's scope
        _check_server(server)
        self.server = server.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"User-Agent": f"tuner/{__version__}"}
        if token := _clean_token(token):
            headers["Authorization"] = f"Bearer {token}"
        self.http = httpx.Client(
            base_url=self.server,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
        )
        self._is_service = False  # its health answered: a 404 then means "none of that here"

    @classmethod
    def from_env(cls, **kwargs: Any) -> FleetClient | None:
        """A client for ``$TUNER_SERVER`` with ``$TUNER_TOKEN``, or None if no server is set."""
        server = os.environ.get("TUNER_SERVER")
        return cls(server, os.environ.get("TUNER_TOKEN"), **kwargs) if server else None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport -----------------------------------------------------------------------------

    def request(self, method: str, path: str, *, once: bool = False, **kwargs: Any) -> Any:
        """One API call with retries; returns the decoded JSON body. ``once``: the call is not
        idempotent, so it is retried only where it surely was not acted upon."""
        r = self._send(path, lambda: self.http.request(method, path, **kwargs), once=once)
        try:
            return r.json()
        except ValueError:  # e.g. --server names some other web server
            raise FleetError(
                f"{self.server}{path}: answered {r.status_code} without JSON; "
                "is this a tuner service?",
                r.status_code,
            ) from None

    def _send(
        self, path: str, send: Callable[[], httpx.Response], *, once: bool = False
    ) -> httpx.Response:
        """``send()`` with retries (``once``: only where it was not acted upon); its response if
        successful, else FleetError."""
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                r = send()
            except httpx.TransportError as e:  # refused, reset, timed out
                if last or (once and not isinstance(e, NOT_SENT)):
                    hint = (" (the service speaks plain http: give an http:// URL, or put a TLS "
                            "proxy in front)" if "WRONG_VERSION_NUMBER" in str(e) else "")  # fmt: skip
                    raise FleetError(
                        f"{self.server} unreachable: {type(e).__name__}: {e}{hint}"
                    ) from None
            else:
                if r.status_code < 400:
                    return r
                retried = NOT_RECEIVED_STATUS if once else RETRY_STATUS
                if r.status_code not in retried or last:
                    raise FleetError(_message(r), r.status_code, _detail(r))
            time.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    # --- API -----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def service_health(self) -> dict[str, Any]:
        """The health of a tuner service here, or FleetError: unreachable, or "no tuner
        service at this URL" (another server, or a wrong base path)."""
        try:
            health = self.health()
        except FleetError as not_ours:
            if not_ours.status is None:  # down or gone: say that, not "no service"
                raise
            raise FleetError(f"no tuner service at this URL (GET /v1/health: {not_ours})") from None
        self._is_service = True
        return health

    def sync_scope(self, store: Store | None = None) -> str:
        """What this host's sync positions with the service are kept under: the id its health
        names now, whatever URL reached it (a service that names none: the URL). ``store``:
        positions kept there under another name of the same service move to this one."""
        service = self.service_health().get("service_id")
        if not service:
            return self.server
        scope = f"service-{service}"
        if store is not None and store.adopt_positions(scope, f"#{service}"):
            log.info("sync positions with %s kept under another URL of it: moved", self.server)
        return scope

    def nothing_there(self, e: FleetError) -> bool:
        """Whether ``e`` is the service saying it has none of what was asked (404), and not a
        server without that path at all (``--server`` naming another server or a wrong base
        path), which raises: the service's health is asked once to tell them apart."""
        if e.status != 404:
            return False
        if not self._is_service:
            self.service_health()
        return True

    def require_scope(self, scope: str) -> None:
        """FleetError (403) unless this client's token may use ``scope``: checked before there
        is anything to send, so a token of the wrong scope is found out at once. A service too
        old to say (no such route) is left to refuse the request itself."""
        if "Authorization" not in self.http.headers:
            raise FleetError(f"this needs a token of scope {scope!r}: pass --token or set "
                             "TUNER_TOKEN", 401)  # fmt: skip
        try:
            token = self.request("GET", "/v1/token")
        except FleetError as e:
            if e.status in (404, 405):
                return
            raise
        if scope not in token["allows"]:
            raise FleetError(
                f"token {token['id']} ({token['name']}) has scopes {token['scopes']}; this "
                f"needs {scope!r} (tuner token create --scope {scope})",
                403,
            )

    def winner(self, device_class: str, key: str, versions: str | None = None) -> dict | None:
        params = {"key": key} | ({"versions": versions} if versions is not None else {})
        try:
            return self.request("GET", f"/v1/winners/{device_class}", params=params)
        except FleetError as e:
            if self.nothing_there(e):
                return None
            raise

    def served_at(self, device_class: str, seq: int) -> dict[str, Any] | None:
        """What the service served under sequence number ``seq`` (``served``: key, versions,
        updated_at, or None), and ``log_from``, above which its log of servings is whole; None
        from a service too old to answer (no such route)."""
        try:
            return self.request("GET", f"/v1/winners/{device_class}/served", params={"seq": seq})
        except FleetError as e:
            if e.status == 404:  # the route never answers 404 where it exists
                return None
            raise

    def lookup(self, device_class: str, versions: str, keys: list[str]) -> dict[str, Any]:
        return self.request(
            "POST", f"/v1/winners/{device_class}/lookup", json={"versions": versions, "keys": keys}
        )

    def feed(
        self, device_class: str, versions: str | None, since: int, limit: int = 10000
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"since": since, "limit": limit}
        if versions is not None:
            params["versions"] = versions
        return self.request("GET", f"/v1/winners/{device_class}/feed", params=params)

    def submit(self, fp: Fingerprint, measurements: list[Measurement]) -> dict[str, Any]:
        """Submit measurements (any number; sent in batches). Returns summed counts, and in
        ``refused`` why each measurement the service would not store was refused."""
        total: dict[str, Any] = {
            "accepted": 0, "duplicates": 0, "served": [], "pending": [], "refused": []
        }  # fmt: skip
        for i in range(0, len(measurements), BATCH):
            out = self._submit_batch(fp, [wire(m) for m in measurements[i : i + BATCH]])
            for k, v in out.items():
                if k in total:
                    total[k] += v
        return total

    def _submit_batch(self, fp: Fingerprint, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """One batch. Refused whole (422) for measurements the service names by index, it is
        sent again without them, their reasons added to ``refused``: one measurement the service
        will never take must not block every later push of the host. Which ones it takes is its
        rule alone: none is checked here."""
        refused: list[str] = []
        while batch:
            try:
                body = {"device": fp.to_dict(), "measurements": batch}
                out = self.request("POST", "/v1/measurements", json=body)
                return out | {"refused": refused + out.get("refused", [])}
            except FleetError as e:
                invalid = _invalid_items(e, "measurements", len(batch))
                if not invalid:
                    raise
            refused += [f"{batch[j]['key']} ({batch[j]['source']}): {why}"
                        for j, why in invalid.items()]  # fmt: skip
            batch = [m for j, m in enumerate(batch) if j not in invalid]
        return {"refused": refused}

    def holds(self, uid: str) -> bool | None:
        """Whether the service holds the measurement ``uid``; None from a service too old to
        answer (it has no such read)."""
        try:
            return bool(self.request("GET", "/v1/measurements", params={"uid": uid}))
        except FleetError as e:
            if e.status == 405:  # the path takes submissions only
                return None
            raise

    def report_misses(self, fp: Fingerprint, misses: list[tuple[str, int]]) -> int:
        queued = 0
        for i in range(0, len(misses), BATCH):
            body = {
                "device": fp.to_dict(),
                "versions": fp.version_tag,
                "misses": [{"key": k, "count": n} for k, n in misses[i : i + BATCH]],
            }
            queued += self.request("POST", "/v1/misses", json=body, once=True)["queued"]
        return queued

    def claim(
        self, fp: Fingerprint, worker: str, *, max_keys: int = 10, lease_s: float = 900.0
    ) -> Lease:
        """Lease queued keys of this device class and versions (for tuning workers)."""
        body = {"device": fp.to_dict(), "versions": fp.version_tag, "worker": worker,
                "max_keys": max_keys, "lease_s": lease_s}  # fmt: skip
        out = self.request("POST", "/v1/queue/claim", json=body, once=True)
        return Lease(out["lease_id"], out["keys"], out["expires_at"])

    def complete(
        self, lease_id: str, fp: Fingerprint, measurements: list[Measurement]
    ) -> dict[str, Any]:
        """Results of a lease (at most one batch: tune fewer keys per lease if more)."""
        if len(measurements) > BATCH:
            raise ValueError(
                f"at most {BATCH} measurements per completion, got {len(measurements)}"
            )
        body = {"lease_id": lease_id, "device": fp.to_dict(),
                "measurements": [wire(m) for m in measurements]}  # fmt: skip
        return self.request("POST", "/v1/queue/complete", json=body)

    def queue(self, **filters: Any) -> list[dict[str, Any]]:
        params = {k: v for k, v in filters.items() if v is not None}
        return self.request("GET", "/v1/queue", params=params)

    # --- artifacts -----------------------------------------------------------------------------

    def publish_artifact(self, spec: ArtifactSpec, data: bytes) -> dict[str, Any]:
        """Publish one artifact (needs a ``build`` token); the service's PublishOut."""
        return self.request(
            "PUT", f"/v1/artifacts/blobs/{sha256(data)}", content=data,
            headers={"Tuner-Artifact-Spec": spec.to_json(),
                     "Content-Type": "application/octet-stream"},
        )  # fmt: skip

    def artifact_lookup(self, spec_ids: list[str]) -> dict[str, Any]:
        """The served build of each spec id (at most ``BATCH_SPECS``) and the ids without one."""
        return self.request("POST", "/v1/artifacts/lookup", json={"spec_ids": spec_ids})

    def artifact_listing(self, archs: list[str], since: int, limit: int = 1000) -> dict[str, Any]:
        params = {"arch": archs, "since": since, "limit": limit}
        return self.request("GET", "/v1/artifacts", params=params)

    def artifact_conflicts(self, limit: int = 10000) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/artifacts/conflicts", params={"limit": limit})

    def download_artifact(self, digest: str, max_bytes: int) -> bytes:
        """A blob's bytes as sent, streamed and cut off past ``max_bytes`` (FleetError). Not
        checked here: ``ArtifactStore.add_verified`` checks them before anything is stored."""
        path = f"/v1/artifacts/blobs/{digest}"

        def send() -> httpx.Response:
            with self.http.stream("GET", path) as r:
                if r.status_code >= 400:
                    r.read()
                    return r
                data = bytearray()
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise FleetError(
                            f"{self.server}{path}: artifact larger than the {max_bytes} bytes "
                            "announced; rejected"
                        )
                return httpx.Response(r.status_code, content=bytes(data))

        return self._send(path, send).content


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:  # another server's page: its type and first line, not the page
        kind = r.headers.get("content-type", "no content type").split(";")[0]
        first = next((line.strip() for line in r.text.splitlines() if line.strip()), "")
        return f"HTTP {r.status_code} ({kind})" + ("" if "html" in kind else f": {first[:120]}")
    detail = body.get("message") or body.get("detail") if isinstance(body, dict) else body
    return f"HTTP {r.status_code}: {detail}"


def _detail(r: httpx.Response) -> Any:
    """The ``detail`` of an error answer in JSON; None for another server's page."""
    try:
        body = r.json()
    except ValueError:
        return None
    return body.get("detail") if isinstance(body, dict) else None


def _invalid_items(e: FleetError, field: str, n: int) -> dict[int, str]:
    """Index -> the service's reason, when ``e`` is a 422 whose every error locates one of the
    ``n`` items of the body's list ``field`` (pydantic's loc ``["body", field, i, ...]``);
    empty when any error lies elsewhere: then the request as a whole is wrong."""
    if e.status != 422 or not isinstance(e.detail, list) or not e.detail:
        return {}
    invalid: dict[int, str] = {}
    for error in e.detail:
        loc = error.get("loc") if isinstance(error, dict) else None
        if not isinstance(loc, list) or loc[:2] != ["body", field] or len(loc) < 3:
            return {}
        i = loc[2]
        if not isinstance(i, int) or not 0 <= i < n:
            return {}
        why = ".".join(str(p) for p in loc[3:]) + ": " if len(loc) > 3 else ""
        invalid[i] = "; ".join(filter(None, (invalid.get(i), f"{why}{error.get('msg')}")))
    return invalid


def wire(m: Measurement) -> dict[str, Any]:
    """A measurement as the service takes it: JSON has no NaN (a NaN error becomes null) and
    free-text fields are cut to the service's limits rather than failing the whole batch."""
    d = dataclasses.asdict(m)
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = None
    d["error"], d["host"], d["run_id"] = d["error"][:4000], d["host"][:255], d["run_id"][:64]
    return d


@dataclass
class PullResult:
    winners: int  # served ones received (those older than the local winner are not stored)
    pages: int
    cursor: int
    seconds: float


@dataclass
class PushResult:
    accepted: int
    duplicates: int
    skipped: int  # measurements of device classes with no known fingerprint here
    misses: int
    queued: int
    refused: int = 0  # measurements the service would not store (it said why; logged here)


WINNER_COLUMNS = Winner.columns()  # the local table's columns


def _winner_rows(columns: list[str], rows: list[list[Any]]) -> list[dict[str, Any]]:
    """Feed rows -> local winners-table rows (the feed's params are already JSON text)."""
    missing = set(WINNER_COLUMNS) - set(columns)
    if missing:
        raise FleetError(f"the service's feed lacks columns {sorted(missing)}")
    index = [(c, columns.index(c)) for c in WINNER_COLUMNS]
    winners = [{c: row[i] for c, i in index} for row in rows]
    for w in winners:  # a service of an older release serves SDPA keys spelt its way
        if w["key"].startswith("sdpa:"):
            w["key"] = spelt_now(w["key"])
    return winners


def _start_over(client: FleetClient, store: Store, scope: str, why: str) -> None:
    """The service at ``scope`` has lost history this host synced with it: it was restored from
    an older backup, keeping its id. What this host pushed since is lost to it, and what it
    serves next may come under numbers the host has passed. So every position of the scope is
    reset and the sync starts from the beginning (pushes are idempotent, pulled winners keep
    the newer), and every miss count is reported to it again in full (the reports to other
    services stand): a count the backup already held is then counted twice, which only moves
    its key up the tuning queue (counts steer the queue, never what is served), where sending
    nothing would leave the lost ones out of it."""
    log.warning(
        "fleet service %s %s (restored from an older backup?): pushing to and pulling from it "
        "from the start", client.server, why,
    )  # fmt: skip
    store.reset_positions(scope)
    store.forget_reported_misses(scope)


def _restarted(
    client: FleetClient, store: Store, scope: str, position: int, last: int | None
) -> bool:
    """Whether this host's ``position`` in ``scope`` lies beyond ``last``, the service's latest
    sequence number (None: a service too old to say); if so, it starts over (``_start_over``)."""
    if last is None or position <= last:
        return False
    why = f"is at sequence number {last}, behind this host's position {position} with it"
    _start_over(client, store, scope, why)
    return True


def _pull_name(scope: str, fp: Fingerprint) -> str:
    return f"pull:{scope}:{fp.device_class}:{fp.version_tag}"


def _feed_page(
    client: FleetClient, fp: Fingerprint, since: int, limit: int
) -> tuple[dict[str, Any] | None, int | None]:
    """A page of ``fp``'s feed and the service's latest sequence number. A device class the
    service does not know (nobody of it has reported, or it was restored from a backup older
    than that) gives (None, 0): it has none of that class's winners."""
    try:
        body = client.feed(fp.device_class, fp.version_tag, since, limit=limit)
    except FleetError as e:
        if client.nothing_there(e):
            return None, 0
        raise
    return body, body.get("last")


def _pull_mark(row: dict[str, Any]) -> str:
    """The last winner a pull took, as the service serves it: the key under these versions, and
    when it was served (with the pull position, its sequence number)."""
    return json.dumps({k: row[k] for k in ("key", "versions", "updated_at")})


def _check_pulled(client: FleetClient, store: Store, scope: str, fp: Fingerprint) -> None:
    """Before a pull: the service must still have served, under this host's pull position, the
    winner pulled there (same key, versions and date), else it lost history and the sync starts
    over, also when new results have since taken its latest sequence number past the position
    (which the feed's ``last`` cannot tell). It keeps every serving by number (fleet schema 5),
    so a restored service that has served that very winner again since, under a later number,
    is caught too.

    Where its log cannot say (a service too old to keep one; a position from before its log
    began), the winner as served now is asked instead: it must be the one pulled, or served
    under a later number (changed since); gone, under an earlier number, or under the same
    number at another date, the service lost history. That cannot tell a restored service that
    has served that very winner again since; ``last`` and a pushing host's own check remain."""
    name = _pull_name(scope, fp)
    mark = store.mark(name)
    if mark is None:
        return
    pulled, seq = json.loads(mark), store.position(name)
    why = f"no longer serves {pulled['key']} as this host pulled it, at sequence number {seq}"
    log = client.served_at(fp.device_class, seq)
    if log is not None and (log["served"] is not None or seq > log["log_from"]):
        # what the mark names (a later release's log may say more of a serving)
        there = log["served"] or {}
        if any(there.get(k) != pulled[k] for k in ("key", "versions", "updated_at")):
            _start_over(client, store, scope, why)
        return
    served = client.winner(fp.device_class, pulled["key"], pulled["versions"])
    if served is not None and (
        served["seq"] > seq
        or (served["seq"] == seq and served["updated_at"] == pulled["updated_at"])
    ):
        return
    _start_over(client, store, scope, why)


def _check_pushed(client: FleetClient, store: Store, scope: str, fp: Fingerprint) -> None:
    """Before a push: the service must still hold the last measurement this host pushed to it
    (one it stored), else it lost history and the sync starts over, which the push position,
    a local row id, cannot tell. Where that cannot be asked (no mark: nothing stored yet, or a
    position kept before marks were; a service too old to answer), a one-winner feed request
    from this host's pull position, if it pulled, compares that with the service's latest
    sequence number."""
    uid = store.mark(f"push:{scope}")
    held = client.holds(uid) if uid is not None else None
    if held is False:
        _start_over(client, store, scope, f"no longer holds measurement {uid}, pushed to it")
    elif held is None and (since := store.position(_pull_name(scope, fp))):
        _restarted(client, store, scope, since, _feed_page(client, fp, since, 1)[1])


def pull(
    client: FleetClient, store: Store, fp: Fingerprint, *, full: bool = False, page: int = 10000
) -> PullResult:
    """Bring the served winners of ``fp``'s device class and versions into ``store``.

    Pages are applied in feed order and the cursor saved after each page, so an interrupted pull
    resumes where it stopped; re-applying a page is harmless (winners are upserts). A served
    winner older than the local one of its key (re-tuned here since) is left out, as by
    ``tuner import``.
    """
    started = time.perf_counter()
    scope = client.sync_scope(store)
    _check_pulled(client, store, scope, fp)
    name = _pull_name(scope, fp)
    cursor = 0 if full else store.position(name)
    total = pages = 0
    while True:
        body, last = _feed_page(client, fp, cursor, page)
        if _restarted(client, store, scope, cursor, last):
            cursor = 0
            continue
        if body is None:  # nobody of this class has reported yet
            break
        rows = _winner_rows(body["columns"], body["rows"])
        if rows:
            store.put_winner_rows(rows)
            store.set_position(name, body["cursor"], _pull_mark(rows[-1]))
        total, pages, cursor = total + len(rows), pages + 1, body["cursor"]
        if not body["more"]:
            break
    return PullResult(total, pages, cursor, time.perf_counter() - started)


def _fingerprints(store: Store, fp: Fingerprint) -> dict[str, Fingerprint]:
    """Device class -> fingerprint, for every class the local cache has results of."""
    known = {fp.device_class: fp}
    for device_class in store.device_classes(limit=-1):
        if device_class in known:
            continue
        if (found := store.fingerprint(device_class)) is not None:
            known[device_class] = found
        else:
            log.warning("unreadable fingerprint for %s in the cache; skipping it", device_class)
    return known


def push_measurements(client: FleetClient, store: Store, fp: Fingerprint) -> dict[str, int]:
    """Send local measurements not sent to this service yet, oldest first. The position's mark
    is the last one the service stored (of a batch it refused none of), for ``_check_pushed``."""
    scope = client.sync_scope(store)
    _check_pushed(client, store, scope, fp)
    name = f"push:{scope}"
    fps = _fingerprints(store, fp)
    counts = {"accepted": 0, "duplicates": 0, "skipped": 0, "refused": 0}
    while True:
        rows = store.measurements_after(store.position(name), BATCH)
        if not rows:
            return counts
        by_class: dict[str, list[tuple[int, Measurement]]] = {}
        for row in rows:
            by_class.setdefault(row[1].device_class, []).append(row)
        stored: list[tuple[int, str]] = []  # (row id, uid) of the last of each batch kept whole
        for dc, batch in by_class.items():
            if dc not in fps:
                counts["skipped"] += len(batch)
                continue
            out = client.submit(fps[dc], [m for _, m in batch])
            counts["accepted"] += out["accepted"]
            counts["duplicates"] += out["duplicates"]
            for why in out.get("refused", []):
                log.warning("the fleet service did not store a measurement: %s", why)
                counts["refused"] += 1
            if not out.get("refused"):
                stored.append((batch[-1][0], batch[-1][1].uid))
        mark = max(stored)[1] if stored else store.mark(name)
        store.set_position(name, rows[-1][0], mark)


def push_misses(client: FleetClient, store: Store, fp: Fingerprint) -> tuple[int, int]:
    """Report the misses recorded here since the last report to this service. Returns (keys,
    newly queued)."""
    scope = client.sync_scope(store)
    todo = store.unreported_misses(fp.device_class, service=scope)
    queued = 0
    for i in range(0, len(todo), BATCH):
        chunk = todo[i : i + BATCH]
        # marked before they are sent: a cache that cannot keep the marks (read-only) sends
        # nothing, where sending first would send the same counts again at every sync; a
        # report that fails takes its marks back
        store.mark_reported(fp.device_class, [(k, now) for k, _, now in chunk], service=scope)
        try:
            queued += client.report_misses(fp, [(k, d) for k, d, _ in chunk])
        except BaseException:
            before = [(k, now - d) for k, d, now in chunk]
            store.mark_reported(fp.device_class, before, service=scope)
            raise
    return len(todo), queued


def push(client: FleetClient, store: Store, fp: Fingerprint) -> PushResult:
    m = push_measurements(client, store, fp)
    keys, queued = push_misses(client, store, fp)
    return PushResult(m["accepted"], m["duplicates"], m["skipped"], keys, queued, m["refused"])


# --- compiled-kernel artifacts ----------------------------------------------------------------


@dataclass
class ArtifactsPushed:
    published: int  # new on the service
    conflicts: int  # the service serves another build of the spec: ours is recorded beside it
    present: int  # the service already serves these very bytes


@dataclass
class ArtifactsFetched:
    fetched: int
    present: int  # already here with the served hash
    missing: int  # the service has no build of the spec
    rejected: list[str]  # one message per download refused (hash mismatch, spec mismatch, size)


def push_artifacts(
    client: FleetClient, artifacts: ArtifactStore, specs: list[ArtifactSpec] | None = None
) -> ArtifactsPushed:
    """Publish this host's artifacts (all, or those of ``specs``) that the service does not
    serve with the same bytes. Needs a ``build`` token."""
    local = artifacts.specs()
    if specs is not None:
        wanted = {s.id for s in specs}
        local = [(spec, digest) for spec, digest in local if spec.id in wanted]
    out = ArtifactsPushed(0, 0, 0)
    for i in range(0, len(local), BATCH_SPECS):
        chunk = local[i : i + BATCH_SPECS]
        served = _served(client, [spec.id for spec, _ in chunk])
        for spec, digest in chunk:
            if served.get(spec.id, {}).get("hash") == digest:
                out.present += 1
                continue
            data = artifacts.get(spec)
            if data is None:  # evicted or found corrupt meanwhile: nothing to publish
                continue
            outcome = client.publish_artifact(spec, data)["outcome"]
            if outcome == "new":
                out.published += 1
            elif outcome == "same":
                out.present += 1
            else:
                out.conflicts += 1
    return out


def _served(client: FleetClient, spec_ids: list[str]) -> dict[str, dict[str, Any]]:
    return {a["spec_id"]: a for a in client.artifact_lookup(spec_ids)["artifacts"]}


def _fetch_one(
    client: FleetClient, artifacts: ArtifactStore, spec: ArtifactSpec, row: dict[str, Any]
) -> str | None:
    """Download and store the served build ``row`` of ``spec``; None, or why it was refused."""
    if spec.id != row["spec_id"]:
        return f"the service listed spec {row['spec_id'][:12]} for spec {spec.id[:12]}; rejected"
    try:
        data = client.download_artifact(row["hash"], row["size"])
        artifacts.add_verified(spec, row["hash"], data)
    except (FleetError, ArtifactError) as e:
        if isinstance(e, FleetError) and e.status is None:
            raise  # unreachable: the next one would fail the same way
        return str(e)
    return None


def fetch_artifacts(
    client: FleetClient, artifacts: ArtifactStore, specs: list[ArtifactSpec]
) -> ArtifactsFetched:
    """Bring the served builds of ``specs`` into ``artifacts`` (e.g. before compiling them).

    Every download is checked against the hash the service announced for it
    (``ArtifactStore.add_verified``): a corrupt or substituted one is logged, listed in
    ``rejected`` and never stored."""
    have = artifacts.hashes()
    out = ArtifactsFetched(0, 0, 0, [])
    unique = list({s.id: s for s in specs}.values())
    for i in range(0, len(unique), BATCH_SPECS):
        chunk = unique[i : i + BATCH_SPECS]
        served = _served(client, [s.id for s in chunk])
        for spec in chunk:
            row = served.get(spec.id)
            if row is None:
                out.missing += 1
            elif have.get(spec.id) == row["hash"]:
                out.present += 1
            else:
                _count_fetch(out, _fetch_one(client, artifacts, spec, row))
    return out


def _count_fetch(out: ArtifactsFetched, refused: str | None) -> None:
    if refused is None:
        out.fetched += 1
    else:
        log.error("artifact download rejected: %s", refused)
        out.rejected.append(refused)


def host_archs(fp: Fingerprint) -> list[str]:
    """The artifact archs a host runs: Triton's target (``cuda:90``), CUTLASS's (``sm90``) and,
    from compute capability 9.0 on, its arch-specific target (``sm_90a``: code for that
    compute capability alone, what our CUDA decode kernels are built for); none for a host
    without a GPU."""
    if fp.kind != "cuda" or not fp.compute_capability:
        return []
    cc = fp.compute_capability.replace(".", "")
    return [f"cuda:{cc}", f"sm{cc}", *([f"sm_{cc}a"] if int(cc) >= 90 else [])]


def sync_artifacts(
    client: FleetClient, artifacts: ArtifactStore, store: Store, archs: list[str],
    *, full: bool = False,
) -> ArtifactsFetched:  # fmt: skip
    """Fetch every served build of ``archs`` published since the last sync (``full``: all).

    The position is kept in ``store`` after each page. A rejected download is reported and
    not retried by later syncs: ``fetch_artifacts`` of its spec, or a ``full`` sync, tries it
    again."""
    if not archs:
        raise ValueError("sync_artifacts needs at least one arch (see host_archs)")
    scope = client.sync_scope(store)
    name = f"artifacts:{scope}:{','.join(sorted(archs))}"
    cursor = 0 if full else store.position(name)
    out = ArtifactsFetched(0, 0, 0, [])
    have = artifacts.hashes()
    while True:
        body = client.artifact_listing(archs, cursor)
        if _restarted(client, store, scope, cursor, body.get("last")):
            cursor = 0
            continue
        for row in body["artifacts"]:
            if have.get(row["spec_id"]) == row["hash"]:
                out.present += 1
                continue
            try:
                spec = ArtifactSpec.from_json(row["spec"])
            except (ValueError, KeyError, TypeError) as e:
                _count_fetch(out, f"the service listed an unreadable spec {row['spec_id']}: {e}")
                continue
            _count_fetch(out, _fetch_one(client, artifacts, spec, row))
        cursor = body["cursor"]
        store.set_position(name, cursor)
        if not body["more"]:
            return out


@dataclass
class ArtifactCheck:
    service: list[dict[str, Any]]  # the service's ConflictOut entries
    local: list[Conflict]  # this host's store: specs that arrived with more than one build

    @property
    def clean(self) -> bool:
        return not self.service and not self.local


def fetch_host_artifacts(
    client: FleetClient, store: Store, fp: Fingerprint, artifacts: ArtifactStore | None = None,
    *, full: bool = False,
) -> ArtifactsFetched | None:  # fmt: skip
    """``sync_artifacts`` of this host's archs into ``artifacts``, by default the process's
    shared store (the one the compile hooks read); None, fetching nothing, on a host without a
    GPU or when that store cannot be opened."""
    archs = host_archs(fp)
    if not archs:
        return None
    kernels = artifacts if artifacts is not None else shared_store()
    if kernels is None:
        return None
    return sync_artifacts(client, kernels, store, archs, full=full)


def check_artifacts(client: FleetClient | None, artifacts: ArtifactStore) -> ArtifactCheck:
    """Specs built differently by different builders, on the service and in this host's store
    (``tuner artifacts --check``); the service's side is skipped without a client."""
    service = client.artifact_conflicts() if client is not None else []
    return ArtifactCheck(service, artifacts.conflicts())


# --- background sync for the dispatcher --------------------------------------------------------


class BackgroundSync:
    """Push, then pull (winners, then the artifacts of this host's archs when given an artifact
    store), every ``interval_s`` in a daemon thread; never raises into the caller.

    After a failure the next try comes sooner (5 s, doubling up to the interval), and the error
    is logged once per distinct message, so a service outage costs a log line, not a crash.
    """

    def __init__(
        self,
        client: FleetClient,
        store_path: str | Path,
        *,
        interval_s: float = SYNC_INTERVAL_S,
        push: bool = True,
        on_change: Callable[[], None] | None = None,
        fingerprint: Callable[[], Fingerprint] | None = None,
        artifacts: ArtifactStore | None = None,
    ) -> None:
        from tuner.core.device import fingerprint as default_fingerprint

        self.client, self.store_path, self.interval_s = client, Path(store_path), interval_s
        self.push, self.on_change, self.artifacts = push, on_change, artifacts
        self._fingerprint = fingerprint or default_fingerprint
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tuner-fleet-sync", daemon=True)
        self.syncs = 0
        self.failures = 0
        self.last_error: str | None = None
        self.synced = threading.Event()  # set after each successful round

    def start(self) -> BackgroundSync:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def trigger(self) -> None:
        """Sync now instead of at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        store: Store | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                store = store or Store(self.store_path)  # this thread's own connection
                self.sync_once(store)
                failures = 0
                wait = self.interval_s
            except Exception as e:  # the service or the cache failing must never kill the host
                failures += 1
                self.failures += 1
                message = f"{type(e).__name__}: {e}"
                if message != self.last_error:
                    log.warning("fleet sync with %s failed: %s", self.client.server, message)
                self.last_error = message
                wait = min(self.interval_s, 5.0 * 2 ** (failures - 1))
            self._wake.wait(wait)
            self._wake.clear()
        if store is not None:
            store.close()

    def sync_once(self, store: Store) -> PullResult:
        fp = self._fingerprint()
        refused: list[str] = []
        if self.push:  # a refused push (e.g. a read-only token) must not stop the pull
            for step in (push_measurements, push_misses):  # a restore found re-sends misses
                try:
                    step(self.client, store, fp)
                except FleetError as e:
                    if e.status is None:  # unreachable: the pull would fail the same way
                        raise
                    refused.append(f"{step.__name__}: {e}")
        result = pull(self.client, store, fp)
        kernels = (
            fetch_host_artifacts(self.client, store, fp, self.artifacts)
            if self.artifacts is not None
            else None
        )
        if (result.winners or (kernels and kernels.fetched)) and self.on_change is not None:
            self.on_change()
        self.syncs += 1
        self.synced.set()
        if refused:
            raise FleetError("; ".join(refused))
        self.last_error = None
        return result


def _sync_interval() -> float:
    """``$TUNER_SYNC_INTERVAL`` in seconds. One that is not a finite number of seconds, or is
    below the minimum, is logged and the default used: a typo in a setting must not leave the
    host without its sync."""
    text = os.environ.get("TUNER_SYNC_INTERVAL") or str(SYNC_INTERVAL_S)
    try:
        interval = float(text)
    except ValueError:
        interval = math.nan
    if not math.isfinite(interval):
        why = "is not a finite number of seconds"
    elif interval < MIN_SYNC_INTERVAL_S:
        why = f"is below the minimum of {MIN_SYNC_INTERVAL_S:g} s"
    elif interval > MAX_SYNC_INTERVAL_S:
        why = f"is above the maximum of {MAX_SYNC_INTERVAL_S:g} s"
    else:
        return interval
    log.warning("TUNER_SYNC_INTERVAL=%r %s; using the default, %g s", text, why, SYNC_INTERVAL_S)
    return SYNC_INTERVAL_S


def attach(
    dispatcher: Any, client: FleetClient | None = None, **kwargs: Any
) -> BackgroundSync | None:
    """Keep ``dispatcher``'s cache in sync with the service in the background.

    Uses ``$TUNER_SERVER``/``$TUNER_TOKEN`` unless a client is given; the interval is
    ``$TUNER_SYNC_INTERVAL`` seconds (default 60, also used, and logged, for a value that is not
    a number of seconds or is below 1). Returns None (and logs) if no service is configured or
    the configuration is unusable: the dispatcher then works from its cache alone.
    """
    from tuner.core.device import fingerprint as default_fingerprint

    try:
        client = client or FleetClient.from_env(timeout_s=5.0, retries=2)
        if client is None:
            return None
        if "interval_s" not in kwargs:
            kwargs["interval_s"] = _sync_interval()
        if "artifacts" not in kwargs:
            fp = (kwargs.get("fingerprint") or default_fingerprint)()
            kwargs["artifacts"] = shared_store() if host_archs(fp) else None
        return BackgroundSync(
            client, dispatcher.store_path, on_change=dispatcher.reload, **kwargs
        ).start()
    except Exception as e:
        log.error("fleet sync not started: %s", e)
        return None

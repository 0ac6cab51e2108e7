"""The HTTP client of the fleet service: one method per API call, with timeouts and retries,
and ``FleetError`` for a refused request or an unreachable service. What is synced, and when,
lives beside it: ``sync`` (winners, measurements, misses), ``artifact_sync``, ``background``.

    client = FleetClient("http://tuner.internal:8000", token="tnr_...")
    client = FleetClient.from_env()  # $TUNER_SERVER with $TUNER_TOKEN, or None

Every request has a bounded timeout and is retried with exponential backoff on connection
errors, timeouts, 429 and 502/503/504; a miss report or a queue claim, which the service counts
or leases, only where it surely was not acted upon (no connection made, 429 or 503). Other 4xx
raise ``FleetError`` with the service's message at once, except that measurements a 422 names by
index are counted as refused and the rest of their batch sent again. An answer is checked before
it is read (``answers``): one of another shape raises ``FleetError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from tuner.cache import Store
from tuner.cache.artifacts import ArtifactSpec, sha256
from tuner.core.device import Fingerprint
from tuner.core.settings import env_number
from tuner.fleet import answers
from tuner.measure.records import Measurement
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


class CompletedEarlier(FleetError):
    """A lease's completion whose answer was lost (no answer in time, a reset connection) and
    whose resend the service refused as already completed: the first try was stored, and what
    its answer said is not known here."""


@dataclass(frozen=True)
class Lease:
    lease_id: str | None
    keys: list[str]
    expires_at: float | None


TIMEOUT_S = 10.0  # seconds to wait for each answer, where $TUNER_SERVER_TIMEOUT is unset


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
        """A client for ``$TUNER_SERVER`` with ``$TUNER_TOKEN``, waiting
        ``$TUNER_SERVER_TIMEOUT`` seconds for each answer as the CLI's ``--timeout`` does (a
        hung service must hold up the background sync, warmup and tune-all no longer than the
        user said); None if no server is set."""
        server = os.environ.get("TUNER_SERVER")
        if not server:
            return None
        timeout_s = env_number("TUNER_SERVER_TIMEOUT", TIMEOUT_S)
        return cls(server, os.environ.get("TUNER_TOKEN"), timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport -----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        answer: type[BaseModel] | None = None,
        context: dict[str, Any] | None = None,
        once: bool = False,
        **kwargs: Any,
    ) -> Any:
        """One API call with retries; returns the decoded JSON body, checked as ``answer``
        (validated with ``context``) where given: one of another shape raises FleetError naming
        the field and what it should be. ``once``: the call is not idempotent, so it is retried
        only where it surely was not acted upon."""
        r = self._send(lambda: self.http.request(method, path, **kwargs), once=once)
        try:
            body = r.json()
        except ValueError:  # e.g. --server names some other web server
            raise FleetError(
                f"{self.server}{path}: answered {r.status_code} without JSON; "
                "is this a tuner service?",
                r.status_code,
            ) from None
        if answer is None:
            return body
        try:
            return answer.model_validate(body, context=context).model_dump(exclude_unset=True)
        except ValidationError as e:
            raise FleetError(
                f"{self.server}{path}: not an answer of a tuner service: "
                f"{answers.what_is_wrong(e)}",
                r.status_code,
            ) from None

    def _send(self, send: Callable[[], httpx.Response], *, once: bool = False) -> httpx.Response:
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
                    if isinstance(e, httpx.ReadTimeout):
                        tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
                        hint = (f" (no answer within {self.http.timeout.read:g} s, {tries}: the "
                                "service is busy or stopped; --timeout or TUNER_SERVER_TIMEOUT "
                                "waits longer)")  # fmt: skip
                    raise FleetError(
                        f"{self.server} unreachable: {type(e).__name__}: {e}{hint}"
                    ) from None
            else:
                if r.status_code < 400:
                    return r
                retried = NOT_RECEIVED_STATUS if once else RETRY_STATUS
                if r.status_code not in retried or last:
                    no_token = r.status_code == 401 and "Authorization" not in self.http.headers
                    hint = " (no token was sent: pass --token or set TUNER_TOKEN)" * no_token
                    raise FleetError(_message(r) + hint, r.status_code, _detail(r))
            time.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    # --- API -----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health", answer=answers.Health)

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
            token = self.request("GET", "/v1/token", answer=answers.Token)
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
            return self.request(
                "GET", f"/v1/winners/{device_class}", params=params, answer=answers.ServedWinner
            )
        except FleetError as e:
            if self.nothing_there(e):
                return None
            raise

    def served_at(self, device_class: str, seq: int) -> dict[str, Any] | None:
        """What the service served under sequence number ``seq`` (``served``: key, versions,
        updated_at, or None), and ``log_from``, above which its log of servings is whole; None
        from a service too old to answer (no such route)."""
        try:
            return self.request(
                "GET", f"/v1/winners/{device_class}/served", params={"seq": seq},
                answer=answers.Served,
            )  # fmt: skip
        except FleetError as e:
            if e.status == 404:  # the route never answers 404 where it exists
                return None
            raise

    def lookup(self, device_class: str, versions: str, keys: list[str]) -> dict[str, Any]:
        return self.request(
            "POST", f"/v1/winners/{device_class}/lookup", json={"versions": versions, "keys": keys},
            answer=answers.Lookup,
        )  # fmt: skip

    def feed(
        self, device_class: str, versions: str | None, since: int, limit: int = 10000
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"since": since, "limit": limit}
        if versions is not None:
            params["versions"] = versions
        return self.request(
            "GET", f"/v1/winners/{device_class}/feed", params=params, answer=answers.Feed,
            context={"since": since},
        )  # fmt: skip

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
                out = self.request("POST", "/v1/measurements", json=body, answer=answers.Submitted)
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
            found = self.request(
                "GET", "/v1/measurements", params={"uid": uid}, answer=answers.Found
            )
            return bool(found)
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
            out = self.request("POST", "/v1/misses", json=body, once=True, answer=answers.Queued)
            queued += out["queued"]
        return queued

    def claim(
        self, fp: Fingerprint, worker: str, *, max_keys: int = 10, lease_s: float = 900.0
    ) -> Lease:
        """Lease queued keys of this device class and versions (for tuning workers)."""
        body = {"device": fp.to_dict(), "versions": fp.version_tag, "worker": worker,
                "max_keys": max_keys, "lease_s": lease_s}  # fmt: skip
        out = self.request("POST", "/v1/queue/claim", json=body, once=True, answer=answers.Claimed)
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
        send = functools.partial(
            self.request, "POST", "/v1/queue/complete", json=body, answer=answers.Completed
        )
        try:
            return send(once=True)
        except FleetError as e:
            if e.status is not None:  # the service answered: as it said
                raise
        # no answer: the first try may have been stored, so a resend's "already completed"
        # means it was
        try:
            return send()
        except FleetError as e:
            if e.status == 409:
                raise CompletedEarlier(
                    f"lease {lease_id}: completed by a try whose answer was lost ({e})", 409
                ) from None
            raise

    def queue(self, **filters: Any) -> list[dict[str, Any]]:
        params = {k: v for k, v in filters.items() if v is not None}
        return self.request("GET", "/v1/queue", params=params, answer=answers.QueueListing)

    # --- artifacts -----------------------------------------------------------------------------

    def publish_artifact(self, spec: ArtifactSpec, data: bytes) -> dict[str, Any]:
        """Publish one artifact (needs a ``build`` token); the service's PublishOut."""
        return self.request(
            "PUT", f"/v1/artifacts/blobs/{sha256(data)}", content=data,
            headers={"Tuner-Artifact-Spec": spec.to_json(),
                     "Content-Type": "application/octet-stream"},
            answer=answers.Published,
        )  # fmt: skip

    def artifact_lookup(self, spec_ids: list[str]) -> dict[str, Any]:
        """The served build of each spec id (at most ``BATCH_SPECS``) and the ids without one."""
        return self.request(
            "POST", "/v1/artifacts/lookup", json={"spec_ids": spec_ids},
            answer=answers.ArtifactLookup,
        )  # fmt: skip

    def artifact_listing(self, archs: list[str], since: int, limit: int = 1000) -> dict[str, Any]:
        params = {"arch": archs, "since": since, "limit": limit}
        return self.request(
            "GET", "/v1/artifacts", params=params, answer=answers.ArtifactListing,
            context={"since": since},
        )  # fmt: skip

    def artifact_conflicts(self, limit: int = 10000) -> list[dict[str, Any]]:
        """Specs the service holds several builds of; a 404 from a server that is no tuner
        service (another web server, a wrong base path) is named so, not as its page's type."""
        try:
            return self.request(
                "GET", "/v1/artifacts/conflicts", params={"limit": limit}, answer=answers.Conflicts
            )
        except FleetError as e:
            if e.status == 404 and not self._is_service:
                self.service_health()
            raise

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

        return self._send(send).content


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

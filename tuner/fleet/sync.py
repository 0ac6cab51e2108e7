"""Pull the winners the fleet service serves this host's device class, and push this host's
measurements and miss counts to it: each resumes where the last one stopped, so a sync sends and
fetches only what is new.

    pull(client, store, fingerprint())        # incremental: only what changed since last time
    push(client, store, fingerprint())        # new local measurements and miss counts

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
again in full; what was reported to other services stands. A ``last`` or a cursor no service
sends (below 0, a cursor behind the position asked from or moved past the service's ``last``) is
no restore: the answer is refused
(``tuner.fleet.answers``) and the positions stay.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from tuner.cache import Store
from tuner.core.device import Fingerprint
from tuner.core.keys import spelt_now
from tuner.fleet.client import BATCH, FleetClient, FleetError
from tuner.measure.records import Measurement, Winner

log = logging.getLogger(__name__)


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


def service_restarted(
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
        service_restarted(client, store, scope, since, _feed_page(client, fp, since, 1)[1])


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
        if service_restarted(client, store, scope, cursor, last):
            cursor = 0
            continue
        if body is None:  # nobody of this class has reported yet
            break
        rows = _winner_rows(body["columns"], body["rows"])
        if rows:
            if not total:  # the device they were served for, as a tune here saves it: what
                store.save_device(fp)  # `report --device-class` reads, and an export carries
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
    # the position written back as it is before anything is sent: a cache that cannot keep
    # what was pushed (read-only) refuses here, where sending first would send it all again
    # at every push
    store.set_position(name, store.position(name), store.mark(name))
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

"""The fleet service end to end: a real uvicorn on loopback, hosts with separate cache files.

Host A tunes (the CPU path of the real engine) and pushes; host B pulls and dispatches A's winner;
B's misses reach the queue, a worker claims and completes them, and B's background sync brings
the winner back; leases expire; a poisoned submission is held, not served.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.live import ThreadServer, backup, restore, wait_until
from server.store import FleetStore
from tests.cache.read_only import read_only
from tuner.cache import ReadOnlyError, Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, parse_key
from tuner.fleet.background import attach
from tuner.fleet.client import CompletedEarlier, FleetClient
from tuner.fleet.sync import pull, push, push_misses
from tuner.measure.records import Measurement
from tuner.serving.dispatcher import Dispatcher
from tuner.tuning.engine import TuneOptions, TuneOutcome, tune

pytestmark = pytest.mark.timeout(180)
FP = fingerprint()
DC, VERSIONS = FP.device_class, FP.version_tag


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ThreadServer]:
    with ThreadServer(tmp_path / "fleet.db") as srv:
        yield srv


def f32(m: int, n: int = 64, k: int = 64) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, dtype="f32", out_dtype="f32")


def tune_fast(key: GemmKey) -> TuneOutcome:
    """A real tuning run of torch's kernel only, on this host's device: on a busy 2-core box
    torch's timings swing enough that the (interpreted) Triton candidate can look 25% faster,
    which the merge would rightly hold for confirmation; these tests are about the flow, not
    that policy."""
    return tune(key, options=TuneOptions(budget_s=0.03, sources=["torch"]))


def made_up(key: GemmKey, source: str, us: float, **fields) -> Measurement:
    """A measurement as a (possibly lying) host would submit it."""
    params = {} if source == "torch" else {"bm": 16, "bn": 16, "bk": 16}
    return Measurement(
        DC, str(key), source, params, "ok", is_baseline=source == "torch", median_us=us,
        p10_us=us * 0.99, p90_us=us * 1.01, reps=100, versions=VERSIONS, **fields,
    )  # fmt: skip


def feed_rows(page: dict) -> list[dict]:
    return [dict(zip(page["columns"], row, strict=True)) for row in page["rows"]]


def resolution(d: Dispatcher, key: GemmKey, kind: str):
    return next((r for r in d.resolutions.values() if r.key == str(key) and r.kind == kind), None)


def test_host_b_dispatches_the_winner_host_a_pushed(fleet: ThreadServer, tmp_path: Path) -> None:
    key = f32(48)
    with Store(tmp_path / "a.db") as a, fleet.client("host-a", "submit") as ca:
        outcome = tune_fast(key)
        a.save_device(FP)
        a.save_run(outcome.measurements, outcome.winner)
        sent = push(ca, a, FP)
        assert sent.accepted == len(outcome.measurements) and sent.duplicates == 0
        assert push(ca, a, FP).accepted == 0  # incremental: nothing new to send
    with Store(tmp_path / "b.db") as b, fleet.client("host-b", "read") as cb:
        assert pull(cb, b, FP).winners == 1
        got = b.winner(DC, str(key))
        assert got is not None
        assert (got.candidate, got.run_id) == (outcome.winner.candidate, outcome.winner.run_id)
        assert pull(cb, b, FP).winners == 0  # nothing changed since
    d = Dispatcher(store_path=tmp_path / "b.db", mode="lookup")
    x, y = torch.randn(48, 64, device=FP.kind), torch.randn(64, 64, device=FP.kind)
    torch.testing.assert_close(d.matmul(x, y), x @ y)
    hit = resolution(d, key, "hit")
    assert hit is not None and hit.winner.run_id == outcome.winner.run_id


def test_a_miss_goes_through_the_queue_and_comes_back_as_a_winner(
    fleet: ThreadServer, tmp_path: Path
) -> None:
    key = f32(40, 24, 56)
    d = Dispatcher(store_path=tmp_path / "b.db", mode="record")
    sync = attach(d, client=fleet.client("host-b", "read"), interval_s=0.2)
    assert sync is not None
    try:
        x, y = torch.randn(40, 56, device=FP.kind), torch.randn(56, 24, device=FP.kind)
        torch.testing.assert_close(d.matmul(x, y), x @ y)  # no winner yet: torch, miss recorded
        assert resolution(d, key, "miss") is not None
        worker = fleet.client("worker", "submit")
        # B's background thread reports the miss; it shows up queued
        wait_until(lambda: [e for e in worker.queue(state="queued") if e["key"] == str(key)])
        lease = worker.claim(FP, "worker-1", max_keys=5)
        assert lease.keys == [str(key)] and lease.lease_id
        measurements = [m for k in lease.keys for m in tune_fast(parse_key(k)).measurements]
        done = worker.complete(lease.lease_id, FP, measurements)
        assert done["done"] == [str(key)] and done["served"] == [str(key)]
        assert not done["lease_expired"] and not done["requeued"]
        assert [e["key"] for e in worker.queue(state="done")] == [str(key)]

        def hit_after_reload():
            d.matmul(x, y)
            return resolution(d, key, "hit")

        hit = wait_until(hit_after_reload)  # pulled in the background, dispatcher reloaded
        assert hit.winner.key == str(key)
    finally:
        sync.stop()
    assert sync.last_error is None and sync.syncs >= 1


def test_an_expired_lease_returns_its_keys(fleet: ThreadServer) -> None:
    keys = [str(f32(8 * i, 32, 32)) for i in (1, 2, 3)]
    fleet.client("host-b", "read").report_misses(FP, [(k, 1) for k in keys])
    w1, w2 = fleet.client("w1", "submit"), fleet.client("w2", "submit")
    first = w1.claim(FP, "w1", max_keys=10, lease_s=1)
    assert sorted(first.keys) == sorted(keys)
    assert w2.claim(FP, "w2").keys == []  # all leased
    time.sleep(1.2)  # w1 "dies"
    assert {e["key"] for e in w2.queue(state="queued")} == set(keys)  # readers see them back
    second = w2.claim(FP, "w2", max_keys=10, lease_s=60)
    assert sorted(second.keys) == sorted(keys)
    # w1 comes back late: its results are kept and serve a winner, the keys are w2's now
    late = w1.complete(first.lease_id, FP, tune_fast(parse_key(keys[0])).measurements)
    assert late["lease_expired"] and late["accepted"] > 0 and late["served"] == [keys[0]]
    assert late["done"] == late["requeued"] == []
    # w2 only manages one of its other two keys; the third goes back to the queue
    last = w2.complete(second.lease_id, FP, tune_fast(parse_key(keys[1])).measurements)
    assert sorted(last["done"]) == sorted(keys[:2]) and last["requeued"] == [keys[2]]
    with pytest.raises(Exception, match="already completed"):
        w2.complete(second.lease_id, FP, [])


def test_a_completion_whose_answer_was_lost_is_told_completed_on_its_resend(
    tmp_path: Path,
) -> None:
    """The service stores a lease's completion, but its answer comes after the client's
    timeout (a slow network): the resend is refused as already completed, which the client
    tells as ``CompletedEarlier``, not as a failure. A completion answered in time is told as
    the service said it."""
    srv = ThreadServer(tmp_path / "fleet.db")
    late = threading.Event()

    @srv.app.middleware("http")
    async def first_completion_answered_late(request, call_next):
        response = await call_next(request)  # stored by now
        if request.url.path == "/v1/queue/complete" and not late.is_set():
            late.set()
            await asyncio.sleep(1.0)
        return response

    with srv:
        keys = [str(f32(8, 16, 16)), str(f32(16, 16, 16))]
        srv.client("host", "read").report_misses(FP, [(k, 1) for k in keys])
        client = FleetClient(srv.url, srv.token("w", "submit"), timeout_s=0.3, retries=8,
                             backoff_s=0.2)  # fmt: skip
        first = client.claim(FP, "w", max_keys=1)
        measurements = tune_fast(parse_key(first.keys[0])).measurements
        with pytest.raises(CompletedEarlier, match="completed by a try whose answer was lost"):
            client.complete(first.lease_id, FP, measurements)
        with FleetStore(srv.db) as store:  # the first try's measurements are stored
            assert store.db["srv_measurements"].count == len(measurements)
        second = client.claim(FP, "w", max_keys=1)
        assert client.complete(second.lease_id, FP, [])["requeued"] == second.keys


def test_a_key_that_keeps_failing_is_not_handed_out_forever(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db", max_attempts=2) as srv:
        key = str(f32(16, 16, 16))
        srv.client("host", "read").report_misses(FP, [(key, 3)])
        w = srv.client("w", "submit")
        assert w.claim(FP, "w", lease_s=1).keys == [key]
        time.sleep(1.1)  # lease 1 runs out
        lease = w.claim(FP, "w", lease_s=60)
        assert lease.keys == [key]
        assert w.complete(lease.lease_id, FP, [])["failed"] == [key]  # attempt 2, no result
        assert w.claim(FP, "w").keys == []
        assert [e["state"] for e in w.queue()] == ["failed"]


def test_a_poisoned_submission_does_not_change_the_served_winner(
    fleet: ThreadServer, tmp_path: Path
) -> None:
    key = f32(56)
    honest = tune_fast(key)
    ca = fleet.client("host-a", "submit")
    ca.submit(FP, honest.measurements)
    served = ca.winner(DC, str(key), VERSIONS)
    assert served["candidate"] == honest.winner.candidate
    base_us = served["baseline_us"]
    evil = fleet.client("evil-host", "submit")
    claim = [made_up(key, "torch", base_us), made_up(key, "triton_gemm", base_us / 100)]
    out = evil.submit(FP, claim)
    assert out["pending"] == [str(key)] and out["served"] == []
    # repeating the lie 20 times is still one voice
    flood = [made_up(key, "triton_gemm", base_us / 100) for _ in range(20)]
    assert evil.submit(FP, flood)["pending"] == [str(key)]
    # and claiming the served kernel is 1000x slower is held too
    evil.submit(FP, [made_up(key, honest.winner.source, base_us * 1000)])
    with Store(tmp_path / "b.db") as b, fleet.client("host-b", "read") as cb:
        pull(cb, b, FP)
        got = b.winner(DC, str(key))
        assert (got.candidate, got.run_id) == (honest.winner.candidate, honest.winner.run_id)
        pending = cb.request("GET", "/v1/pending")
    assert [p["key"] for p in pending] == [str(key)]
    assert pending[0]["supporters"] == [evil.http.headers["authorization"].split("_")[1]]


def test_a_large_change_is_served_once_confirmed(fleet: ThreadServer) -> None:
    key = f32(24)
    claim = lambda: [made_up(key, "torch", 100.0), made_up(key, "triton_gemm", 20.0)]  # noqa: E731
    a, c = fleet.client("host-a", "submit"), fleet.client("host-c", "submit")
    assert a.submit(FP, claim())["pending"] == [str(key)]
    assert a.winner(DC, str(key)) is None  # nothing served yet: a new key starts at baseline
    assert c.submit(FP, claim())["served"] == [str(key)]  # a second host confirms
    assert a.winner(DC, str(key))["source"] == "triton_gemm"
    # an admin token's own results need no second host
    key2 = f32(72)
    admin = fleet.client("ops", "admin")
    out = admin.submit(FP, [made_up(key2, "torch", 100.0), made_up(key2, "triton_gemm", 20.0)])
    assert out["served"] == [str(key2)]
    # or an admin confirms a pending change by hand
    key3 = f32(80)
    a.submit(FP, [made_up(key3, "torch", 100.0), made_up(key3, "triton_gemm", 20.0)])
    group = {"device_class": DC, "versions": VERSIONS, "key": str(key3)}
    with pytest.raises(Exception, match="403"):
        a.request("POST", "/v1/pending/confirm", json=group)
    assert admin.request("POST", "/v1/pending/confirm", json=group)["candidate"].startswith(
        "triton_gemm"
    )
    assert a.winner(DC, str(key3))["source"] == "triton_gemm"


def test_results_of_other_versions_are_kept_apart(fleet: ThreadServer) -> None:
    key = f32(32)
    a = fleet.client("host-a", "submit")
    a.submit(FP, [made_up(key, "torch", 100.0)])
    old = [made_up(key, "torch", 100.0), made_up(key, "triton_gemm", 90.0)]
    for m in old:
        m.versions = "torch=1.0;tuner=0.0.1"
    assert a.submit(FP, old)["served"] == [str(key)]  # served, but for those versions only
    assert a.winner(DC, str(key), VERSIONS)["source"] == "torch"
    assert a.winner(DC, str(key), "torch=1.0;tuner=0.0.1")["source"] == "triton_gemm"
    assert [w["source"] for w in feed_rows(a.feed(DC, VERSIONS, 0))] == ["torch"]
    assert len(a.feed(DC, None, 0)["rows"]) == 2


def test_the_feed_is_incremental_by_sequence_number(fleet: ThreadServer, tmp_path: Path) -> None:
    a = fleet.client("host-a", "submit")
    keys = [f32(8 * i, 8, 8) for i in range(1, 26)]
    a.submit(FP, [made_up(k, "torch", 10.0) for k in keys])
    pages, cursor = [], 0
    while True:
        page = a.feed(DC, VERSIONS, cursor, limit=10)
        pages.append(len(page["rows"]))
        cursor = page["cursor"]
        if not page["more"]:
            break
    assert pages == [10, 10, 5]
    with Store(tmp_path / "b.db") as b:
        assert pull(a, b, FP).winners == 25
        assert pull(a, b, FP).winners == 0
        # a changed winner comes again, under a new sequence number
        changed = a.submit(FP, [made_up(keys[0], "triton_gemm", 9.0)])
        assert changed["served"] == [str(keys[0])]
        again = pull(a, b, FP)
        assert again.winners == 1 and again.cursor == 26
        assert b.winner(DC, str(keys[0])).source == "triton_gemm"
        assert pull(a, b, FP, full=True).winners == 25


def documented_examples(node: Any) -> Iterator[tuple[str, str]]:
    """(pattern, example) of every part of an OpenAPI spec that has a pattern and examples, or
    a description that gives one ("e.g. ...")."""
    if isinstance(node, dict):
        schema = node.get("schema", node)
        if isinstance(schema, dict) and "pattern" in schema:
            said = re.findall(r"e\.g\. (\S+)", node.get("description", ""))
            for example in [*schema.get("examples", []), *said]:
                yield schema["pattern"], example
        for value in node.values():
            yield from documented_examples(value)
    elif isinstance(node, list):
        for value in node:
            yield from documented_examples(value)


def test_lookup_batch_health_ready_metrics_docs(fleet: ThreadServer) -> None:
    a = fleet.client("host-a", "submit")
    keys = [str(f32(8 * i, 8, 8)) for i in (1, 2)]
    a.submit(FP, [made_up(parse_key(keys[0]), "torch", 10.0)])
    found = a.lookup(DC, VERSIONS, keys)
    assert [w["key"] for w in found["winners"]] == [keys[0]] and found["missing"] == [keys[1]]
    health = httpx.get(fleet.url + "/v1/health").json()
    assert health["status"] == "ok" and len(health["service_id"]) == 32
    assert httpx.get(fleet.url + "/v1/ready").json()["status"] == "ready"
    assert "swagger" in httpx.get(fleet.url + "/docs").text.lower()
    spec = httpx.get(fleet.url + "/openapi.json").json()
    assert "/v1/winners/{device_class}/feed" in spec["paths"]
    examples = list(documented_examples(spec))  # what /docs shows passes the API's own checks
    assert ("^(cuda|cpu)-[a-z0-9][a-z0-9-]{0,199}$", "cpu-x86-64-2c") in examples
    assert all(re.fullmatch(pattern, example) for pattern, example in examples), examples
    text = httpx.get(fleet.url + "/metrics").text
    assert 'tuner_measurements_total{result="accepted"} 1.0' in text
    assert 'route="/v1/winners/{device_class}/lookup"' in text
    assert "tuner_served_winners 1.0" in text


def test_reads_can_be_open(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db", open_reads=True) as srv:
        srv.client("host-a", "submit").submit(FP, [made_up(f32(8, 8, 8), "torch", 10.0)])
        anonymous = FleetClient(srv.url)
        assert len(anonymous.feed(DC, VERSIONS, 0)["rows"]) == 1
        with pytest.raises(Exception, match="401"):  # writes still need a token
            anonymous.submit(FP, [made_up(f32(16, 8, 8), "torch", 10.0)])


READS_BY_POST = {"/v1/winners/{device_class}/lookup", "/v1/artifacts/lookup"}


def test_open_reads_leave_every_write_needing_a_token(tmp_path: Path) -> None:
    """Every POST/PUT/DELETE route but the batch lookups writes something (a miss report only
    steers the queue, but anyone filling it could starve real misses): 401 without a token."""
    with ThreadServer(tmp_path / "fleet.db", open_reads=True) as srv:
        writes = [
            (method.upper(), path)
            for path, methods in srv.app.openapi()["paths"].items()
            for method in methods
            if method in ("post", "put", "delete") and path not in READS_BY_POST
        ]
        assert ("POST", "/v1/misses") in writes and len(writes) >= 6
        for method, path in writes:
            url = srv.url + path.format(device_class=DC, digest="0" * 64)
            r = httpx.request(method, url, json={})
            assert r.status_code == 401, (method, path, r.status_code, r.text)


def test_a_token_says_what_it_may_do_even_where_reads_are_open(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db", open_reads=True) as srv:
        token = srv.token("builder-1", "build")
        r = httpx.get(srv.url + "/v1/token", headers={"Authorization": f"Bearer {token}"})
        assert r.json() == {"id": token.split("_")[1], "name": "builder-1", "scopes": ["build"],
                            "allows": ["read", "submit", "build"]}  # fmt: skip
        assert httpx.get(srv.url + "/v1/token").status_code == 401


def test_a_tokens_voice_is_its_recent_results(fleet: ThreadServer) -> None:
    key = f32(88)
    a = fleet.client("host-a", "submit")
    a.submit(FP, [made_up(key, "torch", 100.0) for _ in range(40)])  # an old, slower driver
    assert a.winner(DC, str(key))["baseline_us"] == 100.0
    a.submit(FP, [made_up(key, "torch", 50.0) for _ in range(32)])  # the latest 32 runs
    assert a.winner(DC, str(key))["baseline_us"] == 50.0


def test_a_service_rebuilt_at_the_same_url_is_synced_from_the_start(tmp_path: Path) -> None:
    """A new (or restored) database behind the same URL: the hosts' positions with the old
    service do not carry over, so every measurement is pushed to it and its winner pulled."""
    key = f32(40)
    outcome = tune_fast(key)
    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        a.save_device(FP)
        a.save_run(outcome.measurements, outcome.winner)
        with ThreadServer(tmp_path / "old.db") as old:
            port = int(old.url.rsplit(":", 1)[1])
            with old.client("host-a", "submit") as ca, old.client("host-b", "read") as cb:
                assert push(ca, a, FP).accepted == len(outcome.measurements)
                assert pull(cb, b, FP).winners == 1
        with ThreadServer(tmp_path / "new.db", port=port) as new:
            assert new.url == old.url
            with new.client("host-a", "submit") as ca, new.client("host-b", "read") as cb:
                assert push(ca, a, FP).accepted == len(outcome.measurements)
                assert push(ca, a, FP).accepted == 0  # and incremental again from there
                assert pull(cb, b, FP).winners == 1


@pytest.mark.parametrize("kept", [0, 1], ids=["backup-before-any-result", "backup-of-one"])
def test_a_service_restored_from_an_older_backup_is_synced_from_the_start(
    kept: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restored file keeps the service's id, so the hosts keep their positions with it: past
    the measurements it lost (which no push would send again) and past its winner counter
    (which would hand the next winners numbers the hosts have passed). The feed's `last` gives
    it away to a host that knows only its position, and the last measurement host A pushed,
    which it no longer holds, to A: the hosts sync with it from the start, and what it lost
    comes back."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    results = [made_up(f32(24), "torch", 10.0), made_up(f32(32), "torch", 10.0)]
    lost = len(results) - kept
    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        a.save_device(FP)
        with ThreadServer(db) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            tokens = {"a": srv.token("host-a", "submit"), "b": srv.token("host-b", "read")}
            ca, cb = FleetClient(srv.url, tokens["a"]), FleetClient(srv.url, tokens["b"])
            for i, m in enumerate(results):
                if i == kept:
                    backup(db, saved)
                a.save_run([m])
                assert push(ca, a, FP).accepted == 1  # host A syncs: pushes, then pulls
                pull(ca, a, FP)
                assert pull(cb, b, FP).winners == 1  # host B only pulls
            name = f"pull:{cb.sync_scope()}:{DC}:{VERSIONS}"
            b.set_position(name, b.position(name))  # B's kept as before marks: a position alone
        restore(db, saved)
        with ThreadServer(db, port=port) as srv:
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                assert pull(cb, b, FP).winners == kept
                assert push(ca, a, FP).accepted == lost  # a push alone finds it too
            assert (
                f"fleet service {srv.url} is at sequence number {kept}, behind this host's "
                "position 2 with it (restored from an older backup?)"
            ) in caplog.text
            assert (
                f"fleet service {srv.url} no longer holds measurement {results[1].uid}, pushed "
                "to it (restored from an older backup?)"
            ) in caplog.text
            assert pull(cb, b, FP).winners == lost  # the winners come back
            assert {w["key"] for w in feed_rows(cb.feed(DC, VERSIONS, 0))} == {
                m.key for m in results
            }
            assert push(ca, a, FP).accepted == 0  # and incremental again from there
            assert pull(cb, b, FP).winners == 0


def service_counts(db: Path) -> tuple[int, list[tuple]]:
    """The service's stored measurements, and its per-candidate aggregates' counts."""
    with FleetStore(db) as s:
        (n,) = s.db.conn.execute("select count(*) from srv_measurements").fetchone()
        counts = s.db.conn.execute(
            "select key, candidate, count, submitters from srv_results order by key, candidate"
        ).fetchall()
    return n, counts


def pulled_then_restored(
    db: Path, saved: Path, keys: list, b: Store
) -> tuple[int, FleetClient, FleetClient]:
    """A service that served ``keys`` (sequence numbers 1 and 2), backed up after the first,
    host B pulled both, then the backup restored: (its port, host A's client, host B's)."""
    with ThreadServer(db) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        ca, cb = srv.client("host-a", "submit"), srv.client("host-b", "read")
        ca.submit(FP, [made_up(keys[0], "torch", 10.0)])  # sequence number 1
        backup(db, saved)
        ca.submit(FP, [made_up(keys[1], "torch", 10.0)])  # 2: lost with the restore
        assert pull(cb, b, FP).winners == 2
    restore(db, saved)
    return port, ca, cb


def pull_finds_the_restore(
    cb: FleetClient, b: Store, caplog: pytest.LogCaptureFixture, url: str, lost: object
) -> None:
    """Host B's pull finds that the service no longer serves ``lost`` as B pulled it (at
    sequence number 2) and syncs its three winners from the start."""
    with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
        assert pull(cb, b, FP).winners == 3
    assert (
        f"fleet service {url} no longer serves {lost} as this host pulled it, at "
        "sequence number 2 (restored from an older backup?)"
    ) in caplog.text


@pytest.mark.parametrize("after", ["other-keys", "the-same-key"])
def test_a_restored_service_past_the_hosts_position_is_synced_from_the_start(
    after: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """New results on a restored service take its latest sequence number past a host's
    position, so `last` no longer gives the restore away (the host pulled from there on and
    never got the winners numbered up to its position). The winner at its position does:
    gone, or served under the same number at another time."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    keys = [f32(24), f32(32)]
    later = [f32(40), f32(48)] if after == "other-keys" else [keys[1], f32(40)]
    with Store(tmp_path / "b.db") as b:
        port, ca, cb = pulled_then_restored(db, saved, keys, b)
        with ThreadServer(db, port=port) as srv:
            ca.submit(FP, [made_up(k, "torch", 20.0) for k in later])  # 2 and 3 again
            assert cb.feed(DC, VERSIONS, 0)["last"] == 3
            pull_finds_the_restore(cb, b, caplog, srv.url, keys[1])
            served = {w["key"]: w["baseline_us"] for w in feed_rows(cb.feed(DC, VERSIONS, 0))}
            assert {w.key: w.baseline_us for w in b.winners(DC)} == {
                **served,
                **({str(keys[1]): 10.0} if after == "other-keys" else {}),
            }
            caplog.clear()
            assert pull(cb, b, FP).winners == 0  # and incremental again from there
            assert "restored" not in caplog.text


def test_a_restored_service_that_served_the_hosts_winner_again_since_is_synced_from_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The winner a host pulled last, served again by a restored service under a later number,
    looks like one changed since: the winner as served now cannot tell. The service's log of
    servings can: under the host's position it holds another serving (or none), so the host
    syncs from the start and gets the winner it skipped."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    keys = [f32(24), f32(32)]
    with Store(tmp_path / "b.db") as b:
        port, ca, cb = pulled_then_restored(db, saved, keys, b)  # B's mark: keys[1] at 2
        with ThreadServer(db, port=port) as srv:
            ca.submit(FP, [made_up(f32(40), "torch", 20.0)])  # 2 again, another key
            ca.submit(FP, [made_up(keys[1], "torch", 20.0)])  # 3: B's winner again, later
            served = cb.winner(DC, str(keys[1]), VERSIONS)
            assert served is not None and served["seq"] == 3  # as served, it looks changed since
            pull_finds_the_restore(cb, b, caplog, srv.url, keys[1])
            assert b.winner(DC, str(f32(40))) is not None  # the one numbered 2 now
            caplog.clear()
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                assert pull(cb, b, FP).winners == 0  # and incremental again from there
            assert "restored" not in caplog.text


@pytest.mark.parametrize("log", ["servings-log", "service-without-log", "a-later-release-log"])
def test_a_winner_served_again_by_a_service_that_lost_nothing_is_pulled_incrementally(
    log: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The winner a host pulled last, changed since under a later number by a service that
    lost nothing, is no restore: its serving under the host's position is in the log as pulled
    (or, from a service keeping no log, the winner is served under a later number). A later
    release's log may say more of a serving: only key, versions and date are compared."""
    if log == "service-without-log":  # a service too old to keep a log answers 404
        monkeypatch.setattr(FleetClient, "served_at", lambda self, device_class, seq: None)
    if log == "a-later-release-log":
        served_at = FleetClient.served_at

        def with_more(self: FleetClient, device_class: str, seq: int) -> dict | None:
            found = served_at(self, device_class, seq)
            if found and found["served"]:
                found["served"]["source"] = "triton_gemm"
            return found

        monkeypatch.setattr(FleetClient, "served_at", with_more)
    keys = [f32(24), f32(32)]
    with Store(tmp_path / "b.db") as b, ThreadServer(tmp_path / "fleet.db") as srv:
        ca, cb = srv.client("host-a", "submit"), srv.client("host-b", "read")
        ca.submit(FP, [made_up(k, "torch", 10.0) for k in keys])  # 1 and 2
        assert pull(cb, b, FP).winners == 2  # B's mark: keys[1] at 2
        if log == "servings-log":
            assert cb.served_at(DC, 2) == {
                "seq": 2, "log_from": 0,
                "served": {"key": str(keys[1]), "versions": VERSIONS,
                           "updated_at": cb.winner(DC, str(keys[1]), VERSIONS)["updated_at"]},
            }  # fmt: skip
        ca.submit(FP, [made_up(keys[1], "triton_gemm", 9.0)])  # 3: B's winner, changed
        ca.submit(FP, [made_up(f32(40), "torch", 10.0)])  # 4
        assert cb.winner(DC, str(keys[1]), VERSIONS)["seq"] == 3
        with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
            assert pull(cb, b, FP).winners == 2
            assert pull(cb, b, FP).winners == 0
        assert "restored" not in caplog.text
        assert b.winner(DC, str(keys[1])).source == "triton_gemm"


def test_a_push_only_host_pushes_again_to_a_service_that_lost_its_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A host that never pulls has no pull position to compare with the service's: it asks
    whether the service still holds the last measurement it pushed. A restored one does not,
    and gets everything again; what it kept counts as duplicates, never twice."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    ms = [made_up(f32(24), "torch", 10.0), made_up(f32(32), "torch", 10.0)]
    with Store(tmp_path / "a.db") as a:
        a.save_device(FP)
        with ThreadServer(db) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            ca = srv.client("host-a", "submit")
            a.save_run(ms[:1])
            assert push(ca, a, FP).accepted == 1
            backup(db, saved)
            a.save_run(ms[1:])
            assert push(ca, a, FP).accepted == 1
        restore(db, saved)
        with ThreadServer(db, port=port) as srv:
            assert (ca.holds(ms[0].uid), ca.holds(ms[1].uid)) == (True, False)
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                out = push(ca, a, FP)
            assert (out.accepted, out.duplicates) == (1, 1)
            assert (
                f"fleet service {srv.url} no longer holds measurement {ms[1].uid}, pushed to it "
                "(restored from an older backup?)"
            ) in caplog.text
            assert ca.holds(ms[1].uid) and ca.winner(DC, ms[1].key, VERSIONS) is not None
            assert service_counts(db)[0] == 2
            again = push(ca, a, FP)
            assert (again.accepted, again.duplicates) == (0, 0)  # incremental again


def test_measurements_pushed_again_are_not_counted_twice(fleet: ThreadServer, tmp_path: Path):
    """A host that starts over pushes everything again: the service keeps each measurement
    once, by its uid, so its counts and the merge see no difference."""
    ms = [made_up(f32(24), "torch", 10.0 + i) for i in range(3)]
    ms += [made_up(f32(32), "torch", 10.0)]
    with Store(tmp_path / "a.db") as a:
        a.save_device(FP)
        a.save_run(ms)
        ca = fleet.client("host-a", "submit")
        assert push(ca, a, FP).accepted == 4
        before = service_counts(fleet.db)
        assert before == (4, [(str(f32(24)), "torch", 3, 1), (str(f32(32)), "torch", 1, 1)])
        a.reset_positions(ca.sync_scope())
        again = push(ca, a, FP)
        assert (again.accepted, again.duplicates) == (0, 4)
        assert service_counts(fleet.db) == before


def test_a_measurement_is_found_by_uid_with_a_read_token(fleet: ThreadServer) -> None:
    m = made_up(f32(24), "torch", 10.0)
    fleet.client("host-a", "submit").submit(FP, [m])
    url = fleet.url + "/v1/measurements"
    assert httpx.get(url, params={"uid": m.uid}).status_code == 401
    reader = fleet.client("ops", "read")
    (found,) = reader.request("GET", "/v1/measurements", params={"uid": m.uid})
    assert (found["uid"], found["device_class"], found["key"]) == (m.uid, DC, m.key)
    assert reader.holds(m.uid) is True and reader.holds("0" * 32) is False


def work_after_backup(store: Store, missed: str) -> None:
    """A run and three misses of ``missed`` recorded after the backup: what a restore loses."""
    store.save_run([made_up(f32(24), "torch", 10.0)])
    store.record_misses(DC, [missed], count=3)


def test_miss_counts_a_restored_service_lost_are_sent_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reported marker of each miss count is forgotten with the positions: the counts a
    restored service lost are sent in full again (a count its backup held would be counted
    twice; only the queue's order hangs on it)."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    missed = str(f32(56))
    with Store(tmp_path / "a.db") as a:
        a.save_device(FP)
        with ThreadServer(db) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            ca = srv.client("host-a", "submit")
            backup(db, saved)
            work_after_backup(a, missed)
            assert push(ca, a, FP).misses == 1
            pull(ca, a, FP)
            assert [(e["key"], e["misses"]) for e in ca.queue()] == [(missed, 3)]
        restore(db, saved)
        with ThreadServer(db, port=port) as srv:
            assert ca.queue() == []
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                out = push(ca, a, FP)
            assert "(restored from an older backup?)" in caplog.text
            assert (out.accepted, out.misses, out.queued) == (1, 1, 1)
            assert [(e["key"], e["misses"]) for e in ca.queue()] == [(missed, 3)]
            assert push(ca, a, FP).misses == 0  # and only what is new from there


def test_a_read_only_cache_reports_its_misses_never(tmp_path: Path) -> None:
    """A cache that cannot keep what it reported (read-only) reports nothing: were the counts
    sent first, every sync would send them again."""
    with Store(tmp_path / "a.db") as a:
        a.save_device(FP)
        a.record_misses(DC, [str(f32(56))], count=3)
    with (
        read_only(tmp_path / "a.db"),
        Store(tmp_path / "a.db") as a,
        ThreadServer(tmp_path / "fleet.db") as srv,
    ):
        ca = srv.client("host-a", "submit")
        for _ in range(2):
            with pytest.raises(ReadOnlyError):
                push_misses(ca, a, FP)
        assert ca.queue() == []


def test_a_failed_miss_report_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report the service never got (the connection dropped mid-sync) takes its marks back:
    the next sync sends the counts in full, once."""
    missed = str(f32(56))
    with Store(tmp_path / "a.db") as a, ThreadServer(tmp_path / "fleet.db") as srv:
        a.save_device(FP)
        a.record_misses(DC, [missed], count=3)
        ca = srv.client("host-a", "submit")

        def dropped(fp: object, counts: object) -> int:
            raise httpx.ConnectError("connection dropped")

        with monkeypatch.context() as m:
            m.setattr(ca, "report_misses", dropped)
            with pytest.raises(httpx.ConnectError):
                push_misses(ca, a, FP)
        assert a.unreported_misses(DC, service=ca.sync_scope()) == [(missed, 3, 3)]
        assert push_misses(ca, a, FP) == (1, 1)
        assert [(e["key"], e["misses"]) for e in ca.queue()] == [(missed, 3)]
        assert push_misses(ca, a, FP) == (0, 0)


def test_one_service_reached_by_two_urls_is_one_sync_scope(tmp_path: Path) -> None:
    """Positions and miss reports are the service's (by its id), not its URL's: pushing through
    127.0.0.1 and then localhost sends nothing twice. Those an older release kept under a URL
    move to the id at the next sync, the further of two positions kept."""
    missed = str(f32(56))
    with Store(tmp_path / "a.db") as a, ThreadServer(tmp_path / "fleet.db") as srv:
        a.save_device(FP)
        a.record_misses(DC, [missed], count=3)
        token = srv.token("host-a", "submit")
        by_ip, by_name = srv.url, srv.url.replace("127.0.0.1", "localhost")
        ca = FleetClient(by_ip, token)
        service = ca.health()["service_id"]
        old = [f"push:{url}#{service}" for url in (by_ip, by_name)]
        a.set_position(old[0], 0)
        a.set_position(old[1], 5, "uid-5")
        assert push_misses(ca, a, FP) == (1, 1)
        assert push_misses(FleetClient(by_name, token), a, FP) == (0, 0)
        assert [(e["key"], e["misses"]) for e in ca.queue()] == [(missed, 3)]
        scope = ca.sync_scope()
        assert scope == f"service-{service}" and FleetClient(by_name, token).sync_scope() == scope
        assert [a.position(n) for n in old] == [0, 0]
        assert (a.position(f"push:{scope}"), a.mark(f"push:{scope}")) == (5, "uid-5")


def test_a_restore_of_one_service_sends_the_miss_counts_again_to_it_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A host that syncs with two services reports every miss count to each, and keeps what
    it reported to each apart: finding one restored from an older backup, it sends that one
    its counts in full again, and the other, which lost nothing, only what is new since."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    missed = str(f32(56))

    def queued(client: FleetClient) -> list[tuple[str, int]]:
        return [(e["key"], e["misses"]) for e in client.queue()]

    with Store(tmp_path / "a.db") as a, ThreadServer(tmp_path / "other.db") as other:
        a.save_device(FP)
        co = other.client("host-a", "submit")
        with ThreadServer(db) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            ca = srv.client("host-a", "submit")
            backup(db, saved)
            work_after_backup(a, missed)
            for client in (ca, co):
                assert push(client, a, FP).misses == 1
                assert queued(client) == [(missed, 3)]
        restore(db, saved)
        a.record_misses(DC, [missed], count=2)  # missed again meanwhile
        with ThreadServer(db, port=port) as srv:
            assert ca.queue() == []
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                assert push(ca, a, FP).misses == 1
            assert "(restored from an older backup?)" in caplog.text
            assert queued(ca) == [(missed, 5)]  # all of it again
            assert push(co, a, FP).misses == 1
            assert queued(co) == [(missed, 5)]  # 3 + 2, not 3 + 5
            assert (push(ca, a, FP).misses, push(co, a, FP).misses) == (0, 0)

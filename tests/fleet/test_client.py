"""The fleet client when things go wrong: service down, silent, flaky; crashes mid-pull; and the
dispatcher, which must keep working from its local cache whatever the service does."""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from server.live import AppThread, ThreadServer, free_port, wait_until
from tuner.cache import ReadOnlyError, Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.fleet.background import BackgroundSync, attach
from tuner.fleet.client import FleetClient, FleetError, wire
from tuner.fleet.sync import pull, push, push_misses
from tuner.measure.records import Measurement, Winner
from tuner.serving.dispatcher import Dispatcher

pytestmark = pytest.mark.timeout(120)
FP = fingerprint()
DC = FP.device_class


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A port that accepts TCP connections and never answers (a hung service)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def flaky_app(failures: int, status: int) -> tuple[Starlette, list[int]]:
    """Answers ``status`` ``failures`` times, then 200: a real HTTP server for retry tests."""
    calls: list[int] = []

    async def health(request):
        calls.append(1)
        if len(calls) <= failures:
            return JSONResponse({"detail": "try later"}, status)
        return JSONResponse({"status": "ok"})

    async def ready(request):
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/health", health), Route("/ready", ready)]), calls


def sent_timeouts(client: FleetClient) -> list[dict[str, float]]:
    """The timeouts of each request ``client`` sends from now on (each try, retries included)."""
    sent: list[dict[str, float]] = []
    client.http.event_hooks["request"].append(lambda r: sent.append(r.extensions["timeout"]))
    return sent


def test_unreachable_service_fails_fast_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused: tried once and retried ``retries`` times, waiting only each retry's backoff
    (doubling, jittered by 0.5x to 1.5x), then a clear error."""
    client = FleetClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    sent, slept, sleep, me = sent_timeouts(client), [], time.sleep, threading.get_ident()

    def timed_sleep(seconds: float) -> None:
        if threading.get_ident() == me:
            slept.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", timed_sleep)
    with pytest.raises(FleetError, match="unreachable: ConnectError"):
        client.health()
    assert len(sent) == 3
    assert len(slept) == 2, slept
    assert all(0.5 * 0.05 * 2**i <= s <= 1.5 * 0.05 * 2**i for i, s in enumerate(slept)), slept


def test_a_silent_service_is_cut_off_by_the_timeout(silent_url: str) -> None:
    """Each try waits the client's timeout for an answer (not the default 10 s), and both the
    first and its retry end in a ReadTimeout."""
    client = FleetClient(silent_url, timeout_s=0.3, retries=1, backoff_s=0.05)
    sent = sent_timeouts(client)
    with pytest.raises(FleetError, match="ReadTimeout") as refused:
        client.health()
    assert [t["read"] for t in sent] == [0.3, 0.3]
    assert str(refused.value).endswith("(no answer within 0.3 s, 2 tries: the service is busy "
                                       "or stopped; --timeout or TUNER_SERVER_TIMEOUT waits longer)")  # fmt: skip


def test_retries_with_backoff_on_503_then_succeeds() -> None:
    app, calls = flaky_app(failures=2, status=503)
    with AppThread(app, health_path="/ready") as srv:
        assert FleetClient(srv.url, backoff_s=0.01).health() == {"status": "ok"}
    assert len(calls) == 3


def test_client_errors_are_not_retried() -> None:
    app, calls = flaky_app(failures=5, status=400)
    client_error = pytest.raises(FleetError, match="HTTP 400: try later")
    with AppThread(app, health_path="/ready") as srv, client_error as e:
        FleetClient(srv.url, backoff_s=0.01).health()
    assert e.value.status == 400 and len(calls) == 1


def counting_app(answers: list[tuple[float, int]]) -> tuple[Starlette, list[int]]:
    """Takes miss reports, each answered after the delay and with the status ``answers`` give
    in turn (the last one repeated); ``calls`` counts the reports it received."""
    import asyncio

    calls: list[int] = []

    async def misses(request):
        delay, status = answers[min(len(calls), len(answers) - 1)]
        calls.append(1)
        await asyncio.sleep(delay)
        return JSONResponse({"queued": 1} if status == 200 else {"detail": "x"}, status)

    async def ready(request):
        return JSONResponse({})

    routes = [Route("/v1/misses", misses, methods=["POST"]), Route("/ready", ready)]
    return Starlette(routes=routes), calls


@pytest.mark.parametrize(
    ("answers", "received", "outcome"),
    [
        ([(2.0, 200)], 1, "ReadTimeout"),  # counted, its reply lost: not sent again
        ([(0, 502)], 1, "HTTP 502"),  # a proxy's: the service may have counted it
        ([(0, 503), (0, 429), (0, 200)], 3, None),  # refused before counting: sent again
    ],
)
def test_a_miss_report_is_sent_again_only_where_it_was_not_counted(answers, received, outcome):
    """Miss counts add up on the service, so a report whose answer was lost (a timeout, a
    proxy's 502) is not sent again: that would count it twice. A refusal (503, 429) is."""
    app, calls = counting_app(answers)
    with AppThread(app, health_path="/ready") as srv:
        client = FleetClient(srv.url, timeout_s=0.5, retries=3, backoff_s=0.01)
        if outcome is None:
            assert client.report_misses(FP, [("gemm:m=1", 1)]) == 1
        else:
            with pytest.raises(FleetError, match=outcome):
                client.report_misses(FP, [("gemm:m=1", 1)])
    assert len(calls) == received


def test_the_dispatcher_does_not_wait_for_a_hung_service(silent_url: str, tmp_path: Path) -> None:
    d = Dispatcher(store_path=tmp_path / "host.db", mode="record")
    sync = attach(d, client=FleetClient(silent_url, timeout_s=60, retries=0), interval_s=0.1)
    try:
        time.sleep(0.2)  # the sync thread is now stuck in its request, for up to 60 s
        x, y = torch.randn(16, 32), torch.randn(32, 8)
        for _ in range(20):  # misses, resolution, store writes, hits: none waits for it
            torch.testing.assert_close(d.matmul(x, y), x @ y)
        assert sync.syncs == 0 and sync.failures == 0  # ... which is still waiting
    finally:
        sync.stop(timeout_s=0.1)


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A service under uvicorn whose every API call hangs until the test is over (then answers
    503, so that the server stops at once)."""
    import asyncio

    over = threading.Event()

    async def hang(request):
        while not over.is_set():
            await asyncio.sleep(0.02)
        return JSONResponse({"detail": "over"}, 503)

    async def ready(request):
        return JSONResponse({})

    routes = [Route("/ready", ready), Route("/v1/{path:path}", hang, methods=["GET", "POST"])]
    with AppThread(Starlette(routes=routes), health_path="/ready") as srv:
        try:
            yield srv.url
        finally:
            over.set()


def test_the_process_dispatchers_sync_waits_the_configured_timeout(
    hung_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher's background sync reads ``server_timeout`` (here from the config file):
    each try waits that long for a hung service's answer, not a fixed default."""
    from tuner.serving import dispatcher

    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'server = "{hung_url}"\nserver_timeout = 0.2\ncache = "{tmp_path / "host.db"}"\n'
    )
    monkeypatch.setenv("TUNER_CONFIG", str(cfg))
    for name in ("TUNER_SERVER", "TUNER_SERVER_TIMEOUT", "TUNER_CACHE", "TUNER_TOKEN"):
        monkeypatch.setenv(name, "")  # unset, so the file fills them; restored after the test
    monkeypatch.setattr(dispatcher, "_dispatcher", None)
    sync = dispatcher.get_dispatcher().fleet_sync
    started = time.monotonic()
    try:
        wait_until(lambda: sync.failures, timeout_s=8)  # 3 tries of 0.2 s, 2 backoffs
        assert "ReadTimeout" in sync.last_error
        assert time.monotonic() - started < 8
    finally:
        sync.stop(timeout_s=2)


def test_warmup_waits_the_configured_timeout_for_the_kernels_it_fetches(
    hung_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tuner warmup`` fetches this host's kernels (here a GPU host's, whose fingerprint is
    given) waiting ``TUNER_SERVER_TIMEOUT`` a try for a hung service, not the client's
    default."""
    from tuner.serving.warmup import WarmupReport, _fetch

    gpu = dataclasses.replace(FP, kind="cuda", compute_capability="9.0")  # a host with kernels
    monkeypatch.setenv("TUNER_SERVER", hung_url)
    monkeypatch.setenv("TUNER_SERVER_TIMEOUT", "0.2")
    monkeypatch.setenv("TUNER_ARTIFACTS", str(tmp_path / "kernels"))
    report = WarmupReport(gpu.device_class)
    started = time.monotonic()
    _fetch(Dispatcher(store_path=tmp_path / "host.db", mode="record"), gpu, report)
    assert time.monotonic() - started < 8  # 4 tries of 0.2 s, 3 backoffs
    assert "unreachable: ReadTimeout" in report.fetch_error  # warmup goes on without them


def test_outage_then_recovery_loses_no_miss(tmp_path: Path) -> None:
    port = free_port()
    client = FleetClient(f"http://127.0.0.1:{port}", retries=0, timeout_s=2)
    d = Dispatcher(store_path=tmp_path / "host.db", mode="record")
    x, y = torch.randn(24, 40, device=FP.kind), torch.randn(40, 8, device=FP.kind)  # served here
    key = str(GemmKey.from_tensors(x, y))
    with ThreadServer(tmp_path / "fleet.db", port=port) as srv:  # tokens need the db; then down
        client.http.headers["Authorization"] = f"Bearer {srv.token('host', 'read')}"
    sync = attach(d, client=client, interval_s=0.1)
    try:
        torch.testing.assert_close(d.matmul(x, y), x @ y)  # the miss is recorded locally
        wait_until(lambda: sync.failures >= 2)
        assert "unreachable" in sync.last_error
        with ThreadServer(tmp_path / "fleet.db", port=port) as srv:  # the service comes back
            sync.trigger()
            reader = srv.client("ops", "read")
            queued = wait_until(lambda: reader.queue(state="queued"))
            assert [(e["key"], e["misses"]) for e in queued] == [(key, 1)]
            wait_until(lambda: sync.last_error is None)
    finally:
        sync.stop()


def test_miss_reports_send_only_what_is_new(tmp_path: Path) -> None:
    k1, k2 = (str(GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32")) for m in (8, 16))
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        client = srv.client("host", "read")

        def counts() -> dict[str, int]:
            return {e["key"]: e["misses"] for e in client.queue()}

        store.record_misses(DC, [k1, k2])
        assert push_misses(client, store, FP) == (2, 2)
        assert push_misses(client, store, FP) == (0, 0)  # nothing new
        store.record_misses(DC, [k1], count=2)
        assert push_misses(client, store, FP) == (1, 0)
        assert counts() == {k1: 3, k2: 1}
        store.clear_misses(DC, [k1])  # e.g. tuned offline, then missed again later
        store.record_misses(DC, [k1])
        push_misses(client, store, FP)
        assert counts() == {k1: 4, k2: 1}


class Interrupted(FleetClient):
    """A client whose connection drops after ``pages`` feed pages (fault injection)."""

    def __init__(self, *args, pages: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pages = pages

    def feed(self, *args, **kwargs):
        if self.pages == 0:
            raise FleetError("connection dropped")
        self.pages -= 1
        return super().feed(*args, **kwargs)


def test_an_interrupted_pull_resumes_where_it_stopped(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        token = srv.token("host", "submit")
        keys = [str(GemmKey(m=8 * i, n=8, k=8, dtype="f32", out_dtype="f32")) for i in range(1, 31)]
        FleetClient(srv.url, token).submit(FP, [
            Measurement(DC, k, "torch", {}, "ok", is_baseline=True, median_us=5.0,
                        versions=FP.version_tag) for k in keys
        ])  # fmt: skip
        with pytest.raises(FleetError, match="dropped"):
            pull(Interrupted(srv.url, token, pages=2), store, FP, page=10)
        name = f"pull:{FleetClient(srv.url, token).sync_scope()}:{DC}:{FP.version_tag}"
        assert store.position(name) == 20 and len(store.winners(DC)) == 20
        resumed = pull(FleetClient(srv.url, token), store, FP, page=10)
        assert resumed.winners == 10 and len(store.winners(DC)) == 30
        assert store.fingerprint(DC) == FP  # the device they were served for, as a tune saves it


def test_a_pull_from_a_wrong_url_fails_while_an_unknown_class_pulls_nothing(tmp_path: Path):
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        token = srv.token("host", "read")
        assert pull(FleetClient(srv.url, token), store, FP).winners == 0  # nobody reported yet
        for wrong in (f"{srv.url}/nonsense", f"{srv.url}/api"):  # (/v1 is named at once)
            with pytest.raises(FleetError, match="no tuner service at this URL"):
                pull(FleetClient(wrong, token), store, FP)
            with pytest.raises(FleetError, match="no tuner service at this URL"):
                FleetClient(wrong, token).winner(DC, "gemm:m=1,n=8,k=8")


def test_measurements_the_service_refuses_by_index_do_not_block_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 422 naming measurements of a batch: they are counted as refused, with the service's
    reason, the rest stored and the push position moved on (kept put, every later push would
    be refused whole)."""
    keys = [str(GemmKey(m=8 * i, n=8, k=8, dtype="f32", out_dtype="f32")) for i in (1, 2, 3)]
    good = [Measurement(DC, k, "torch", {}, "ok", is_baseline=True, median_us=5.0,
                        versions=FP.version_tag) for k in keys[:2]]  # fmt: skip
    bad = [
        Measurement(DC, keys[2], "my source!", {}, "ok", median_us=4.0, versions=FP.version_tag),
        Measurement(DC, keys[2], "triton", {"x": "y" * 5000}, "ok", median_us=4.0,
                    versions=FP.version_tag),
    ]  # fmt: skip
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        store.save_device(FP)
        store.save_run([good[0], *bad, good[1]])
        client = srv.client("host", "submit")
        with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
            out = push(client, store, FP)
        assert (out.accepted, out.refused) == (2, 2)
        assert "(my source!): source: String should match pattern" in caplog.text
        assert "(triton): params: Value error, params must be at most 4000" in caplog.text
        page = client.feed(DC, FP.version_tag, 0)
        assert {row[page["columns"].index("key")] for row in page["rows"]} == set(keys[:2])
        again = push(client, store, FP)
        assert (again.accepted, again.duplicates, again.refused) == (0, 0, 0)


def test_a_push_from_a_read_only_cache_sends_nothing(tmp_path: Path) -> None:
    """A cache that cannot keep its push position is refused before anything is sent: sending
    first would send every measurement again at each push, each ending in the same error."""
    from tests.cache.read_only import read_only

    key = str(GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32"))
    with Store(tmp_path / "host.db") as store:
        store.save_device(FP)
        store.save_run([Measurement(DC, key, "torch", {}, "ok", is_baseline=True, median_us=5.0,
                                    versions=FP.version_tag)])  # fmt: skip
    with ThreadServer(tmp_path / "fleet.db") as srv, read_only(tmp_path / "host.db") as before:
        client = srv.client("host", "submit")
        with Store(tmp_path / "host.db") as store, pytest.raises(ReadOnlyError, match="read-only"):
            push(client, store, FP)
        with pytest.raises(FleetError, match="unknown device class"):  # nothing reached it
            client.feed(DC, FP.version_tag, 0)
        assert (tmp_path / "host.db").read_bytes() == before


def test_a_request_refused_for_want_of_a_token_says_how_to_give_one(tmp_path: Path) -> None:
    """A host that sent no token is told where one goes, not a bare HTTP 401."""
    with ThreadServer(tmp_path / "fleet.db") as srv:
        with pytest.raises(FleetError, match=r"^HTTP 401: .*\(no token was sent: pass --token or "
                           r"set TUNER_TOKEN\)$"):  # fmt: skip
            srv.client("host").feed(DC, FP.version_tag, 0)
        with pytest.raises(FleetError) as refused:
            FleetClient(srv.url, "tnr_0123456789ab_wrong").feed(DC, FP.version_tag, 0)
        assert refused.value.status == 401 and "no token was sent" not in str(refused.value)


def test_wire_form_has_no_nan() -> None:
    m = Measurement(DC, "gemm:m=1,n=8,k=8", "torch", {}, "rejected", max_rel_err=math.nan,
                    error="x" * 9000)  # fmt: skip
    w = wire(m)
    assert w["max_rel_err"] is None and len(w["error"]) == 4000


def test_background_sync_reports_refusals_but_still_pulls(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        store.save_run(
            [Measurement(DC, "gemm:m=8,n=8,k=8,dtype=f32,out_dtype=f32", "torch", {}, "ok",
                         is_baseline=True, median_us=5.0, versions=FP.version_tag)]
        )  # fmt: skip
        sync = BackgroundSync(srv.client("reader", "read"), tmp_path / "host.db")
        with pytest.raises(FleetError, match="push_measurements: HTTP 403"):
            sync.sync_once(store)
        assert sync.syncs == 1  # the pull ran although the push was refused


def test_another_servers_page_is_one_line_in_the_error() -> None:
    """--server naming some other web server: its status and content type, not its page."""
    from starlette.responses import HTMLResponse

    page = "<!DOCTYPE HTML>\n<html>\n<head><title>Error</title></head>\n<body>nope</body>\n</html>"

    async def anything(request):
        return HTMLResponse(page, 404)

    async def ready(request):
        return JSONResponse({})

    app = Starlette(routes=[Route("/ready", ready), Route("/{path:path}", anything)])
    with AppThread(app, health_path="/ready") as srv, pytest.raises(FleetError) as e:
        FleetClient(srv.url, retries=0).health()
    message = str(e.value)
    assert message == "HTTP 404 (text/html)"


@pytest.mark.parametrize(
    "interval",
    ["abc", "nan", "inf", "0", "-5", "0.01", "1e10"],  # 1e10: past threading.TIMEOUT_MAX
)
def test_a_sync_interval_that_is_not_usable_is_named_and_the_default_used(
    interval: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A typo must not leave the host without its sync, nor 0 or less make it loop with no
    wait, hammering the service: both are logged, naming the variable, and the default used."""
    monkeypatch.setenv("TUNER_SYNC_INTERVAL", interval)
    d = Dispatcher(store_path=tmp_path / "host.db", mode="record")
    with caplog.at_level("WARNING"):
        sync = attach(d, client=FleetClient(f"http://127.0.0.1:{free_port()}", retries=0))
    assert sync is not None
    try:
        assert sync.interval_s == 60.0
        assert (
            f"TUNER_SYNC_INTERVAL (environment variable) must be a number from 1 to 604800, "
            f"got '{interval}'; using 60.0 (the default)"
        ) in caplog.text
    finally:
        sync.stop()


def test_a_usable_sync_interval_is_taken_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TUNER_SYNC_INTERVAL", " 2.5 ")
    d = Dispatcher(store_path=tmp_path / "host.db", mode="record")
    with caplog.at_level("WARNING"):
        sync = attach(d, client=FleetClient(f"http://127.0.0.1:{free_port()}", retries=0))
    assert sync is not None
    try:
        assert sync.interval_s == 2.5 and "TUNER_SYNC_INTERVAL" not in caplog.text
    finally:
        sync.stop()


@pytest.mark.parametrize(
    ("server", "why"),
    [
        ("http://[::1", "not a valid URL"),
        ("http://localhost:abc", "not a valid URL: Invalid port: 'abc'"),
        ("http://localhost:99999", "port 99999 is not in 1-65535"),
        ("http://", "no host name"),
        ("localhost:8000", "expected an http:// or https:// URL"),
        ("http://localhost:8000/v1/", "give the service's base URL, without /v1"),
    ],
)
def test_a_malformed_server_url_is_named_with_why(server: str, why: str) -> None:
    with pytest.raises(ValueError) as e:
        FleetClient(server)
    assert str(e.value).startswith(f"--server/TUNER_SERVER {server!r}: ") and why in str(e.value)


def test_a_token_is_sent_without_surrounding_whitespace(tmp_path: Path) -> None:
    """A token read from a secret file keeps its newline: it is sent stripped, since as a header
    value it would be refused and reported as "service unreachable"."""
    with ThreadServer(tmp_path / "fleet.db") as srv:
        token = srv.token("host", "read")
        assert FleetClient(srv.url, f" {token}\n", retries=0).queue() == []
        # nor with the header's word, copied with it; nor a URL with a stray space
        assert FleetClient(f"{srv.url} ", f"Bearer {token}", retries=0).queue() == []


def test_https_to_the_plain_http_service_says_so(tmp_path: Path) -> None:
    with ThreadServer(tmp_path / "fleet.db") as srv:
        client = FleetClient(srv.url.replace("http://", "https://"), retries=0)
        with pytest.raises(FleetError, match="the service speaks plain http: give an http://"):
            client.health()


@pytest.mark.parametrize("bad", ["é", "\x00", "\u200b"])
def test_a_token_no_header_can_carry_is_named_not_shown(bad: str) -> None:
    token = f"tnr_0123456789ab_sec{bad}ret"
    with pytest.raises(ValueError, match=r"^--token/TUNER_TOKEN: character 21 ") as e:
        FleetClient("http://127.0.0.1:9", token)
    assert "sec" not in str(e.value)


def test_resetting_a_services_positions_leaves_other_services_alone(tmp_path: Path) -> None:
    scope, other = "http://h:80#1f2e", "http://h:80#1f2e0"
    names = [f"pull:{scope}:{DC}:v", f"push:{scope}", f"artifacts:{scope}:cuda:90",
             f"pull:{other}:{DC}:v", f"push:{other}", "push:http://h:8000#1f2e"]  # fmt: skip
    with Store(tmp_path / "host.db") as store:
        for name in names:
            store.set_position(name, 7)
        assert sorted(store.reset_positions(scope)) == sorted(names[:3])
        assert [store.position(n) for n in names] == [0, 0, 0, 7, 7, 7]


def test_a_pull_keeps_a_local_winner_newer_than_the_fleets(tmp_path: Path) -> None:
    """As ``tuner import`` does: a served winner replaces a local one older than it, and leaves
    one re-tuned here since alone."""
    old, new = (str(GemmKey(m=m, n=8, k=8, dtype="f32", out_dtype="f32")) for m in (8, 16))
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        client = srv.client("host", "submit")
        client.submit(FP, [
            Measurement(DC, k, "torch", {}, "ok", is_baseline=True, median_us=5.0,
                        versions=FP.version_tag) for k in (old, new)
        ])  # fmt: skip
        served = {k: client.winner(DC, k, FP.version_tag)["updated_at"] for k in (old, new)}
        local = {
            k: Winner(DC, k, "triton", {"bm": 16}, 4.0, 5.0, FP.version_tag) for k in (old, new)
        }
        local[old].updated_at = served[old] - 60.0  # tuned here before the fleet's
        local[new].updated_at = served[new] + 60.0  # re-tuned here since
        store.put_winners(local.values())
        assert pull(client, store, FP).winners == 2
        assert store.winner(DC, old).source == "torch"
        assert store.winner(DC, old).updated_at == served[old]
        assert store.winner(DC, new) == local[new]


def test_the_background_sync_serves_every_gpu_class_of_the_host(tmp_path: Path) -> None:
    """A host of two GPU models (``fingerprints``: one per class): each class's winners are
    pulled and its measurements pushed, in one round."""
    other = dataclasses.replace(FP, name="Other GPU", sm_count=FP.sm_count + 1)
    key = str(GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32"))
    with ThreadServer(tmp_path / "fleet.db") as srv, Store(tmp_path / "host.db") as store:
        srv.client("elsewhere", "submit").submit(FP, [
            Measurement(DC, key, "torch", {}, "ok", is_baseline=True, median_us=5.0,
                        versions=FP.version_tag)
        ])  # fmt: skip
        store.save_device(other)
        store.save_run([
            Measurement(other.device_class, key, "torch", {}, "ok", is_baseline=True,
                        median_us=7.0, versions=other.version_tag)
        ])  # fmt: skip
        client = srv.client("host", "submit")
        sync = BackgroundSync(client, tmp_path / "host.db", fingerprints=lambda: [FP, other])
        pulled = sync.sync_once(store)
        assert [r.winners for r in pulled] == [1, 1]  # the other's: pushed, then served back
        assert store.winner(DC, key).median_us == 5.0
        assert store.winner(other.device_class, key).median_us == 7.0
        assert client.winner(other.device_class, key, other.version_tag)["median_us"] == 7.0

"""Bad input gets a 4xx with a message naming what is wrong, never a 500 (real uvicorn)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import sqlite3
from collections.abc import Iterator

import httpx
import pytest

from server import tokens
from server.live import ThreadServer
from server.store import FleetStore
from tuner.core.device import fingerprint
from tuner.core.keys import parse_key
from tuner.fleet.client import wire
from tuner.measure.records import Measurement

pytestmark = pytest.mark.timeout(120)
FP = fingerprint()
DC = FP.device_class
KEY = "gemm:m=8,n=8,k=8,dtype=f32,out_dtype=f32"


@dataclasses.dataclass
class Env:
    url: str
    tokens: dict[str, str]  # role -> token


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    db = tmp_path_factory.mktemp("fleet") / "fleet.db"
    with ThreadServer(db, max_body_bytes=4 * 2**20) as srv:
        roles = {
            r: srv.token(r, s)
            for r, s in (
                ("reader", "read"),
                ("submitter", "submit"),
                ("other", "submit"),
                ("admin", "admin"),
            )
        }
        revoked = srv.token("gone", "submit")
        with FleetStore(db) as store:
            tokens.revoke(store, revoked.split("_")[1])
        roles["revoked"] = revoked
        ok = submit_body([measurement()])
        assert (
            httpx.post(
                srv.url + "/v1/measurements", json=ok, headers=auth(roles["submitter"])
            ).status_code
            == 200
        )
        yield Env(srv.url, roles)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def measurement(**changes) -> dict:
    m = Measurement(
        DC,
        KEY,
        "torch",
        {},
        "ok",
        is_baseline=True,
        median_us=10.0,
        p10_us=9.9,
        p90_us=10.1,
        reps=10,
        versions=FP.version_tag,
    )
    return wire(m) | changes


def submit_body(measurements: list[dict], **device_changes) -> dict:
    return {"device": FP.to_dict() | device_changes, "measurements": measurements}


def call(env: Env, method: str, path: str, role: str | None = "submitter", **kw) -> httpx.Response:
    headers = kw.pop("headers", {}) | (auth(env.tokens[role]) if role else {})
    return httpx.request(method, env.url + path, headers=headers, timeout=30, **kw)


def expect(r: httpx.Response, status: int, *needles: str) -> None:
    body = r.json()
    text = body.get("message") or body.get("detail") if isinstance(body, dict) else str(body)
    assert r.status_code == status, (r.status_code, body)
    for needle in needles:
        assert needle in str(text), (needle, text)


SUBMIT = "/v1/measurements"


@pytest.mark.parametrize(
    ("role", "headers", "status", "needle"),
    [
        (None, {}, 401, "needs a bearer token with scope 'submit'"),
        (None, {"Authorization": "Basic dXNlcjpwdw=="}, 401, "got a 'Basic' scheme"),
        (None, {"Authorization": "tnr_0123456789ab_x"}, 401, "got a bare value (no 'Bearer ')"),
        (None, {"Authorization": "Bearer"}, 401, "got 'Bearer' with no token after it"),
        (
            None,
            {"Authorization": "Bearer tnr_0123456789ab_wrong"},
            401,
            "invalid token '0123456789ab': unknown id or wrong secret",
        ),
        (
            None,
            {"Authorization": "Bearer not-a-token"},
            401,
            "invalid token: not of the form tnr_<id>_<secret>",
        ),
        ("revoked", {}, 401, "is revoked"),
        ("reader", {}, 403, "has scopes ['read']; this needs 'submit'"),
    ],
)
def test_tokens_are_checked(env: Env, role, headers, status, needle, caplog) -> None:
    with caplog.at_level("WARNING", logger="tuner.server"):
        r = call(env, "POST", SUBMIT, role, headers=headers, json=submit_body([measurement()]))
    expect(r, status, needle)
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    # the operator sees each refusal in the service's log, with its reason
    assert any(f"refused POST {SUBMIT} from 127.0.0.1: {status} " in m and needle.split("'")[0] in m
               for m in caplog.messages), caplog.messages  # fmt: skip


def test_a_refused_long_path_is_logged_cut_short(env: Env, caplog) -> None:
    """Anyone may send a path of any length: the refusal's log line holds a cut form of it."""
    from server.app import LOGGED_PATH

    path = "/v1/winners/" + "a" * 5000 + "/feed"
    with caplog.at_level("WARNING", logger="tuner.server"):
        r = call(env, "GET", path, None)
    assert r.status_code == 401
    (line,) = [m for m in caplog.messages if m.startswith("refused GET /v1/winners/aaa")]
    assert "a" * LOGGED_PATH not in line and len(line) < LOGGED_PATH + 200, len(line)


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ({"device": FP.to_dict(), "measurements": "abc"}, ["body.measurements", "list"]),
        (submit_body([measurement(status="great")]), ["status", "'ok'", "'rejected'"]),
        (submit_body([measurement(median_us="fast")]), ["median_us", "number"]),
        (submit_body([measurement(median_us=-1.0)]), ["median_us", "greater than or equal to 0"]),
        (submit_body([measurement(median_us=None)]), ["status 'ok' needs a positive median_us"]),
        (submit_body([measurement(p10_us=11.0)]), ["p10_us (11.0) must not exceed median_us"]),
        (submit_body([measurement(p90_us=1.0)]), ["median_us (10.0) must not exceed p90_us"]),
        (submit_body([measurement(key="gemm:m=0,n=8,k=8")]), ["m must be a positive integer"]),
        (
            submit_body(
                [measurement(key="sdpa:batch=1,q_heads=1,kv_heads=1,q_len=1,kv_len=1,head_dim=0")]
            ),
            ["invalid key"],
        ),
        (submit_body([measurement(key="conv:x=1")]), ["key must start with one of"]),
        (submit_body([measurement(uid="!")]), ["uid", "pattern"]),
        (submit_body([measurement(colour="red")]), ["colour", "Extra inputs"]),
        (submit_body([measurement(device_class="cpu-other-1c")]), ["does not match the device's"]),
        (submit_body([measurement()], name="!!!"), ["gives no usable device class"]),
        (submit_body([measurement()], device_class="cpu-x-1c"), ["does not match the fingerprint"]),
        (submit_body([measurement(params={"x": "y" * 5000})]), ["params must be at most 4000"]),
        (submit_body([measurement()] * 5001), ["at most 5000 items"]),
        ({"measurements": []}, ["body.device", "Field required"]),
    ],
)
def test_bad_submissions_name_the_problem(env: Env, body: dict, needles: list[str]) -> None:
    expect(call(env, "POST", SUBMIT, json=body), 422, *needles)


def test_a_result_flipping_its_candidates_baseline_flag_is_refused_and_the_rest_kept(
    env: Env,
) -> None:
    """torch was submitted as KEY's baseline (the module's first batch); a result saying it is
    not would leave the merge without a baseline. It alone is refused, named in the answer:
    the rest of its batch is stored, so a host's pushes (which resend a refused batch) go on."""
    flipped = measurement(is_baseline=False, median_us=11.0, p90_us=11.1)
    other = measurement(key="gemm:m=8,n=8,k=16,dtype=f32,out_dtype=f32")
    r = call(env, "POST", SUBMIT, json=submit_body([other, flipped]))
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.json()
    (why,) = r.json()["refused"]
    assert why.startswith("measurements.1.is_baseline=false: candidate 'torch' of")
    assert "was submitted with is_baseline=true before" in why
    again = call(env, "POST", SUBMIT, json=submit_body([other, flipped]))
    assert again.json()["duplicates"] == 1 and len(again.json()["refused"]) == 1
    winner = call(env, "GET", f"/v1/winners/{DC}", "reader", params={"key": KEY})
    assert winner.status_code == 200 and winner.json()["candidate"] == "torch"


def test_malformed_json_and_nan(env: Env) -> None:
    r = call(
        env, "POST", SUBMIT, content=b'{"device": ', headers={"Content-Type": "application/json"}
    )
    expect(r, 422, "the body is not valid JSON at character 11: Expecting value")
    assert "input" not in r.json()["detail"][0]  # not an empty stand-in for what was sent
    raw = json.dumps(submit_body([measurement()])).replace('"median_us": 10.0', '"median_us": NaN')
    r = call(
        env, "POST", SUBMIT, content=raw.encode(), headers={"Content-Type": "application/json"}
    )
    expect(r, 422, "median_us", "finite")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"device": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested too deeply"),
        (b'{"device": "\xff"}', "the body is not UTF-8 text, as JSON is: 'utf-8' codec can't"),
        (b'{"device": ' + b"7" * 5000 + b"}", "a number in the body has more than 4300 digits"),
    ],
    ids=["nested", "not-utf8", "long-integer"],
)
def test_a_body_python_cannot_parse_is_named_so(env: Env, body: bytes, needle: str) -> None:
    """A body nested past Python's parser, not UTF-8 or with an integer too long for Python
    raises no JSON syntax error (those say where): the 400 names what is wrong rather than
    FastAPI's bare 'There was an error parsing the body'."""
    r = call(env, "POST", SUBMIT, content=body, headers={"Content-Type": "application/json"})
    expect(r, 400, needle)


# a number beyond a float's range, with an exponent or written out, reads as Infinity
TOO_LARGE = ["1e999", "-1.5E+400", "1" + "0" * 400 + ".5"]


@pytest.mark.parametrize(
    "number", ["NaN", "Infinity", "-Infinity", *TOO_LARGE], ids=lambda n: n[:12]
)
def test_a_nan_in_params_is_refused_and_the_winner_stays_readable(env: Env, number: str) -> None:
    """Python's parser takes NaN and Infinity, and reads 1e999 as Infinity; no JSON reader takes
    them served back as params. The submit is refused naming the field, and the winner of a
    sound push stays readable."""
    key = "gemm:m=8,n=8,k=40,dtype=f32,out_dtype=f32"
    raw = json.dumps(submit_body([measurement(key=key, params={"bm": 0})]))
    r = call(env, "POST", SUBMIT, content=raw.replace('"bm": 0', f'"bm": {number}').encode(),
             headers={"Content-Type": "application/json"})  # fmt: skip
    expect(r, 422, "measurements.0.params", "NaN, Infinity and numbers beyond a float's range")
    assert call(env, "POST", SUBMIT, json=submit_body([measurement(key=key)])).status_code == 200
    served = call(env, "GET", f"/v1/winners/{DC}", "reader", params={"key": key})
    assert served.status_code == 200 and served.json()["params"] == {}, served.text


def test_a_lone_surrogate_in_params_is_refused_and_the_winner_stays_readable(env: Env) -> None:
    """A string holding half a surrogate pair (sent as the escape \\ud800) cannot be encoded in
    UTF-8, so no answer holding it could be sent: it is refused where it enters. A whole pair
    (an emoji) is taken and served."""
    key = "gemm:m=8,n=8,k=48,dtype=f32,out_dtype=f32"
    raw = json.dumps(submit_body([measurement(key=key, params={"tag": "x"})]))
    r = call(env, "POST", SUBMIT, content=raw.replace('"x"', '"\\ud800"').encode(),
             headers={"Content-Type": "application/json"})  # fmt: skip
    expect(r, 422, "measurements.0.params", "lone surrogate")
    pair = submit_body([measurement(key=key, params={"tag": "\U0001f600"})])
    assert call(env, "POST", SUBMIT, json=pair).status_code == 200
    served = call(env, "GET", f"/v1/winners/{DC}", "reader", params={"key": key})
    assert served.status_code == 200 and served.json()["params"] == {"tag": "\U0001f600"}


def test_a_time_too_small_to_divide_by_is_refused_and_the_feed_stays_readable(env: Env) -> None:
    """A challenger timed at 5e-324 us makes its speedup over the baseline infinite, and an
    admin's result is served at once, to every read of the class's winners (each host's sync).
    It is refused where it enters, naming the field; the feed still answers."""
    key = "gemm:m=8,n=8,k=24,dtype=f32,out_dtype=f32"
    base = measurement(key=key)
    tiny = measurement(key=key, source="triton_gemm", params={"bm": 16}, is_baseline=False,
                       median_us=5e-324, p10_us=5e-324, p90_us=5e-324)  # fmt: skip
    r = call(env, "POST", SUBMIT, "admin", json=submit_body([base, tiny]))
    expect(r, 422, "measurements.1.median_us", "at least 1e-06 us, got 5e-324")
    assert call(env, "POST", SUBMIT, "admin", json=submit_body([base])).status_code == 200
    feed = call(env, "GET", f"/v1/winners/{DC}/feed", "reader")
    assert feed.status_code == 200, feed.text
    served = call(env, "GET", f"/v1/winners/{DC}", "reader", params={"key": key})
    assert served.status_code == 200 and served.json()["candidate"] == "torch", served.text


def test_a_time_too_small_an_older_release_stored_is_ignored_by_the_merge(tmp_path) -> None:
    """A challenger timed at 5e-324 us, stored by a release that took such times: merged into the
    served winner, its infinite speedup would leave the key with no winner reads serve. The
    merge weighs no time below the floor of the service's entry; the sound challenger pushed
    is served."""
    import sqlite3

    db = tmp_path / "fleet.db"
    key = "gemm:m=8,n=8,k=24,dtype=f32,out_dtype=f32"
    with ThreadServer(db) as srv:
        admin = auth(srv.token("admin", "admin"))
        r = httpx.post(srv.url + SUBMIT, json=submit_body([measurement(key=key)]), headers=admin)
        assert r.status_code == 200, r.text
        with contextlib.closing(sqlite3.connect(db)) as c, c:
            c.row_factory = sqlite3.Row
            (base,) = c.execute("select * from srv_measurements where key like '%,k=24,%'")
            tiny = {k: v for k, v in dict(base).items() if k != "id"} | {
                "uid": "tiny-from-an-older-release", "candidate": 'triton_gemm:{"bm":32}',
                "source": "triton_gemm", "params": '{"bm": 32}', "is_baseline": 0,
                "median_us": 5e-324, "p10_us": 5e-324, "p90_us": 5e-324,
            }  # fmt: skip
            c.execute(f"insert into srv_measurements({', '.join(tiny)}) "
                      f"values ({', '.join('?' * len(tiny))})", list(tiny.values()))  # fmt: skip
        sound = measurement(key=key, source="triton_gemm", params={"bm": 16}, is_baseline=False,
                            median_us=5.0, p10_us=4.9, p90_us=5.1)  # fmt: skip
        r = httpx.post(srv.url + SUBMIT, json=submit_body([sound]), headers=admin)
        assert r.status_code == 200, r.text
        served = httpx.get(f"{srv.url}/v1/winners/{DC}", params={"key": key}, headers=admin)
    assert served.status_code == 200, served.text
    assert served.json()["params"] == {"bm": 16}
    assert served.json()["speedup"] == pytest.approx(2.0)


def test_winners_an_older_release_stored_unservable_are_left_out_and_the_rest_served(
    tmp_path, caplog
) -> None:
    """A database written by a release that took such results holds an infinite speedup, a NaN
    time (SQLite keeps it as NULL) and a NaN in params; served, any of them would stop every
    host of the class syncing. Each is left out of reads and feed pages and named in the log
    once; the good winner is served, and a host pulls it a row a page."""
    import sqlite3

    from tuner.cache import Store
    from tuner.fleet.sync import pull

    db = tmp_path / "fleet.db"
    keys = [f"gemm:m=8,n=8,k={k},dtype=f32,out_dtype=f32" for k in (8, 16, 24, 32)]
    good = str(parse_key(keys[0]))
    with ThreadServer(db) as srv:
        admin = auth(srv.token("admin", "admin"))
        for key in keys:
            r = httpx.post(srv.url + SUBMIT, json=submit_body([measurement(key=key)]),
                           headers=admin)  # fmt: skip
            assert r.status_code == 200, r.text
        with contextlib.closing(sqlite3.connect(db)) as c, c:
            for column, value, k in (("speedup", "9e999", 16), ("median_us", "null", 24),
                                     ("params", """'{"bm": NaN}'""", 32)):  # fmt: skip
                c.execute(f"update srv_winners set {column} = {value} where key like ?",
                          (f"%,k={k},%",))  # fmt: skip
        for _ in range(2):
            feed = httpx.get(f"{srv.url}/v1/winners/{DC}/feed", headers=admin)
            assert feed.status_code == 200, feed.text
            assert [row[2] for row in feed.json()["rows"]] == [good]
            assert feed.json()["cursor"] == 1
            for key in keys:
                r = httpx.get(f"{srv.url}/v1/winners/{DC}", params={"key": key}, headers=admin)
                assert r.status_code == (200 if key == keys[0] else 404), r.text
        with Store(tmp_path / "host.db") as host:
            client = srv.client("host", "read")
            first, again = (pull(client, host, FP, page=1) for _ in range(2))
            assert [w.key for w in host.winners(DC)] == [good]
        assert (first.winners, first.pages, first.cursor) == (1, 4, 4)
        assert again.winners == 0  # resumed after the good row, not started over
    told = [r.getMessage() for r in caplog.records if "left out of every answer" in r.message]
    assert len(told) == 3, told
    for k, why in ((16, "speedup is inf"), (24, "median_us is None"),
                   (32, 'params {"bm": NaN} hold NaN')):  # fmt: skip
        assert any(f",k={k}," in t and why in t for t in told), (k, told)


def only_the_first_served(url: str, headers: dict, keys: list[str]) -> list[dict]:
    """Check that of ``keys`` only the first is served, read alone and in a lookup (the others
    404 and missing); the params the lookup serves it with."""
    for key in keys:
        r = httpx.get(f"{url}/v1/winners/{DC}", params={"key": key}, headers=headers)
        assert r.status_code == (200 if key == keys[0] else 404), r.text
    r = httpx.post(f"{url}/v1/winners/{DC}/lookup", headers=headers,
                   json={"versions": FP.version_tag, "keys": keys})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["missing"] == [str(parse_key(key)) for key in keys[1:]], r.text
    return [w["params"] for w in r.json()["winners"]]


def test_params_beyond_a_floats_range_an_older_release_stored_are_left_out(tmp_path) -> None:
    """Params such as {"bm": 1e999} hold no NaN or Infinity in their text, but Python reads the
    number as Infinity, which JSON cannot carry. They are left out of reads and the feed like a
    NaN; params whose text holds an exponent JSON can carry (or an e in a word) are served."""
    import sqlite3

    db = tmp_path / "fleet.db"
    sound = {"tol": 1e-05, "order": "wide"}
    keys = [f"gemm:m=8,n=8,k={k},dtype=f32,out_dtype=f32" for k in (8, 16, 24, 32)]
    canonical = [str(parse_key(key)) for key in keys]
    with ThreadServer(db) as srv:
        admin = auth(srv.token("admin", "admin"))
        body = submit_body([measurement(key=keys[0], params=sound)]
                           + [measurement(key=key) for key in keys[1:]])  # fmt: skip
        assert httpx.post(srv.url + SUBMIT, json=body, headers=admin).status_code == 200
        with contextlib.closing(sqlite3.connect(db)) as c, c:
            for number, key in zip(TOO_LARGE, canonical[1:], strict=True):
                c.execute("update srv_winners set params = ? where key = ?",
                          (f'{{"bm": {number}}}', key))  # fmt: skip
        feed = httpx.get(f"{srv.url}/v1/winners/{DC}/feed", headers=admin)
        assert feed.status_code == 200, feed.text
        assert [(row[2], json.loads(row[6])) for row in feed.json()["rows"]] == [
            (canonical[0], sound)
        ]
        only_the_first_served(srv.url, admin, keys)


def test_params_that_are_no_json_object_are_left_out(tmp_path, caplog) -> None:
    """Params a damaged page left as no JSON at all (cut short, or garbage), as JSON that is no
    object, nested past Python's parser, holding a lone surrogate (no answer holding it can be
    sent as UTF-8) or an integer past Python's digit limit: no read can serve them, and every
    host's pull would refuse them in the feed. Each is left out like a NaN and named in the
    log once; the good winner is served and pulled."""
    import sqlite3

    from tuner.cache import Store
    from tuner.fleet.sync import pull

    db = tmp_path / "fleet.db"
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    damaged = [
        '{"bm": 64,',
        "garbage",
        "[64]",
        deep,
        '{"tag": "\\ud800"}',
        '{"bm": ' + "1" * 5000 + "}",
    ]
    keys = [f"gemm:m=8,n=8,k={8 * k},dtype=f32,out_dtype=f32" for k in range(1, 8)]
    canonical = [str(parse_key(key)) for key in keys]
    with ThreadServer(db) as srv:
        admin = auth(srv.token("admin", "admin"))
        body = submit_body([measurement(key=keys[0], params={"bm": 64})]
                           + [measurement(key=key) for key in keys[1:]])  # fmt: skip
        assert httpx.post(srv.url + SUBMIT, json=body, headers=admin).status_code == 200
        with contextlib.closing(sqlite3.connect(db)) as c, c:
            for params, key in zip(damaged, canonical[1:], strict=True):
                c.execute("update srv_winners set params = ? where key = ?", (params, key))
        for _ in range(2):
            feed = httpx.get(f"{srv.url}/v1/winners/{DC}/feed", headers=admin)
            assert feed.status_code == 200, feed.text
            assert [(row[2], row[6]) for row in feed.json()["rows"]] == [
                (canonical[0], '{"bm": 64}')
            ]
            assert only_the_first_served(srv.url, admin, keys) == [{"bm": 64}]
        with Store(tmp_path / "host.db") as host:
            pull(srv.client("host", "read"), host, FP)
            assert [w.key for w in host.winners(DC)] == [canonical[0]]
    told = [r.getMessage() for r in caplog.records if "left out of every answer" in r.message]
    assert len(told) == 6, told
    whys = ['params {"bm": 64, are not JSON', "params garbage are not JSON",
            "params [64] are not a JSON object", "nested too deep",
            "lone surrogate", "a number JSON or Python cannot carry"]  # fmt: skip
    for key, why in zip(canonical[1:], whys, strict=True):
        assert any(key in t and why in t for t in told), (key, told)


def test_a_body_sent_without_a_json_content_type_is_named_so(env: Env) -> None:
    """curl -d sends a JSON body as a form (application/x-www-form-urlencoded) unless told:
    the answer names the header, not the body's shape."""
    body = json.dumps(submit_body([measurement()])).encode()
    r = call(env, "POST", SUBMIT, content=body,
             headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    expect(r, 415, "Content-Type must be application/json, got 'application/x-www-form-urlencoded'")
    expect(call(env, "POST", SUBMIT, content=body), 415, "none sent: curl -H 'Content-Type")
    r = call(env, "POST", SUBMIT, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_huge_body_is_refused_before_parsing(env: Env) -> None:
    r = call(
        env,
        "POST",
        SUBMIT,
        content=b"x" * (4 * 2**20 + 1),
        headers={"Content-Type": "application/json"},
    )
    expect(r, 413, "at most 4194304 bytes")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(80):
            yield b" " * 65536

    expect(call(env, "POST", SUBMIT, content=chunks()), 413, "too large")
    metrics = httpx.get(env.url + "/metrics").text  # answered before routing, counted by route
    assert f'method="POST",route="{SUBMIT}",status="413"}} 2.0' in metrics, metrics


@pytest.mark.parametrize(
    ("method", "path", "kw", "status", "needle"),
    [
        ("GET", "/v1/winners/cpu-nope-1c/feed", {}, 404, "unknown device class 'cpu-nope-1c'"),
        ("GET", "/v1/winners/cpu-nope-1c", {"params": {"key": KEY}}, 404, "unknown device class"),
        (
            "GET",
            f"/v1/winners/{DC}",
            {"params": {"key": KEY.replace("8,", "16,", 1)}},
            404,
            "no winner",
        ),
        ("GET", "/v1/winners/GPU!/feed", {}, 422, "device_class"),
        ("GET", f"/v1/winners/{DC}/feed", {"params": {"since": -1}}, 422, "since"),
        ("GET", f"/v1/winners/{DC}/feed", {"params": {"limit": 0}}, 422, "limit"),
        ("GET", f"/v1/winners/{DC}/feed", {"params": {"since": "soon"}}, 422, "since"),
        ("GET", f"/v1/winners/{DC}", {"params": {"key": "gemm:m=8"}}, 422, "incomplete gemm key"),
        ("GET", f"/v1/winners/{DC}", {}, 422, "query.key: Field required"),
        (
            "POST",
            f"/v1/winners/{DC}/lookup",
            {"json": {"versions": "", "keys": []}},
            422,
            "at least 1",
        ),
        ("GET", "/v1/queue", {"params": {"state": "lost"}}, 422, "state"),
        (
            "POST",
            "/v1/queue/claim",
            {"json": {"device": FP.to_dict(), "versions": "", "worker": "w", "max_keys": 0}},
            422,
            "max_keys",
        ),
        (
            "POST",
            "/v1/queue/complete",
            {"json": submit_body([]) | {"lease_id": "0" * 32}},
            404,
            "unknown lease_id",
        ),
        (
            "POST",
            "/v1/queue/complete",
            {"json": submit_body([]) | {"lease_id": "x"}},
            422,
            "lease_id",
        ),
        (
            "POST",
            "/v1/misses",
            {
                "json": {
                    "device": FP.to_dict(),
                    "versions": "",
                    "misses": [{"key": KEY, "count": 0}],
                }
            },
            422,
            "count",
        ),
        ("GET", "/v1/nothing-here", {}, 404, "Not Found"),
        ("DELETE", SUBMIT, {}, 405, "Method Not Allowed"),
    ],
)
def test_bad_requests_get_clear_4xx(env: Env, method, path, kw, status, needle) -> None:
    expect(call(env, method, path, **kw), status, needle)


def test_confirm_needs_admin_and_something_pending(env: Env) -> None:
    group = {"device_class": DC, "versions": FP.version_tag, "key": KEY}
    expect(call(env, "POST", "/v1/pending/confirm", json=group), 403, "this needs 'admin'")
    expect(call(env, "POST", "/v1/pending/confirm", "admin", json=group), 404, "nothing pending")


def test_a_lease_belongs_to_its_claimer(env: Env) -> None:
    miss = {"device": FP.to_dict(), "versions": "v-lease", "misses": [{"key": KEY}]}
    assert call(env, "POST", "/v1/misses", "reader", json=miss).json()["queued"] == 1
    claim = {"device": FP.to_dict(), "versions": "v-lease", "worker": "w"}
    lease = call(env, "POST", "/v1/queue/claim", json=claim).json()["lease_id"]
    done = submit_body([]) | {"lease_id": lease}
    expect(call(env, "POST", "/v1/queue/complete", "other", json=done), 403, "another token")
    assert call(env, "POST", "/v1/queue/complete", json=done).status_code == 200
    expect(call(env, "POST", "/v1/queue/complete", json=done), 409, "already completed")
    # a refused completion stores nothing, its device neither
    device = dataclasses.replace(FP, name="Ghost GPU").to_dict()
    ghost = {"device": device, "measurements": [], "lease_id": "0" * 32}
    expect(call(env, "POST", "/v1/queue/complete", json=ghost), 404)
    classes = call(env, "GET", "/v1/device-classes", "reader").json()
    assert not any("ghost" in c for c in classes), classes


def test_a_database_with_a_damaged_page_is_refused_at_startup(tmp_path) -> None:
    """Its header and schema read fine, so only the startup's page check can tell: the service
    does not start on it (and so never says ready and fails every request)."""
    from server import Settings, create_app
    from tuner.cache import StoreError

    built = tmp_path / "built.db"
    with FleetStore(built) as store:
        for i in range(600):
            store.add_token(f"t{i:04d}", "x" * 100, "h" * 64, "read", 0.0)
    data = bytearray(built.read_bytes())
    middle = len(data) // 4096 // 2 * 4096
    data[middle : middle + 2 * 4096] = b"\xa5" * 2 * 4096
    damaged = tmp_path / "fleet.db"
    damaged.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="is corrupt"):
        create_app(Settings(db=damaged))
    assert damaged.read_bytes() == bytes(data)  # left as it was
    assert not (tmp_path / "fleet.db.artifacts").exists()  # nor a folder made beside it


def test_a_lock_held_by_another_process_gets_503_and_stores_nothing(tmp_path) -> None:
    """A backup or an operator's sqlite3 shell holding the write lock past the wait: the
    request is answered 503 with Retry-After (clients send it again), not a 500, and once the
    lock is let go the same request is stored."""
    db = tmp_path / "fleet.db"
    with ThreadServer(db, lock_wait_s=0.2) as srv:
        headers = auth(srv.token("host", "submit"))
        body = submit_body([measurement()])
        with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as other:
            other.execute("begin immediate")
            r = httpx.post(srv.url + "/v1/measurements", json=body, headers=headers)
            expect(r, 503, "locked by another process", "nothing was stored")
            assert r.headers["retry-after"].isdigit()
            other.execute("rollback")
        r = httpx.post(srv.url + "/v1/measurements", json=body, headers=headers)
        assert r.status_code == 200, r.text
    with FleetStore(db) as store:
        assert store.db["srv_measurements"].count == 1


def test_a_database_that_cannot_be_written_is_refused_at_startup(tmp_path) -> None:
    """A read-only file (its mode, a read-only mount) is refused before the service listens,
    naming the service's own option, rather than served with every write failing; no
    artifacts folder is left beside it, and a token cannot be made in it either, said the same
    way."""
    from server import Settings, create_app
    from tests.cache.read_only import read_only
    from tuner.cache import ReadOnlyError

    db = tmp_path / "fleet.db"
    FleetStore(db).close()
    with read_only(db) as before:
        with pytest.raises(ReadOnlyError, match=r"or name another fleet database \(--db / "):
            create_app(Settings(db=db))
        with FleetStore(db) as store, pytest.raises(ReadOnlyError, match=r"\$TUNER_SERVER_DB"):
            tokens.create(store, "host", ["read"])
        assert db.read_bytes() == before
    assert not (tmp_path / "fleet.db.artifacts").exists()


def test_a_file_of_another_kind_is_refused_and_nothing_made_beside_it(tmp_path) -> None:
    """A cache or a text file named as the service's database: refused by name, with no
    artifacts folder left beside it; an existing folder stays."""
    from server import Settings, create_app
    from tuner.cache import Store, StoreError

    Store(tmp_path / "cache.db").close()
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "kept.txt.artifacts").mkdir()
    (tmp_path / "kept.txt").write_text("hi")
    for name, says in (("cache.db", "is a tuner cache"), ("notes.txt", "not a SQLite database"),
                       ("kept.txt", "not a SQLite database")):  # fmt: skip
        with pytest.raises(StoreError, match=says):
            create_app(Settings(db=tmp_path / name))
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["cache.db", "kept.txt", "kept.txt.artifacts", "notes.txt"]


def test_uploads_a_killed_service_left_are_removed_at_startup(tmp_path) -> None:
    import os
    import time

    from server.blobs import STALE_UPLOAD_S, BlobDir

    root = tmp_path / "blobs"
    root.mkdir()
    old, fresh, blob = root / ".aaaaaaaaaaaa.x1.tmp", root / ".bbbbbbbbbbbb.x2.tmp", root / "cccc"
    for f in (old, fresh, blob):
        f.write_bytes(b"part")
    then = time.time() - STALE_UPLOAD_S - 60
    os.utime(old, (then, then))
    BlobDir(root)
    assert not old.exists() and fresh.exists() and blob.exists()  # another's upload may be live


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_database_removed_or_replaced_under_the_service_refuses_writes(tmp_path, how) -> None:
    """Its connections still hold the old file, where a write would be lost at the next start,
    and a new pool thread would open whatever is at the path: not ready, and every request
    that may touch the database refused (503) naming why, reads on many threads at once too;
    nothing made at the path of a removed one."""
    db = tmp_path / "fleet.db"
    with ThreadServer(db) as srv:
        submitter = auth(srv.token("submitter", "submit"))
        body = submit_body([measurement()])
        assert (
            httpx.post(srv.url + "/v1/measurements", json=body, headers=submitter).status_code
            == 200
        )
        assert httpx.get(srv.url + "/v1/ready").status_code == 200
        for f in tmp_path.glob("fleet.db*"):
            if f.is_file():
                f.unlink()
        if how == "replaced":
            FleetStore(db).close()
        ready = httpx.get(srv.url + "/v1/ready")
        assert ready.status_code == 503 and f"was {how}" in ready.json()["detail"]
        refused = httpx.post(srv.url + "/v1/measurements", json=body, headers=submitter)
        assert refused.status_code == 503
        assert f"the database {db} was {how}" in refused.json()["detail"]
        assert "restart the service" in refused.json()["detail"]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            reads = list(pool.map(lambda _: httpx.get(srv.url + "/v1/device-classes",
                                                      headers=submitter), range(64)))  # fmt: skip
        assert {r.status_code for r in reads} == {503}
        assert httpx.get(srv.url + "/v1/health").status_code == 200
        if how == "removed":
            assert not any(f.is_file() for f in tmp_path.glob("fleet.db*")), list(
                tmp_path.iterdir()
            )


def test_a_write_the_services_disk_refuses_is_a_503_to_send_again(tmp_path, caplog) -> None:
    """Rolled back whole: 503 (a host sends it again later), logged with the cause; once the
    disk takes it again, the same push is stored."""
    from tests.cache.full_disk import file_size_limit

    db = tmp_path / "fleet.db"
    with ThreadServer(db) as srv:
        submitter = auth(srv.token("submitter", "submit"))
        body = submit_body([measurement(params={"i": i}, is_baseline=False, error="x" * 200)
                            for i in range(400)])  # fmt: skip
        biggest = max(f.stat().st_size for f in tmp_path.glob("fleet.db*") if f.is_file())
        with file_size_limit(biggest + 1024):
            refused = httpx.post(srv.url + "/v1/measurements", json=body, headers=submitter)
        assert refused.status_code == 503, refused.text
        assert "send it again later" in refused.json()["detail"]
        assert "could not be written" in caplog.text
        stored = httpx.post(srv.url + "/v1/measurements", json=body, headers=submitter)
        assert stored.status_code == 200, stored.text


def test_a_database_made_read_only_while_serving_is_a_503_logged_once(tmp_path, caplog) -> None:
    """A remount made read-only under the service: a pool thread's new connection opens the
    file read-only and its write raises ``ReadOnlyError``. The push gets a 503 naming why, with
    one line in the log (not a second from uvicorn); once the file is writable again, the same
    push is stored."""
    import logging

    from tests.cache.read_only import read_only

    db = tmp_path / "fleet.db"
    with ThreadServer(db) as srv:
        uvicorn_log = logging.getLogger("uvicorn.error")  # set up by the server; not propagated
        uvicorn_log.addHandler(caplog.handler)
        try:
            submitter = auth(srv.token("submitter", "submit"))
            body = submit_body([measurement()])
            with read_only(db):
                refused = httpx.post(srv.url + SUBMIT, json=body, headers=submitter)
            stored = httpx.post(srv.url + SUBMIT, json=body, headers=submitter)
        finally:
            uvicorn_log.removeHandler(caplog.handler)
    assert refused.status_code == 503, refused.text
    assert "its database is read-only" in refused.json()["detail"]
    assert "send it again later" in refused.json()["detail"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "fleet.db is read-only" in errors[0], errors
    assert stored.status_code == 200, stored.text


def test_an_unexpected_error_is_a_500_logged_once_with_its_traceback(tmp_path, caplog) -> None:
    """Pages damaged under a running service (the startup's page check passed): its read fails
    with an error the service has no answer for. The answer is a 500 and the traceback is
    logged once, by the service, not again by uvicorn as 'Exception in ASGI application'."""
    import logging

    from tests.cache.damaged import PAGE

    db = tmp_path / "fleet.db"
    with ThreadServer(db) as srv:  # many winners, so many pages
        admin = auth(srv.token("admin", "admin"))
        body = submit_body([measurement(key=f"gemm:m={m},n=8,k=8", params={"pad": "x" * 200})
                            for m in range(1, 400)])  # fmt: skip
        assert httpx.post(srv.url + SUBMIT, json=body, headers=admin).status_code == 200
    with ThreadServer(db) as srv:  # no request has read a page yet: none is cached
        data = bytearray(db.read_bytes())
        middle = len(data) // PAGE // 2 * PAGE
        data[middle : middle + 4 * PAGE] = b"\xa5" * 4 * PAGE
        db.write_bytes(bytes(data))
        uvicorn_log = logging.getLogger("uvicorn.error")  # set up by the server; not propagated
        uvicorn_log.addHandler(caplog.handler)
        try:
            r = httpx.get(f"{srv.url}/v1/winners/{DC}/feed", headers=admin)
        finally:
            uvicorn_log.removeHandler(caplog.handler)
    assert r.status_code == 500 and r.json() == {"detail": "internal error; see the service log"}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [e.getMessage() for e in errors]
    assert errors[0].getMessage() == f"unhandled error on GET /v1/winners/{DC}/feed"
    assert errors[0].exc_info is not None and "malformed" in str(errors[0].exc_info[1])


def test_a_winner_asked_for_under_other_versions_names_those_it_is_served_under(
    env: Env,
) -> None:
    """curl sends the '+' of ``2.13.0+cpu`` unencoded, and the service reads a space: the 404
    names the versions asked for and those the key's winner is served under, rather than
    saying only that there is no winner, as if the key had none."""
    sent = FP.version_tag.replace("+", " ") + ";sent-with-a-space"
    r = call(env, "GET", f"/v1/winners/{DC}", "reader", params={"key": KEY, "versions": sent})
    expect(r, 404, f"under versions {sent!r}; served under [{FP.version_tag!r}]")

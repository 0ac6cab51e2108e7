"""A fleet database written by the release with one shared schema opens in the new service with
its tokens, served winners, queue and leases (see tests/cache/test_compat.py for how the fixture
was made), and the launch mode travels from a host's measurements to another host's pull."""

from __future__ import annotations

import math
import shutil
import sqlite3
import time
from pathlib import Path

import httpx

from server.live import ThreadServer
from server.store import FleetStore
from tuner.cache import Store
from tuner.cache.schema import HOST_TABLES
from tuner.core.device import Fingerprint
from tuner.core.keys import GemmKey, SdpaKey, parse_key
from tuner.fleet.sync import pull, push
from tuner.measure.records import Measurement, Winner

DATA = Path(__file__).parents[1] / "data" / "compat"
FP = Fingerprint("cpu", "x86_64", "", 2, 0, versions={"torch": "2.5.0", "tuner": "0.1.0"})
DC, V = FP.device_class, FP.version_tag
K1 = "gemm:m=64,n=64,k=64,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
K4 = "gemm:m=256,n=64,k=64,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"


def test_release_fleet_database_serves_the_same_data(tmp_path: Path) -> None:
    db = Path(shutil.copy(DATA / "fleet-v2.db", tmp_path / "fleet.db"))
    with FleetStore(db) as s:
        assert [t["name"] for t in s.tokens()] == ["admin", "host-a", "reader"]
        assert not set(s.db.table_names()) & {*HOST_TABLES, "meta"}
        assert s.served_count() == 2
        with s.transaction() as c:  # the fixture's lease ran out in wall-clock time: renew it
            c.execute("update srv_queue set lease_expires = ? where state = 'leased'",
                      (time.time() + 3600,))  # fmt: skip
    with ThreadServer(db) as srv:
        assert httpx.get(srv.url + "/v1/ready").json()["status"] == "ready"
        with srv.client("new-reader", "read") as c:
            w = c.winner(DC, K1, V)
            assert w is not None
            assert (w["candidate"], w["median_us"], w["launch"]) == (
                'triton:{"bm":16}',
                8.0,
                "eager",
            )
            states = {e["key"]: e["state"] for e in c.queue(device_class=DC)}
            assert states[K4] == "queued" and "leased" in states.values()
            with Store(tmp_path / "host.db") as host:
                assert pull(c, host, FP).winners == 2
                assert host.winner(DC, K1).candidate == 'triton:{"bm":16}'


def test_launch_mode_travels_from_a_push_to_a_pull(tmp_path: Path) -> None:
    key = str(GemmKey(m=32, n=64, k=64, dtype="f32", out_dtype="f32"))
    ms = [
        Measurement(DC, key, "torch", {}, "ok", is_baseline=True, median_us=10.0, p10_us=9.9,
                    p90_us=10.1, reps=9, versions=V, launch="graph"),
        Measurement(DC, key, "triton", {"bm": 16}, "ok", median_us=9.0, p10_us=8.9,
                    p90_us=9.1, reps=9, versions=V, launch="graph"),
    ]  # fmt: skip
    with ThreadServer(tmp_path / "fleet.db") as srv:
        with Store(tmp_path / "a.db") as a, srv.client("host-a", "submit") as ca:
            a.save_device(FP)
            a.save_run(
                ms, Winner(DC, key, "triton", {"bm": 16}, 9.0, 10.0, versions=V, launch="graph")
            )
            assert a.winner(DC, key).launch == "graph"
            assert {m.launch for m in a.measurements(DC)} == {"graph"}
            assert push(ca, a, FP).accepted == 2
        with Store(tmp_path / "b.db") as b, srv.client("host-b", "read") as cb:
            assert cb.lookup(DC, V, [key])["winners"][0]["launch"] == "graph"
            assert pull(cb, b, FP).winners == 1
            assert b.winner(DC, key).launch == "graph"
            exported = b.export()
        with Store(tmp_path / "c.db") as c:
            c.import_(exported)
            assert c.winner(DC, key).launch == "graph"


def test_an_unknown_launch_mode_is_refused_by_name(tmp_path: Path) -> None:
    key = str(GemmKey(m=32, n=64, k=64, dtype="f32", out_dtype="f32"))
    m = Measurement(
        DC, key, "torch", {}, "ok", is_baseline=True, median_us=1.0, versions=V, launch="warp"
    )
    with ThreadServer(tmp_path / "fleet.db") as srv:
        r = httpx.post(
            srv.url + "/v1/measurements",
            json={"device": FP.to_dict(), "measurements": [{**m.__dict__}]},
            headers={"Authorization": f"Bearer {srv.token('h', 'submit')}"},
        )
    assert r.status_code == 422 and "launch" in r.text and "eager" in r.text


def test_sdpa_keys_of_the_default_scale_written_another_way_join_the_defaults(
    tmp_path: Path,
) -> None:
    """Schema 6 of the service, as of the cache: the fixture's queued and missed SDPA key was
    written with ``scale=head_dim ** -0.5``, which hosts now send and look up as the default's
    key. Its rows take that key: miss counts add up, the newer served winner stays (with its own
    sequence number), the queue entry already under the default's key stays, with both counts."""
    db = Path(shutil.copy(DATA / "fleet-v2.db", tmp_path / "fleet.db"))
    conn = sqlite3.connect(db)
    ((written,),) = conn.execute("select key from srv_misses where op = 'sdpa'").fetchall()
    canonical = str(parse_key(written))
    assert canonical == str(SdpaKey(1, 4, 4, 16, 16, 32, dtype="f32", scale=32**-0.5))
    assert canonical != written
    served = (
        "insert into srv_winners(device_class, versions, key, op, candidate, source, params, "
        "median_us, baseline_us, speedup, run_id, submitters, seq, updated_at) values "
        "(?, ?, ?, 'sdpa', 'torch_sdpa', 'torch_sdpa', '{}', ?, 5.0, 1.0, 'r', 1, ?, ?)"
    )
    conn.execute(served, (DC, V, written, 4.0, 3, 200.0))  # the newer
    conn.execute(served, (DC, V, canonical, 5.0, 4, 100.0))
    conn.execute("insert into srv_misses values (?, ?, ?, 'sdpa', 2, 50.0, 60.0)",
                 (DC, V, canonical))  # fmt: skip
    conn.execute("insert into srv_queue(device_class, versions, key, op, state, misses, attempts, "
                 "enqueued_at, updated_at) values (?, ?, ?, 'sdpa', 'queued', 1, 0, 1.0, 1.0)",
                 (DC, V, canonical))  # fmt: skip
    conn.execute("update srv_measurements set key = ? where id = 1", (written,))
    conn.commit()
    conn.close()
    with FleetStore(db) as s:
        q = s.db.conn
        assert not q.execute("select 1 from srv_measurements where key = ?", (written,)).fetchall()
        (winner,) = s.winners_of(DC, canonical, V)
        assert (winner["median_us"], winner["seq"], winner["updated_at"]) == (4.0, 3, 200.0)
        assert not s.winners_of(DC, written, V)
        misses = q.execute("select key, count from srv_misses where op = 'sdpa'").fetchall()
        assert misses == [(canonical, 4 + 2)]
        queued = q.execute("select key, state, misses from srv_queue where op = 'sdpa'").fetchall()
        assert queued == [(canonical, "queued", 1 + 4)]
        assert q.execute("select key from srv_measurements where id = 1").fetchone() == (canonical,)


def test_a_host_pulls_an_older_services_sdpa_key_under_its_own_spelling(tmp_path: Path) -> None:
    """A service not yet upgraded serves the default scale's SDPA key as ``head_dim ** -0.5``
    writes it; the pulling host stores it under the default's key, which its calls look up."""
    canonical = str(SdpaKey(1, 4, 4, 16, 16, 32, dtype="f32"))
    written = canonical.replace(f"scale={1 / math.sqrt(32)!r}", f"scale={32**-0.5!r}")
    assert written != canonical  # one rounding apart
    with ThreadServer(tmp_path / "fleet.db") as srv:
        with FleetStore(tmp_path / "fleet.db") as s:  # as an older release serves it
            s.save_device(FP)
            with s.transaction() as c:
                c.execute(
                    "insert into srv_winners(device_class, versions, key, op, candidate, source, "
                    "params, median_us, baseline_us, speedup, run_id, submitters, seq, updated_at, "
                    "launch) values (?, ?, ?, 'sdpa', 'torch_sdpa', 'torch_sdpa', '{}', 4.0, 5.0, "
                    "1.25, 'r', 1, 1, 1.0, 'eager')",
                    (DC, V, written),
                )
                c.execute("update srv_counters set value = 1 where name = 'winner_seq'")
        with Store(tmp_path / "host.db") as host, srv.client("reader", "read") as client:
            assert pull(client, host, FP).winners == 1
            (w,) = host.winners(DC)
            assert w.key == canonical

"""A fleet database written by the release with one shared schema opens in the new service with
its tokens, served winners, queue and leases (see tests/cache/test_compat.py for how the fixture
was made), and the launch mode travels from a host's measurements to another host's pull."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx

from server.live import ThreadServer
from server.store import FleetStore
from tuner.cache import Store
from tuner.cache.schema import HOST_TABLES
from tuner.core.device import Fingerprint
from tuner.core.keys import GemmKey
from tuner.fleet.client import pull, push
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

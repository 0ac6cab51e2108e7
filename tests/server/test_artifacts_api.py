"""The /v1/artifacts routes on a real service: who may publish, what the service checks before
it stores a blob (declared hash, size, spec), and how differing builds of one spec are reported."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.blobs import default_dir
from server.live import ThreadServer
from server.store import FleetStore
from server.tokens import create
from tuner.cache.artifacts import ArtifactSpec, sha256
from tuner.fleet.client import FleetError

pytestmark = pytest.mark.timeout(120)
SPEC = ArtifactSpec("cutlass", {"tile": [128, 128, 64]}, "sm90", {"cutlass": "4.2.0"})
DATA = b"\x7fELF a compiled kernel" * 20


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ThreadServer]:
    with ThreadServer(tmp_path / "fleet.db", max_artifact_bytes=1000) as srv:
        yield srv


def put(srv: ThreadServer, token: str, digest: str, body: object, spec: str) -> httpx.Response:
    return httpx.put(
        f"{srv.url}/v1/artifacts/blobs/{digest}", content=body,
        headers={"Authorization": f"Bearer {token}", "Tuner-Artifact-Spec": spec},
    )  # fmt: skip


def stored(srv: ThreadServer) -> list[str]:
    """Every file in the service's blob directory, temporary ones included."""
    return sorted(p.name for p in default_dir(srv.db).iterdir())


def test_publishing_needs_the_build_scope(fleet: ThreadServer) -> None:
    for scope in ("read", "submit"):
        with fleet.client(f"host-{scope}", scope) as c, pytest.raises(FleetError) as e:
            c.publish_artifact(SPEC, DATA)
        assert e.value.status == 403
        assert f"has scopes ['{scope}']; this needs 'build'" in str(e.value)
    assert stored(fleet) == []
    for scope in ("build", "admin"):
        with fleet.client(f"host-{scope}", scope) as c:
            assert c.publish_artifact(SPEC, DATA)["outcome"] == (
                "new" if scope == "build" else "same"
            )
    with fleet.client("anonymous") as c, pytest.raises(FleetError) as e:
        c.publish_artifact(SPEC, DATA)
    assert e.value.status == 401


def test_build_sits_between_submit_and_admin(tmp_path: Path) -> None:
    with FleetStore(tmp_path / "fleet.db") as store:
        build, _ = create(store, "builder", ["build"])
        submit, _ = create(store, "host", ["submit"])
    assert build.allows("read") and build.allows("submit") and not build.allows("admin")
    assert not submit.allows("build")


def test_the_declared_hash_is_checked_before_anything_is_stored(fleet: ThreadServer) -> None:
    token = fleet.token("builder", "build")
    r = put(fleet, token, sha256(b"something else"), DATA, SPEC.to_json())
    assert r.status_code == 422
    assert f"has sha256 {sha256(DATA)}, declared {sha256(b'something else')}" in r.json()["detail"]
    assert stored(fleet) == []
    with fleet.client("reader", "read") as c:
        assert c.artifact_lookup([SPEC.id])["missing"] == [SPEC.id]


def test_an_oversize_artifact_gets_413_whether_declared_or_streamed(fleet: ThreadServer) -> None:
    big = bytes(range(256)) * 8  # 2048 bytes, over the fixture's 1000
    with fleet.client("builder", "build") as c, pytest.raises(FleetError) as e:
        c.publish_artifact(SPEC, big)
    assert e.value.status == 413 and "at most 1000 bytes" in str(e.value)
    assert "max_artifact_bytes" in str(e.value)
    token = fleet.token("builder-2", "build")
    chunks = (big[i : i + 256] for i in range(0, len(big), 256))  # chunked: no Content-Length
    r = put(fleet, token, sha256(big), chunks, SPEC.to_json())
    assert r.status_code == 413 and "max_artifact_bytes" in r.json()["detail"]
    assert stored(fleet) == []  # the partial upload left nothing behind
    small = (DATA[i : i + 100] for i in range(0, len(DATA), 100))
    assert put(fleet, token, sha256(DATA), small, SPEC.to_json()).json()["outcome"] == "new"
    assert stored(fleet) == [sha256(DATA)]


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ("not json", "not JSON"),
        ('{"source": "cutlass", "config": {}, "arch": "sm 90"}', "arch"),
        ('{"source": "cutlass", "config": {}, "arch": "sm90", "extra": 1}', "extra"),
        ('{"source": "cutlass", "config": {"x": NaN}, "arch": "sm90"}', "JSON-serialisable"),
        ("[" * 3000 + "]" * 3000, "not JSON: nested too deeply"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(
    fleet: ThreadServer, header: str, named: str
) -> None:
    r = put(fleet, fleet.token("builder", "build"), sha256(DATA), DATA, header)
    assert r.status_code == 422
    assert "tuner-artifact-spec" in r.json()["message"] and named in r.json()["message"]
    assert stored(fleet) == []


def test_two_builders_builds_of_one_spec_are_reported_and_the_first_served(
    fleet: ThreadServer,
) -> None:
    rebuilt = DATA.replace(b"kernel", b"KERNEL")
    with fleet.client("builder-a", "build") as a, fleet.client("builder-b", "build") as b:
        assert a.publish_artifact(SPEC, DATA)["outcome"] == "new"
        assert b.publish_artifact(SPEC, rebuilt)["outcome"] == "conflict"
        assert b.publish_artifact(SPEC, rebuilt)["outcome"] == "known conflict"
        assert a.publish_artifact(SPEC, DATA)["outcome"] == "same"
        ids = {c.http.headers["authorization"].split("_")[1] for c in (a, b)}
    with fleet.client("reader", "read") as c:
        (served,) = c.artifact_lookup([SPEC.id])["artifacts"]
        assert served["hash"] == sha256(DATA) and served["spec"] == SPEC.to_json()
        assert c.download_artifact(served["hash"], served["size"]) == DATA
        (conflict,) = c.artifact_conflicts()
    assert conflict["spec_id"] == SPEC.id and conflict["served"] == sha256(DATA)
    builds = {(x["hash"], x["builder"]) for x in conflict["builds"]}
    assert {h for h, _ in builds} == {sha256(DATA), sha256(rebuilt)}
    assert {bid for _, bid in builds} == ids
    metrics = httpx.get(fleet.url + "/metrics").text
    assert "tuner_artifact_conflicting_specs 1.0" in metrics
    assert 'tuner_artifact_publishes_total{outcome="conflict"} 1.0' in metrics
    assert 'tuner_artifact_publishes_total{outcome="known conflict"} 1.0' in metrics


def test_listing_pages_by_arch_and_unknown_blobs_are_404(fleet: ThreadServer) -> None:
    specs = [ArtifactSpec("triton", {"kernel": f"k{i}"}, f"cuda:{arch}") for i, arch in
             enumerate((90, 90, 80, 90))]  # fmt: skip
    with fleet.client("builder", "build") as c:
        for i, s in enumerate(specs):
            c.publish_artifact(s, b"kernel %d" % i)
        first = c.artifact_listing(["cuda:90"], 0, limit=2)
        rest = c.artifact_listing(["cuda:90"], first["cursor"], limit=2)
        assert first["more"] and not rest["more"]
        got = [a["spec_id"] for a in first["artifacts"] + rest["artifacts"]]
        assert got == [specs[i].id for i in (0, 1, 3)]
        assert len(c.artifact_listing([], 0)["artifacts"]) == 4
        with pytest.raises(FleetError) as e:
            c.download_artifact("0" * 64, 100)
        assert e.value.status == 404


def test_a_release_fleet_database_takes_artifacts(tmp_path: Path) -> None:
    data = Path(__file__).parents[1] / "data" / "compat" / "fleet-v2.db"
    db = Path(shutil.copy(data, tmp_path / "fleet.db"))
    with ThreadServer(db) as srv, srv.client("builder", "build") as c:
        assert c.publish_artifact(SPEC, DATA)["outcome"] == "new"
        assert c.artifact_lookup([SPEC.id])["artifacts"][0]["hash"] == sha256(DATA)
    with FleetStore(db) as store:
        assert [t["name"] for t in store.tokens()] == ["admin", "host-a", "reader", "builder"]
        assert store.served_count() == 2


def test_an_artifacts_folder_that_cannot_take_an_upload_gets_507_in_one_line(
    fleet: ThreadServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The folder removed under the running service (an unmounted volume, a clean-up): the
    publisher is told why, the log has one line and no traceback, the database records nothing."""
    token = fleet.token("builder", "build")
    shutil.rmtree(default_dir(fleet.db))
    r = put(fleet, token, sha256(DATA), DATA, SPEC.to_json())
    assert r.status_code == 507, r.text
    assert r.json()["detail"] == (
        f"the service cannot store artifacts in {default_dir(fleet.db)}: No such file or directory"
    )
    said = [rec for rec in caplog.records if rec.name == "tuner.server"]
    assert [rec.exc_info for rec in said] == [None] and "refused PUT" in said[0].getMessage()
    with fleet.client("reader", "read") as c:
        assert c.artifact_lookup([SPEC.id])["missing"] == [SPEC.id]

"""Compiled-kernel artifacts through a real service on loopback, between real artifact stores:
a builder publishes, other hosts fetch the same bytes, and a download that does not match the
hash the service announced is refused and never stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.blobs import default_dir
from server.live import ThreadServer, backup, restore
from tuner.cache import Store
from tuner.cache.artifacts import ArtifactSpec, ArtifactStore, pack, sha256
from tuner.candidates import cuda_fp8, cuda_w4a16
from tuner.core.device import Fingerprint
from tuner.fleet.artifact_sync import (
    check_artifacts,
    fetch_artifacts,
    host_archs,
    push_artifacts,
    sync_artifacts,
)
from tuner.fleet.background import BackgroundSync
from tuner.fleet.client import FleetClient

pytestmark = pytest.mark.timeout(120)
H100 = Fingerprint("cuda", "NVIDIA H100 80GB HBM3", "9.0", 132, 80)


def spec(name: str, arch: str = "cuda:90") -> ArtifactSpec:
    return ArtifactSpec(
        "triton", {"kernel": name, "cache_key": name * 4}, arch, {"triton": "3.9.0"}
    )


def bundle(name: str) -> bytes:
    return pack({f"{name}.cubin": f"\x7fELF {name} ".encode() * 50, f"{name}.json": b"{}"})


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ThreadServer]:
    with ThreadServer(tmp_path / "fleet.db") as srv:
        yield srv


@pytest.fixture
def builder(tmp_path: Path) -> Iterator[ArtifactStore]:
    """A build host's store holding two kernels for sm90 and one for sm80."""
    with ArtifactStore(tmp_path / "builder") as store:
        for name, arch in (("mm", "cuda:90"), ("attn", "cuda:90"), ("old", "cuda:80")):
            store.put(spec(name, arch), bundle(name))
        yield store


def test_published_artifacts_reach_other_hosts_byte_for_byte(
    fleet: ThreadServer, builder: ArtifactStore, tmp_path: Path
) -> None:
    with fleet.client("builder", "build") as c:
        assert push_artifacts(c, builder).published == 3
        again = push_artifacts(c, builder)  # nothing new: nothing uploaded
        assert (again.published, again.present, again.conflicts) == (0, 3, 0)
    with fleet.client("host-b", "read") as c, ArtifactStore(tmp_path / "host-b") as host:
        out = fetch_artifacts(c, host, [spec("mm"), spec("attn"), spec("never-built")])
        assert (out.fetched, out.missing, out.rejected) == (2, 1, [])
        assert host.get(spec("mm")) == bundle("mm") and host.get(spec("attn")) == bundle("attn")
        assert host.get(spec("old", "cuda:80")) is None
        assert fetch_artifacts(c, host, [spec("mm")]).present == 1
    with (
        fleet.client("host-c", "read") as c,
        ArtifactStore(tmp_path / "host-c") as host,
        Store(tmp_path / "host-c.db") as cache,
    ):
        assert sync_artifacts(c, host, cache, host_archs(H100)).fetched == 2  # no cuda:80 one
        assert host.hashes() == {s.id: sha256(bundle(s.config["kernel"])) for s in
                                 (spec("mm"), spec("attn"))}  # fmt: skip
        with fleet.client("builder-2", "build") as b:
            b.publish_artifact(spec("new"), bundle("new"))
        later = sync_artifacts(c, host, cache, host_archs(H100))  # only what came since
        assert (later.fetched, later.present) == (1, 0)
        assert host.get(spec("new")) == bundle("new")


def test_a_hopper_host_syncs_every_familys_kernels_an_ampere_host_none_of_sm_90a(
    fleet: ThreadServer, tmp_path: Path
) -> None:
    """Our CUDA decode kernels are built for ``sm_90a`` (arch-specific: Hopper alone), CUTLASS's
    for ``sm90``, Triton's for ``cuda:90``: a Hopper host without nvcc fetches all three."""
    libraries = [cuda_w4a16.library({"split": "k", "slices": 2, "stages": 2}).artifact_spec(),
                 cuda_fp8.library({"stages": 6, "atoms": 2, "cluster": 2}).artifact_spec()]  # fmt: skip
    cutlass = ArtifactSpec("cutlass", {"kernel": "k"}, "sm90", {"cutlass": "4.2.0.0"})
    with ArtifactStore(tmp_path / "builder") as store, fleet.client("builder", "build") as c:
        for s in [*libraries, cutlass, spec("mm")]:
            store.put(s, bundle(s.source))
        assert push_artifacts(c, store).published == 4
    a100 = Fingerprint("cuda", "NVIDIA A100-SXM4-80GB", "8.0", 108, 80)
    assert host_archs(a100) == ["cuda:80", "sm80"]
    with (
        fleet.client("hopper", "read") as c,
        ArtifactStore(tmp_path / "hopper") as host,
        Store(tmp_path / "hopper.db") as cache,
    ):
        assert sync_artifacts(c, host, cache, host_archs(H100)).fetched == 4
        assert all(host.get(s) is not None for s in libraries)


def test_a_corrupted_download_is_rejected_and_not_stored(
    fleet: ThreadServer, builder: ArtifactStore, tmp_path: Path
) -> None:
    with fleet.client("builder", "build") as c:
        push_artifacts(c, builder, [spec("mm")])
    blob = default_dir(fleet.db) / sha256(bundle("mm"))
    data = bytearray(blob.read_bytes())
    data[600] ^= 0xFF  # one flipped bit inside the cubin, same size
    blob.write_bytes(bytes(data))
    with (
        fleet.client("host-b", "read") as c,
        ArtifactStore(tmp_path / "host-b") as host,
        Store(tmp_path / "host-b.db") as cache,
    ):
        out = fetch_artifacts(c, host, [spec("mm")])
        assert out.fetched == 0 and len(out.rejected) == 1
        assert f"expected {sha256(bundle('mm'))}; rejected" in out.rejected[0]
        assert host.get(spec("mm")) is None and host.hashes() == {}
        assert list(host.blobs.iterdir()) == []  # not even a blob file
        synced = sync_artifacts(c, host, cache, ["cuda:90"])
        assert synced.fetched == 0 and len(synced.rejected) == 1 and host.hashes() == {}
        blob.write_bytes(b"short")  # truncated on the service: also refused
        assert "rejected" in fetch_artifacts(c, host, [spec("mm")]).rejected[0]
        assert host.hashes() == {}


def test_builds_that_differ_are_reported_never_mixed(
    fleet: ThreadServer, builder: ArtifactStore, tmp_path: Path
) -> None:
    with fleet.client("builder", "build") as c:
        push_artifacts(c, builder, [spec("mm")])
    with ArtifactStore(tmp_path / "builder-2") as other, fleet.client("builder-2", "build") as c:
        other.put(spec("mm"), bundle("mm-rebuilt"))
        assert push_artifacts(c, other).conflicts == 1
        check = check_artifacts(c, other)
        assert not check.clean and not check.local
        (conflict,) = check.service
        assert conflict["served"] == sha256(bundle("mm"))
        assert {b["hash"] for b in conflict["builds"]} == {
            sha256(bundle("mm")), sha256(bundle("mm-rebuilt"))
        }  # fmt: skip
        fetched = fetch_artifacts(c, other, [spec("mm")])  # the served build, kept apart here
        assert fetched.fetched == 1
        assert other.get(spec("mm")) == bundle("mm-rebuilt")  # its first one stays served here
        assert len(check_artifacts(None, other).local) == 1


def test_a_service_restored_from_an_older_backup_is_listed_from_the_start(
    builder: ArtifactStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The restored service keeps its id but not the builds published after its backup: the
    next one published takes a number the host has passed, and would never be fetched."""
    db, saved = tmp_path / "fleet.db", tmp_path / "backup.db"
    with (
        ArtifactStore(tmp_path / "host") as host,
        Store(tmp_path / "host.db") as cache,
        ArtifactStore(tmp_path / "builder-2") as later,
    ):
        with ThreadServer(db) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            b = FleetClient(srv.url, srv.token("builder", "build"))  # kept across the restore
            c = FleetClient(srv.url, srv.token("host", "read"))
            push_artifacts(b, builder, [spec("mm")])
            backup(db, saved)
            push_artifacts(b, builder, [spec("attn")])
            assert sync_artifacts(c, host, cache, ["cuda:90"]).fetched == 2
        restore(db, saved)
        with ThreadServer(db, port=port):
            with caplog.at_level("WARNING", logger="tuner.fleet.sync"):
                assert sync_artifacts(c, host, cache, ["cuda:90"]).present == 1
            assert "at sequence number 1, behind this host's position 2 with it" in caplog.text
            later.put(spec("new"), bundle("new"))
            assert push_artifacts(b, later).published == 1
            assert sync_artifacts(c, host, cache, ["cuda:90"]).fetched == 1
            assert host.get(spec("new")) == bundle("new")


def test_background_sync_fetches_the_artifacts_of_its_arch(
    fleet: ThreadServer, builder: ArtifactStore, tmp_path: Path
) -> None:
    """Kernels that arrive without new winners still tell the dispatcher (``on_change``): a
    winner it refused for want of a kernel may serve now."""
    with fleet.client("builder", "build") as c:
        push_artifacts(c, builder)
    changes = []
    with fleet.client("host", "read") as c, ArtifactStore(tmp_path / "host") as host:
        sync = BackgroundSync(c, tmp_path / "host.db", push=False, fingerprints=lambda: [H100],
                              artifacts=host, on_change=lambda: changes.append(1))  # fmt: skip
        with Store(tmp_path / "host.db") as cache:
            sync.sync_once(cache)
            assert host.get(spec("mm")) == bundle("mm")
            assert host.get(spec("old", "cuda:80")) is None
            assert len(changes) == 1  # no winners on the service: the kernels alone
            sync.sync_once(cache)
            assert len(changes) == 1  # nothing new


def test_push_artifacts_and_artifacts_check_commands(
    fleet: ThreadServer, builder: ArtifactStore, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from tuner.cli.main import app

    def cli(store: Path, *args: str) -> tuple[int, str]:
        env = {"COLUMNS": "200", "TUNER_CACHE": str(tmp_path / "cache.db"),
               "TUNER_ARTIFACTS": str(store), "TUNER_SERVER": fleet.url}  # fmt: skip
        r = CliRunner().invoke(app, list(args), env=env)
        return r.exit_code, r.output

    code, out = cli(builder.root, "push", "--artifacts", "--token", fleet.token("b", "build"))
    assert code == 0 and "published 3 compiled kernels (0 already there" in out
    code, out = cli(builder.root, "artifacts", "--check", "--token", fleet.token("r", "read"))
    assert code == 0 and "3 compiled kernels" in out and "no conflicting builds" in out
    with ArtifactStore(tmp_path / "builder-2") as other:
        other.put(spec("mm"), bundle("mm-rebuilt"))
    code, out = cli(other.root, "push", "--artifacts", "--token", fleet.token("h", "submit"))
    assert code == 1 and "this needs 'build'" in out
    code, out = cli(
        tmp_path / "builder-2", "push", "--artifacts", "--token", fleet.token("b2", "build")
    )
    assert code == 0 and "1 differing from the build the service serves" in out
    code, out = cli(builder.root, "artifacts", "--check", "--token", fleet.token("r2", "read"))
    assert code == 1 and f"service: spec {spec('mm').id[:12]}" in out

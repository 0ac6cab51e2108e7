"""The artifact store on real files: round trip, LRU eviction, corruption, verified downloads,
conflicts, and two processes writing one store at once."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tuner.cache.artifacts import (
    ArtifactError,
    ArtifactSpec,
    ArtifactStore,
    default_root,
    pack,
    sha256,
    unpack,
)
from tuner.cache.sqlite import StoreError


def spec(name: str, **config: object) -> ArtifactSpec:
    return ArtifactSpec("triton", {"kernel": name, **config}, "cuda:90", {"triton": "3.9.0"})


def test_round_trip_and_stable_ids(tmp_path: Path) -> None:
    bundle = pack({"k.cubin": b"\x7fELF cubin", "k.json": b'{"name": "k"}'})
    with ArtifactStore(tmp_path / "a") as store:
        digest = store.put(spec("k"), bundle)
        assert digest == sha256(bundle)
        assert store.get(spec("k")) == bundle
        assert store.get(spec("other")) is None
    with ArtifactStore(tmp_path / "a") as again:  # reopened: the index persisted
        assert unpack(again.get(spec("k")) or b"") == {
            "k.cubin": b"\x7fELF cubin",
            "k.json": b'{"name": "k"}',
        }
    a = ArtifactSpec("s", {"b": 1, "a": [1, 2]}, "sm90", {"x": "1"})
    b = ArtifactSpec("s", {"a": [1, 2], "b": 1}, "sm90", {"x": "1"})
    assert a.id == b.id and a.id != ArtifactSpec("s", {"a": [1, 2], "b": 1}, "sm80", {"x": "1"}).id
    assert ArtifactSpec.from_json(a.to_json()) == a


def test_bundles_are_deterministic_and_flat() -> None:
    files = {"b.json": b"{}", "a.cubin": b"\x00" * 100}
    assert pack(files) == pack(dict(reversed(list(files.items()))))
    with pytest.raises(ArtifactError, match="not allowed"):
        pack({"../escape": b""})
    with pytest.raises(ArtifactError, match="not an artifact bundle"):
        unpack(b"garbage" * 100)


def test_bad_specs_name_the_field() -> None:
    with pytest.raises(ArtifactError, match="source"):
        ArtifactSpec("", {}, "sm90")
    with pytest.raises(ArtifactError, match="toolchain"):
        ArtifactSpec("cutlass", {}, "sm90", {"nvcc": 13})  # type: ignore[dict-item]
    with pytest.raises(ArtifactError, match="JSON"):
        ArtifactSpec("cutlass", {"x": object()}, "sm90")


def test_eviction_drops_least_recently_used(tmp_path: Path) -> None:
    blob = {name: pack({"k.bin": name.encode() * 400}) for name in "abcd"}
    size = len(blob["a"])
    with ArtifactStore(tmp_path, max_bytes=3 * size) as store:
        for name in "abc":
            store.put(spec(name), blob[name])
        assert store.get(spec("a")) == blob["a"]  # a is now more recent than b and c
        store.put(spec("d"), blob["d"])
        assert store.get(spec("b")) is None  # the least recently used went first
        assert {store.get(spec(n)) for n in "acd"} == {blob[n] for n in "acd"}
        assert sum(e.size for e in store.entries()) <= 3 * size
        assert not (store.blobs / sha256(blob["b"])).exists()
        with pytest.raises(ArtifactError, match="TUNER_ARTIFACTS_MAX_BYTES"):
            store.put(spec("huge"), b"x" * (3 * size + 1))


def test_corrupt_blob_is_reported_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bundle = pack({"k.cubin": b"good bytes" * 50})
    with ArtifactStore(tmp_path) as store:
        digest = store.put(spec("k"), bundle)
        path = store.blobs / digest
        path.write_bytes(bundle[:-1] + b"!")  # one flipped byte
        with caplog.at_level(logging.ERROR, logger="tuner.cache.artifacts"):
            assert store.get(spec("k")) is None
        assert "corrupt" in caplog.text
        assert not path.exists() and store.entries() == []
        assert store.put(spec("k"), bundle) == digest  # a fresh copy is accepted again
        assert store.get(spec("k")) == bundle


def test_add_verified_rejects_a_wrong_hash(tmp_path: Path) -> None:
    bundle = pack({"k.so": b"module"})
    with ArtifactStore(tmp_path) as store:
        with pytest.raises(ArtifactError, match="expected " + sha256(b"other")):
            store.add_verified(spec("k"), sha256(b"other"), bundle)
        with pytest.raises(ArtifactError, match="expected_hash"):
            store.add_verified(spec("k"), "not-a-hash", bundle)
        assert store.get(spec("k")) is None and list(store.blobs.iterdir()) == []
        assert store.add_verified(spec("k"), sha256(bundle), bundle) == sha256(bundle)
        assert store.get(spec("k")) == bundle


def test_two_hashes_for_one_spec_are_a_conflict(tmp_path: Path) -> None:
    first, second = pack({"k.so": b"build one"}), pack({"k.so": b"build two"})
    with ArtifactStore(tmp_path) as store:
        store.put(spec("k"), first)
        store.put(spec("k"), first)  # the same bytes again are no conflict
        assert store.conflicts() == []
        store.add_verified(spec("k"), sha256(second), second)
        assert store.get(spec("k")) == first  # never silently replaced
        [conflict] = store.conflicts()
        assert conflict.spec == spec("k")
        assert conflict.hashes == (sha256(first), sha256(second))
        assert (store.blobs / sha256(second)).read_bytes() == second  # kept apart


def test_conflicting_builds_are_evicted_before_any_served_one(tmp_path: Path) -> None:
    """A conflict is never served (it shows a build is not reproducible): it goes first, and a
    spec's own conflicts never hold the store past its limit, where the next put of another
    spec would evict that spec's served build."""
    blob = {name: pack({"k.bin": name.encode() * 400}) for name in ("a", "a2", "a3", "b", "c")}
    size = len(blob["a"])
    with ArtifactStore(tmp_path, max_bytes=3 * size) as store:
        store.put(spec("a"), blob["a"])
        for again in ("a2", "a3"):  # two more builds of a, each kept apart while they fit
            store.add_verified(spec("a"), sha256(blob[again]), blob[again])
        assert [c.hashes for c in store.conflicts()] == [
            tuple(sha256(blob[n]) for n in ("a", "a2", "a3"))
        ]
        store.put(spec("b"), blob["b"])  # over the limit: the oldest conflict goes
        store.put(spec("c"), blob["c"])  # and the other one
        assert store.conflicts() == []
        assert {store.get(spec(n)) for n in "abc"} == {blob[n] for n in "abc"}
        assert sorted(p.name for p in store.blobs.iterdir()) == sorted(
            sha256(blob[n]) for n in "abc"
        )


def test_a_read_only_index_still_serves_its_artifacts(tmp_path: Path) -> None:
    """A baked image or a read-only mount: a read cannot note its use, and serves anyway."""
    from tests.cache.read_only import frozen_folder, read_only

    bundle = pack({"k.so": b"module"})
    with ArtifactStore(tmp_path) as store:
        store.put(spec("k"), bundle)
    with frozen_folder(tmp_path), read_only(tmp_path / "index.db"), ArtifactStore(tmp_path) as ro:
        assert ro.get(spec("k")) == bundle


def test_an_unreadable_index_is_never_written(tmp_path: Path) -> None:
    (tmp_path / "index.db").write_bytes(b"not a database at all" * 10)
    with pytest.raises(StoreError, match="not a SQLite database"):
        ArtifactStore(tmp_path)
    assert not (tmp_path / "blobs").exists()
    other = tmp_path / "other"
    other.mkdir()
    sqlite3.connect(other / "index.db").execute("create table t(x)").connection.commit()
    with pytest.raises(StoreError, match="not a tuner artifact index"):
        ArtifactStore(other)


def test_settings_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TUNER_ARTIFACTS", raising=False)
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "c" / "tuner.db"))
    assert default_root() == tmp_path / "c" / "artifacts"
    monkeypatch.setenv("TUNER_ARTIFACTS", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TUNER_ARTIFACTS_MAX_BYTES", "1234")
    store = ArtifactStore()
    assert store.root == tmp_path / "elsewhere" and store.max_bytes == 1234
    store.close()
    monkeypatch.setenv("TUNER_ARTIFACTS_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match=r"TUNER_ARTIFACTS_MAX_BYTES.*'lots'"):
        ArtifactStore()


WRITER = textwrap.dedent(
    """
    import sys
    from tuner.cache.artifacts import ArtifactSpec, ArtifactStore, pack
    root, who = sys.argv[1], sys.argv[2]
    store = ArtifactStore(root, max_bytes=1 << 30)
    for i in range(60):
        # every writer stores its own kernels and the shared ones, with the same bytes
        for name in (f"{who}-{i}", f"shared-{i}"):
            spec = ArtifactSpec("triton", {"kernel": name}, "cuda:90", {})
            store.put(spec, pack({"k.bin": name.encode() * 200}))
            assert store.get(spec) is not None
    """
)


def test_two_processes_writing_at_once(tmp_path: Path) -> None:
    ArtifactStore(tmp_path).close()  # the index exists: the writers race on writes, not on creation
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), who]) for who in ("p", "q")
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    with ArtifactStore(tmp_path) as store:
        conn = sqlite3.connect(tmp_path / "index.db")
        assert conn.execute("pragma integrity_check").fetchone() == ("ok",)
        assert len(store.entries()) == 180 and store.conflicts() == []
        for who in ("p", "q", "shared"):
            for i in range(60):
                name = f"{who}-{i}"
                got = store.get(ArtifactSpec("triton", {"kernel": name}, "cuda:90", {}))
                assert got is not None and unpack(got) == {"k.bin": name.encode() * 200}
        assert not list(store.blobs.glob("*.tmp"))


def test_a_file_where_the_store_folder_belongs_is_named(tmp_path: Path) -> None:
    taken = tmp_path / "out.json"
    taken.write_text("{}")
    with pytest.raises(StoreError, match=r"out\.json is a file, not a folder for compiled kernels"):
        ArtifactStore(taken)
    assert taken.read_text() == "{}"


def test_a_conflict_the_limit_cannot_hold_is_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second build that pushes the store past its limit goes at once, before any served
    build, and the warning says it was not kept."""
    blob = {name: pack({"k.bin": name.encode() * 400}) for name in ("a", "a2", "b")}
    size = len(blob["a"])
    with ArtifactStore(tmp_path, max_bytes=2 * size) as store:
        store.put(spec("a"), blob["a"])
        store.put(spec("b"), blob["b"])
        with caplog.at_level(logging.WARNING, logger="tuner.cache.artifacts"):
            store.add_verified(spec("a"), sha256(blob["a2"]), blob["a2"])
        assert "the first stays served, the second not kept" in caplog.text
        assert store.conflicts() == []
        assert {store.get(spec(n)) for n in "ab"} == {blob[n] for n in "ab"}


def test_a_conflict_too_big_to_stay_spares_the_other_specs_conflicts(tmp_path: Path) -> None:
    """Where the new conflict cannot fit even with every other conflict gone, it goes alone."""
    blob = {name: pack({"k.bin": name.encode() * 400}) for name in ("a", "b", "b2")}
    size = len(blob["a"])
    big = pack({"k.bin": b"A" * 2 * size})  # (bundles are tar records: whole blocks)
    with ArtifactStore(tmp_path, max_bytes=3 * size + size // 2) as store:
        store.put(spec("a"), blob["a"])
        store.put(spec("b"), blob["b"])
        store.add_verified(spec("b"), sha256(blob["b2"]), blob["b2"])  # fits: kept
        store.add_verified(spec("a"), sha256(big), big)  # cannot fit beside a and b
        assert [c.spec for c in store.conflicts()] == [spec("b")]
        assert {store.get(spec(n)) for n in "ab"} == {blob[n] for n in "ab"}

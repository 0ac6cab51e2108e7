"""Files written by the release before the cache and the fleet service got separate schemas open
with their data, and each kind of file is refused by the other's store without a write.

The fixtures under tests/data/compat were made with that release (schema 2 in a ``meta`` table,
one shared schema) by a script run from the repository root; in short::

    FP = Fingerprint("cpu", "x86_64", "", 2, 0, versions={"torch": "2.5.0", "tuner": "0.1.0"})
    K1, K2 = gemm keys m=64 and m=128 (n=k=64, f32); K3 = an f32 sdpa key; K4 = gemm m=256
    ms(key, run) = [torch baseline 10 us (uid run-torch-0001), triton {"bm": 16} 8 us
                    (uid run-triton-001)], versions=FP.version_tag, host "a"
    with Store("cache-v2.db") as s:
        s.save_device(FP)
        s.save_run(ms(K1, "r1"), Winner(DC, K1, "triton", {"bm": 16}, 8.0, 10.0, run_id="r1"))
        s.save_run(ms(K2, "r2"), Winner(DC, K2, "torch", {}, 10.0, 10.0, run_id="r2"))
        s.record_misses(DC, [K3], count=3)
        sync_state ('pull:x', 7); reported_misses (DC, K3, 1)
    with ThreadServer("fleet-v2.db") as srv:     # server.live
        tokens admin (admin), host-a (submit), reader (read)
        host-a submits ms(K1, "r1") + ms(K2, "r2"); reports misses K3 x4, K4 x2; claims 1 key
    then each file is checkpointed and set to journal_mode=delete.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from server.store import FleetStore
from tests.cache.read_only import read_only
from tuner.cache import ReadOnlyError, Store, StoreError
from tuner.cache.schema import CACHE, SERVICE_TABLES
from tuner.core.keys import SdpaKey, parse_key

DATA = Path(__file__).parents[1] / "data" / "compat"
DC = "cpu-x86-64-2c"
K1 = "gemm:m=64,n=64,k=64,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
K2 = "gemm:m=128,n=64,k=64,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
SCOPE = "http://127.0.0.1:8000#1f2e"  # cache-v4.db's service (its push position and mark)


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copy(DATA / name, tmp_path / name))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def altered(path: Path, *statements: str) -> Path:
    """``path`` after ``statements``, run and committed by a plain SQLite connection."""
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return path


def schema_of(path: Path) -> tuple[str, int, int]:
    conn = sqlite3.connect(path)
    try:
        sql = "\n".join(
            r[0] for r in conn.execute("select sql from sqlite_master order by name") if r[0]
        )
        return sql, *(
            conn.execute(f"pragma {p}").fetchone()[0] for p in ("application_id", "user_version")
        )
    finally:
        conn.close()


def test_release_cache_opens_migrated_with_its_data(tmp_path):
    path = copy("cache-v2.db", tmp_path)
    with Store(path) as s:
        assert s.schema_version() == CACHE.version
        winners = {w.key: w for w in s.winners(DC)}
        assert set(winners) == {K1, K2}
        assert winners[K1].candidate == 'triton:{"bm":16}' and winners[K1].median_us == 8.0
        assert {w.launch for w in winners.values()} == {"eager"}
        assert len(s.measurements(DC)) == 4
        assert [(m["key"].split(":")[0], m["count"]) for m in s.misses(DC)] == [("sdpa", 3)]
        assert s.position("pull:x") == 7
        assert s.devices()[0]["device_class"] == DC
        tables = set(s.db.table_names())
    assert not tables & {*SERVICE_TABLES, "meta"}  # the service's tables left the cache


def test_release_fleet_database_is_refused_by_the_cache_untouched(tmp_path):
    path = copy("fleet-v2.db", tmp_path)
    before = digest(path)
    with pytest.raises(StoreError, match=r"fleet database.*tuner serve"):
        Store(path)
    assert digest(path) == before


def test_migrated_files_are_refused_by_the_other_kind(tmp_path):
    cache, fleet = copy("cache-v2.db", tmp_path), copy("fleet-v2.db", tmp_path)
    Store(cache).close()
    FleetStore(fleet).close()
    for path, other, kind in (
        (cache, FleetStore, "is a tuner cache"),
        (fleet, Store, "is a tuner fleet database"),
    ):
        before = digest(path)
        with pytest.raises(StoreError, match=kind):
            other(path)
        assert digest(path) == before


def test_foreign_application_id_is_refused_untouched(tmp_path):
    path = altered(tmp_path / "other.db", "pragma application_id = 1234", "create table t (x)")
    before = digest(path)
    with pytest.raises(StoreError, match=r"another application \(application_id=0x4d2\)"):
        Store(path)
    assert digest(path) == before


def test_a_failing_migration_leaves_the_file_as_it_was(tmp_path):
    """All migrations run in one transaction: one that fails undoes those before it."""
    # a column the launch migration would add makes it fail
    path = altered(copy("cache-v2.db", tmp_path), "alter table winners add column launch text")
    before = schema_of(path)
    with pytest.raises(StoreError, match="corrupt or not a tuner cache"):
        Store(path)
    assert schema_of(path) == before  # the srv_* tables and meta are still there: rolled back
    assert "srv_tokens" in before[0]


# cache-v3.db: cache-v2.db opened once by the release before schema 4 (c395656), which migrated
# it to schema 3; then checkpointed and set to journal_mode=delete, as above.


def test_a_schema_3_cache_migrates_and_keeps_its_positions_without_marks(tmp_path):
    path = copy("cache-v3.db", tmp_path)
    with Store(path) as s:
        assert s.winner(DC, K1).source == "triton"
        assert (s.position("pull:x"), s.mark("pull:x")) == (7, None)
        s.set_position("pull:x", 8, "a mark")
        assert s.mark("pull:x") == "a mark"
    assert schema_of(path)[2] == CACHE.version


def test_a_read_only_schema_3_cache_is_read_as_it_is(tmp_path, caplog):
    """An older release's cache baked read-only into an image: its winners still serve (no
    migration can be written), and every write is refused naming the file."""
    path = copy("cache-v3.db", tmp_path)
    with read_only(path) as before, caplog.at_level("WARNING"), Store(path) as s:
        assert s.winner(DC, K1).source == "triton" and s.mark("pull:x") is None
        assert f"read as it is (not migrated to {CACHE.version})" in caplog.text
        for write in (
            lambda: s.record_misses(DC, [K2]),
            lambda: s.set_position("pull:x", 8, "a mark"),  # a column schema 3 lacks
        ):
            with pytest.raises(ReadOnlyError, match="is read-only"):
                write()
        assert path.read_bytes() == before


def test_a_read_only_cache_older_than_schema_3_is_refused(tmp_path):
    path = copy("cache-v2.db", tmp_path)
    with read_only(path) as before, pytest.raises(ReadOnlyError, match="is read-only"):
        Store(path)
    assert path.read_bytes() == before


# cache-v4.db: cache-v3.db opened once by the release of schema 4 (25b9e3e), which migrated it to
# schema 4, then set_position(f"push:{SCOPE}", 4, "r2-triton-001"); checkpointed and set to
# journal_mode=delete, as above.


def test_a_schema_4_cache_migrates_keeping_its_positions_and_marks(tmp_path):
    """Its sync positions and marks are kept; its miss reports, which do not say to which
    service they went, are dropped: every count is reported in full again to each service."""
    path = copy("cache-v4.db", tmp_path)
    with Store(path) as s:
        assert s.winner(DC, K1).source == "triton" and len(s.measurements(DC)) == 4
        assert (s.position("pull:x"), s.mark("pull:x")) == (7, None)
        assert (s.position(f"push:{SCOPE}"), s.mark(f"push:{SCOPE}")) == (4, "r2-triton-001")
        ((k3, count),) = [(m["key"], m["count"]) for m in s.misses(DC)]
        assert count == 3  # 1 of them reported (to SCOPE's service or another: not said)
        for service in (SCOPE, "http://127.0.0.1:9000#3c4d"):
            assert s.unreported_misses(DC, service=service) == [(k3, 3, 3)]
        s.mark_reported(DC, [(k3, 3)], service=SCOPE)
        assert s.unreported_misses(DC, service=SCOPE) == []
    assert schema_of(path)[2] == CACHE.version


def test_a_read_only_schema_4_cache_is_read_as_it_is(tmp_path, caplog):
    """Its miss reports are read as the release that wrote it read them, for every service
    alike; marking one is refused as every write is."""
    path = copy("cache-v4.db", tmp_path)
    with read_only(path) as before, caplog.at_level("WARNING"), Store(path) as s:
        assert s.winner(DC, K1).source == "triton" and s.mark(f"push:{SCOPE}") == "r2-triton-001"
        assert f"at schema version 4: read as it is (not migrated to {CACHE.version})" in (
            caplog.text
        )
        ((k3, _, _),) = s.unreported_misses(DC, service=SCOPE)
        assert s.unreported_misses(DC, service="http://other:1") == [(k3, 2, 3)]
        with pytest.raises(ReadOnlyError, match="is read-only"):
            s.mark_reported(DC, [(k3, 3)], service=SCOPE)
        assert path.read_bytes() == before


def test_sdpa_keys_of_the_default_scale_written_another_way_join_the_defaults(tmp_path):
    """Schema 6: a model passing ``scale=head_dim ** -0.5`` (one rounding away from
    1 / sqrt(head_dim)) made keys of its own, which the default's winners never served; the
    fixture's miss is one. Its rows take the default's key: misses and reports add up, the
    newer winner stays."""
    path = copy("cache-v4.db", tmp_path)
    conn = sqlite3.connect(path)
    ((written,),) = conn.execute("select key from misses").fetchall()
    canonical = str(parse_key(written))
    assert written.endswith("scale=0.1767766952966369") and canonical != written
    row = "(?, ?, 'sdpa', 'torch_sdpa', 'torch_sdpa', '{}', 5.0, 5.0, 1.0, '', '', ?, 'eager')"
    conn.executemany(
        f"insert into winners values {row}",
        [(DC, written, 200.0), (DC, canonical, 100.0)],
    )
    conn.execute("insert into misses values (?, ?, 'sdpa', 2, 50.0, 60.0)", (DC, canonical))
    conn.commit()
    conn.close()
    with Store(path) as s:
        (miss,) = s.misses(DC)
        assert (miss["key"], miss["count"]) == (canonical, 3 + 2)
        (winner,) = [w for w in s.winners(DC) if w.op == "sdpa"]
        assert (winner.key, winner.updated_at) == (canonical, 200.0)
        assert winner.key == str(SdpaKey(1, 4, 4, 16, 16, 32, dtype="f32", scale=32**-0.5))


def test_a_legacy_version_that_is_no_number_is_refused_naming_it_and_leaves_nothing_open(tmp_path):
    from tuner.cache.sqlite import _OPEN_FILES

    path = altered(
        copy("cache-v2.db", tmp_path), "update meta set value = '' where name = 'schema_version'"
    )
    before = digest(path)
    with pytest.raises(StoreError, match=r"meta.schema_version is '', not a whole number"):
        Store(path)
    assert digest(path) == before and not _OPEN_FILES.get(str(path.resolve()))

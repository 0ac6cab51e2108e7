"""The SQLite store: round trips, export/import, and refusing files that are not ours."""

import contextlib
import json
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
import sqlite_utils

from tests.cache.damaged import damaged_cache
from tests.cache.full_disk import file_size_limit
from tests.cache.read_only import frozen_folder, read_only
from tuner.cache import ReadOnlyError, Store, StoreError, WriteFailedError
from tuner.cache.schema import CACHE
from tuner.cache.store import EXPORTED_TABLES, EXPORTED_VERSION
from tuner.measure.records import Measurement, Winner, candidate_name, candidate_params

KEY = "gemm:m=8,n=8,k=8,batch=1,layout=nn,dtype=f32,out_dtype=f32,compute=f32,align=16"
OTHER_KEY = KEY.replace("m=8", "m=16")


def measurement(**kw) -> Measurement:
    fields = dict(
        device_class="cpu-test",
        key=KEY,
        source="torch",
        params={},
        status="ok",
        is_baseline=True,
        median_us=10.0,
        p10_us=9.0,
        p90_us=11.0,
        reps=5,
    )
    return Measurement(**(fields | kw))


def winner(**kw) -> Winner:
    return Winner(
        **(
            dict(
                device_class="cpu-test",
                key=KEY,
                source="triton_gemm",
                params={"bm": 32},
                median_us=5.0,
                baseline_us=10.0,
            )
            | kw
        )
    )


def test_save_run_and_read_back(tmp_path):
    with Store(tmp_path / "c.db") as store:
        rejected = measurement(
            source="bad",
            is_baseline=False,
            status="rejected",
            median_us=None,
            error="relative error 1 > tolerance 0.01",
        )
        store.save_run([measurement(), rejected], winner())
        w = store.winner("cpu-test", KEY)
        assert w.params == {"bm": 32} and w.speedup == 2.0
        assert [m.status for m in store.measurements("cpu-test", KEY)] == ["ok", "rejected"]
        assert store.measurements()[1].error.startswith("relative error")
        assert store.winners("other-class") == []


def test_newer_run_replaces_the_winner(tmp_path):
    with Store(tmp_path / "c.db") as store:
        store.put_winners([winner()])
        store.put_winners([winner(source="torch", params={}, median_us=10.0)])
        assert [w.source for w in store.winners()] == ["torch"]


def test_misses_are_counted(tmp_path):
    with Store(tmp_path / "c.db") as store:
        store.record_misses("cpu-test", [KEY])
        store.record_misses("cpu-test", [KEY, KEY.replace("m=8", "m=9")])
        counts = {m["key"]: m["count"] for m in store.misses("cpu-test")}
        assert counts[KEY] == 2 and len(counts) == 2
        store.clear_misses("cpu-test", [KEY])
        assert len(store.misses()) == 1


def test_miss_reports_are_kept_per_service(tmp_path):
    """What was reported to one fleet service says nothing of another, and forgetting one's
    reports (it was restored from an older backup) leaves the other's."""
    one, two = "http://h:80#1f2e", "http://h:81#3c4d"
    other = KEY.replace("m=8", "m=9")
    with Store(tmp_path / "c.db") as store:
        store.record_misses("cpu-test", [KEY], count=3)
        store.record_misses("cpu-test", [other])
        store.mark_reported("cpu-test", [(KEY, 3), (other, 1)], service=one)
        assert store.unreported_misses("cpu-test", service=one) == []
        assert sorted(store.unreported_misses("cpu-test", service=two)) == [
            (KEY, 3, 3), (other, 1, 1)
        ]  # fmt: skip
        store.mark_reported("cpu-test", [(KEY, 3), (other, 1)], service=two)
        store.record_misses("cpu-test", [KEY], count=2)
        store.forget_reported_misses(one)
        assert sorted(store.unreported_misses("cpu-test", service=one)) == [
            (KEY, 5, 5), (other, 1, 1)
        ]  # fmt: skip
        assert store.unreported_misses("cpu-test", service=two) == [(KEY, 2, 5)]


def test_a_miss_report_without_a_service_is_refused(tmp_path):
    """The previous release, still running on a file this one migrated, marks its reports
    without a service: refused, instead of rows that its unscoped reads would count twice."""
    with Store(tmp_path / "c.db") as store:
        store.record_misses("cpu-test", [KEY], count=3)
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            store.db.conn.execute(
                "insert or replace into reported_misses(device_class, key, reported) "
                "values (?, ?, ?)",
                ("cpu-test", KEY, 3),
            )
        assert store.unreported_misses("cpu-test", service="http://h:80#1f2e") == [(KEY, 3, 3)]


def test_export_import_is_idempotent(tmp_path):
    with Store(tmp_path / "a.db") as a:
        a.save_run([measurement()], winner())
        data = json.loads(json.dumps(a.export()))
    with Store(tmp_path / "b.db") as b:
        assert b.import_(data)["measurements"] == 1
        assert b.import_(data)["measurements"] == 0  # same uids: nothing added twice
        assert b.winner("cpu-test", KEY).candidate == winner().candidate


def test_an_export_names_the_last_schema_that_changed_what_it_holds(tmp_path):
    """An export imports into a release whose schema differs only in tables it does not hold:
    its version is the last one that changed those, and every migration since left them as
    they were (a migration that changes one must bump ``EXPORTED_VERSION``)."""

    def exported_tables(version: int) -> dict[str, str]:
        db = sqlite_utils.Database(memory=True)
        for step in CACHE.migrations[:version]:
            step(db)
        return {t: db[t].schema for t in EXPORTED_TABLES}

    with Store(tmp_path / "c.db") as store:
        assert store.export()["schema_version"] == EXPORTED_VERSION <= CACHE.version
    assert exported_tables(EXPORTED_VERSION) == exported_tables(CACHE.version)


def test_import_keeps_the_newer_winner_and_counts_what_changed(tmp_path):
    other = KEY.replace("m=8", "m=9")
    old_export = {"format": "tuner-results", "winners": [
        winner(updated_at=1.0).to_row(), winner(key=other, updated_at=1.0).to_row()]}  # fmt: skip
    with Store(tmp_path / "c.db") as store:
        store.put_winners([winner(source="torch", params={}, updated_at=2.0)])  # re-tuned since
        counts = store.import_(old_export)
        assert (counts["winners"], counts["older_winners"]) == (1, 1)  # the other key is added
        assert store.winner("cpu-test", KEY).source == "torch"
        newer = {"format": "tuner-results", "winners": [winner(updated_at=3.0).to_row()]}
        assert store.import_(newer)["winners"] == 1
        assert store.winner("cpu-test", KEY).source == "triton_gemm"
        again = store.import_(newer)  # the same winner again changes nothing
        assert (again["winners"], again["older_winners"]) == (0, 0)
        # the same winner stamped earlier (the export the fleet's copy came from) is no older one
        earlier = {"format": "tuner-results", "winners": [winner(updated_at=2.5).to_row()]}
        assert store.import_(earlier)["older_winners"] == 0


def test_a_large_pulled_page_keeps_the_newer_winner_per_key(tmp_path):
    keys = [KEY.replace("m=8", f"m={m}") for m in range(1, 1001)]
    with Store(tmp_path / "c.db") as store:
        store.put_winners([winner(key=k, source="torch", params={}, updated_at=2.0) for k in keys])
        page = [
            winner(key=k, updated_at=1.0 if i % 2 else 3.0).to_row() for i, k in enumerate(keys)
        ]
        assert store.put_winner_rows(page) == 500  # the even keys' winners are newer
        sources = [store.winner("cpu-test", k).source for k in keys]
        assert sources == ["triton_gemm", "torch"] * 500


def test_a_pulled_winner_replaces_one_of_other_versions_whatever_its_date(tmp_path):
    """A feed serves winners for this host's versions: a local winner tuned under the versions
    the host ran before is stale, even when tuned after the fleet's. An import keeps the newer."""
    with Store(tmp_path / "c.db") as store:
        store.put_winners([winner(source="torch", params={}, versions="torch=OLD", updated_at=2.0)])
        fleet = winner(versions="torch=NEW", updated_at=1.0)
        assert (
            store.import_({"format": "tuner-results", "winners": [fleet.to_row()]})["winners"] == 0
        )
        assert store.put_winner_rows([fleet.to_row()]) == 1
        assert store.winner("cpu-test", KEY).versions == "torch=NEW"


def test_import_rejects_foreign_json_and_keeps_the_store(tmp_path):
    with Store(tmp_path / "a.db") as a:
        a.put_winners([winner()])
        with pytest.raises(StoreError, match="not a tuner export"):
            a.import_({"rows": []})
        with pytest.raises(StoreError, match=r"malformed export: winners\[0\]: missing field"):
            a.import_({"format": "tuner-results", "winners": [{"key": "x"}]})
        # rows that would break 'tuner show' / 'report' later: a key that does not parse, a
        # time that is not a number
        bad_key = winner().to_row() | {"key": "gemm:m=1"}
        with pytest.raises(StoreError, match=r"malformed export.*incomplete gemm key"):
            a.import_({"format": "tuner-results", "winners": [bad_key]})
        bad_time = measurement().to_row() | {"median_us": "fast"}
        with pytest.raises(StoreError, match=r"measurements\[0\]: median_us must be a number"):
            a.import_({"format": "tuner-results", "measurements": [bad_time]})
        with pytest.raises(StoreError, match=r"winners\[0\]: updated_at must be a number"):
            a.import_({"format": "tuner-results", "winners": [winner(updated_at="now").to_row()]})
        for field, value in (("median_us", float("inf")), ("baseline_us", 0.0)):
            endless = winner().to_row() | {field: value}
            with pytest.raises(StoreError, match=f"winners.0.: {field} must be a finite time"):
                a.import_({"format": "tuner-results", "winners": [endless]})
        for name in ("measurements", "winners", "devices"):
            expected = f"malformed export: {name} must be a list, got NoneType"
            with pytest.raises(StoreError, match=expected):
                a.import_({"format": "tuner-results", name: None})
        with pytest.raises(StoreError, match="schema_version must be an integer"):
            a.import_({"format": "tuner-results", "schema_version": "2"})
        newer = rf"schema version {CACHE.version + 1}: this tuner reads exports of schema "
        newer += rf"versions up to {CACHE.version} \(it writes version {EXPORTED_VERSION}\)"
        with pytest.raises(StoreError, match=newer):
            a.import_({"format": "tuner-results", "schema_version": CACHE.version + 1})
        assert len(a.winners()) == 1 and not a.measurements()


def test_import_names_each_bad_field_and_stores_none_of_the_file(tmp_path):
    """Each record is checked whole before anything is written: a NOT NULL column given null
    (which `insert or ignore` would skip silently), a value of the wrong type (which SQLite
    would refuse mid-transaction), a value no later command understands."""
    good = {
        "format": "tuner-results",
        "devices": [{"device_class": "cpu-test", "fingerprint": {}, "first_seen": 1.0,
                     "last_seen": 2.0}],
        "measurements": [measurement().to_row(), measurement(source="triton_gemm").to_row()],
        "winners": [winner().to_row()],
    }  # fmt: skip

    def edited(table: str, **fields) -> dict:
        return good | {table: [good[table][0] | fields, *good[table][1:]]}

    cases = [
        (edited("measurements", status=None), r"measurements\[0\]: status must be a string, got None"),
        (edited("measurements", status="weird"), r"status must be one of \['ok', .*got 'weird'"),
        (edited("measurements", uid=[1]), r"measurements\[0\]: uid must be a string, got \[1\]"),
        (edited("measurements", created_at=None), r"created_at must be a number"),
        (edited("winners", key=5), r"winners\[0\]: key must be a string, got 5"),
        (edited("winners", launch="sideways"), r"launch must be one of \['eager', 'graph'\]"),
        (edited("winners", updated_at=float("inf")), r"updated_at must be a finite date"),
        (edited("winners", params=[]), r"params must be an object"),
        (edited("winners", params="{notjson"), r"winners\[0\]: params must be a JSON object, got '\{notjson'"),
        (edited("devices", first_seen="x"), r"devices\[0\]: first_seen must be a number"),
        (good | {"devices": ["cpu"]}, r"devices\[0\]: must be an object of fields, got str"),
        (good | {"devices": [{"device_class": "cpu-test"}]}, r"devices\[0\]: missing field"),
    ]  # fmt: skip
    uid_less = dict(good["measurements"][0])
    del uid_less["uid"]  # a uid made up afresh would store the record again at each import
    cases.append((good | {"measurements": [uid_less]}, r"missing field\(s\) \['uid'\]"))
    with Store(tmp_path / "c.db") as store:
        for data, message in cases:
            with pytest.raises(StoreError, match="malformed export: .*" + message):
                store.import_(data)
            assert not store.winners() and not store.measurements() and not store.devices()
        # a winner that names no launch mode stands for the default, as the cache reads it; a
        # fleet-served winner's run_id may be null, as the cache keeps it
        counts = store.import_(edited("winners", launch=None, run_id=None))
        assert counts == {"measurements": 2, "winners": 1, "older_winners": 0, "devices": 1}
        assert store.winner("cpu-test", KEY).launch == "eager"
        assert store.import_(good)["measurements"] == 0  # idempotent


def test_import_refuses_an_integer_too_large_for_sqlite(tmp_path):
    """JSON's integers have no bound and SQLite's stop at 64 bits: such a number is named like
    any other bad field, not an OverflowError from inside the import's transaction."""
    huge = 10**30
    cases = [
        ({"winners": [winner(updated_at=huge).to_row()]}, r"winners\[0\]: updated_at"),
        ({"measurements": [measurement(reps=huge).to_row()]}, r"measurements\[0\]: reps"),
    ]
    with Store(tmp_path / "c.db") as store:
        for data, field in cases:
            with pytest.raises(
                StoreError, match=f"{field} must be .* within SQLite.s 64 bits, got {huge}"
            ):
                store.import_({"format": "tuner-results"} | data)
        assert not store.winners() and not store.measurements()


def test_corrupt_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "c.db"
    path.write_bytes(b"this is not a database, it is a note\n" * 10)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a SQLite database"):
        Store(path)
    assert path.read_bytes() == before


def test_a_page_damaged_inside_the_file_is_refused_before_any_write(tmp_path):
    path = tmp_path / "c.db"
    before = damaged_cache(path)
    with Store(path) as store:  # the header and the schema read fine
        with pytest.raises(StoreError, match=r"c\.db is corrupt \(.*\); refusing to use it"):
            store.save_run([measurement()], winner())
        with pytest.raises(StoreError, match="is corrupt"):
            store.verify()
    assert path.read_bytes() == before


@pytest.mark.skipif(
    not os.path.isdir("/proc/sys") or os.access("/proc/sys", os.W_OK),
    reason="needs /proc/sys, a folder this user cannot write",
)
def test_a_new_cache_in_a_folder_it_cannot_write_says_so():
    with pytest.raises(StoreError, match=r"/proc/sys is not writable, so no new file can be made"):
        Store("/proc/sys/c.db")


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("create table customers (id integer)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="another application"):
        Store(path)


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "c.db"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"pragma user_version = {CACHE.version + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer than this tuner"):
        Store(path)


def test_default_path_follows_env(tmp_path, monkeypatch):
    from tuner.cache import default_path

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "x.db"))
    assert default_path() == tmp_path / "x.db"
    monkeypatch.delenv("TUNER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_path() == tmp_path / "xdg" / "tuner" / "tuner.db"


def test_candidate_params_read_back_what_candidate_name_wrote():
    params = {"bn": 128, "fused": True, "splits": 16}
    assert candidate_params(candidate_name("triton_decode", params)) == params
    assert candidate_params(candidate_name("torch", {})) == {}  # no params: no JSON part


def test_a_read_only_file_is_read_and_its_writes_refused_naming_it(tmp_path):
    path = tmp_path / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
    with read_only(path) as before, Store(path) as store:
        assert [w.key for w in store.winners()] == [KEY]
        with pytest.raises(ReadOnlyError, match=f"{path} is read-only"):
            store.save_run([measurement()], winner(updated_at=2e9))
        assert path.read_bytes() == before


def test_check_writable_refuses_what_a_write_would_and_stores_nothing(tmp_path):
    """What a long command asks before it starts: a new cache still holds nothing after it,
    a read-only one is refused as a write would be, and neither file changes."""
    path = tmp_path / "c.db"
    with Store(path) as store:
        store.check_writable()
        assert store.holds_nothing()
        store.put_winners([winner()])
    with read_only(path) as before, Store(path) as store:
        with pytest.raises(ReadOnlyError, match=f"{path} is read-only"):
            store.check_writable()
        assert [w.key for w in store.winners()] == [KEY]  # still read after the refusal
        assert path.read_bytes() == before


def test_a_cache_in_a_folder_that_cannot_be_written_is_read_and_its_writes_refused(tmp_path):
    """A cache baked into an image or on a read-only mount: SQLite cannot put its WAL index
    beside the file, yet its winners are read; a write names the folder to make writable."""
    path = tmp_path / "baked" / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
    with frozen_folder(path.parent) as before, Store(path) as store:
        assert [w.key for w in store.winners()] == [KEY]
        with pytest.raises(ReadOnlyError, match=f"make its folder {path.parent} writable"):
            store.save_run([measurement()], winner(updated_at=2e9))
        assert {p.name: p.read_bytes() for p in path.parent.iterdir()} == before


def test_a_frozen_folders_unmerged_write_ahead_log_is_read(tmp_path):
    """Frozen while a writer was open, the folder holds rows only in the WAL file: they are
    read (a reader that took the file as immutable would not see them)."""
    path = tmp_path / "baked" / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
        store.db.conn.execute("PRAGMA wal_autocheckpoint=0")
        store.put_winners([winner(key=OTHER_KEY)])
        with frozen_folder(path.parent) as files:
            assert files["c.db-wal"]  # the second winner lies in the log only
            with Store(path) as baked:
                assert {w.key for w in baked.winners()} == {KEY, OTHER_KEY}


def test_a_winner_that_is_to_stay_is_tested_and_kept_in_one_transaction(tmp_path):
    path = tmp_path / "c.db"
    with Store(path) as store, contextlib.closing(sqlite3.connect(path, timeout=0)) as other:
        store.put_winners([winner(median_us=4.0)])

        def faster_stays(held: Winner) -> bool:
            # the write lock is held while the stored winner is judged: no other writer gets in
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("delete from winners")
            return held.median_us <= 4.5

        held = store.save_run_unless_held([measurement()], winner(median_us=4.5), faster_stays)
        assert held is not None and held.median_us == 4.0
        assert store.winner("cpu-test", KEY).median_us == 4.0
        assert len(store.measurements("cpu-test", KEY)) == 1

        replacing = winner(median_us=3.0, params={"bm": 64})
        assert store.save_run_unless_held([], replacing, lambda held: False) is None
        assert store.winner("cpu-test", KEY).params == {"bm": 64}


def test_a_key_without_a_winner_stores_the_run_and_asks_nothing(tmp_path):
    def never(held: Winner) -> bool:
        raise AssertionError("no stored winner to judge")

    with Store(tmp_path / "c.db") as store:
        assert store.save_run_unless_held([measurement()], winner(), never) is None
        assert store.winner("cpu-test", KEY).params == {"bm": 32}


def test_a_judge_that_fails_stores_nothing_and_frees_the_cache(tmp_path):
    path = tmp_path / "c.db"

    def broken(held: Winner) -> bool:
        raise OSError("journal unreadable")

    with Store(path) as store:
        store.put_winners([winner()])
        with pytest.raises(OSError, match="journal unreadable"):
            store.save_run_unless_held([measurement()], winner(median_us=1.0), broken)
        assert store.measurements() == [] and store.winner("cpu-test", KEY).median_us == 5.0
    with contextlib.closing(sqlite3.connect(path, timeout=0)) as other:
        other.execute("delete from winners")  # not locked: the transaction was rolled back


def test_judging_a_winner_in_a_read_only_cache_is_refused_as_read_only(tmp_path):
    path = tmp_path / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
    with read_only(path), Store(path) as store, pytest.raises(ReadOnlyError):
        store.save_run_unless_held([measurement()], winner(median_us=1.0), lambda held: False)


def test_a_write_the_file_system_refuses_is_rolled_back_and_said_not_raised_raw(tmp_path):
    """The disk full (here: a file-size limit) at a write: WriteFailedError, a ReadOnlyError
    (readers go on), naming the folder to look at; what was stored before stands, nothing
    of the refused write is kept, and the cache takes writes again once there is room."""
    path = tmp_path / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
        many = [measurement(key=f"{KEY},{i}", error="x" * 2000) for i in range(200)]
        with file_size_limit(64 * 1024), pytest.raises(WriteFailedError) as refused:
            store.save_run(many, winner(key=OTHER_KEY))
        assert isinstance(refused.value, ReadOnlyError)
        # a file-size limit reads as an I/O error (EFBIG); a full disk as SQLITE_FULL
        assert f"check the file system of {tmp_path} (its space, the file-size limit" in str(
            refused.value
        )
        assert not store.db.conn.in_transaction
        assert [w.key for w in store.winners()] == [KEY] and store.measurements() == []
        store.save_run([measurement()], winner(key=OTHER_KEY))
    with Store(path) as store:
        assert {w.key for w in store.winners()} == {KEY, OTHER_KEY}
        store.verify()


def test_a_rollback_that_fails_too_ends_the_transaction_by_reopening(tmp_path):
    """SQLite ends a transaction itself when the file system refuses its write (a full disk, a
    file-size limit: above), so a ROLLBACK fails only where SQLite aborts it too: interrupted
    (``interrupt()``, a progress handler: a service cancelling work) or out of memory. Here a
    progress handler aborts every statement while ``cancel`` is set, the ROLLBACK too: the
    connection must not stay inside the transaction, holding the write lock and refusing its
    own next write as nested, and nothing of the transaction is kept."""
    path = tmp_path / "c.db"
    cancel = threading.Event()
    with Store(path) as store:
        store.put_winners([winner()])
        aborted = pytest.raises(sqlite3.OperationalError, match="interrupted")
        with aborted, store.transaction() as c:
            c.execute("delete from winners")
            c.set_progress_handler(cancel.is_set, 1)
            cancel.set()
            c.execute("select count(*) from winners")  # aborted, as the ROLLBACK will be
        cancel.clear()
        assert not store.db.conn.in_transaction
        with contextlib.closing(sqlite3.connect(path, timeout=0)) as other:
            other.execute("delete from misses")  # the write lock was let go at once
        store.put_winners([winner(key=OTHER_KEY)])
        assert {w.key for w in store.winners()} == {KEY, OTHER_KEY}


def test_an_in_memory_cache_whose_rollback_fails_too_is_not_reopened_empty():
    """Reopened, an in-memory cache would be a new empty database without its tables: its
    connection is left as it is, the first error told."""
    cancel = threading.Event()
    with Store(":memory:") as store:
        store.put_winners([winner()])
        aborted = pytest.raises(sqlite3.OperationalError, match="interrupted")
        with aborted, store.transaction() as c:
            c.set_progress_handler(cancel.is_set, 1)
            cancel.set()
            c.execute("select count(*) from winners")
        cancel.clear()
        assert [w.key for w in store.winners()] == [KEY]


def test_a_cache_that_cannot_be_set_up_for_want_of_room_is_not_called_corrupt(tmp_path):
    """A new cache on a full file system: the error says so, not "corrupt ... restore it from
    a backup"; once there is room it is made as any other."""
    path = tmp_path / "c.db"
    with file_size_limit(2048), pytest.raises(StoreError) as refused:
        Store(path)
    assert "corrupt" not in str(refused.value) and f"{tmp_path}" in str(refused.value)
    with Store(path) as store:
        store.put_winners([winner()])


def test_a_device_is_refused_as_no_regular_file(tmp_path):
    with pytest.raises(StoreError, match="/dev/null is not a regular file"):
        Store("/dev/null")


def test_write_ahead_files_left_read_only_beside_a_writable_cache_are_named(tmp_path):
    """A reader of a cache that was read-only leaves its ``-wal`` and ``-shm`` files as the cache
    was; the cache made writable again, a write is refused naming them, not a raw SQLite error."""
    path = tmp_path / "c.db"
    with Store(path) as store:
        store.put_winners([winner()])
    shm = tmp_path / "c.db-shm"
    reader = Store(path)
    assert [w.key for w in reader.winners()] == [KEY] and shm.exists()
    with read_only(shm):
        reader.close()  # the -shm cannot be removed: it stays beside the file
        with Store(path) as store:
            assert [w.key for w in store.winners()] == [KEY]
            with pytest.raises(ReadOnlyError, match=f"{shm} beside it is read-only"):
                store.put_winners([winner(key=OTHER_KEY)])
    with Store(path) as store:
        store.put_winners([winner(key=OTHER_KEY)])


def test_an_older_cache_the_disk_cannot_migrate_is_refused_not_read_as_read_only(tmp_path):
    """Its migration refused for want of room: WriteFailedError naming the folder, not a cache
    read as it is and refused every later write as read-only; with room it migrates."""
    path = tmp_path / "c.db"
    shutil.copy(Path(__file__).parents[1] / "data" / "compat" / "cache-v4.db", path)
    with contextlib.closing(sqlite3.connect(path)) as reader:
        reader.execute("pragma journal_mode=wal")  # the WAL and its index made: the
        reader.execute("select count(*) from sqlite_master").fetchone()  # migration's write fails
        with file_size_limit(5000), pytest.raises(WriteFailedError, match="check the"):
            Store(path)
    with Store(path) as store:
        store.record_misses("cpu-x", ["gemm:m=1,n=1,k=1"])
        assert store.schema_version() == CACHE.version


def test_a_write_another_process_holds_the_lock_past_the_timeout_for_is_a_store_error(tmp_path):
    """SQLite's bare "database is locked" becomes a StoreError that says so, which every caller
    tells (a dispatch falls back to torch), and nothing is written."""
    path = tmp_path / "c.db"
    Store(path).close()
    with (
        Store(path, timeout_s=0.1) as store,
        contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other,
    ):
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="is locked by another process"):
            store.put_winners([winner()])
        other.execute("ROLLBACK")
        assert store.winners() == []

"""Several connections opening one new cache file at once: each finds it a tuner cache (or makes
it one), none refuses it as another application's."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
import sqlite_utils

from tuner.cache import Store
from tuner.cache.schema import CACHE


def assert_a_current_cache(path: Path) -> None:
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == CACHE.application_id
        assert conn.execute("PRAGMA user_version").fetchone()[0] == CACHE.version
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_a_file_initialised_while_it_is_checked_is_not_another_applications(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The new file as its first opener leaves it before its schema commits: in WAL mode, no
    # application_id, no tables.
    path = tmp_path / "c.db"
    sqlite3.connect(path).execute("PRAGMA journal_mode=WAL").connection.close()
    # The second opener is held after it read the application_id (0) and before it lists the
    # tables, until the first has created them and set the application_id.
    checking, initialised = threading.Event(), threading.Event()
    table_names = sqlite_utils.Database.table_names

    def held(db: sqlite_utils.Database, *args: object, **kwargs: object) -> list[str]:
        if threading.current_thread().name == "second" and not checking.is_set():
            checking.set()
            initialised.wait(10)
        return table_names(db, *args, **kwargs)

    monkeypatch.setattr(sqlite_utils.Database, "table_names", held)
    failed: list[BaseException] = []

    def second() -> None:
        try:
            Store(path).close()
        except BaseException as e:  # reported below, in the test's thread
            failed.append(e)

    t = threading.Thread(target=second, name="second")
    t.start()
    try:
        assert checking.wait(10)
        Store(path).close()
    finally:
        initialised.set()
        t.join(10)
    assert not t.is_alive()
    assert failed == []
    assert_a_current_cache(path)

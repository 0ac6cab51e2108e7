"""Several connections opening one new cache file at once: each finds it a tuner cache (or makes
it one), none refuses it as another application's or finds it locked."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
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


def test_a_new_file_another_connection_writes_is_switched_to_wal_once_it_lets_go(
    tmp_path: Path,
) -> None:
    # Another connection holds the new file's write lock (as another opener does while it
    # switches the file to WAL) when the Store switches it to WAL: SQLite refuses that switch at
    # once, without waiting.
    path = tmp_path / "c.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    let_go = threading.Timer(0.3, writer.execute, ("ROLLBACK",))
    let_go.start()
    try:
        Store(path).close()
    finally:
        let_go.join()
        writer.close()
    assert_a_current_cache(path)


OPENER = """
import json, sys, time
from pathlib import Path
from tuner.cache import Store, StoreError
folder, rounds, start, slot = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
failed = []
for i in range(rounds):
    while time.time() < start + i * slot:
        pass
    try:
        Store(folder / f"{i}.db").close()
    except StoreError as e:
        failed.append(str(e))
print(json.dumps(failed))
"""


def test_processes_opening_new_files_at_once_all_open_them(tmp_path: Path) -> None:
    processes, rounds, slot = 4, 60, 0.04
    start = time.time() + 2.0  # all started (and imported) by then, on a slow machine too
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(tmp_path), str(rounds), str(start), str(slot)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    failed = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        failed += json.loads(out.strip().splitlines()[-1])
    assert failed == []
    for i in range(rounds):
        assert_a_current_cache(tmp_path / f"{i}.db")

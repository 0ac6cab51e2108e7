"""Fleet schema 5: the log of servings by sequence number, and a schema-4 file migrated to it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from server.schema import FLEET
from server.store import FleetStore

DC, V = "cpu-x86_64-2c", "torch=2.5.0"
GROUP = (DC, V, "gemm:m=24")


def schema_4_file(path: Path) -> None:
    """A fleet database as the release of schema 4 left it: key 1 served under 1, then again
    under 3; key 2 under 2 (the counter at 3)."""
    db = sqlite_utils.Database(path)
    for step in FLEET.migrations[:4]:
        step(db)
    winner = {"op": "gemm", "candidate": "torch", "source": "torch", "params": "{}",
              "median_us": 1.0, "baseline_us": 1.0, "speedup": 1.0, "run_id": "",
              "submitters": 1}  # fmt: skip
    db["srv_winners"].insert_all([
        {"device_class": DC, "versions": V, "key": "k1", "seq": 3, "updated_at": 30.0, **winner},
        {"device_class": DC, "versions": V, "key": "k2", "seq": 2, "updated_at": 20.0, **winner},
    ])  # fmt: skip
    db.conn.execute("update srv_counters set value = 3 where name = 'winner_seq'")
    db.conn.execute(f"pragma application_id = {FLEET.application_id}")
    db.conn.execute("pragma user_version = 4")
    db.conn.commit()
    db.close()


def test_a_schema_4_file_logs_the_winners_it_serves_and_whole_from_its_counter(tmp_path):
    """Its current servings are logged under their numbers; what was replaced before (key 1
    under 1) is not, and ``log_from`` says an absence at or below 3 proves nothing."""
    path = tmp_path / "fleet.db"
    schema_4_file(path)
    with FleetStore(path) as s:
        assert s.schema_version() == FLEET.version == 6
        assert s.served_at(DC, 3) == {
            "seq": 3, "served": {"key": "k1", "versions": V, "updated_at": 30.0}, "log_from": 3
        }  # fmt: skip
        assert s.served_at(DC, 2)["served"] == {"key": "k2", "versions": V, "updated_at": 20.0}
        assert s.served_at(DC, 1) == {"seq": 1, "served": None, "log_from": 3}
        assert s.served_at("other-class", 3)["served"] is None


def test_every_serving_is_kept_after_a_later_one_replaces_it(tmp_path):
    with FleetStore(tmp_path / "fleet.db") as s:
        assert s.served_at(DC, 1) == {"seq": 1, "served": None, "log_from": 0}
        winner = {"candidate": "torch", "source": "torch", "params": "{}", "median_us": 1.0,
                  "baseline_us": 1.0, "speedup": 1.0, "run_id": "", "submitters": 1,
                  "launch": "eager"}  # fmt: skip
        with s.transaction():
            assert s.serve(GROUP, {**winner, "updated_at": 10.0}) == 1
            assert s.serve(GROUP, {**winner, "updated_at": 11.0}) == 2
        rows = s.db.conn.execute("select seq, key, updated_at from srv_served order by seq")
        assert rows.fetchall() == [(1, GROUP[2], 10.0), (2, GROUP[2], 11.0)]
        assert s.served_at(DC, 1)["served"] == {"key": GROUP[2], "versions": V, "updated_at": 10.0}


def test_a_failing_serving_log_rolls_the_serving_back(tmp_path):
    """The log row and the winner are written in one transaction: a seq already logged (only a
    damaged file could hold one) leaves the winner and its counter as they were."""
    path = tmp_path / "fleet.db"
    with FleetStore(path) as s:
        s.db.conn.execute(
            "insert into srv_served(seq, device_class, versions, key, updated_at) "
            "values (1, ?, ?, 'other', 1.0)",
            (DC, V),
        )
        s.db.conn.commit()
    with FleetStore(path) as s:
        with pytest.raises(sqlite3.IntegrityError), s.transaction():
            s.serve(GROUP, {"candidate": "torch", "source": "torch", "params": "{}",
                            "median_us": 1.0, "baseline_us": 1.0, "speedup": 1.0, "run_id": "",
                            "submitters": 1, "launch": "eager", "updated_at": 1.0})  # fmt: skip
        assert s.served_count() == 0 and s.winner_seq() == 0

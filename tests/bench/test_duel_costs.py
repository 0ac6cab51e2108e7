"""bench/duel_costs.py on a real SQLite cache: each duel's kind and seconds read back from the
verdict notes the tuning engine writes, summed by kind."""

from __future__ import annotations

import lzma
import sqlite3
from pathlib import Path

import pytest

from tests.bench_scripts import load_script

costs = load_script("duel_costs")

SUSTAINED = "rounds of 0.15 s stretches (GPU-bound or heavy calls)"
NOTES = [  # (key, the challenger's note): as trials.Trial.confirm writes it
    ("a", f"confirmation: 90.00 us vs baseline 99.00 us, host 9.0 vs 9.0 us per call; {SUSTAINED}, "
          "kept (margin 2.0%; the duel took 1.5 s)"),
    ("a", f"confirmation: 99.50 us vs baseline 99.00 us, host 9.0 vs 9.0 us per call; {SUSTAINED}, "
          "lost (margin 2.0%; the duel took 2.5 s)"),
    ("b", "host time read again: 5.0 us; confirmation: 10.00 us vs baseline 10.10 us, host 5.0 vs "
          "5.0 us per call, lost (margin 2.0%; the duel took 0.1 s)"),
    ("b", "confirmation: 10.0 us vs baseline 10.1 us, lost (margin 2.0%)"),  # not timed: left out
    ("d", "confirmation: 8.00 us vs baseline 19.00 us, host 4.0 vs 18.0 us per call; GPU 8.50 vs "
          "5.00 us in a CUDA graph (margin 2.0%), lost: slower on the GPU (margin 2.0%; the duel "
          "took 0.1 s)"),
    ("d", "confirmation: 19.00 us vs baseline 19.10 us, host 4.0 vs 18.0 us per call; GPU 8.50 vs "
          "5.00 us in a CUDA graph (margin 2.0%), lost: no faster beyond the margin, slower on "
          "the GPU (margin 2.0%; the duel took 0.1 s)"),
    ("c", "relative error 0.5 > tolerance 0.01"),  # no duel
]  # fmt: skip


def cache(path: Path) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY, key TEXT, error TEXT)")
        db.executemany("INSERT INTO measurements (key, error) VALUES (?, ?)", NOTES)
    return path


def test_duels_are_read_by_kind_and_summed(tmp_path):
    found = costs.duels(cache(tmp_path / "tuner.db"))
    assert found == {
        "a": [("Ks", 1.5), ("ls", 2.5)], "b": [("l-", 0.1)], "d": [("l-", 0.1), ("l-", 0.1)]
    }  # fmt: skip
    assert costs.by_kind(found) == {
        "Ks": {"duels": 1, "seconds": 1.5},
        "l-": {"duels": 3, "seconds": pytest.approx(0.3)},
        "ls": {"duels": 1, "seconds": 2.5},
    }


def test_lost_duels_are_counted_by_each_test_they_failed(tmp_path):
    """A loss names every test it failed; notes from before it did count as not named."""
    assert costs.loss_reasons(cache(tmp_path / "tuner.db")) == {
        "slower on the GPU": 2, "no faster beyond the margin": 1, "not named": 3
    }  # fmt: skip


def test_one_runs_duels_are_those_past_the_caches_last_id_before_it(tmp_path):
    db = cache(tmp_path / "tuner.db")
    assert costs.last_id(db) == len(NOTES) and costs.last_id(tmp_path / "none.db") == 0
    assert costs.duels(db, after=4) == {"d": [("l-", 0.1), ("l-", 0.1)]}  # "a", "b" came before


def test_a_compressed_cache_is_read_as_it_is(tmp_path):
    plain = cache(tmp_path / "tuner.db")
    packed = tmp_path / "tuner.db.xz"
    packed.write_bytes(lzma.compress(plain.read_bytes()))
    assert costs.duels(packed) == costs.duels(plain)

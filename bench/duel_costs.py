"""What the duels that confirm winners cost, from a tuner cache's measurements.

Each duel's verdict is in its challenger's note ("confirmation: ... kept (margin 2.0%; the duel
took 1.4 s)"); a sustained one (long or heavy calls back to back, at the power limit) says
"rounds of ... stretches". Prints, per kind of duel (kept / lost, sustained / short), how many
and their seconds, then each problem's duels (K kept, l lost; s sustained, - short) in the
order their challengers' trials were recorded, which need not be the order they duelled in, and
how many lost duels failed each test a loss names ("lost: slower on the GPU (margin ...").

    python bench/duel_costs.py bench/results/cold_start_s59_call2_h200_fleet_host.db.xz
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import lzma
import re
import sqlite3
import tempfile
from pathlib import Path

DUEL_SECONDS = re.compile(r"the duel took ([\d.]+) s\)")
KEPT = re.compile(r"\bkept \(margin")
LOST_BECAUSE = re.compile(r"\blost: ([^(]+) \(margin")
LOST_UNNAMED = re.compile(r"\blost \(margin")


def last_id(db: Path) -> int:
    """The id of ``db``'s last measurement (0 for none, or no such file): a later run's
    measurements come after it (``duels(db, after=...)``)."""
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT coalesce(max(id), 0) FROM measurements").fetchone()[0]


def verdicts(db: Path, after: int = 0) -> list[tuple[str, str]]:
    """Every duel's verdict, (key, its text), in the order of their challengers' records; only
    measurements past id ``after`` (one run's, in a cache that runs share)."""
    with tempfile.NamedTemporaryFile(suffix=".db") as plain:
        if db.suffix == ".xz":
            plain.write(lzma.decompress(db.read_bytes()))
            plain.flush()
            db = Path(plain.name)
        with contextlib.closing(sqlite3.connect(db)) as conn:
            rows = conn.execute(
                "SELECT key, error FROM measurements WHERE error LIKE '%confirmation:%' "
                "AND id > ? ORDER BY id",
                (after,),
            ).fetchall()
    return [(key, verdict) for key, note in rows for verdict in note.split("confirmation:")[1:]]


def duels(db: Path, after: int = 0) -> dict[str, list[tuple[str, float]]]:
    """Each problem's duels, (kind, seconds), in the order of their challengers' records; only
    measurements past id ``after`` (one run's, in a cache that runs share)."""
    found: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    for key, verdict in verdicts(db, after):
        took = DUEL_SECONDS.search(verdict)
        if took is None:  # a note from before the duels were timed
            continue
        kind = ("K" if KEPT.search(verdict) else "l") + ("s" if "stretches" in verdict else "-")
        found[key].append((kind, float(took.group(1))))
    return found


def loss_reasons(db: Path, after: int = 0) -> collections.Counter[str]:
    """How many lost duels failed each test (a loss may fail several); notes written before a
    loss named its tests count as "not named"."""
    reasons: collections.Counter[str] = collections.Counter()
    for _, verdict in verdicts(db, after):
        if named := LOST_BECAUSE.search(verdict):
            reasons.update(named.group(1).split(", "))
        elif LOST_UNNAMED.search(verdict):
            reasons["not named"] += 1
    return reasons


def by_kind(by_problem: dict[str, list[tuple[str, float]]]) -> dict[str, dict[str, float]]:
    """Per kind of duel: how many ("duels") and their seconds ("seconds")."""
    kinds: dict[str, dict[str, float]] = {}
    for problem in by_problem.values():
        for kind, s in problem:
            k = kinds.setdefault(kind, {"duels": 0, "seconds": 0.0})
            k["duels"] += 1
            k["seconds"] += s
    return dict(sorted(kinds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", nargs="+", type=Path, help="tuner.db files (.xz taken)")
    for db in parser.parse_args().caches:
        by_problem = duels(db)
        kinds = by_kind(by_problem)
        total = sum(k["seconds"] for k in kinds.values())
        print(f"{db}: {sum(k['duels'] for k in kinds.values()):.0f} duels, {total:.1f} s")
        for kind, k in kinds.items():
            print(f"  {kind}: {k['duels']:3.0f} duels {k['seconds']:6.1f} s "
                  f"({k['seconds'] / k['duels']:.2f} s each)")  # fmt: skip
        orders = collections.Counter(" ".join(k for k, _ in p) for p in by_problem.values())
        print(
            "  problems by their duels: "
            + ", ".join(f"{n} x '{o}'" for o, n in orders.most_common())
        )
        if reasons := loss_reasons(db):
            print("  lost duels by what they failed: "
                  + ", ".join(f"{why} {n}" for why, n in reasons.most_common()))  # fmt: skip


if __name__ == "__main__":
    main()

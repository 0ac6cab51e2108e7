"""Served winners that JSON cannot carry, left out of every read of them.

An older release stored some before the service refused them where they enter
(``server.models``): a time of 5e-324 us made its speedup infinite, and a NaN, an Infinity or a
number beyond a float's range (1e999, which Python reads as Infinity) in params was kept as it
came (SQLite keeps a NaN time as NULL). Served, one such row failed each read of its winner and
each feed page that held it with a 500, so every host of its class stopped syncing. Reads leave
it out instead, and the log names it once: the operator deletes it with the measurements it was
merged from (which a later merge would serve again).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("tuner.server")
FIGURES = ("median_us", "baseline_us", "speedup")
# What params' text holds where it may read as a number JSON cannot carry: NaN or Infinity as
# Python writes them, or a number beyond a float's range (about 1.8e308), which has an exponent
# or at least 309 digits in a row. Only such text is parsed: a feed page has many rows to check,
# and most params hold none of these (an "e" alone is in most of their names).
_SUSPECT = re.compile(r"NaN|Infinity|\d[eE]|\d{309}")


def _refuse(constant: str) -> None:
    raise ValueError(constant)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(text)
    return number


class Servable:
    """Checks rows of ``columns`` (a winner's columns, params as JSON text)."""

    def __init__(self, columns: Sequence[str]) -> None:
        self._figures = [(name, columns.index(name)) for name in FIGURES]
        self._params = columns.index("params")
        self._names = [columns.index(c) for c in ("device_class", "versions", "key", "seq")]
        self._told: set[tuple] = set()
        self._lock = threading.Lock()

    def flaw(self, row: Sequence[Any]) -> str | None:
        """What in ``row`` JSON cannot carry, or None (params are parsed only where ``_SUSPECT``
        finds something in their text)."""
        for name, i in self._figures:
            if not isinstance(row[i], float) or not math.isfinite(row[i]):
                return f"{name} is {row[i]!r}"
        text = row[self._params]
        if _SUSPECT.search(text):
            try:
                json.loads(text, parse_constant=_refuse, parse_float=_finite)
            except ValueError:
                return f"params {text[:200]} hold NaN, Infinity or a number beyond a float's range"
        return None

    def keep(self, rows: list[tuple], db: Path) -> list[tuple]:
        """``rows`` less those with a flaw, each named in the log once (of ``db``'s rows)."""
        kept = []
        for row in rows:
            why = self.flaw(row)
            if why is None:
                kept.append(row)
                continue
            name = tuple(row[i] for i in self._names)
            with self._lock:
                told = (db, *name) in self._told
                self._told.add((db, *name))
            if not told:
                dc, versions, key, seq = name
                log.warning(
                    "left out of every answer: the winner of %s under %r on %s (sequence number "
                    "%d in %s): its %s, which JSON cannot carry (stored by an older release); "
                    "delete it and the measurements of its key it was merged from",
                    key, versions, dc, seq, db, why,
                )  # fmt: skip
        return kept

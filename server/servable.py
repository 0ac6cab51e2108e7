"""Served winners that JSON cannot carry, left out of every read of them.

An older release stored some before the service refused them where they enter
(``server.models``): a time of 5e-324 us made its speedup infinite, and a NaN, an Infinity or a
number beyond a float's range (1e999, which Python reads as Infinity) in params was kept as it
came (SQLite keeps a NaN time as NULL). Served, one such row failed each read of its winner and
each feed page that held it with a 500, so every host of its class stopped syncing. Params that
are no JSON object (a damaged page left ``{"bm": 64,``) failed each read of the winner alike,
and the feed sent their text, which every host's pull refused. Reads leave such a row out
instead, and the log names it once: the operator deletes it with the measurements it was merged
from (which a later merge would serve again).
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


class Unservable(ValueError):
    """What in a winner's row JSON cannot carry."""


def _refuse(constant: str) -> None:
    raise ValueError(constant)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(text)
    return number


# a JSON escape of a UTF-16 surrogate: alone (not one of a pair) it parses into a string that
# UTF-8, which every answer is sent in, cannot carry
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def utf8_unsafe(params: dict[str, Any], text: str) -> bool:
    """Whether ``params`` (parsed from, or dumped as, the JSON ``text``) hold a lone
    surrogate, which no answer can be encoded with; only text with such an escape is
    checked further."""
    if not _SURROGATE.search(text):
        return False
    try:
        json.dumps(params, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


# each row's params are parsed once, with this: NaN and Infinity as Python writes them are
# refused, and so is a number beyond a float's range (1e999, which Python reads as Infinity);
# the object is kept for the reads that send one (the feed sends the text)
_PARAMS = json.JSONDecoder(parse_constant=_refuse, parse_float=_finite)


class Servable:
    """Checks rows of ``columns`` (a winner's columns, params as JSON text)."""

    def __init__(self, columns: Sequence[str]) -> None:
        self._figures = [(name, columns.index(name)) for name in FIGURES]
        self._params = columns.index("params")
        self._names = [columns.index(c) for c in ("device_class", "versions", "key", "seq")]
        self._told: set[tuple] = set()
        self._lock = threading.Lock()

    def check(self, row: Sequence[Any]) -> dict[str, Any]:
        """``row``'s params as an object, parsed once here for the reads that serve it, or
        ``Unservable`` naming what in the row JSON cannot carry."""
        for name, i in self._figures:
            if not isinstance(row[i], float) or not math.isfinite(row[i]):
                raise Unservable(f"its {name} is {row[i]!r}, which JSON cannot carry")
        text = row[self._params]
        if not isinstance(text, str):
            raise Unservable(f"its params are {text!r}, not JSON text")
        try:
            params = _PARAMS.decode(text)
        except json.JSONDecodeError:
            raise Unservable(f"its params {text[:200]} are not JSON (a damaged page?)") from None
        except RecursionError:
            raise Unservable(f"its params {text[:200]} are nested too deep to read") from None
        except ValueError:
            raise Unservable(f"its params {text[:200]} hold NaN, Infinity or a number JSON or "
                             "Python cannot carry (1e999, thousands of digits)") from None  # fmt: skip
        if not isinstance(params, dict):
            raise Unservable(f"its params {text[:200]} are not a JSON object")
        if utf8_unsafe(params, text):
            raise Unservable(f"its params {text[:200]} hold a lone surrogate, which UTF-8 "
                             "cannot carry")  # fmt: skip
        return params

    def keep(self, rows: list[tuple], db: Path) -> list[tuple[tuple, dict[str, Any]]]:
        """``rows`` less those with a flaw, each named in the log once (of ``db``'s rows); each
        kept row with its params as an object (``check``)."""
        kept = []
        for row in rows:
            try:
                kept.append((row, self.check(row)))
            except Unservable as e:
                self._tell(row, db, str(e))
        return kept

    def _tell(self, row: tuple, db: Path, why: str) -> None:
        """Log that ``row`` of ``db`` is left out, unless it was told already."""
        name = tuple(row[i] for i in self._names)
        with self._lock:
            told = (db, *name) in self._told
            self._told.add((db, *name))
        if not told:
            dc, versions, key, seq = name
            log.warning(
                "left out of every answer: the winner of %s under %r on %s (sequence number %d "
                "in %s): %s; delete it and the measurements of its key it was merged from",
                key, versions, dc, seq, db, why,
            )  # fmt: skip

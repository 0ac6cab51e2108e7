"""What an export must hold before ``Store.import_`` writes any of it.

Every record is checked whole, against the types and values its table keeps, so that an import
stores all of a file or none of it and names the first record and field it refuses: a value
SQLite would reject mid-transaction (a traceback), or skip silently under ``insert or ignore``
(a NOT NULL column), or store for later commands to trip over (an unknown status, an infinite
date that no later winner can ever replace), is refused here.

    measurements = records(data, "measurements", Measurement, also_required=("uid",))
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, TypeVar

from tuner.core.keys import parse_key
from tuner.measure.records import (
    DEFAULT_LAUNCH,
    LAUNCHES,
    STATUSES,
    Measurement,
    Winner,
    quoted,
)

_R = TypeVar("_R", Measurement, Winner)

# a record field's annotation -> the JSON types it takes, and how an error names them
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "a string"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool, int), "a boolean"),
    "dict[str, Any]": ((dict,), "an object"),
}
# times in microseconds: (field, lowest allowed); a fenced graph time may read 0, and a
# speedup divides by the baseline
_TIMES = {"median_us": 0.0, "p10_us": 0.0, "p90_us": 0.0, "host_us": 0.0, "baseline_us": 1e-9}
_DATES = ("created_at", "updated_at", "first_seen", "last_seen")
DEVICE_FIELDS = ("device_class", "fingerprint", "first_seen", "last_seen")
# the integers SQLite stores: a larger one (JSON has no bound) fails the insert mid-transaction
_SQLITE_INTEGERS = range(-(2**63), 2**63)


@contextlib.contextmanager
def naming(where: str) -> Iterator[None]:
    """A ValueError inside says which record it is about."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def rows(data: dict[str, Any], name: str) -> list[Any]:
    """An export's list ``name`` (none: empty); ValueError naming it when it is not a list
    (``"measurements": null`` would otherwise fail as "'NoneType' object is not iterable")."""
    found = data.get(name, [])
    if not isinstance(found, list):
        raise ValueError(f"{name} must be a list, got {type(found).__name__}")
    return found


def records(
    data: dict[str, Any], name: str, cls: type[_R], *, also_required: tuple[str, ...] = ()
) -> list[_R]:
    """The checked records of the export's list ``name``. ``also_required``: fields with a
    default that an import must still be given (a measurement's ``uid``: made up afresh, it
    would store the record again at each import)."""
    out = []
    for i, row in enumerate(rows(data, name)):
        with naming(f"{name}[{i}]"):
            missing = [f for f in also_required if isinstance(row, dict) and f not in row]
            if missing:
                raise ValueError(f"missing field(s) {missing}")
            record = cls.from_row(row)
            _check(record)
            out.append(record)
    return out


def devices(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], float, float]]:
    """The export's devices as (device class, fingerprint, first seen, last seen)."""
    out = []
    for i, row in enumerate(rows(data, "devices")):
        with naming(f"devices[{i}]"):
            if not isinstance(row, dict):
                raise ValueError(f"must be an object of fields, got {type(row).__name__}")
            if missing := [f for f in DEVICE_FIELDS if f not in row]:
                raise ValueError(f"missing field(s) {missing}")
            _of_kind("device_class", row["device_class"], "str")
            _of_kind("fingerprint", row["fingerprint"], "dict[str, Any]")
            for name in ("first_seen", "last_seen"):
                _finite(name, row[name])
            out.append(tuple(row[f] for f in DEVICE_FIELDS))
    return out


def _check(record: Measurement | Winner) -> None:
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        kind = str(f.type)
        if f.name == "launch" and value in (None, ""):  # names none: the default, as in the cache
            record.launch = DEFAULT_LAUNCH
            continue
        # null where the column may be: an optional field, or one with a default that a cache
        # can hold as NULL (a fleet-served winner's run_id); never an id, a date, a required field
        may_be_null = kind.endswith(" | None") or (
            _has_default(f) and f.name != "uid" and f.name not in _DATES
        )
        if value is None and may_be_null:
            continue
        _of_kind(f.name, value, kind.removesuffix(" | None"))
        if f.name in _TIMES and not _TIMES[f.name] <= value < math.inf:
            raise ValueError(
                f"{f.name} must be a finite time of at least {_TIMES[f.name]} us, got {quoted(value)}"
            )
        if f.name in _DATES:
            _finite(f.name, value)
    record.key = str(parse_key(record.key))  # `show` and `report` parse every key; an older
    # release's spelling of a key (an SDPA scale rounded another way) is stored as this one's
    _one_of("launch", record.launch, LAUNCHES)
    if isinstance(record, Measurement):
        _one_of("status", record.status, STATUSES)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _of_kind(name: str, value: Any, kind: str) -> None:
    types, described = _KINDS[kind]
    if not isinstance(value, types) or (kind in ("int", "float") and isinstance(value, bool)):
        raise ValueError(f"{name} must be {described}, got {quoted(value)}")
    if isinstance(value, int) and value not in _SQLITE_INTEGERS:
        raise ValueError(f"{name} must be {described} within SQLite's 64 bits, got {quoted(value)}")


def _finite(name: str, value: Any) -> None:
    _of_kind(name, value, "float")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite date (seconds since 1970), got {quoted(value)}")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {quoted(value)}")

"""The tune-all journal (``<cache file>.tune-all.jsonl``): one line per finished problem (its
status, tuning time and error; the report reads it, as failures have no winner in the store),
and what it tells the next run: which problems are done, which to tune again, and in which
order."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.cache import Store
from tuner.core.device import Fingerprint
from tuner.core.keys import Key
from tuner.measure.records import DEFAULT_LAUNCH, clipped

# skipped: another process tuned it first; partial: the run stopped (its time limit, Ctrl-C,
# SIGTERM) between the problem's two passes, so its first pass's verdict is kept
PARTIAL = "partial"
STATUSES = ("tuned", "failed", "timeout", PARTIAL, "skipped")
FAILURES = ("failed", "timeout")  # counted against --retries
UNFINISHED = (*FAILURES, PARTIAL)  # a winner such a problem kept is tuned again by a later run
# the end of the error of a problem cut short, saying what it serves (``tune_all._Pool._keep``)
KEPT_FIRST_PASS = "; the first pass's verdict kept"
KEPT_BASELINE = "; its baseline kept"
# the winner stored before, which stays: a finished run's, or an unfinished run's as fast
KEPT_EARLIER = "; the earlier run's winner kept"
KEPT_ENDINGS = (KEPT_FIRST_PASS, KEPT_BASELINE, KEPT_EARLIER)


def clipped_error(error: str, width: int) -> str:
    """A problem's error cut to about ``width`` for a line or a cell: cut before its ending
    (``KEPT_ENDINGS``), which stays whole, so a reader still learns what it serves."""
    ending = next((e for e in KEPT_ENDINGS if error.endswith(e)), "")
    cause = error.removesuffix(ending) if ending else error
    return clipped(cause, width) + ending


def journal_path(store_path: Path) -> Path:
    """Beside the cache file (a link's target), named after its whole name: ``tuner.db``'s is
    ``tuner.db.tune-all.jsonl``, so caches of one stem (``a.db``, ``a.sqlite``) keep their own."""
    cache = Path(store_path).resolve()
    return cache.with_name(cache.name + ".tune-all.jsonl")


def _stem_journal_path(store_path: Path) -> Path:
    """Where earlier releases wrote the journal: named after the cache's stem."""
    cache = Path(store_path).resolve()
    return cache.with_name(cache.stem + ".tune-all.jsonl")


def journal_records(store_path: Path) -> list[dict[str, Any]]:
    """The records of the cache's journal, after those an earlier release wrote under the
    cache's stem (still read, so that a run after an upgrade resumes where the last one
    stopped; nothing is written there any more)."""
    return read_journal(_stem_journal_path(store_path)) + read_journal(journal_path(store_path))


def append_journal(path: Path, record: dict[str, Any]) -> None:
    """One JSON line per finished problem; O_APPEND keeps concurrent writers' lines whole. A
    line cut short (SIGKILL mid-write, the disk full: OSError) is ended before the next one,
    so that only it is lost (``read_journal`` skips it), not the next one with it."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        written = os.write(fd, line)
        if written < len(line):
            raise OSError(errno.ENOSPC, f"{written} of the line's {len(line)} bytes written")
    finally:
        os.close(fd)


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The journal's records; a torn last line (a write cut by SIGKILL) is ignored. ValueError
    naming the file where it cannot be read, or a line that reads as JSON but as no record
    (edited by hand: the report and the next run would fail on it with a traceback): without it
    a run would tune again what is done, and retry what gave up."""
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not text"
        raise ValueError(
            f"the tune-all journal {path} cannot be read ({why}): make it a readable file, or "
            "move it aside (its runs' times, failures and retries are then forgotten)"
        ) from None
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not all(
            isinstance(rec.get(f), str) for f in ("key", "status")
        ):
            raise ValueError(
                f"the tune-all journal {path}: line {no} is no record of a problem (an object "
                f"with a 'key' and a 'status'): {clipped(line, 80)!r}; mend it, or move the "
                "journal aside (its runs' times, failures and retries are then forgotten)"
            )
        out.append(rec)
    return out


# --- what the next run tunes ------------------------------------------------------------------


def current_launches(store: Store, fp: Fingerprint) -> dict[str, str]:
    """Each key with a winner for this device class measured under these versions, and the
    launch mode that winner was chosen for."""
    return {w.key: w.launch_mode for w in store.winners(fp.device_class) if w.measured_under(fp)}


def current_keys(store: Store, fp: Fingerprint, launch: str = DEFAULT_LAUNCH) -> set[str]:
    """Keys with a current winner chosen for ``launch``: the fastest kernel launched eagerly
    need not be the fastest replayed in a CUDA graph, so one chosen for the other mode is due."""
    return {k for k, mode in current_launches(store, fp).items() if mode == launch}


def pending(
    store: Store,
    fp: Fingerprint,
    keys: Iterable[Key],
    journal: list[dict[str, Any]] | None = None,
    launch: str = DEFAULT_LAUNCH,
) -> list[Key]:
    """Keys without a current winner for ``launch``, or whose winner is what an unfinished run
    kept (``--force`` tunes every key: the command's choice, not this one's)."""
    done = current_keys(store, fp, launch) - kept_after_unfinished(journal or [], fp)
    return [k for k in keys if str(k) not in done]


def _last_records(journal: list[dict[str, Any]], device_class: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for rec in journal:
        if rec.get("device_class") in (device_class, ""):
            out[rec["key"]] = rec
    return out


def kept_after_unfinished(journal: list[dict[str, Any]], fp: Fingerprint) -> set[str]:
    """Keys whose last run did not finish them (``UNFINISHED``): whatever winner it kept is to
    be tuned again, within ``--retries``, until a run finishes."""
    last = _last_records(journal, fp.device_class)
    return {k for k, rec in last.items() if rec["status"] in UNFINISHED}


def kept_runs(journal: list[dict[str, Any]]) -> set[str]:
    """The runs whose winners a problem cut short kept (its verdict stored, its status
    ``UNFINISHED``): a later attempt's verdict may replace such a winner, never a finished run's."""
    return {rec["run_id"] for rec in journal if rec["status"] in UNFINISHED and rec.get("run_id")}


@dataclass
class Order:
    todo: list[Key]  # never failed first, in their order; then earlier failures, shortest first
    given_up: list[tuple[Key, int]]  # failed more than ``retries`` times: (key, failures)


def order(keys: list[Key], journal: list[dict[str, Any]], device_class: str, retries: int) -> Order:
    """The run's order: problems that failed or timed out before (since their last success)
    go last, by the longest time one of their failures took, so one that hangs cannot hold up
    the others; one that failed more than ``retries`` times is not tried again."""
    failures: dict[str, list[float]] = {}
    for rec in journal:
        if rec.get("device_class") not in (device_class, ""):
            continue
        if rec["status"] == "tuned":
            failures.pop(rec["key"], None)
        elif rec["status"] in FAILURES:
            failures.setdefault(rec["key"], []).append(float(rec.get("seconds") or 0.0))
    fresh = [k for k in keys if str(k) not in failures]
    again = [k for k in keys if 0 < len(failures.get(str(k), ())) <= retries]
    again.sort(key=lambda k: max(failures[str(k)]))
    given_up = [(k, len(failures[str(k)])) for k in keys if len(failures.get(str(k), ())) > retries]
    return Order(fresh + again, given_up)

"""The fleet service's database access: every SQL statement of the service lives here.

``FleetStore`` is one connection to the service's file (schema ``server.schema.FLEET``). The
policy modules (``results`` for the merge, ``queue`` for leases, ``tokens``) call its methods and
never see SQL. Methods that write assume the caller holds ``transaction()`` where several
statements must agree (a winner, its sequence number and the queue); the others open their own.
Hot reads (winner lookups, the feed, token checks) use raw sqlite3 cursors: building dicts
through sqlite-utils costs more than the queries.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from typing import Any

from server import shutdown
from server.merge import MIN_US
from server.schema import FLEET
from server.servable import Servable
from tuner.cache import ReadOnlyError
from tuner.cache.store import DeviceFile
from tuner.core.keys import key_op

Group = tuple[str, str, str]  # device class, versions, key

MEASUREMENT_COLS = (
    "uid", "submitter", "device_class", "versions", "key", "op", "candidate", "source", "params",
    "is_baseline", "status", "median_us", "p10_us", "p90_us", "reps", "host_us", "max_rel_err",
    "error", "host", "run_id", "created_at", "received_at", "launch",
)  # fmt: skip
WINNER_COLUMNS = (
    "device_class", "versions", "key", "op", "candidate", "source", "params", "median_us",
    "baseline_us", "speedup", "run_id", "submitters", "seq", "updated_at", "launch",
)  # fmt: skip
SERVABLE = Servable(WINNER_COLUMNS)
_WINNER_SELECT = f"select {', '.join(WINNER_COLUMNS)} from srv_winners"
_GROUP = "device_class = ? and versions = ? and key = ?"
# what the merge weighs: a time below the floor the service refuses on entry, stored by an older
# release, would be served with an infinite speedup, which no read can carry
_OK = f"{_GROUP} and status = 'ok' and median_us >= {MIN_US}"


class FleetStore(DeviceFile):
    schema = FLEET
    _refused = False  # a write was refused as read-only (``transaction``)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The base's transaction, reported to this request's ledger: once a stop has cut the
        request, it begins none and rolls back the one it is in (``server.shutdown``), so a cut
        request's answer can say what was stored.

        After a write refused as read-only, the next one opens a new connection first: SQLite
        opens one read-only where the file was so (a pool thread's first request during a
        read-only remount), and it would refuse every write of the thread, also once the file
        is writable again."""
        if self._refused:
            self._refused = False
            self.reconnect()
        book = shutdown.ledger()
        try:
            with book.transaction(), super().transaction() as c:
                yield c
                book.raise_if_cut()
        except ReadOnlyError:
            self._refused = True
            raise

    def service_id(self) -> str:
        """The id made with this file: hosts key their sync positions by it."""
        return self.db.conn.execute("select id from srv_service").fetchone()[0]

    # --- tokens ---------------------------------------------------------------------------------

    def add_token(
        self, token_id: str, name: str, secret_hash: str, scopes: str, now: float
    ) -> None:
        with self.transaction() as c:
            c.execute(
                "insert into srv_tokens(id, name, secret_hash, scopes, created_at) "
                "values (?, ?, ?, ?, ?)",
                (token_id, name, secret_hash, scopes, now),
            )

    def tokens(self) -> list[dict[str, Any]]:
        return list(self.db.query("select * from srv_tokens order by created_at"))

    def token(self, token_id: str) -> dict[str, Any] | None:
        rows = list(self.db.query("select * from srv_tokens where id = ?", [token_id]))
        return rows[0] if rows else None

    def token_for_check(self, token_id: str) -> tuple | None:
        """(id, name, scopes, created_at, revoked_at, secret_hash): runs on every request."""
        return self.db.conn.execute(
            "select id, name, scopes, created_at, revoked_at, secret_hash from srv_tokens "
            "where id = ?",
            (token_id,),
        ).fetchone()

    def revoke_token(self, token_id: str, now: float) -> bool:
        """Mark a valid token revoked; False if it is unknown or already revoked."""
        with self.transaction() as c:
            return bool(
                c.execute(
                    "update srv_tokens set revoked_at = ? where id = ? and revoked_at is null",
                    (now, token_id),
                ).rowcount
            )

    def valid_token_scopes(self) -> list[tuple[str, str]]:
        """(id, comma-separated scopes) of every token not revoked."""
        return self.db.conn.execute(
            "select id, scopes from srv_tokens where revoked_at is null"
        ).fetchall()

    # --- measurements and merged results (in the caller's transaction) --------------------------

    def add_measurement(self, row: dict[str, Any]) -> bool:
        """Insert one submitted measurement; False if its uid was seen before."""
        sql = (
            f"insert or ignore into srv_measurements({', '.join(MEASUREMENT_COLS)}) "
            f"values ({', '.join('?' * len(MEASUREMENT_COLS))})"
        )
        return bool(self.db.conn.execute(sql, [row[k] for k in MEASUREMENT_COLS]).rowcount)

    def measurement_refs(self, uid: str) -> list[dict[str, Any]]:
        """The measurement stored under ``uid`` (none or one: uids are unique)."""
        return list(
            self.db.query(
                "select uid, device_class, key, received_at from srv_measurements where uid = ?",
                [uid],
            )
        )

    def baseline_flag(self, group: Group, candidate: str) -> bool | None:
        """Whether ``candidate``'s first ok result of ``group`` (what the merge weighs) was
        submitted as the baseline's (None: it has none)."""
        row = self.db.conn.execute(
            f"select is_baseline from srv_measurements where {_OK} and candidate = ? "
            "order by id limit 1",
            (*group, candidate),
        ).fetchone()
        return None if row is None else bool(row[0])

    def recent_ok(self, group: Group, recent: int) -> list[tuple]:
        """The ok results of ``group``, each token's latest ``recent`` per candidate, oldest
        first: (candidate, source, params, is_baseline, submitter, median_us, p10_us, p90_us,
        host_us, run_id, launch)."""
        return self.db.conn.execute(
            "select candidate, source, params, is_baseline, submitter, median_us, p10_us, p90_us, "
            "host_us, run_id, launch from (select *, row_number() over (partition by submitter, "
            f"candidate order by id desc) as recent from srv_measurements where {_OK}) "
            "where recent <= ? order by id",
            (*group, recent),
        ).fetchall()

    def ok_counts(self, group: Group) -> dict[str, int]:
        """Candidate -> number of ok results of ``group``, however old."""
        return dict(
            self.db.conn.execute(
                f"select candidate, count(*) from srv_measurements where {_OK} group by candidate",
                group,
            )
        )

    def put_results(self, group: Group, rows: Iterable[dict[str, Any]], now: float) -> None:
        """Replace the per-candidate aggregates of ``group`` (rows of ``Aggregate.to_row``)."""
        self.db.conn.executemany(
            "insert or replace into srv_results(device_class, versions, key, candidate, source, "
            "params, is_baseline, us, spread, noise, count, submitters, updated_at) "
            f"values ({', '.join('?' * 13)})",
            [
                (*group, r["candidate"], r["source"], r["params"], r["is_baseline"], r["us"],
                 r["spread"], r["noise"], r["count"], r["submitters"], now)
                for r in rows
            ],
        )  # fmt: skip

    # --- served winners -------------------------------------------------------------------------

    def served_candidate(self, group: Group) -> str | None:
        row = self.db.conn.execute(
            f"select candidate from srv_winners where {_GROUP}", group
        ).fetchone()
        return row[0] if row else None

    def serve(self, group: Group, winner: dict[str, Any]) -> int:
        """Make ``winner`` (``WINNER_COLUMNS`` less the group, op and seq) the served winner of
        ``group`` under the next sequence number, clear what was pending and mark its queue entry
        done (in the caller's transaction). Returns the sequence number."""
        c = self.db.conn
        (seq,) = c.execute(
            "update srv_counters set value = value + 1 where name = 'winner_seq' returning value"
        ).fetchone()
        row = {"device_class": group[0], "versions": group[1], "key": group[2],
               "op": key_op(group[2]), "seq": seq, **winner}  # fmt: skip
        c.execute(
            f"insert or replace into srv_winners({', '.join(WINNER_COLUMNS)}) "
            f"values ({', '.join('?' * len(WINNER_COLUMNS))})",
            [row[k] for k in WINNER_COLUMNS],
        )
        c.execute(
            "insert into srv_served(seq, device_class, versions, key, updated_at) "
            "values (?, ?, ?, ?, ?)",
            (seq, *group, row["updated_at"]),
        )
        self.clear_pending(group)
        c.execute(  # lease_id kept: ending the lease reports the key as done
            f"update srv_queue set state = 'done', updated_at = ? where {_GROUP}",
            (time.time(), *group),
        )
        return seq

    def refresh_winner(
        self, group: Group, median_us: float, baseline_us: float, submitters: int
    ) -> None:
        """Fresher figures for the same served winner (no new sequence number)."""
        self.db.conn.execute(
            "update srv_winners set median_us = ?, baseline_us = ?, speedup = ?, submitters = ? "
            f"where {_GROUP}",
            (median_us, baseline_us, baseline_us / median_us if median_us else 1.0, submitters,
             *group),
        )  # fmt: skip

    def winners_of(self, device_class: str, key: str, versions: str | None) -> list[dict]:
        """The served winners of a key: one per versions, or the one of ``versions``."""
        where = "device_class = ? and key = ?" + (
            " and versions = ?" if versions is not None else ""
        )
        args = [device_class, key] + ([versions] if versions is not None else [])
        return self._winners_where(where, args)

    def lookup(self, device_class: str, versions: str, keys: list[str]) -> list[dict]:
        found: list[dict] = []
        for i in range(0, len(keys), 500):  # SQLite's bound-parameter limit
            chunk = keys[i : i + 500]
            found += self._winners_where(
                f"device_class = ? and versions = ? and key in ({', '.join('?' * len(chunk))})",
                [device_class, versions, *chunk],
            )
        return found

    def feed(self, device_class: str, versions: str | None, since: int, limit: int) -> list[tuple]:
        """Up to ``limit`` winners changed after sequence ``since``, oldest first, as rows of
        ``WINNER_COLUMNS`` (params as JSON text)."""
        where = "device_class = ? and seq > ?" + (
            " and versions = ?" if versions is not None else ""
        )
        args = [device_class, since] + ([versions] if versions is not None else [])
        return self.db.conn.execute(
            f"{_WINNER_SELECT} where {where} order by seq limit ?", [*args, limit]
        ).fetchall()

    def winner_seq(self) -> int:
        """The latest winner sequence number (of any class): no host's feed cursor is beyond it
        unless this file is older than what that host pulled (restored from a backup)."""
        return self.db.conn.execute(
            "select value from srv_counters where name = 'winner_seq'"
        ).fetchone()[0]

    def served_at(self, device_class: str, seq: int) -> dict[str, Any]:
        """What this file served under sequence number ``seq`` in ``device_class`` (key,
        versions, updated_at; None: nothing), and ``log_from``: the log of servings is whole for
        numbers above it (it began with schema 5; below, only the winners served then are in
        it, so finding nothing there proves nothing).

        Why a log, not an id: a restore copies the file, so any id kept in it (``service_id``)
        comes back with the backup, and the file cannot tell it was restored. What a backup
        cannot hold is what was served after it was taken: a host that pulled a serving asks
        for it by number, and a restored service has lost it, or (having passed that number
        again) holds another serving there, of another key or at another time; a winner served
        again since under a later number no longer hides the loss."""
        row = self.db.conn.execute(
            "select key, versions, updated_at from srv_served where seq = ? and device_class = ?",
            (seq, device_class),
        ).fetchone()
        (log_from,) = self.db.conn.execute(
            "select value from srv_counters where name = 'served_log_from'"
        ).fetchone()
        served = dict(zip(("key", "versions", "updated_at"), row, strict=True)) if row else None
        return {"seq": seq, "served": served, "log_from": log_from}

    def served_count(self) -> int:
        return self.db.conn.execute("select count(*) from srv_winners").fetchone()[0]

    def servable(self, rows: list[tuple]) -> list[tuple]:
        """Rows of ``WINNER_COLUMNS`` less those JSON cannot carry (``server.servable``)."""
        return [row for row, _ in SERVABLE.keep(rows, self.path)]

    def _winners_where(self, where: str, args: list[Any]) -> list[dict]:
        """The servable winners matching ``where``, as the API sends them: dicts, params as
        objects (the select is ``WINNER_COLUMNS``'s, which ``SERVABLE`` and the dicts' names
        read; params parsed once, by its check)."""
        rows = self.db.conn.execute(f"{_WINNER_SELECT} where {where}", args).fetchall()
        return [{**dict(zip(WINNER_COLUMNS, row, strict=True)), "params": params}
                for row, params in SERVABLE.keep(rows, self.path)]  # fmt: skip

    # --- pending changes ------------------------------------------------------------------------

    def put_pending(self, group: Group, proposal: dict[str, Any]) -> None:
        """Remember a change awaiting confirmation (candidate, source, params, us,
        served_candidate, served_us, margin, supporters)."""
        self.db.conn.execute(
            "insert or replace into srv_pending(device_class, versions, key, candidate, source, "
            "params, us, served_candidate, served_us, margin, supporters, updated_at) "
            "values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*group, proposal["candidate"], proposal["source"], proposal["params"],
             proposal["us"], proposal["served_candidate"], proposal["served_us"],
             proposal["margin"], json.dumps(proposal["supporters"]), time.time()),
        )  # fmt: skip

    def clear_pending(self, group: Group) -> None:
        self.db.conn.execute(f"delete from srv_pending where {_GROUP}", group)

    def pending_candidate(self, group: Group) -> str | None:
        row = self.db.conn.execute(
            f"select candidate from srv_pending where {_GROUP}", group
        ).fetchone()
        return row[0] if row else None

    def pending(self, device_class: str | None, limit: int) -> list[dict[str, Any]]:
        where = " where device_class = ?" if device_class else ""
        rows = self.db.query(
            f"select * from srv_pending{where} order by updated_at desc limit ?",
            [device_class, limit] if device_class else [limit],
        )
        return [
            {**r, "params": json.loads(r["params"]), "supporters": json.loads(r["supporters"])}
            for r in rows
        ]

    # --- misses and the queue -------------------------------------------------------------------

    def count_misses(self, device_class: str, versions: str, misses: list[tuple[str, int]]) -> None:
        now = time.time()
        self.db.conn.executemany(
            "insert into srv_misses(device_class, versions, key, op, count, first_seen, last_seen) "
            "values (?, ?, ?, ?, ?, ?, ?) on conflict(device_class, versions, key) do update set "
            "count = count + excluded.count, last_seen = excluded.last_seen",
            [(device_class, versions, k, key_op(k), n, now, now) for k, n in misses],
        )

    def enqueue(self, group: Group, misses: int) -> bool:
        """Queue an unserved key, or add to its miss count. True if newly queued."""
        if self.served_candidate(group) is not None:
            return False
        now = time.time()
        c = self.db.conn
        inserted = c.execute(
            "insert into srv_queue(device_class, versions, key, op, state, misses, attempts, "
            "enqueued_at, updated_at) values (?, ?, ?, ?, 'queued', ?, 0, ?, ?) "
            "on conflict(device_class, versions, key) do nothing",
            (*group, key_op(group[2]), misses, now, now),
        ).rowcount
        if not inserted:
            c.execute(
                f"update srv_queue set misses = misses + ?, updated_at = ? where {_GROUP}",
                (misses, now, *group),
            )
        return bool(inserted)

    def expire_leases(self, max_attempts: int, now: float) -> int:
        """Return the keys of run-out leases to the queue (or fail them). Returns how many."""
        c = self.db.conn
        c.execute(
            "update srv_queue set attempts = attempts + 1, lease_id = null, lease_expires = null, "
            "updated_at = ?, state = case when attempts + 1 >= ? then 'failed' else 'queued' end "
            "where state = 'leased' and lease_expires <= ?",
            (now, max_attempts, now),
        )
        return c.execute("select changes()").fetchone()[0]

    def queued_keys(self, device_class: str, versions: str, limit: int) -> list[str]:
        """The most-missed queued keys of a device class and versions."""
        return [
            r[0]
            for r in self.db.conn.execute(
                "select key from srv_queue where device_class = ? and versions = ? "
                "and state = 'queued' order by misses desc, enqueued_at, key limit ?",
                (device_class, versions, limit),
            )
        ]

    def lease(self, lease: dict[str, Any], keys: list[str]) -> None:
        """Record a lease (id, worker, submitter, device_class, versions, created_at,
        expires_at) and mark its keys leased."""
        c = self.db.conn
        c.executemany(
            "update srv_queue set state = 'leased', lease_id = ?, lease_expires = ?, "
            f"updated_at = ? where {_GROUP}",
            [(lease["id"], lease["expires_at"], lease["created_at"], lease["device_class"],
              lease["versions"], k) for k in keys],
        )  # fmt: skip
        c.execute(
            "insert into srv_leases(id, worker, submitter, device_class, versions, keys, "
            "created_at, expires_at) values (?, ?, ?, ?, ?, ?, ?, ?)",
            (lease["id"], lease["worker"], lease["submitter"], lease["device_class"],
             lease["versions"], len(keys), lease["created_at"], lease["expires_at"]),
        )  # fmt: skip

    def lease_row(self, lease_id: str) -> dict[str, Any] | None:
        row = self.db.conn.execute(
            "select id, submitter, completed_at, expires_at from srv_leases where id = ?",
            (lease_id,),
        ).fetchone()
        return (
            dict(zip(("id", "submitter", "completed_at", "expires_at"), row, strict=True))
            if row
            else None
        )

    def lease_entries(self, lease_id: str) -> list[tuple[str, str, int]]:
        """(key, state, attempts) of the queue entries under a lease."""
        return self.db.conn.execute(
            "select key, state, attempts from srv_queue where lease_id = ?", (lease_id,)
        ).fetchall()

    def return_key(self, lease_id: str, key: str, state: str, now: float) -> None:
        """Take a key out of its lease into ``state`` (queued or failed), counting an attempt."""
        self.db.conn.execute(
            "update srv_queue set state = ?, attempts = attempts + 1, lease_id = null, "
            "lease_expires = null, updated_at = ? where lease_id = ? and key = ?",
            (state, now, lease_id, key),
        )

    def complete_lease(self, lease_id: str, now: float) -> None:
        self.db.conn.execute("update srv_leases set completed_at = ? where id = ?", (now, lease_id))

    def queue(
        self, device_class: str | None, versions: str | None, state: str | None, limit: int
    ) -> list[dict[str, Any]]:
        """Queue entries as a reader sees them: a run-out lease already shows as queued."""
        now = time.time()
        shown = "case when state = 'leased' and lease_expires <= ? then 'queued' else state end"
        where, args = [], []
        for expr, val in (("device_class = ?", device_class), ("versions = ?", versions)):
            if val is not None:
                where.append(expr)
                args.append(val)
        if state is not None:
            where.append(f"{shown} = ?")
            args += [now, state]
        sql = (
            f"select device_class, versions, key, op, {shown} as state, misses, attempts, "
            "lease_expires, enqueued_at, updated_at from srv_queue"
            + (" where " + " and ".join(where) if where else "")
            + " order by misses desc, enqueued_at, key limit ?"
        )
        return list(self.db.query(sql, [now, *args, limit]))

    def queue_counts(self) -> dict[str, int]:
        return dict(self.db.conn.execute("select state, count(*) from srv_queue group by state"))

    def misses(self, device_class: str | None, limit: int) -> list[dict[str, Any]]:
        where = " where device_class = ?" if device_class else ""
        return list(
            self.db.query(
                f"select * from srv_misses{where} order by count desc, key limit ?",
                [device_class, limit] if device_class else [limit],
            )
        )

    # --- compiled-kernel artifacts --------------------------------------------------------------

    def add_build(self, spec: dict[str, str], digest: str, size: int, builder: str) -> str:
        """Record that ``builder`` published ``digest`` for the spec (``spec_id``, ``spec``,
        ``source``, ``arch``); the first build of a spec becomes the served one. Returns
        ``new`` (now served), ``same`` (the served build again), ``conflict`` (a different
        build, first seen now) or ``known conflict`` (one seen before)."""
        now = time.time()
        with self.transaction() as c:
            seen = c.execute(
                "select 1 from srv_artifact_builds where spec_id = ? and hash = ? limit 1",
                (spec["spec_id"], digest),
            ).fetchone()
            c.execute(
                "insert into srv_artifact_builds(spec_id, hash, builder, size, first_seen, "
                "last_seen) values (?, ?, ?, ?, ?, ?) on conflict(spec_id, hash, builder) "
                "do update set last_seen = excluded.last_seen",
                (spec["spec_id"], digest, builder, size, now, now),
            )
            served = c.execute(
                "select hash from srv_artifacts where spec_id = ?", (spec["spec_id"],)
            ).fetchone()
            if served is None:
                c.execute(
                    "insert into srv_artifacts(spec_id, spec, source, arch, hash, size, builder, "
                    "created_at) values (?, ?, ?, ?, ?, ?, ?, ?)",
                    (spec["spec_id"], spec["spec"], spec["source"], spec["arch"], digest, size,
                     builder, now),
                )  # fmt: skip
                return "new"
        if served[0] == digest:
            return "same"
        return "known conflict" if seen else "conflict"

    _ARTIFACT_COLS = "seq, spec_id, spec, hash, size, builder, created_at"

    def served_artifacts(self, spec_ids: list[str]) -> list[dict[str, Any]]:
        """The served build of each of these specs that has one."""
        return list(
            self.db.query(
                f"select {self._ARTIFACT_COLS} from srv_artifacts where spec_id in "
                f"({', '.join('?' * len(spec_ids))}) order by seq",
                spec_ids,
            )
        )

    def artifact_feed(self, archs: list[str], since: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` served builds published after ``since``, oldest first (all archs
        when ``archs`` is empty)."""
        where = f" and arch in ({', '.join('?' * len(archs))})" if archs else ""
        return list(
            self.db.query(
                f"select {self._ARTIFACT_COLS} from srv_artifacts where seq > ?{where} "
                "order by seq limit ?",
                [since, *archs, limit],
            )
        )

    def artifact_seq(self) -> int:
        """The latest artifact sequence number (0: none), the bound of listing cursors."""
        return self.db.conn.execute("select coalesce(max(seq), 0) from srv_artifacts").fetchone()[0]

    def artifact_conflicts(self, limit: int) -> list[dict[str, Any]]:
        """Specs published with more than one hash: the spec, its served hash and every build."""
        specs = list(
            self.db.query(
                "select a.spec_id, a.spec, a.hash as served from srv_artifacts a where "
                "(select count(distinct hash) from srv_artifact_builds b "
                "where b.spec_id = a.spec_id) > 1 order by a.seq limit ?",
                [limit],
            )
        )
        for spec in specs:
            spec["builds"] = list(
                self.db.query(
                    "select hash, builder, size, first_seen, last_seen from srv_artifact_builds "
                    "where spec_id = ? order by first_seen, hash, builder",
                    [spec["spec_id"]],
                )
            )
        return specs

    def conflicting_specs(self) -> int:
        (n,) = self.db.conn.execute(
            "select count(*) from (select spec_id from srv_artifact_builds group by spec_id "
            "having count(distinct hash) > 1)"
        ).fetchone()
        return n

"""The local artifact store: compiled kernels as content-addressed blobs found by a spec.

A compiled kernel (Triton's files for one kernel, a built CUTLASS module, ...) is an artifact:
its bytes are named by their sha256 and found by an ``ArtifactSpec`` (source, kernel config,
arch, toolchain versions), whose stable ``id`` keys the index. A kernel made of several files is
one bundle (``pack``/``unpack``: a tar with sorted names and zeroed metadata, so equal files give
equal bytes and an equal hash on every host).

Blobs live under ``$TUNER_ARTIFACTS``, else ``artifacts/`` beside the tuner cache file, with an
``index.db`` (spec -> hash, size, created, last used). The store keeps at most
``$TUNER_ARTIFACTS_MAX_BYTES`` and evicts conflicting builds (below), then the least recently
used artifacts, beyond it. Every read re-checks the hash: a corrupt blob is reported and
dropped, never returned. Downloads go through ``add_verified``, which rejects bytes that do not
match the hash they were announced with. A second, different build of a spec is kept apart as a
conflict and reported by ``conflicts()``; the first one stays the one served. Blobs are written
atomically (temp file, fsync, rename) under the index's write lock, and an index that cannot be
read raises ``StoreError`` before anything is written.

    store = ArtifactStore()
    spec = ArtifactSpec("triton", {"kernel": "matmul", "cache_key": "..."}, "cuda:90", {...})
    store.put(spec, pack({"matmul.cubin": cubin, "matmul.json": meta}))
    files = unpack(store.get(spec))
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import sqlite3
import tarfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils

from tuner.cache.sqlite import ReadOnlyError, Schema, SqliteFile, StoreError, register
from tuner.cache.store import default_path
from tuner.core.atomic import write_atomic
from tuner.core.settings import ENV, NUMBERS, number_refused

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 30
HASH_RE = re.compile(r"[0-9a-f]{64}")
_NAME_RE = re.compile(r"[A-Za-z0-9_.+-]{1,255}")


class ArtifactError(ValueError):
    """Bytes or a spec the store refuses; the message says which and why."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- specs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactSpec:
    """What identifies one compiled kernel: the source that builds it, the kernel's config (any
    JSON object), the arch it runs on and the versions of the tools that built it."""

    source: str
    config: Mapping[str, Any]
    arch: str
    toolchain: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("source", "arch"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ArtifactError(
                    f"artifact spec {name} must be a non-empty string, got {value!r}"
                )
        if not isinstance(self.config, Mapping):
            raise ArtifactError(f"artifact spec config must be a JSON object, got {self.config!r}")
        if not isinstance(self.toolchain, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.toolchain.items()
        ):
            raise ArtifactError(
                f"artifact spec toolchain must map tool names to version strings, got {self.toolchain!r}"
            )
        try:
            self.to_json()
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"artifact spec config is not JSON-serialisable: {e}") from None

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces; the same spec gives the same text anywhere."""
        data = {
            "source": self.source,
            "config": dict(self.config),
            "arch": self.arch,
            "toolchain": dict(self.toolchain),
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def id(self) -> str:
        return sha256(self.to_json().encode())

    @classmethod
    def from_json(cls, text: str) -> ArtifactSpec:
        data = json.loads(text)
        return cls(data["source"], data["config"], data["arch"], data["toolchain"])


# --- bundles ----------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ArtifactError(
            f"bundle file name {name!r} is not allowed: use 1-255 of A-Z a-z 0-9 _ . + - (no folders)"
        )


def pack(files: Mapping[str, bytes]) -> bytes:
    """A deterministic tar of flat ``name -> bytes``: sorted names, mode 0644, no owner, mtime 0."""
    if not files:
        raise ArtifactError("a bundle needs at least one file")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            _check_name(name)
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return out.getvalue()


def unpack(bundle: bytes) -> dict[str, bytes]:
    """The files of a ``pack`` bundle; ArtifactError for anything but flat regular files."""
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:") as tar:
            for info in tar:
                _check_name(info.name)
                if not info.isreg() or info.name in files:
                    raise ArtifactError(f"bundle entry {info.name!r} is not a single regular file")
                member = tar.extractfile(info)
                assert member is not None
                files[info.name] = member.read()
    except tarfile.TarError as e:
        raise ArtifactError(f"not an artifact bundle: {e}") from None
    if not files:
        raise ArtifactError("not an artifact bundle: no files")
    return files


# --- the index --------------------------------------------------------------------------------


def _v1(db: sqlite_utils.Database) -> None:
    db["artifacts"].create(
        {
            "spec_id": str,
            "hash": str,
            "size": int,
            "spec": str,
            "created": float,
            "last_used": float,
        },
        pk="spec_id",
        not_null={"hash", "size", "spec", "created", "last_used"},
    )
    db["artifacts"].create_index(["last_used"])
    db["artifacts"].create_index(["hash"])
    db["conflicts"].create(  # further builds of a spec whose first build is in ``artifacts``
        {"spec_id": str, "hash": str, "size": int, "spec": str, "seen": float},
        pk=("spec_id", "hash"),
        not_null={"size", "spec", "seen"},
    )
    db["conflicts"].create_index(["hash"])


def _not_an_index(db: sqlite_utils.Database, path: Path) -> int:
    raise StoreError(
        f"{path} is a SQLite database but not a tuner artifact index; refusing to touch it"
    )


INDEX = register(
    Schema(
        kind="tuner artifact index",
        application_id=0x544E5241,  # "TNRA"
        migrations=[_v1],
        legacy_version=_not_an_index,
        elsewhere="name another artifact folder ($TUNER_ARTIFACTS)",
    )
)


class _Index(SqliteFile):
    schema = INDEX


@dataclass(frozen=True)
class Entry:
    spec_id: str
    hash: str
    size: int
    created: float
    last_used: float


@dataclass(frozen=True)
class Conflict:
    """A spec that arrived with more than one hash: ``hashes[0]`` is the one served."""

    spec: ArtifactSpec
    hashes: tuple[str, ...]


def default_root() -> Path:
    """``$TUNER_ARTIFACTS``, else ``artifacts/`` in the tuner cache file's directory."""
    if env := os.environ.get("TUNER_ARTIFACTS"):
        return Path(env).expanduser()
    return default_path().parent / "artifacts"


def default_max_bytes() -> int:
    """``$TUNER_ARTIFACTS_MAX_BYTES`` read as the config file's value is (``1e9`` included);
    a ValueError saying why for one that is no positive whole number: a store with a limit
    other than the one asked for would evict what it should keep, or keep what it should not."""
    text = os.environ.get("TUNER_ARTIFACTS_MAX_BYTES")
    if not text:
        return DEFAULT_MAX_BYTES
    if (limit := NUMBERS["artifacts_max_bytes"].read(text)) is None:
        raise ValueError(number_refused("artifacts_max_bytes", text, ENV))
    return int(limit)


class ArtifactStore:
    """The artifacts of one directory. Safe to share between threads (one index connection per
    thread) and between processes (writes serialise on the index's write lock)."""

    def __init__(self, root: str | Path | None = None, *, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = max_bytes if max_bytes is not None else default_max_bytes()
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(
                f"{self.root} is a file, not a folder for compiled kernels "
                "(named by $TUNER_ARTIFACTS, else artifacts/ beside the cache)"
            )
        self.blobs = self.root / "blobs"
        self._local = threading.local()
        self._open: list[_Index] = []
        self._lock = threading.Lock()
        self._index()  # an unreadable index fails here, before any blob is written
        self.blobs.mkdir(parents=True, exist_ok=True)

    def _index(self) -> _Index:
        index = getattr(self._local, "index", None)
        if index is None:
            index = self._local.index = _Index(self.root / "index.db")
            with self._lock:
                self._open.append(index)
        return index

    def close(self) -> None:
        with self._lock:
            for index in self._open:
                index.close()
            self._open.clear()
        self._local = threading.local()

    def __enter__(self) -> ArtifactStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writes --------------------------------------------------------------------------------

    def put(self, spec: ArtifactSpec, data: bytes) -> str:
        """Store ``data`` as ``spec``'s artifact; its sha256. Bytes that differ from the spec's
        stored ones are kept as a conflict (logged), and the stored ones stay served."""
        digest = sha256(data)
        if len(data) > self.max_bytes:
            raise ArtifactError(
                f"artifact of {len(data)} bytes for {spec.source} spec {spec.id[:12]} exceeds "
                f"the store's limit of {self.max_bytes} bytes (TUNER_ARTIFACTS_MAX_BYTES)"
            )
        now = time.time()
        with self._index().transaction() as c:
            row = c.execute("select hash from artifacts where spec_id = ?", (spec.id,)).fetchone()
            self._write_blob(digest, data)
            if row is None:
                c.execute(
                    "insert into artifacts(spec_id, hash, size, spec, created, last_used) "
                    "values (?, ?, ?, ?, ?, ?)",
                    (spec.id, digest, len(data), spec.to_json(), now, now),
                )
            elif row[0] == digest:
                c.execute("update artifacts set last_used = ? where spec_id = ?", (now, spec.id))
            else:
                c.execute(
                    "insert or ignore into conflicts(spec_id, hash, size, spec, seen) "
                    "values (?, ?, ?, ?, ?)",
                    (spec.id, digest, len(data), spec.to_json(), now),
                )
            self._evict(c, keep=spec.id)
            if row is not None and row[0] != digest:
                kept = c.execute(
                    "select 1 from conflicts where spec_id = ? and hash = ?", (spec.id, digest)
                ).fetchone()
                log.warning(
                    "artifact conflict: %s spec %s was stored with sha256 %s and now arrives with "
                    "%s; the first stays served, %s",
                    spec.source, spec.id[:12], row[0][:12], digest[:12],
                    "both kept" if kept else "the second not kept (the store is at its limit)",
                )  # fmt: skip
        return digest

    def add_verified(self, spec: ArtifactSpec, expected_hash: str, data: bytes) -> str:
        """``put`` for downloaded bytes: ArtifactError unless they hash to ``expected_hash``."""
        if not isinstance(expected_hash, str) or not HASH_RE.fullmatch(expected_hash):
            raise ArtifactError(
                f"expected_hash must be 64 lowercase hex digits (a sha256), got {expected_hash!r}"
            )
        actual = sha256(data)
        if actual != expected_hash:
            raise ArtifactError(
                f"downloaded artifact for {spec.source} spec {spec.id[:12]} has sha256 {actual}, "
                f"expected {expected_hash}; rejected"
            )
        return self.put(spec, data)

    def _blob(self, digest: str) -> Path:
        return self.blobs / digest

    def _write_blob(self, digest: str, data: bytes) -> None:
        path = self._blob(digest)
        if path.exists() and sha256(path.read_bytes()) == digest:
            return
        write_atomic(path, data, durable=True)

    def _drop_unreferenced(self, c: sqlite3.Connection, digest: str) -> None:
        used = c.execute(
            "select 1 from artifacts where hash = ? union all select 1 from conflicts where hash = ?",
            (digest, digest),
        ).fetchone()
        if used is None:
            self._blob(digest).unlink(missing_ok=True)

    def _evict(self, c: sqlite3.Connection, keep: str) -> None:
        """Drop conflicting builds, oldest first (never served: kept to show that a build is not
        reproducible), then the least recently used artifacts (never ``keep``), until the store
        fits its limit. A spec's conflicts alone may otherwise hold it past the limit, and the
        next put of another spec evict that spec's served build."""
        total = self._total(c)
        if total <= self.max_bytes:
            return
        # ``keep``'s last (one may have just been found), unless it cannot stay whatever goes
        (others,) = c.execute(
            "select coalesce(sum(size), 0) from conflicts where spec_id != ?", (keep,)
        ).fetchone()
        last = "spec_id = ?" if total - others <= self.max_bytes else "spec_id != ?"
        for spec_id, digest in c.execute(
            f"select spec_id, hash from conflicts order by {last}, seen, rowid", (keep,)
        ).fetchall():
            c.execute("delete from conflicts where spec_id = ? and hash = ?", (spec_id, digest))
            self._drop_unreferenced(c, digest)
            if self._total(c) <= self.max_bytes:
                return
        rows = c.execute(
            "select spec_id, hash from artifacts where spec_id != ? order by last_used, rowid",
            (keep,),
        ).fetchall()
        for spec_id, digest in rows:  # no conflicts are left by now
            c.execute("delete from artifacts where spec_id = ?", (spec_id,))
            self._drop_unreferenced(c, digest)
            if self._total(c) <= self.max_bytes:
                return

    @staticmethod
    def _total(c: sqlite3.Connection) -> int:
        (total,) = c.execute(
            "select coalesce(sum(size), 0) from (select hash, size from artifacts "
            "union select hash, size from conflicts)"
        ).fetchone()
        return int(total)

    # --- reads ---------------------------------------------------------------------------------

    def get(self, spec: ArtifactSpec) -> bytes | None:
        """``spec``'s bytes, hash re-checked; None if absent, or corrupt (then reported, dropped)."""
        index = self._index()
        row = index.db.conn.execute(
            "select hash from artifacts where spec_id = ?", (spec.id,)
        ).fetchone()
        if row is None:
            return None
        digest = row[0]
        try:
            data = self._blob(digest).read_bytes()
        except FileNotFoundError:
            data = None
        if data is None or sha256(data) != digest:
            self._drop_corrupt(spec, digest)
            return None
        # a read-only index (a baked image, a read-only mount) still serves: its use goes unnoted
        with contextlib.suppress(ReadOnlyError), index.transaction() as c:
            c.execute(
                "update artifacts set last_used = ? where spec_id = ?", (time.time(), spec.id)
            )
        return data

    def _drop_corrupt(self, spec: ArtifactSpec, digest: str) -> None:
        with self._index().transaction() as c:
            path = self._blob(digest)
            if path.exists() and sha256(path.read_bytes()) == digest:
                return  # rewritten by another writer meanwhile
            log.error(
                "artifact %s of %s spec %s is missing or corrupt on disk (%s); dropped",
                digest[:12], spec.source, spec.id[:12], path,
            )  # fmt: skip
            c.execute("delete from artifacts where hash = ?", (digest,))
            c.execute("delete from conflicts where hash = ?", (digest,))
            path.unlink(missing_ok=True)

    def entries(self) -> list[Entry]:
        """Every served artifact, most recently used first."""
        rows = self._index().db.conn.execute(
            "select spec_id, hash, size, created, last_used from artifacts "
            "order by last_used desc, rowid desc"
        )
        return [Entry(*r) for r in rows]

    def conflicts(self) -> list[Conflict]:
        """Every spec that arrived with more than one hash, the served hash first."""
        conn = self._index().db.conn
        out = []
        for spec_id, spec in conn.execute(
            "select distinct spec_id, spec from conflicts order by spec_id"
        ).fetchall():
            served = conn.execute(
                "select hash from artifacts where spec_id = ?", (spec_id,)
            ).fetchall()
            others = conn.execute(
                "select hash from conflicts where spec_id = ? order by seen, hash", (spec_id,)
            ).fetchall()
            hashes = tuple(h for (h,) in [*served, *others])
            out.append(Conflict(ArtifactSpec.from_json(spec), hashes))
        return out

    def specs(self) -> list[tuple[ArtifactSpec, str]]:
        """Every served artifact's spec and hash, oldest first (what a host publishes)."""
        rows = self._index().db.conn.execute(
            "select spec, hash from artifacts order by created, rowid"
        )
        return [(ArtifactSpec.from_json(spec), digest) for spec, digest in rows]

    def hashes(self) -> dict[str, str]:
        """Spec id -> hash of every served artifact (what a host already has)."""
        return dict(self._index().db.conn.execute("select spec_id, hash from artifacts"))


@functools.cache
def shared_store() -> ArtifactStore | None:
    """This process's artifact store, shared by the compile hooks (Triton's cache manager,
    CUTLASS builds) and the warmup; None, reported once, when it cannot be opened: kernels are
    then compiled and cached locally only."""
    try:
        return ArtifactStore()
    except (StoreError, OSError, ValueError) as e:
        log.warning("compiled kernels are not shared: the artifact store cannot be opened: %s", e)
        return None

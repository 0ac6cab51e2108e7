"""The service's artifact blobs: one file per sha256 in a directory beside its database.

An upload is streamed into a temporary file in that directory while it is hashed, so a large
artifact never sits in memory and is never visible half-written: it is renamed to its hash only
once it is complete, within the size limit and equal to the hash the publisher declared (an
upload that fails any check leaves nothing behind). Equal bytes share one file; a verified
upload replaces the file of its hash, which mends one damaged on disk. Clients re-hash what they
download, so a blob damaged after upload is refused there, never run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from tuner.cache.sqlite import StoreError
from tuner.core.atomic import fsync_dir


class BlobError(Exception):
    """An upload refused: ``status`` is the HTTP answer (413 too large, 422 hash mismatch,
    507 the folder cannot take it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def default_dir(db: Path) -> Path:
    """``<db name>.artifacts/`` beside the database file."""
    return db.with_name(db.name + ".artifacts")


STALE_UPLOAD_S = 3600.0  # a temporary upload file untouched this long is left from a killed one


class BlobDir:
    def __init__(self, root: Path) -> None:
        """StoreError (one line from ``tuner serve``) if the folder cannot be made."""
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"artifacts folder {root}: cannot make it: {e.strerror}") from None
        self.remove_stale_uploads()

    def remove_stale_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> int:
        """Remove the temporary files of uploads a killed process left (another service on the
        same folder may be receiving one now: only files untouched this long); how many."""
        cutoff, removed = time.time() - older_than_s, 0
        for tmp in self.root.glob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
        return removed

    def path(self, digest: str) -> Path:
        return self.root / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    async def receive(self, chunks: AsyncIterator[bytes], declared: str, max_bytes: int) -> int:
        """Store a streamed upload as blob ``declared``; its size. BlobError, and nothing
        stored, if it exceeds ``max_bytes``, its sha256 is not ``declared``, or the folder
        cannot take it (gone, read-only, full: 507, said in one line, not a 500)."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{declared[:12]}.", suffix=".tmp")
        except OSError as e:
            raise self._cannot_store(e) from None
        try:
            with os.fdopen(fd, "wb") as f:
                size = await _write_checked(f, chunks, declared, max_bytes)
            os.replace(tmp, self.path(declared))
            fsync_dir(self.root)
        except OSError as e:
            raise self._cannot_store(e) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        return size

    def _cannot_store(self, e: OSError) -> BlobError:
        return BlobError(f"the service cannot store artifacts in {self.root}: {e.strerror}", 507)


async def _write_checked(
    f: BinaryIO, chunks: AsyncIterator[bytes], declared: str, max_bytes: int
) -> int:
    """Write the upload to ``f`` (flushed to disk) while hashing it; its size, or BlobError
    if it is too large, empty or not the bytes ``declared`` names."""
    digest, size = hashlib.sha256(), 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise BlobError(
                f"artifact too large: more than {max_bytes} bytes (the service's "
                "max_artifact_bytes)",
                413,
            )
        digest.update(chunk)
        f.write(chunk)
    f.flush()
    os.fsync(f.fileno())
    if size == 0:
        raise BlobError("artifact body is empty", 422)
    if digest.hexdigest() != declared:
        raise BlobError(
            f"artifact body has sha256 {digest.hexdigest()}, declared {declared}; nothing stored",
            422,
        )
    return size

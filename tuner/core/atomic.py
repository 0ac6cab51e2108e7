"""Write a file all at once: a reader sees the old content or the new, never part of it.

The content goes to a temporary file in the target's folder (one file system, so the rename is
atomic), which then replaces the target; on any error the temporary file is removed and the
target is left as it was. Temporary names are unique per writer, so writers racing on one path
never write into each other's partial files: the last rename wins whole.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, *, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one rename.

    ``durable``: also flush the file and its folder to disk before returning, for files whose
    loss after a power cut would be worse than the time a sync costs.
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writable_dir(path: Path, what: str) -> Path:
    """``path`` made a writable folder, or a ValueError that names it as ``what`` ("the output
    directory"): checked before the work that fills it, so a run does not end, hours in, unable
    to write what it was for."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{path}: cannot create {what}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: {what} is not writable")
    return path

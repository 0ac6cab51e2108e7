"""A file system that takes no more bytes: the process's file-size limit (``RLIMIT_FSIZE``, as
``ulimit -f`` sets it), which fails a write past it with EFBIG as a full disk fails one with
ENOSPC (Python ignores the SIGXFSZ that would otherwise kill the process). It binds root too,
and needs no mount."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(limit_bytes: int) -> Iterator[None]:
    """No file of this process grows past ``limit_bytes`` inside the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def limit_in_child(limit_bytes: int):
    """A ``preexec_fn`` that sets the limit in a child process (and its own children)."""

    def set_limit() -> None:
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )

    return set_limit

"""A module lock that a forked child gets anew.

A child forked from a threaded process (a DataLoader worker) starts with the forking thread
alone: a lock another thread held at the fork would stay held there for good, and the child's
first use would wait forever.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType


class ForkSafeLock:
    """``threading.Lock`` for ``with`` blocks, replaced by a fresh one in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()

"""Child processes that never outlive their parent.

A killed parent must not leave children behind: orphans keep the parent's stdout open, so a
shell pipeline (``tuner tune-all ... | tee log``) waits for them forever, and they hold GPU memory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it exits (even by
    SIGKILL). Only for processes started from a thread that lives as long as its process."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def exit_when_orphaned(parent: int | None = None, poll_s: float = 1.0) -> None:
    """Exit as soon as the parent process (``parent``: its pid, as the parent saw it; default
    this process's parent now) is gone, whichever thread started this one (for pool workers,
    which a pool may start from a short-lived thread). Given the pid, a child whose parent died
    before this call exits at once."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="tuner-orphan-watch", daemon=True).start()

"""Child processes that never outlive their parent.

A killed parent must not leave children behind: orphans keep the parent's stdout open, so a
shell pipeline (``tuner tune-all ... | tee log``) waits for them forever, and they hold GPU memory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

PARENT_PID = "TUNER_PARENT_PID"  # set for a child that ``run_group`` starts


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


def run_group(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``cmd`` run to its end with its output captured, in a process group of its own: the whole
    group is killed when it outlives ``timeout_s`` (then TimeoutExpired), and, where the child
    calls ``group_dies_with_parent``, when this process dies. A compiler child's own children
    (nvcc and what it runs) so never outlive the run that wanted their work."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, PARENT_PID: str(os.getpid())})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def group_dies_with_parent(poll_s: float = 1.0) -> None:
    """In a child of ``run_group``: kill this process group (this process and what it started)
    as soon as the process that started it is gone. Elsewhere, nothing."""
    parent = int(os.environ.get(PARENT_PID, "0"))
    if not parent or os.getpgrp() != os.getpid():
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getppid() != parent:  # the parent died while this process was starting
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, name="tuner-group-watch", daemon=True).start()

"""Child processes that a parent supervises: started with ``spawn``, tied to the parent's life,
watched through one pipe, killed when they hang and replaced when they die.

Both process pools of the tuner stand on it: tune-all's worker per GPU (``tuner.offline.tune_all``)
and the crash-isolating candidate worker (``tuner.tuning.isolation``). Each child gets the parent's
end of a duplex pipe; the parent closes the child's end, so EOF on its own end means the child is
gone, whatever killed it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tuner.core.lifetime import die_with_parent, exit_when_orphaned
from tuner.core.profiling import profiled

CTX = mp.get_context("spawn")  # CUDA cannot be forked; queues and events shared with children


def _child_main(
    target: Callable[..., None],
    conn: Connection,
    args: tuple[Any, ...],
    parent: int,
    pdeathsig: bool,
    log_path: str | None,
) -> None:
    """Runs in the child: tie it to the parent, send stderr to the log, then ``target(conn, *args)``
    (profiled where ``TUNER_PROFILE`` asks for it)."""
    if pdeathsig:
        die_with_parent()
    exit_when_orphaned(parent)
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 2)  # the tail of stderr says why a child died
    with profiled(mp.current_process().name):
        target(conn, *args)


class Child:
    """One spawned process and the parent's end of the pipe to it.

    A child dies with its parent: by the kernel's parent-death signal when it was started from the
    main thread (the signal follows the starting thread, so not from a short-lived one), and in any
    case by a watcher that exits once the parent is gone. Not a daemon: a child may start children
    of its own (a compile pool, an isolated candidate worker).
    """

    def __init__(
        self, target: Callable[..., None], args: tuple[Any, ...], *, name: str, keep_stderr: bool
    ) -> None:
        self.log_path: str | None = None
        if keep_stderr:
            fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
            os.close(fd)
        self.conn, child_end = CTX.Pipe()
        pdeathsig = threading.current_thread() is threading.main_thread()
        self.process = CTX.Process(
            target=_child_main,
            args=(target, child_end, args, os.getpid(), pdeathsig, self.log_path),
            name=name,
            daemon=False,
        )
        self.process.start()
        child_end.close()
        self.pid: int = self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def log_tail(self, limit: int) -> str:
        """The last ``limit`` bytes the child wrote to stderr ("" without ``keep_stderr``)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def close(self, *, grace_s: float = 0.0, stop_message: Any = None) -> None:
        """End the child: ask it to stop (``stop_message``), give it ``grace_s`` seconds to exit
        cleanly (so that its own children exit with it), then kill it and free its pipe and log."""
        if self.process.is_alive() and stop_message is not None:
            with contextlib.suppress(OSError):
                self.conn.send(stop_message)
        if grace_s > 0 and self.process.is_alive():
            self.process.join(timeout=grace_s)
        self.kill()
        self.conn.close()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


class Supervised:
    """A place for one child of one kind, refilled on demand: ``live()`` replaces a dead child,
    ``restart()`` any child. ``started`` lists the pid of every child started, in order."""

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...] = (),
        *,
        name: str,
        keep_stderr: bool = False,
        stop_message: Any = None,
        grace_s: float = 0.0,
    ) -> None:
        self.target, self.args, self.name, self.keep_stderr = target, args, name, keep_stderr
        self.stop_message, self.grace_s = stop_message, grace_s
        self.child: Child | None = None
        self.started: list[int] = []

    def live(self) -> Child:
        if self.child is None or not self.child.alive:
            return self.restart()
        return self.child

    def restart(self) -> Child:
        self.close()
        self.child = Child(self.target, self.args, name=self.name, keep_stderr=self.keep_stderr)
        self.started.append(self.child.pid)
        return self.child

    def close(self, *, grace_s: float | None = None) -> None:
        """End the current child (see ``Child.close``); the default grace is the one given above."""
        if self.child is not None:
            grace = self.grace_s if grace_s is None else grace_s
            self.child.close(grace_s=grace, stop_message=self.stop_message)
            self.child = None

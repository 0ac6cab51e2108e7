"""The one process supervisor: children replaced after they die, stopped cleanly, their stderr
kept, and gone with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tuner.tuning.supervisor import Supervised


def echo(conn) -> None:
    """Answers each message with (pid, message) until "stop"; says so on stderr."""
    print(f"child {os.getpid()} up", file=sys.stderr, flush=True)
    while (msg := conn.recv()) != "stop":
        conn.send((os.getpid(), msg))


def ask(slot: Supervised, msg: str) -> tuple[int, str]:
    child = slot.live()
    child.conn.send(msg)
    assert child.conn.poll(60)
    return child.conn.recv()


def test_a_dead_child_is_replaced_and_a_live_one_reused():
    slot = Supervised(echo, name="echo", keep_stderr=True, stop_message="stop", grace_s=10)
    try:
        first, _ = ask(slot, "a")
        assert ask(slot, "b") == (first, "b")
        assert f"child {first} up" in slot.child.log_tail(200)
        os.kill(first, signal.SIGKILL)
        slot.child.join(timeout=10)
        second, answer = ask(slot, "c")
        assert answer == "c" and second != first and slot.started == [first, second]
        child = slot.child
    finally:
        slot.close()
    assert child.exitcode == 0  # it got the stop message and returned
    assert not os.path.exists(child.log_path)


PARENT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from test_supervisor import echo
    from tuner.tuning.supervisor import Supervised
    slot = Supervised(echo, name="echo")
    print(slot.live().pid, flush=True)
    time.sleep(600)
    """
)


def test_children_exit_with_a_killed_parent():
    here = os.path.dirname(__file__)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, here], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(") ")[1][0] == "Z":
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} outlived its killed parent")


def test_a_child_writes_its_profile_where_tuner_profile_asks(tmp_path, monkeypatch):
    """``TUNER_PROFILE``: the child's cProfile file, named after it, once it returns."""
    import pstats

    monkeypatch.setenv("TUNER_PROFILE", str(tmp_path))
    slot = Supervised(echo, name="echo", stop_message="stop", grace_s=10)
    try:
        pid, _ = ask(slot, "a")
    finally:
        slot.close()
    (path,) = tmp_path.glob("*.prof")
    assert path.name == f"echo-{pid}.prof"
    assert any(fn[2] == "echo" for fn in pstats.Stats(str(path)).stats)

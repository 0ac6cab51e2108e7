"""Children never outlive a killed parent: a pipeline reading the parent's output ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux process semantics")

# A parent that starts the Triton compile pool (spawned workers inheriting its stdout), prints the
# workers' pids, then waits to be killed: what `tuner tune-all ... | tee log` saw on the GPU box.
PARENT = textwrap.dedent(
    """
    import os, sys, time
    from tuner.candidates.triton_kernels.launch import _get_pool
    pool = _get_pool()
    pids = {pool.submit(os.getpid).result() for _ in range(8)}
    print(" ".join(map(str, sorted(pids))), flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited already
        return f.read().split(") ")[1][0] != "Z"


def test_compile_pool_workers_exit_with_a_killed_parent():
    env = {**os.environ, "TUNER_COMPILE_WORKERS": "2"}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env=env, text=True
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert pids and parent.pid not in pids
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    # EOF on the pipe means every process that inherited the parent's stdout is gone
    deadline = time.monotonic() + 20
    assert parent.stdout.read() == ""
    assert time.monotonic() < deadline
    assert not [p for p in pids if _alive(p)]

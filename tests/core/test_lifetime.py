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
# workers' pids, then waits to be killed, as `tuner tune-all ... | tee log` runs it.
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


# A compiler child as `nvcc_build._compile_child` starts it (through `run_group`): it watches its
# parent, starts a grandchild (nvcc's stand-in) and writes both pids to the file it is given.
COMPILER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from tuner.core.lifetime import group_dies_with_parent
    group_dies_with_parent(poll_s=0.1)
    nvcc = subprocess.Popen(["sleep", "600"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {nvcc.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
    """
)


def _pids(path, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, "the compiler child never wrote its pids"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if _alive(p)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_run_group_returns_the_childs_output_and_exit_code():
    from tuner.core.lifetime import run_group

    done = run_group([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], 60)
    assert (done.returncode, done.stdout) == (3, "out\n")


def test_a_compiler_child_and_its_nvcc_die_with_a_killed_run(tmp_path):
    pids_file = tmp_path / "pids"
    run = textwrap.dedent(
        f"""
        import sys
        from tuner.core.lifetime import run_group
        run_group([sys.executable, "-c", {COMPILER!r}, {str(pids_file)!r}], 600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", run])
    pids = _pids(pids_file)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    assert _gone(pids), [p for p in pids if _alive(p)]


def test_a_compiler_child_past_its_time_goes_with_its_nvcc(tmp_path):
    from tuner.core.lifetime import run_group

    pids_file = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", COMPILER, str(pids_file)], 5)
    assert _gone(_pids(pids_file, timeout_s=0))

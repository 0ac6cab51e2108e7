"""A run's end stops the compile pool's processes, idle or mid-job, without a warning: each
releases the semaphores it made (Triton's compile workers' queues) before it dies, else the
resource tracker reports them as leaked when the run exits (tuner.tuning.compile_pool)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import time
from pathlib import Path

from tests.tuning.compile_log_source import TritonPoolLog
from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.tuning import compile_pool
from tuner.tuning.compile_pool import CompilePool
from tuner.tuning.engine import TuneOptions
from tuner.tuning.isolation import runtime_sources

registry.register(TritonPoolLog())
done, running = (GemmKey(m=m, n=256, k=64, dtype="f32", out_dtype="f32") for m in (64, 1))
options = TuneOptions(sources=["triton_pool_log"])
pool = CompilePool([done, running], options, "cpu", jobs=2, sources=runtime_sources())
pool.start()
compile_pool.wait(pool.events, done, timeout_s=120)
result = pool.result(done)
assert result is not None and not result.errors, result
log, deadline = Path("{log}"), time.monotonic() + 120
while str(running) not in log.read_text() and time.monotonic() < deadline:
    time.sleep(0.05)
assert pool.futures[str(running)].running(), "the slow job is not running"
pool.close()
print("closed")
"""


def test_a_pool_closed_with_jobs_done_and_running_leaks_no_semaphore(tmp_path):
    log = tmp_path / "compiled.jsonl"
    proc = subprocess.run(
        [sys.executable, "-c", RUN.format(log=log)], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "TUNER_TEST_COMPILE_LOG": str(log)}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr
    assert "leaked semaphore" not in proc.stderr, proc.stderr

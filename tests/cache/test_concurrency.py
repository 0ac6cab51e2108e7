"""Several processes tuning into one cache file at once lose no result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tuner.cache import Store

WORKER = """
import json, sys
from tuner.cache import Store
from tuner.tuning.engine import TuneOptions, tune
from tuner.core.keys import GemmKey
store = Store(sys.argv[1])
uids = []
for m in range(int(sys.argv[2]), int(sys.argv[2]) + 6):
    outcome = tune(GemmKey(m=m, n=16, k=16, dtype="f32", out_dtype="f32"), options=TuneOptions(budget_s=0.005, sources=[]))
    store.save_run(outcome.measurements, outcome.winner)
    uids += [x.uid for x in outcome.measurements]
print(json.dumps(uids))
"""


def test_parallel_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.db"
    Store(path).close()
    env = os.environ | {"TRITON_INTERPRET": "1"}
    # four writers, two pairs overlapping on the same keys (m = 1..6 twice, 4..9 twice)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), str(start)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for start in (1, 1, 4, 4)
    ]
    written = set()
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        written |= set(json.loads(out.strip().splitlines()[-1]))
    store = Store(path)
    assert {m.uid for m in store.measurements()} == written
    assert len({w.key for w in store.winners()}) == 9

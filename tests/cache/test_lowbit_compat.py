"""A cache written by the current release serves its results under the low-bit keys' code, and
one store holds old and low-bit keys side by side.

No schema change is needed: keys are stored as their strings, and a plain key's string is the
same as before (the low-bit fields are written only when they differ from a plain GEMM's), so
this opens the release-written file (tests/data/compat/cache-v2.db, see test_compat.py) and
looks its rows up by keys built with today's ``GemmKey``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tuner.cache import Store
from tuner.core.keys import GemmKey, lowbit_fields, parse_key
from tuner.measure.records import Measurement, Winner

DATA = Path(__file__).parents[1] / "data" / "compat"
DC = "cpu-x86-64-2c"


def test_release_cache_serves_old_results_beside_lowbit_ones(tmp_path):
    path = Path(shutil.copy(DATA / "cache-v2.db", tmp_path / "cache-v2.db"))
    old = GemmKey(m=64, n=64, k=64, dtype="f32", out_dtype="f32")
    int4 = GemmKey(m=16, n=64, k=256, **lowbit_fields("int4-g128"))
    fp8 = GemmKey(m=16, n=64, k=256, **lowbit_fields("fp8-rowwise-fast"))
    with Store(path) as s:
        found = s.winner(DC, str(old))
        assert found is not None and found.source == "triton" and found.median_us == 8.0
        for key, source in ((int4, "triton_w4a16"), (fp8, "triton_fp8")):
            m = Measurement(DC, str(key), source, {"bm": 16}, "ok", median_us=5.0)
            s.save_run([m], Winner(DC, str(key), source, {"bm": 16}, 5.0, 6.0))
    with Store(path) as s:
        winners = {parse_key(w.key): w for w in s.winners(DC)}
        assert set(winners) == {
            old,
            GemmKey(m=128, n=64, k=64, dtype="f32", out_dtype="f32"),
            int4,
            fp8,
        }
        assert winners[int4].source == "triton_w4a16" and winners[fp8].source == "triton_fp8"
        assert s.winner(DC, str(old)).median_us == 8.0
        assert {m.key for m in s.measurements(DC)} >= {str(int4), str(fp8), str(old)}

"""bench/cold_start.py in its --dry-run mode: both tune-all runs (pruned, compile-everything) on
fresh caches of their own on the CPU, the result file and the comparison of their winners."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cold_start.py"


def test_dry_run_writes_both_runs_and_their_comparison(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "cold_start.json").read_text())
    for part in ("cold", "everything"):
        run = result[part]
        assert run["exit"] == 0 and run["summary"]["tuned"] == 5  # 4 model GEMMs + 1 odd shape
        assert (tmp_path / part / "tuner.db").exists()  # each run on its own caches
        titles = [p["title"] for p in run["problems"]]
        assert "5x7x9 nt f32 align 4 (odd.yaml[0])" in titles
        assert all(p["timing_s"] is not None and p["compiled"] is not None for p in run["problems"])
    assert "--no-prune" in result["everything"]["command"]
    assert result["comparison"]["problems"] == 5
    assert result["comparison"]["geomean_ratio"] > 0


def test_parts_not_written_yet_say_so(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--part", "fleet", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "fleet not implemented yet" in r.stderr

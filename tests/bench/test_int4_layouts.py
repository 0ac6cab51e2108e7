"""bench/int4_layouts.py on the CPU: each layout made from torch's packed weight, checked against
the nibbles it came from, timed, its bytes counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_small_weights_get_every_layout_checked_timed_and_sized(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.int4_layouts", "--out", str(out), "--reps", "1",
         "--shape", "small", "64", "256", "--shape", "ragged", "208", "384"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["device"] and result["versions"]["torch"]
    assert [row["name"] for row in result["rows"]] == ["small", "ragged"]
    for row in result["rows"]:
        n, k = row["n"], row["k"]
        assert row["checked"]
        for layout in ("torch_packed", "ours", "cutlass_a", "cutlass_a_reordered"):
            assert row[layout]["bytes"] == n * k // 2 and row[layout]["seconds"] > 0
        assert row["cutlass_scales"]["bytes"] == 2 * (k // 128) * n * 2


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    for args, named in (
        (["--reps", "0"], "--reps=0"),
        (["--shape", "w", "64", "200"], "--shape w 64 200"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "bench.int4_layouts", "--out", str(tmp_path / "x.json"), *args],
            capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr

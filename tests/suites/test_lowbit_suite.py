"""``tuner bench gemm --suite lowbit``: the suite's shapes, and a tiny shape list end to end on
this device (JSON rows beside torch's op and bf16, both PNGs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tuner.suites import lowbit
from tuner.tuning.engine import TuneOptions


def test_suite_has_the_issue_shapes_and_formats() -> None:
    problems = lowbit.problems()
    assert len(problems) == 2 * 4 * 8 * 3
    keys = {(k.m, k.n, k.k) for _, k in problems}
    assert {(1, 6144, 4096), (2048, 4096, 14336), (16, 2 * 18944, 3584)} <= keys
    assert {label.rsplit(" ", 1)[1] for label, _ in problems} == set(lowbit.FORMATS)
    assert {k.m for _, k in problems} == set(lowbit.M_SIZES)


def test_tiny_shapes_end_to_end(tmp_path: Path, monkeypatch) -> None:
    """Every source allowed (Triton's low-bit kernels through the interpreter on a CPU host):
    each row times torch's op for its format against the winner, and no candidate fails."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    problems = lowbit.problems(ms=(2,), shapes=[("tiny", 32, 256)])
    result = lowbit.run(problems, tmp_path, TuneOptions(budget_s=0.005))
    saved = json.loads((tmp_path / "gemm_lowbit.json").read_text())
    assert saved["targets"] == json.loads(json.dumps(result["targets"]))
    assert [r["format"] for r in saved["rows"]] == list(lowbit.FORMATS)
    for row in saved["rows"]:
        assert (row["m"], row["n"], row["k"]) == (2, 32, 256)
        assert row["baseline_us"] > 0 and row["winner_us"] > 0 and row["bf16_us"] > 0
        assert row["speedup_vs_bf16"] == row["bf16_us"] / row["winner_us"]
        assert row["bytes"] > 0 and row["pct_copy"] > 0
        assert row["baseline_source"] == "torch_lowbit"
        assert row["failures"] == []
    assert {r["source"] for r in saved["rows"]} <= {"torch_lowbit", "triton_w4a16", "triton_fp8"}
    int4_row = saved["rows"][0]
    assert int4_row["bytes"] < saved["rows"][1]["bytes"]  # half-byte weights move fewer bytes
    assert saved["device"]["name"] and saved["versions"]["torch"]
    assert set(saved["targets"]) == set(lowbit.FORMATS)
    for png in ("gemm_lowbit.png", "gemm_lowbit_vs_bf16.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"

"""``tuner bench gemm``: the suite's shapes, and one small part end to end on this device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.offline.model_config import gemm_key
from tuner.suites import gemm
from tuner.tuning.engine import TuneOptions


def test_suite_parts_have_the_issue_shapes() -> None:
    bf16 = gemm.llama_suite("bf16-8b") + gemm.llama_suite("bf16-70b")
    assert len(bf16) == 2 * 4 * 15
    assert all(k.dtype == "bf16" and k.layout == "nt" for _, k in bf16)
    keys = {(k.m, k.n, k.k) for _, k in bf16}
    assert {(1, 6144, 4096), (16, 4096, 14336), (16384, 57344, 8192), (1, 8192, 28672)} <= keys
    odd = {(k.m, k.n, k.k): k for _, k in gemm.llama_suite("odd")}
    assert odd[(4097, 4099, 4101)].align == 2 and (127, 5120, 3333) in odd
    fp32 = gemm.llama_suite("fp32")
    assert {k.compute for _, k in fp32} == {"f32", "tf32"} and len(fp32) == 40
    assert len(gemm.llama_suite("fp16")) == 20
    for part, labels in gemm.INDUCTOR.items():
        assert set(labels) <= {label for label, _ in gemm.llama_suite(part)}
    with pytest.raises(ValueError, match="part must be one of"):
        gemm.llama_suite("bf16-405b")


def test_a_small_part_end_to_end(tmp_path: Path) -> None:
    problems = [("tiny", gemm_key(8, 40, 56, layout="nt", dtype="f32")),
                ("odd", gemm_key(5, 33, 7, layout="nt", dtype="f32"))]  # fmt: skip
    result = gemm.run_part("test", problems, tmp_path, TuneOptions(budget_s=0.005),
                                 inductor=False, warm_sample=1)  # fmt: skip
    saved = json.loads((tmp_path / "gemm_llama_test.json").read_text())
    assert saved["targets"] == result["targets"]
    assert [r["label"] for r in saved["rows"]] == ["tiny", "odd"]
    for row in saved["rows"]:
        assert row["speedup"] > 0 and row["pct_copy"] > 0 and row["candidates"]["ok"] >= 1
    assert len(saved["warm_retune"]) == 1
    assert saved["targets"]["decode_n"] == 2
    assert (tmp_path / "gemm_llama_test.png").exists() and (
        tmp_path / "gemm_llama_test.db"
    ).exists()


def test_ctrl_c_after_the_rows_keeps_an_earlier_complete_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the steps after the rows (here the warm re-tune): the earlier complete JSON and
    PNG of the part stay; this run's rows go to the partial files, marked interrupted."""
    for ext in ("json", "png"):
        (tmp_path / f"gemm_llama_test.{ext}").write_text(f"complete {ext}")

    def cut(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gemm, "warm_retune", cut)
    problems = [("tiny", gemm_key(8, 40, 56, layout="nt", dtype="f32"))]
    with pytest.raises(KeyboardInterrupt):
        gemm.run_part("test", problems, tmp_path, TuneOptions(budget_s=0.005, sources=["torch"]),
                      inductor=False, warm_sample=1)  # fmt: skip
    for ext in ("json", "png"):
        assert (tmp_path / f"gemm_llama_test.{ext}").read_text() == f"complete {ext}"
    partial = json.loads((tmp_path / "gemm_llama_test.interrupted.json").read_text())
    assert partial["interrupted"] is True and [r["label"] for r in partial["rows"]] == ["tiny"]
    assert (tmp_path / "gemm_llama_test.interrupted.png").read_bytes()[:4] == b"\x89PNG"

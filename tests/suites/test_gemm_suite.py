"""``tuner bench gemm``: the suite's shapes, and one small part end to end on this device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.offline.model_config import gemm_key
from tuner.suites import catalog, gemm
from tuner.suites.runner import verdict_notes
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


def test_quick_on_a_cpu_picks_a_few_small_rows_of_each_part() -> None:
    """On a CPU, --quick times the small shape in each part's dtypes (the odd part's odd one),
    labelled as such; on a GPU every 4th of the part's rows, and without --quick all of them."""
    for part in gemm.PARTS:
        rows = gemm.chosen_problems(part, quick=True, device="cpu")
        dtypes = {key.dtype for _, key in gemm.llama_suite(part)}
        assert {key.dtype for _, key in rows} == dtypes and 2 <= len(rows) <= 4, rows
        for label, key in rows:
            assert catalog.is_quick_cpu(label), label
            assert key.m in catalog.GEMM_QUICK_CPU_M and key.flops <= 2 * 64 * 65 * 257, key
        assert gemm.chosen_problems(part, quick=True, device="cuda") == gemm.llama_suite(part)[::4]
        assert gemm.chosen_problems(part, device="cpu") == gemm.llama_suite(part)
    odd = gemm.chosen_problems("odd", quick=True, device="cpu")
    assert {(key.n, key.k) for _, key in odd} == {catalog.GEMM_QUICK_CPU_ODD_SHAPE}
    with pytest.raises(ValueError, match="part must be one of"):
        gemm.chosen_problems("bf16-405b", quick=True, device="cpu")


@pytest.mark.cpu_host
def test_quick_on_a_cpu_runs_small_rows_labelled_so_and_judges_no_target(tmp_path: Path) -> None:
    """``bench gemm --quick`` on a CPU: the small rows in seconds, their JSON, console and PNG
    title saying they are CPU-path rows of small shapes, and the targets marked not judged."""
    out = tmp_path / "bench"
    args = ["bench", "gemm", "--quick", "--part", "fp16", "--source", "torch", "--out", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "gemm_llama_fp16.json").read_text())
    want = gemm.chosen_problems("fp16", quick=True, device="cpu")
    assert [r["label"] for r in saved["rows"]] == [label for label, _ in want]
    assert saved["title"].endswith(gemm.QUICK_CPU_ROWS)
    assert saved["shapes_note"].startswith(gemm.QUICK_CPU_ROWS)
    assert saved["targets_judged"] is False and saved["targets_note"].startswith("targets not")
    said = " ".join(result.output.split())
    assert f"{saved['shapes_note']}." in said and "Targets not judged" in said
    assert (out / "gemm_llama_fp16.png").read_bytes()[:4] == b"\x89PNG"


def test_a_cpu_decode_rows_bandwidth_prints_with_its_digits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A CPU decode row reads a few GB/s: printed as 4.82 and 5.61, not 5 and 6, and with no
    empty CUDA-graph column where none was timed."""
    row = {"label": "small N=64 K=256 M=1", "m": 1, "failures": [], "baseline_gbs": 4.823,
           "baseline_pct_copy": 17.2, "gbs": 5.614, "pct_copy": 20.1}  # fmt: skip
    result = {"rows": [row], "targets": {}, **verdict_notes("cpu", None)}
    gemm.print_report(result)
    said = " ".join(capsys.readouterr().out.split())
    assert "cuBLAS 4.82 GB/s (17%) -> 5.61 GB/s (20% of copy)" in said
    assert "CUDA graphs" not in said


def test_a_failed_recheck_and_a_candidates_error_print_as_they_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recheck's error (a number, or an exception's text) and a candidate's failure, with
    brackets that are no console markup."""
    row = {"label": "small [a] M=1", "m": 1, "recheck_err": 0.3, "baseline_gbs": 4.8,
           "baseline_pct_copy": 17.2, "gbs": 5.6, "pct_copy": 20.1,
           "failures": ["cutlass: shape [n, k] refused [/red]"]}  # fmt: skip
    gemm.print_report({"rows": [row], "targets": {}, **verdict_notes("cpu", None)})
    said = " ".join(capsys.readouterr().out.split())
    assert "small [a] M=1: winner recheck failed: 0.3" in said
    assert "small [a] M=1: cutlass: shape [n, k] refused [/red]" in said


def test_decode_rows_without_a_graph_reading_report_none_not_zero() -> None:
    """On a CPU no decode row is timed in a CUDA graph: the suite's graph figure is null (as the
    Triton one beside it), not 0% of copy; where some rows were read, the least of theirs."""
    rows = [{"m": 1, "n": 64, "k": 256, "speedup": 1.0, "pct_copy": 20.0, "tune_s": 0.1}]
    assert gemm.targets({"rows": rows})["decode_graph_min_pct_copy"] is None
    rows.append(dict(rows[0], graph_baseline_pct_copy=61.0, graph_winner_pct_copy=70.0))
    rows.append(dict(rows[0], graph_baseline_pct_copy=55.0))  # the winner's capture failed
    assert gemm.targets({"rows": rows})["decode_graph_min_pct_copy"] == 55.0
    # a row whose every capture failed is no row left out: it counts 0% (and says why)
    rows.append(dict(rows[0], graph_baseline_error="capture", graph_winner_error="capture"))
    assert gemm.targets({"rows": rows})["decode_graph_min_pct_copy"] == 0.0


def test_inductor_on_a_gpu_says_which_quick_parts_keep_none_of_its_shapes() -> None:
    """--quick's every 4th row keeps one Inductor shape of most parts but none of fp32's: that
    part is named with the shape it left out; on a CPU none runs anywhere, said so."""
    quick = {p: gemm.chosen_problems(p, quick=True, device="cuda") for p in ("fp16", "fp32")}
    assert gemm.no_inductor({"fp16": quick["fp16"]}, "cuda") is None
    said = gemm.no_inductor(quick, "cuda")
    assert said is not None and "(fp32's 8B qkv M=1024 tf32)" in said and "fp16" not in said
    assert "no CUDA GPU here" in str(gemm.no_inductor(quick, "cpu"))

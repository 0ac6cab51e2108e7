"""``tuner bench sdpa``'s arguments, checked before anything is made or run, and ``--quick``'s rows
(on a CPU a few small ones: seconds in bf16, minutes in f16 and f32)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.core.keys import SdpaKey
from tuner.suites import catalog, runner, sdpa
from tuner.tuning.engine import TuneOptions


def test_a_bad_dtype_is_named_before_the_out_folder_is_made(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "sdpa", "--dtype", "float16", "--out", str(out)])
    assert isinstance(result.exception, ValueError)
    assert "['bf16', 'f16', 'f32'], got 'float16'" in str(result.exception)
    assert not out.exists()


def test_help_names_every_dtype_the_suite_takes() -> None:
    result = CliRunner().invoke(app, ["bench", "sdpa", "--help"], env={"COLUMNS": "300"})
    assert "bf16, f16 or f32." in result.output


def test_help_says_where_a_run_cut_short_writes_its_rows() -> None:
    """Both suites' --out say that Ctrl-C leaves a complete earlier result in place."""
    for suite in ("gemm", "sdpa"):
        result = CliRunner().invoke(app, ["bench", suite, "--help"], env={"COLUMNS": "300"})
        said = " ".join(result.output.replace("│", " ").split())  # the help's lines joined
        assert "<name>.interrupted.json/.png, leaving a complete result" in said


def test_quick_says_what_a_cpu_run_costs_in_each_dtype() -> None:
    """On a CPU --quick takes seconds in bf16 only (torch's SDPA alone): in f16 and f32 the
    Triton candidates run through the interpreter, minutes a row. The help says so, not seconds
    for every dtype."""
    result = CliRunner().invoke(app, ["bench", "sdpa", "--help"], env={"COLUMNS": "300"})
    said = " ".join(result.output.replace("│", " ").split())
    assert "seconds in bf16" in said and "in f16 and f32 the Triton candidates run" in said
    assert "minutes a row" in said
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    at = readme.index("tuner bench sdpa --quick ")
    assert "seconds in bf16" in readme[at:].split("\ntuner ", 1)[0], readme[at : at + 300]


def test_quick_on_a_cpu_picks_a_few_small_rows_of_each_part() -> None:
    for part in sdpa.PARTS:
        rows = sdpa.chosen_problems(part, "bf16", quick=True, device="cpu")
        assert 1 <= len(rows) <= 8, rows
        for _, key in rows:
            assert key.batch == 1
            assert key.q_len * key.kv_len <= 256 * 4096, key  # attention scores per head
            assert key.kv_bytes <= 16 * 2**20, key  # K/V of MBs, not the GPU rows' GBs
    prefill = sdpa.chosen_problems("prefill", quick=True, device="cpu")
    assert {key.q_len for _, key in prefill} == {catalog.SDPA_QUICK_CPU_PREFILL_SEQ}
    decode = sdpa.chosen_problems("decode", quick=True, device="cpu")
    assert {key.kv_len for _, key in decode} == set(catalog.SDPA_QUICK_CPU_DECODE_KV)
    assert {key.q_len for _, key in decode} == set(sdpa.DECODE_Q)


def test_quick_on_a_gpu_keeps_every_4th_row_and_without_quick_every_row() -> None:
    for part, problems in sdpa.PARTS.items():
        every = problems("f16")
        assert sdpa.chosen_problems(part, "f16", quick=True, device="cuda") == every[::4]
        assert sdpa.chosen_problems(part, "f16", device="cpu") == every


@pytest.mark.slow
@pytest.mark.cpu_host
def test_quick_on_a_cpu_runs_to_its_reports(tmp_path: Path) -> None:
    """The whole CPU smoke run, torch's SDPA only: under TRITON_INTERPRET the Triton candidates
    would run in the interpreter."""
    out = tmp_path / "bench"
    args = ["bench", "sdpa", "--quick", "--source", "torch_sdpa", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for part in ("prefill", "decode"):
        text = (out / f"sdpa_{part}.json").read_text()
        report = json.loads(text, parse_constant=_refuse)  # strict JSON: no NaN or Infinity
        assert len(report["rows"]) == len(sdpa.chosen_problems(part, quick=True, device="cpu"))
        assert all(row["baseline_us"] > 0 for row in report["rows"])


def _refuse(constant: str) -> None:
    raise ValueError(f"not JSON: {constant}")


def test_workers_left_out_keeps_the_environments_compile_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--workers`` overrides ``$TUNER_COMPILE_WORKERS`` only where given: its default must not
    replace the environment's (or the config file's) setting."""
    monkeypatch.setenv("TUNER_COMPILE_WORKERS", "3")
    ran = []
    monkeypatch.setattr(
        sdpa, "run", lambda *a, **k: ran.append(os.environ["TUNER_COMPILE_WORKERS"])
    )
    args = ["bench", "sdpa", "--quick", "--out", str(tmp_path / "b")]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--workers", "5"]).exit_code == 0
    assert ran == ["3", "5"]


def test_ctrl_c_after_the_rows_keeps_an_earlier_complete_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the rows are annotated: the earlier complete sdpa_decode.json and .png stay;
    this run's rows go to the partial files, marked interrupted."""
    for ext in ("json", "png"):
        (tmp_path / f"sdpa_decode.{ext}").write_text(f"complete {ext}")

    def cut(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sdpa, "annotate", cut)
    key = SdpaKey(batch=1, q_heads=2, kv_heads=2, q_len=1, kv_len=64, head_dim=16, causal="none",
                  dtype="f32")  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        sdpa.run({"decode": [("tiny", key)]}, tmp_path,
                 TuneOptions(budget_s=0.005, sources=["torch_sdpa"]), dtype="f32")  # fmt: skip
    for ext in ("json", "png"):
        assert (tmp_path / f"sdpa_decode.{ext}").read_text() == f"complete {ext}"
    partial = json.loads((tmp_path / "sdpa_decode.interrupted.json").read_text())
    assert partial["interrupted"] is True and [r["label"] for r in partial["rows"]] == ["tiny"]
    assert (tmp_path / "sdpa_decode.interrupted.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.cpu_host
def test_a_cpu_run_says_its_targets_are_not_judged_and_its_rows_are_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As both GEMM suites: the JSON of a run on a CPU marks its targets not judged and why, and
    says where its rows are --quick's small CPU ones (labelled so), the console with it; a row
    of the suite's own shapes has no shapes note."""
    key = SdpaKey(batch=1, q_heads=2, kv_heads=2, q_len=1, kv_len=64, head_dim=16, causal="none",
                  dtype="f32")  # fmt: skip
    options = TuneOptions(budget_s=0.005, sources=["torch_sdpa"])
    small = catalog.quick_cpu_label("tiny")
    sdpa.run({"decode": [(small, key)]}, tmp_path, options, dtype="f32")
    saved = json.loads((tmp_path / "sdpa_decode.json").read_text())
    assert saved["targets_judged"] is False and saved["targets_note"] == runner.NOT_JUDGED
    assert saved["shapes_note"].startswith(f"{sdpa.QUICK_CPU_ROWS['decode']}, not the suite's")
    said = " ".join(capsys.readouterr().out.split())
    assert f"{saved['shapes_note']}." in said and "Targets not judged: they are GPU" in said
    sdpa.run({"prefill": [("tiny", key)]}, tmp_path, options, dtype="f32")
    saved = json.loads((tmp_path / "sdpa_prefill.json").read_text())
    assert saved["shapes_note"] is None and saved["targets_judged"] is False
    assert all(catalog.is_quick_cpu(label) for part in sdpa.PARTS
               for label, _ in sdpa.chosen_problems(part, quick=True, device="cpu"))  # fmt: skip


def test_cpu_rates_print_with_their_digits(capsys: pytest.CaptureFixture[str]) -> None:
    """A CPU prefill row's TFLOP/s and a decode row's GB/s print as 0.0123 and 3.46, not as
    0 and 3."""
    prefill = {"label": "p", "candidates": [], "baseline_tflops": 0.01234, "tflops": 0.02345,
               "cudnn_tflops": 0.004567}  # fmt: skip
    sdpa._print_extra({"rows": [prefill], "summary": {}}, "prefill")
    decode = {"label": "d", "candidates": [], "baseline_kv_gbs": 3.456, "kv_gbs": 12.34,
              "baseline_pct_copy": 12.0, "pct_copy": 44.0, "baseline_host_us": None,
              "winner_host_us": None}  # fmt: skip
    sdpa._print_extra({"rows": [decode], "summary": {}}, "decode")
    said = " ".join(capsys.readouterr().out.split())
    assert "default 0.0123 -> 0.0234 TFLOP/s" in said and "cudnn 0.00457" in said
    assert "default 3.46 GB/s (12%) -> 12.3 GB/s (44%)" in said


def test_a_failed_recheck_prints_its_error_and_the_suite_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A recheck's error is a number: printed as it reads, not taken for console markup."""
    row = {"label": "decode [b] kv=256", "recheck_err": 0.3, "candidates": [],
           "baseline_kv_gbs": 900.0, "baseline_pct_copy": 30.0, "kv_gbs": 1200.0,
           "pct_copy": 40.0, "baseline_host_us": 9.0, "winner_host_us": 8.0}  # fmt: skip
    sdpa._print_extra({"rows": [row], "summary": {}}, "decode")
    assert "decode [b] kv=256: winner recheck failed: 0.3" in " ".join(
        capsys.readouterr().out.split()
    )

"""``tuner bench sdpa``'s arguments, checked before anything is made or run."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tuner.cli.main import app


def test_a_bad_dtype_is_named_before_the_out_folder_is_made(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "sdpa", "--dtype", "float16", "--out", str(out)])
    assert isinstance(result.exception, ValueError)
    assert "['bf16', 'f16', 'f32'], got 'float16'" in str(result.exception)
    assert not out.exists()


def test_help_names_every_dtype_the_suite_takes() -> None:
    result = CliRunner().invoke(app, ["bench", "sdpa", "--help"], env={"COLUMNS": "300"})
    assert "bf16, f16 or f32." in result.output

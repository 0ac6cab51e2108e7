"""``tuner warmup``: a summary line, a table of the winners it could not load and why, exit 1
when there are any."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from tuner.cache import Store
from tuner.cli.main import app
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure.records import Winner

TRITON = {"bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1}


def warm(cache: Path) -> tuple[int, str]:
    before = os.environ.get("TUNER_CACHE")
    result = CliRunner().invoke(
        app, ["warmup", "--cache", str(cache), "--no-fetch", "--no-progress"]
    )
    assert os.environ.get("TUNER_CACHE") == before  # --cache's stand-in is put back after
    return result.exit_code, result.output


def test_warmup_command_loads_winners_and_fails_on_what_it_could_not_load(
    tmp_path: Path,
) -> None:
    dc = fingerprint().device_class
    good = GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8)
    Store(tmp_path / "c.db").put_winners([Winner(dc, str(good), "triton_gemm", TRITON, 1.0, 2.0)])
    code, out = warm(tmp_path / "c.db")
    assert code == 0, out
    assert f"{dc}: 1 winner: 1 loaded now, 0 ready already, 0 failed" in out

    gone = GemmKey(m=24, n=8, k=8)
    Store(tmp_path / "c.db").put_winners([Winner(dc, str(gone), "no_such_source", {}, 1.0, 2.0)])
    code, out = warm(tmp_path / "c.db")
    assert code == 1
    assert "1 loaded now, 0 ready already, 1 failed" in out
    assert "not loaded" in out and "no_such_source" in out and "m=24" in out


def test_warmup_in_mode_off_says_nothing_is_served_rather_than_no_winners(
    tmp_path: Path, monkeypatch
) -> None:
    """Mode off never reads the cache: "0 winners" would read as an empty cache."""
    dc = fingerprint().device_class
    key = GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8)
    Store(tmp_path / "c.db").put_winners([Winner(dc, str(key), "triton_gemm", TRITON, 1.0, 2.0)])
    monkeypatch.setenv("TUNER_MODE", "off")
    code, out = warm(tmp_path / "c.db")
    assert code == 0, out
    assert "mode off" in out and "nothing to load" in out and "winner:" not in out


def test_warmup_command_names_a_device_that_is_not_here(tmp_path: Path) -> None:
    Store(tmp_path / "c.db").close()
    result = CliRunner().invoke(
        app, ["warmup", "--cache", str(tmp_path / "c.db"), "--device", "cuda:64"]
    )
    assert isinstance(result.exception, ValueError)
    assert "--device 'cuda:64': this host has" in str(result.exception)

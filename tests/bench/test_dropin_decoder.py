"""bench/dropin_decoder.py: the GPU benchmark's own logic, run on the CPU with tiny dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

bench = load_script("dropin_decoder")


def test_dropin_benchmark_smoke_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/dropin_decoder.py end to end with tiny dimensions: record, tune, measure, JSON, PNG."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "c.db"))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--smoke", "--out", str(out), "--plot", str(png), "--source", "torch"]
    args += ["--decode-batches", "1,4", "--extra-batches", "3", "--prefill-seq", "8"]
    args += ["--kv-len", "16", "--rounds", "2", "--iters", "2", "--overhead-calls", "50"]
    args += ["--overhead-rounds", "3"]
    result = bench.main(args)
    assert result["complete"] and png.stat().st_size > 0
    assert json.loads(out.read_text())["targets"] == result["targets"]
    assert {row["status"] for row in result["tuning"]} == {"tuned"}
    assert result["warmup"]["failures"] == []
    rows = {row["label"]: row for row in result["phases"]}
    assert set(rows) == {"decode b=1", "decode b=4", "prefill b=1 s=8", "decode b=3 (untuned M)"}
    for row in rows.values():
        assert row["rel_err_on_vs_off"] < 1e-6
        assert row["eager_on"]["median_us"] > 0 and row["eager_ratio"] > 0
    assert rows["decode b=4"]["stats"]["hits"] == rows["decode b=4"]["stats"]["calls"] > 0
    untuned = rows["decode b=3 (untuned M)"]
    assert untuned["stats"]["bucketed"] > 0  # its GEMMs borrow M=4's winners
    assert {s["via"].split(",")[0] for s in untuned["served"] if s["kind"] == "bucketed"} == {
        "gemm:m=4"
    }
    assert result["overhead"]["per_call_us"]["tuner_linear_on"] > 0


def test_speedup_bound_is_amdahl_over_the_routed_kernels() -> None:
    """The decode bound of the benchmark: routed kernels replaced by reads at a bandwidth."""
    layer = bench.DecoderLayer(bench.TINY, max_pos=16)
    phase = bench.Phase("decode", 2, 1)
    c = bench.TINY
    weights = c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.hidden
    weights += 3 * c.hidden * c.intermediate
    kv = 2 * 2 * c.kv_heads * 16 * c.head_dim
    assert bench.routed_bytes(layer, phase, 16) == 4 * (weights + kv)  # f32
    row = {"graph_off": {"median_us": 200.0}, "breakdown": {"routed_us": 150.0}}
    bound = bench.speedup_bound(row, 100_000_000, {"peak": 1000.0})  # 100 MB at 1 TB/s: 100 us
    assert bound["floor_us_at_peak"] == pytest.approx(100.0)
    assert bound["max_ratio_at_peak"] == pytest.approx(200.0 / 150.0)
    row["breakdown"]["routed_us"] = 210.0  # profiled eagerly, a little over the graph step
    assert bench.speedup_bound(row, 100_000_000, {"peak": 1000.0})["max_ratio_at_peak"] == 2.0


def test_replot_redraws_both_plots_from_a_saved_run(tmp_path: Path) -> None:
    bound = {"max_ratio_at_copy": 1.1, "max_ratio_at_peak": 1.2}
    rows = [{"label": "decode b=1", "phase": "decode", "graph_ratio": 1.01, "bound": bound}]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"smoke": False, "phases": rows}))
    png = tmp_path / "run.png"
    bench.main(["--replot", str(saved), "--plot", str(png)])
    assert png.stat().st_size > 0 and bench.bound_plot_path(png).stat().st_size > 0
    with pytest.raises(SystemExit):  # nothing to write the results to
        bench.parse_args(["--smoke"])

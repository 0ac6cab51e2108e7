"""bench/quantized_decoder.py: the GPU benchmark's own logic, run on the CPU with tiny dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

bench = load_script("quantized_decoder")


def test_quantized_benchmark_smoke_run(tmp_path: Path, cache_path: Path) -> None:
    """Quantize, record, tune, time every variant, JSON and PNG, with tiny dimensions (the tuned
    winners go to ``cache_path``, TUNER_CACHE)."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--smoke", "--out", str(out), "--plot", str(png), "--source", "torch"]
    args += ["--decode-batches", "1,4", "--prefill-seq", "8", "--kv-len", "16"]
    args += ["--rounds", "2", "--iters", "2", "--profile-host-batch", "4"]
    result = bench.main(args)
    assert result["complete"] and png.stat().st_size > 0
    assert json.loads(out.read_text())["phases"] == result["phases"]
    assert result["tuning"] and {row["status"] for row in result["tuning"]} == {"tuned"}
    assert result["warmup"]["failures"] == []
    recorded = "\n".join(result["recorded"])
    assert "dtype=bf16" in recorded and "int4" in recorded and "fp8_e4m3" in recorded
    weights = result["weight_bytes"]
    assert weights["int4"] < weights["fp8"] < weights["bf16"]  # packed int4 with its scales
    names = [v.name for v in bench.variants_of(["int4", "fp8"])]
    assert names == ["bf16 torch", "bf16 tuner", "int4 torch", "int4 tuner", "fp8 torch",
                     "fp8 tuner", "fp8 tuner, torch's act. quant"]  # fmt: skip
    profiled = result["phases"][1]["host_profile"]
    assert set(profiled) == {"int4 tuner", "fp8 tuner"}
    assert profiled["fp8 tuner"]["step_us_on"] > 0 and profiled["fp8 tuner"]["profile_on"]
    assert [row["label"] for row in result["phases"]] == [
        "decode b=1", "decode b=4", "prefill b=1 s=8"
    ]  # fmt: skip
    for row in result["phases"]:
        assert set(row["variants"]) == set(names)
        for name, times in row["variants"].items():
            assert times["eager"]["median_us"] > 0
            # quantized weights change the output by their rounding, never more
            limit = 1e-6 if name.startswith("bf16") else 0.2
            assert times["rel_err_vs_bf16_torch"] < limit, name
        over = row["ratios"]["over_bf16_torch"]["eager"]
        assert over["bf16 torch"] == 1.0 and set(over) == set(names)
        assert set(row["ratios"]["tuner_over_torch"]["eager"]) == {"bf16", "int4", "fp8"}


def test_variants_without_fp8_have_no_act_quant_twin() -> None:
    assert [v.name for v in bench.variants_of(["int4"])] == [
        "bf16 torch", "bf16 tuner", "int4 torch", "int4 tuner"
    ]  # fmt: skip


def test_each_variant_is_served_as_it_says(tmp_path: Path) -> None:
    """The twin with torch's activation quantization runs torch's ops (on a CPU the kernel's
    path is torch's anyway, so the smoke run alone could not tell); the others leave it."""
    import tuner.torch as tt
    from tuner.quant import fp8
    from tuner.serving.dispatcher import Dispatcher

    fused = fp8.quantize_rowwise
    tuned = Dispatcher(tmp_path / "c.db", mode="lookup")
    untuned = Dispatcher(mode="off")
    for variant in bench.variants_of(["int4", "fp8"]):
        with bench.serving(variant, tt, tuned, untuned):
            swapped = fp8.quantize_rowwise is fp8.quantize_rowwise_torch
            assert swapped == variant.torch_act_quant, variant.name
            assert tt.is_enabled() == (variant != bench.BASELINE), variant.name
    assert fp8.quantize_rowwise is fused and not tt.is_enabled()


def test_twins_add_each_formats_torch_variant_again_and_rounds_default_to_one_cycle() -> None:
    names = [v.name for v in bench.variants_of(["fp8"], twins=True)]
    assert names == ["bf16 torch", "bf16 tuner", "fp8 torch", "fp8 tuner", "fp8 torch, twin",
                     "fp8 tuner, torch's act. quant"]  # fmt: skip
    assert bench.parse_args(["--out", "r.json", "--formats", "fp8", "--twins"]).rounds == 6
    assert bench.parse_args(["--out", "r.json", "--rounds", "3"]).rounds == 3
    assert bench.parse_args(["--out", "r.json", "--twins", "--shared-pool"]).shared_pool
    step_us = [10, 10, 12, 8, 12.5, 9]
    times = {name: {"graph": {"median_us": us}} for name, us in zip(names, step_us, strict=True)}
    got = bench.ratios(times, ["fp8"])
    assert got["tuner_over_torch"]["graph"] == {"bf16": 1.0, "fp8": 1.5}
    assert got["twin_over_torch"]["graph"] == {"fp8": 12 / 12.5}


def test_graphs_are_dumped_only_from_a_profiled_phase(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "r.json", "--dump-graphs", "graphs"])
    assert "--dump-graphs" in capsys.readouterr().err


def test_a_profiled_step_reads_as_one_sequence_of_kernel_times_and_gaps() -> None:
    # two steps of two kernels: a (2 us) after a 1 us gap, then b (3 us) after 0.5 us
    spans = [("b", 3.5, 6.5), ("a", 1.0, 3.0), ("a", 7.5, 9.5), ("b", 10.5, 13.5)]
    got = bench.timeline(spans, steps=2)
    assert [p["name"] for p in got["timeline"]] == ["a", "b"]
    assert [p["us"] for p in got["timeline"]] == [2.0, 3.0]
    # a's gap: only the second step has a step before it (6.5 -> 7.5); b's: 0.5 and 1.0
    assert [p["gap_before_us"] for p in got["timeline"]] == [1.0, 0.75]
    assert got["between_steps_us"] == 1.0 and got["gaps_us"] == 0.75
    assert got["step_period_us"] == 6.5


def test_a_timeline_needs_two_steps_of_the_same_sequence() -> None:
    spans = [("a", 1.0, 3.0), ("b", 3.5, 6.5), ("a", 7.5, 9.5), ("b", 10.5, 13.5)]
    assert bench.timeline(spans[:3], steps=2) == {}  # not two equal steps
    assert bench.timeline(spans[:2], steps=1) == {}  # no step before the first: no gap to read
    assert bench.timeline(spans, steps=0) == {}
    swapped = [("a", 1.0, 3.0), ("b", 3.5, 6.5), ("b", 7.5, 9.5), ("a", 10.5, 13.5)]
    assert bench.timeline(swapped, steps=2) == {}  # equal counts, another order


def test_twins_in_one_shared_pool_run_on_the_cpu_too(tmp_path: Path) -> None:
    """--shared-pool is a GPU option; on the CPU (eager only) it changes nothing and fails nothing."""
    out = tmp_path / "r.json"
    args = ["--smoke", "--out", str(out), "--skip-tune", "--formats", "fp8", "--twins"]
    args += ["--shared-pool", "--decode-batches", "1", "--prefill-seq", "8", "--kv-len", "16"]
    result = bench.main([*args, "--rounds", "1", "--iters", "1"])
    assert result["complete"]
    for row in result["phases"]:
        assert row["variants"]["fp8 torch, twin"]["eager"]["median_us"] > 0
        assert set(row["ratios"]["twin_over_torch"]["eager"]) == {"fp8"}

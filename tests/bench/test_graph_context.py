"""bench/graph_context.py: the GPU benchmark's own logic, run on the CPU with tiny dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_scripts import load_script

from bench.dropin_decoder import TINY, DecoderLayer

bench = load_script("graph_context")


def test_graph_context_smoke_run(tmp_path: Path, cache_path: Path) -> None:
    """Record, tune, every setup of the step and each projection alone, JSON and PNG."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--smoke", "--out", str(out), "--plot", str(png), "--source", "torch"]
    args += [
        "--prefill-seq",
        "8",
        "--kv-len",
        "16",
        "--rounds",
        "2",
        "--iters",
        "2",
        "--calls",
        "2",
    ]
    result = bench.main(args)
    assert result["complete"] and png.stat().st_size > 0
    assert json.loads(out.read_text())["alone"] == result["alone"]
    assert {row["status"] for row in result["tuning"]} == {"tuned"}
    assert set(result["step"]) == {setup.name for setup in bench.SETUPS}
    for times in result["step"].values():
        assert times["eager"]["median_us"] > 0
        assert times["rel_err_vs_bf16_torch"] < 1e-6  # every setup computes the same step
    assert set(result["step_saving_us"]) == {"tuner", *bench.PROJECTIONS}
    assert result["winners"] == dict.fromkeys(bench.PROJECTIONS, "torch")  # --source torch
    for name in bench.PROJECTIONS:
        alone = result["alone"][name]
        assert alone["torch_us"] > 0 and alone["tuner_us"] > 0 and alone["fence_us"] > 0


def test_a_setup_routes_only_its_projection_and_fences_every_one(tmp_path: Path) -> None:
    """``tuner qkv only``: the tuner sees qkv's call and no other; fenced: one fence kernel a
    projection (counted by the hook's calls to ``fence_kernel``'s function)."""
    import tuner.torch as tt
    from tuner.serving.dispatcher import Dispatcher

    layer = DecoderLayer(TINY, max_pos=16).eval()
    x = torch.randn(1, 4, TINY.hidden)
    disp = Dispatcher(tmp_path / "c.db", mode="record")
    with torch.no_grad(), bench.serving(bench.Setup("qkv"), layer, tt, disp):
        layer(x, torch.arange(4))
    (key,) = {r.key for r in disp.resolutions.values()}  # one problem seen: qkv's
    assert key.startswith(f"gemm:m=4,n={layer.qkv.out_features},k={TINY.hidden},")
    assert not tt.is_enabled()
    calls = []
    fenced = bench.Setup("torch", fenced=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "fence_kernel", lambda device: lambda: calls.append(str(device)))
        with torch.no_grad(), bench.serving(fenced, layer, tt, disp):
            layer(x, torch.arange(4))
    assert calls == ["cpu"] * len(bench.PROJECTIONS)
    assert not any(m._forward_pre_hooks for m in layer.modules())  # hooks removed on exit


def test_phase_option_names_what_it_takes() -> None:
    assert bench.parse_args(["--out", "x", "--phase", "decode:4"]).phase == bench.Phase(
        "decode", 4, 1
    )
    assert bench.parse_args(["--out", "x", "--prefill-seq", "64"]).phase.tokens == 64
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--phase", "decode:0"])


def test_a_setup_whose_capture_failed_saves_nothing_and_breaks_nothing() -> None:
    """``measure_phase`` leaves out the graph times of a setup it could not capture: its saving
    reads NaN and every other setup's is still computed."""
    times = {s.name: {"graph": {"median_us": 100.0}} for s in bench.SETUPS}
    del times[bench.Setup("qkv").name]["graph"]  # its capture failed
    times[bench.Setup("down").name]["graph"]["median_us"] = 90.0
    savings = bench.step_savings(times, "graph")
    assert savings["qkv"]["plain"] != savings["qkv"]["plain"]  # NaN
    assert savings["down"] == {"plain": 10.0, "fenced": 0.0}


def test_a_projection_that_raises_leaves_the_tuner_off(tmp_path: Path) -> None:
    import tuner.torch as tt
    from tuner.serving.dispatcher import Dispatcher

    layer = DecoderLayer(TINY, max_pos=16).eval()
    disp = Dispatcher(tmp_path / "c.db", mode="record")
    with pytest.raises(RuntimeError), bench.serving(bench.Setup("qkv"), layer, tt, disp):
        layer.qkv(torch.randn(2, TINY.hidden + 1))  # a wrong K: torch raises inside the forward
    assert not tt.is_enabled()

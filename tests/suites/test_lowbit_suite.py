"""``tuner bench gemm --suite lowbit``: the suite's shapes and its quick selection, the targets
each row is judged by, and a tiny shape list end to end on this device (rows beside torch's op,
bf16 cuBLAS and the tuner's own bf16 winner; per-target counts; the PNG)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tuner.cache import Store
from tuner.cli.main import app
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, fp8_shape_error, lowbit_fields
from tuner.measure.timing import Timing
from tuner.quant import int4_torch
from tuner.suites import lowbit
from tuner.tuning.engine import PHASES, TuneOptions

MODELS = {"Llama-3-8B", "Qwen2.5-7B"}


def test_suite_has_the_issue_shapes_and_formats() -> None:
    problems = lowbit.problems()
    assert len(problems) == 2 * 4 * 8 * 3
    keys = {(k.m, k.n, k.k) for _, k in problems}
    assert {(1, 6144, 4096), (2048, 4096, 14336), (16, 2 * 18944, 3584)} <= keys
    assert {label.rsplit(" ", 1)[1] for label, _ in problems} == set(lowbit.FORMATS)
    assert {k.m for _, k in problems} == set(lowbit.M_SIZES)


def test_quick_covers_every_format_on_both_models_with_few_rows() -> None:
    quick = lowbit.chosen_problems(lowbit.FORMATS, quick=True, device="cuda")
    assert len(quick) == 2 * len(lowbit.QUICK_OPS) * len(lowbit.QUICK_M) * len(lowbit.FORMATS)
    for fmt in lowbit.FORMATS:
        mine = [label for label, _ in quick if label.endswith(f" {fmt}")]
        assert {label.split(" ", 1)[0] for label in mine} == MODELS
        assert {int(label.split("M=")[1].split()[0]) for label in mine} == set(lowbit.QUICK_M)
    # each quick projection has a weight the decode targets judge (bf16 >= 64 MB)
    assert min(lowbit.bf16_twin(k).weight_bytes for _, k in quick) >= 64 * lowbit.MB
    fp8_only = lowbit.chosen_problems(["fp8-rowwise"], quick=True)
    assert {label.rsplit(" ", 1)[1] for label, _ in fp8_only} == {"fp8-rowwise"}


def test_a_quick_run_on_a_cpu_times_one_small_shape_in_place_of_the_projections() -> None:
    """On a CPU each projection of the models takes minutes in Triton's interpreter: a smoke run
    there times every format on one small shape that both formats' packings take, at a decode M
    and a larger one."""
    on_cpu = lowbit.chosen_problems(lowbit.FORMATS, quick=True, device="cpu")
    assert [label for label, _ in on_cpu] == [
        f"{lowbit.QUICK_CPU_NAME} M={m} {fmt}" for m in lowbit.QUICK_CPU_M for fmt in lowbit.FORMATS
    ]
    n, k = lowbit.QUICK_CPU_SHAPE
    assert {(key.n, key.k) for _, key in on_cpu} == {(n, k)}
    assert n % int4_torch.n_multiple(torch.device("cpu")) == 0  # torch's CPU int4 packing
    assert fp8_shape_error(n, k) is None
    assert all(key.k % key.group == 0 for _, key in on_cpu if key.wdtype == "int4")
    ms = {key.m for _, key in on_cpu}
    assert min(ms) <= lowbit.DECODE_M < max(ms)  # a decode row and one past decode
    # rows named on the command line are kept as given: --m on the small shape, --proj the
    # models' projections themselves
    small_16 = lowbit.chosen_problems(["int4-g128"], quick=True, ms=[16], device="cpu")
    assert [label for label, _ in small_16] == [f"{lowbit.QUICK_CPU_NAME} M=16 int4-g128"]
    down = lowbit.chosen_problems(["int4-g128"], quick=True, ops=["down"], device="cpu")
    assert {label.split(" ", 1)[0] for label, _ in down} == MODELS
    assert {key.m for _, key in down} == set(lowbit.QUICK_CPU_M)


def test_unknown_projection_or_format_names_the_field() -> None:
    with pytest.raises(ValueError, match="projection 'lm_head'"):
        lowbit.problems(ops=["lm_head"])
    with pytest.raises(ValueError, match="low-bit format must be one of"):
        lowbit.problems(formats=["int3"])
    result = CliRunner().invoke(app, ["bench", "gemm", "--suite", "lowbit", "--part", "int8"])
    assert isinstance(result.exception, ValueError) and "'int8'" in str(result.exception)


def test_the_command_line_can_choose_rows_by_m_and_projection() -> None:
    chosen = lowbit.chosen_problems(["int4-g128"], ms=[1, 2048, 1], ops=["down"])  # each once
    assert [label for label, _ in chosen] == [
        f"{model} down M={m} int4-g128" for model in ("Llama-3-8B", "Qwen2.5-7B") for m in (1, 2048)
    ]
    quick_down = lowbit.chosen_problems(["fp8-rowwise"], quick=True, ops=["down"], device="cuda")
    assert {k.m for _, k in quick_down} == set(lowbit.QUICK_M)
    assert lowbit.chosen_problems(lowbit.FORMATS) == lowbit.problems()
    twice = lowbit.chosen_problems(["int4-g128", "int4-g128"], ms=[1], ops=["down"])
    assert [label for label, _ in twice] == [
        f"{m} down M=1 int4-g128" for m in ("Llama-3-8B", "Qwen2.5-7B")
    ]
    with pytest.raises(ValueError, match="--m must be >= 1, got 0"):
        lowbit.chosen_problems(["int4-g128"], ms=[0])


def test_rows_the_command_line_cannot_choose_are_named_before_any_folder_is_made(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench"
    for args, named in ((["--proj", "lm_head"], "'lm_head'"), (["--m", "0"], "got 0")):
        result = CliRunner().invoke(
            app, ["bench", "gemm", "--suite", "lowbit", "--out", str(out), *args]
        )
        assert isinstance(result.exception, ValueError) and named in str(result.exception)
    result = CliRunner().invoke(app, ["bench", "gemm", "--m", "1", "--out", str(out)])
    assert isinstance(result.exception, ValueError) and "lowbit" in str(result.exception)
    assert not out.exists()


def test_options_of_the_llama_suite_are_refused_for_lowbit_not_ignored(tmp_path: Path) -> None:
    """``--inductor`` and ``--warm-sample`` time the llama suite only: given with ``--suite
    lowbit`` they are named in an error before anything runs (a bad ``--proj`` beside them, so a
    command that ignored them stops at once all the same), instead of being dropped silently."""
    out = tmp_path / "bench"
    for option in (["--no-inductor"], ["--inductor"], ["--warm-sample", "0"]):
        result = CliRunner().invoke(
            app, ["bench", "gemm", "--suite", "lowbit", *option, "--proj", "lm_head",
                  "--out", str(out)],
        )  # fmt: skip
        assert isinstance(result.exception, ValueError), option
        assert "--inductor and --warm-sample are options of --suite llama" in str(result.exception)
    assert not out.exists()


def row(fmt: str, m: int, mb: int, **times: float) -> dict:
    """A measured row as ``annotate`` leaves it before judging: ``mb`` MiB of bf16 weight."""
    n = k = int((mb * lowbit.MB / 2) ** 0.5)
    return {"label": f"w{mb} M={m} {fmt}", "format": fmt, "m": m, "n": n, "k": k,
            "weight_bytes": n * k // (2 if fmt.startswith("int4") else 1),
            "bf16_weight_bytes": 2 * n * k, "timing": "graph" if m <= 16 else "eager",
            **times}  # fmt: skip


def test_each_row_is_judged_by_the_targets_of_its_format_and_m() -> None:
    rows = [
        # int4 decode on a 128 MB bf16 weight: 2.5x bf16 cuBLAS in graphs misses the 3x target
        row("int4-g128", 1, 128, graph_baseline_us=40.0, graph_winner_us=40.0,
            graph_bf16_us=100.0, graph_bf16_served_us=90.0, graph_winner_pct_copy=50.0),
        # int4 prefill: judged against 0.8x bf16 cuBLAS, not against the bf16 winner
        row("int4-g128", 256, 128, baseline_us=500.0, winner_us=100.0, bf16_us=90.0,
            bf16_served_us=85.0, winner_pct_copy=10.0),
        # fp8 prefill: 1.0x torch, 1.5x bf16 cuBLAS and the bf16 winner
        row("fp8-rowwise", 2048, 128, baseline_us=110.0, winner_us=100.0, bf16_us=160.0,
            bf16_served_us=150.0, winner_pct_copy=30.0),
        # fp8 decode whose winner's graph could not be captured: unmeasured, a miss
        row("fp8-rowwise", 4, 128, graph_baseline_us=30.0, graph_bf16_us=60.0,
            graph_bf16_served_us=60.0),
        # a small fp8-tensorwise decode weight: no bandwidth target
        row("fp8-tensorwise", 16, 8, graph_baseline_us=10.0, graph_winner_us=9.0,
            graph_bf16_us=20.0, graph_bf16_served_us=20.0, graph_winner_pct_copy=40.0),
    ]  # fmt: skip
    for r in rows:
        lowbit.judge(r)
    int4_decode, int4_prefill, fp8_prefill, fp8_decode, small = rows
    assert int4_decode["vs_bf16_cublas"] == 2.5 and int4_decode["vs_bf16_served"] == 2.25
    assert int4_decode["missed"] == ["int4 decode >= 3x bf16 cuBLAS"]
    assert set(int4_prefill["targets"]) == {"torch >= 0.98x", "int4 M>=256 >= 0.8x bf16 cuBLAS"}
    assert int4_prefill["missed"] == []
    assert set(fp8_prefill["targets"]) == {"torch >= 0.98x", "bf16 served >= 0.98x",
                                           "fp8 prefill >= 1.0x torch",
                                           "fp8 prefill >= 1.5x bf16 cuBLAS"}  # fmt: skip
    assert fp8_prefill["missed"] == []
    assert fp8_decode["vs_torch"] is None
    assert fp8_decode["missed"] == ["torch >= 0.98x", "bf16 served >= 0.98x",
                                    "fp8 decode >= 80% copy"]  # fmt: skip
    assert set(small["targets"]) == {"torch >= 0.98x", "bf16 served >= 0.98x"}
    counts = lowbit.target_counts(rows)
    torch_target = counts["torch >= 0.98x"]
    assert (torch_target["judged"], torch_target["met"], torch_target["unmeasured"]) == (5, 4, 1)
    assert torch_target["missed"] == [fp8_decode["label"]]
    assert counts["int4 decode >= 3x bf16 cuBLAS"]["worst"] == 2.5
    geo = counts["fp8 geomean >= 1.15x torch"]
    assert (geo["judged"], geo["met"], geo["unmeasured"]) == (1, 0, 1)


def test_an_eager_rows_verdict_has_its_kernels_graph_times_beside() -> None:
    """Both calls host-bound (eager ~26-28 us a call): the eager ratio meets 0.8x bf16 cuBLAS,
    the kernels' own graph times (22.6 against 14.8 us) do not; the count reports both."""
    host_bound = row("int4-g128", 256, 128, eager_baseline_us=400.0, eager_winner_us=26.4,
                     eager_bf16_us=27.9, eager_bf16_served_us=27.9, eager_winner_pct_copy=30.0,
                     gpu_baseline_us=390.0, gpu_winner_us=22.6, gpu_bf16_us=14.8,
                     gpu_bf16_served_us=14.8)  # fmt: skip
    gpu_bound = row("int4-g128", 2048, 128, eager_baseline_us=9000.0, eager_winner_us=100.0,
                    eager_bf16_us=98.0, eager_bf16_served_us=98.0, eager_winner_pct_copy=3.0,
                    gpu_baseline_us=8900.0, gpu_winner_us=97.0, gpu_bf16_us=95.0,
                    gpu_bf16_served_us=95.0)  # fmt: skip
    for r in (host_bound, gpu_bound):
        lowbit.judge(r)
    target = "int4 M>=256 >= 0.8x bf16 cuBLAS"
    assert host_bound["vs_bf16_cublas"] == pytest.approx(27.9 / 26.4)
    assert host_bound["vs_bf16_cublas_gpu"] == pytest.approx(14.8 / 22.6)
    assert host_bound["targets"][target]["met"] and not host_bound["targets"][target]["met_on_gpu"]
    count = lowbit.target_counts([host_bound, gpu_bound])[target]
    assert (count["judged"], count["met"]) == (2, 2)
    assert count["on_gpu"] == {"judged": 2, "met": 1, "unmeasured": 0,
                               "worst": pytest.approx(14.8 / 22.6)}  # fmt: skip
    # a winner that could not be captured: a miss by graph times, counted unmeasured
    uncaptured = {k: v for k, v in gpu_bound.items() if k != "gpu_winner_us"}
    uncaptured["gpu_winner_error"] = "RuntimeError: not permitted when stream is capturing"
    lowbit.judge(uncaptured)
    verdict = uncaptured["targets"][target]
    assert verdict["met"] and verdict["gpu_value"] is None and verdict["met_on_gpu"] is False
    count = lowbit.target_counts([host_bound, uncaptured])[target]["on_gpu"]
    assert (count["judged"], count["met"], count["unmeasured"]) == (2, 0, 1)


def test_an_eager_row_whose_baseline_raised_in_its_retime_is_a_miss_not_its_tuning() -> None:
    """Retimed on a GPU, torch's op raised (``retime`` drops the runner, keeping its error): the
    row is judged on its retime, torch's ratio unmeasured and missed, the others from the times
    taken side by side, not on the tuning's own times, which said 5x with a winner twice as fast."""
    r = row("int4-g128", 64, 128, baseline_us=100.0, winner_us=20.0, bf16_us=30.0,
            bf16_served_us=30.0, winner_pct_copy=10.0, eager_sustained_s=0.0,
            eager_winner_us=40.0, eager_bf16_us=30.0, eager_bf16_served_us=30.0,
            eager_winner_pct_copy=5.0)  # fmt: skip
    r["eager_baseline_error"] = "RuntimeError: CUDA error: out of memory"
    lowbit.judge(r)
    assert r["vs_torch"] is None and r["missed"] == ["torch >= 0.98x"]
    assert r["vs_bf16_cublas"] == 0.75 and r["served_pct_copy"] == 5.0


def test_an_eager_row_whose_retime_raised_is_a_miss_on_every_target() -> None:
    """Its retime raised partway (a build, an allocation), after the GPU times of some runners:
    the row stays in the suite, judged unmeasured on every target that applies, neither on the
    tuning's times nor on the GPU times it took."""
    r = row("int4-g128", 256, 128, baseline_us=500.0, winner_us=100.0, bf16_us=90.0,
            bf16_served_us=85.0, winner_pct_copy=10.0, gpu_winner_us=90.0,
            gpu_bf16_us=90.0)  # fmt: skip
    r["retime_error"] = "RuntimeError: CUDA error: out of memory"
    lowbit.judge(r)
    assert r["vs_torch"] is None and r["vs_bf16_cublas"] is None and r["served_pct_copy"] is None
    assert r["vs_bf16_cublas_gpu"] is None
    assert r["missed"] == ["torch >= 0.98x", "int4 M>=256 >= 0.8x bf16 cuBLAS"]


def test_the_report_gives_each_formats_geomeans_as_judged(capsys) -> None:
    """Below the verdicts, each format's geomean of the served ratios the rows were judged on:
    torch's op at 2x and 8x make 4x, bf16 cuBLAS at 2.5x and 3.6x make 3x."""
    rows = [row("int4-g128", m, 128, graph_baseline_us=base, graph_winner_us=10.0,
                graph_bf16_us=bf16, graph_bf16_served_us=bf16, graph_winner_pct_copy=80.0)
            for m, base, bf16 in ((1, 20.0, 25.0), (16, 80.0, 36.0))]  # fmt: skip
    for r in rows:
        r.update(tune_s=0.5, bf16_tune_s=1.0, bf16_key=f"bf16 M={r['m']}",
                 candidate="torch_lowbit:{}")  # fmt: skip
        lowbit.judge(r)
    lowbit.print_table(rows, lowbit.target_counts(rows), lowbit.format_summary(rows))
    out = capsys.readouterr().out
    assert ("int4-g128, geomean of the 2 rows' served ratios (as judged): 4.000x torch's op, "
            "3.000x the tuner's bf16, 3.000x bf16 cuBLAS") in out  # fmt: skip


def test_a_small_ratio_keeps_its_digits_in_the_table(capsys) -> None:
    """A CPU row's 0.00044x (torch's int4 op against an interpreted kernel) printed as 0.000x,
    read as nothing; it keeps two significant digits, and ratios of 0.1 and up their three
    decimals."""
    r = row("int4-g128", 1, 128, baseline_us=0.044, winner_us=100.0, bf16_us=250.0,
            bf16_served_us=100.0, winner_pct_copy=5.0)  # fmt: skip
    r.update(tune_s=0.5, bf16_tune_s=1.0, bf16_key="bf16 M=1", candidate="torch_lowbit:{}",
             timing="eager")  # fmt: skip
    lowbit.judge(r)
    lowbit.print_table([r], {}, {}, judged=False)
    line = next(line for line in capsys.readouterr().out.splitlines() if r["label"] in line)
    assert "│ 0.00044x │ 1.000x │ 2.500x │ - │" in " ".join(line.split()), line


def test_tuning_a_format_is_judged_against_its_bf16_twins_median() -> None:
    def row(fmt: str, tune_s: float, bf16_tune_s: float | None, twin: str) -> dict:
        bf16 = {} if bf16_tune_s is None else {"bf16_tune_s": bf16_tune_s}
        return {"format": fmt, "tune_s": tune_s, "bf16_key": twin, "vs_torch": 1.0,
                "vs_bf16_served": 1.0, "vs_bf16_cublas": 1.0, "targets": {}, "label": twin,
                **bf16}  # fmt: skip

    rows = [row("int4-g128", 0.5, 0.8, "a"), row("int4-g128", 0.7, 0.8, "b"),  # 0.6 vs 0.8
            row("fp8-rowwise", 0.9, 0.8, "a"), row("fp8-rowwise", 1.1, 0.8, "b"),  # 1.0 vs 0.8
            row("fp8-tensorwise", 0.1, None, "a")]  # fmt: skip  # no bf16 twin tuned
    summary = lowbit.format_summary(rows)
    assert summary["int4-g128"]["median_tune_s"] == pytest.approx(0.6)
    assert summary["int4-g128"]["targets"][lowbit.TUNING_TARGET] == "1/1"
    assert summary["fp8-rowwise"]["targets"][lowbit.TUNING_TARGET] == "0/1"
    assert summary["fp8-tensorwise"]["bf16_median_tune_s"] is None
    assert summary["fp8-tensorwise"]["targets"][lowbit.TUNING_TARGET] == "0/1"  # unmeasured


def test_rows_are_retimed_over_sustained_stretches_as_the_engine_duelled_them() -> None:
    """A row is timed at the power limit's clock where a pair the tuning duelled (torch's op and
    the winner, or bf16 cuBLAS and the bf16 winner) is GPU-bound and long, or holds the GPU at
    its power limit by its graph times, judged from short full-clock timings as the engine's
    trials are; a host-bound pair of fast kernels, a light one, or stretches turned off, over a
    short budget. Graph times are read only where the eager times allow a heavy call."""
    options = TuneOptions()
    heavy_from = 5e8  # FLOPs per us
    down, qkv = 2.0 * 256 * 4096 * 14336, 2.0 * 256 * 6144 * 4096  # 30.1 and 12.9 GFLOP
    asked: list[list[str]] = []

    def short(**us: tuple[float, float]) -> dict[str, Timing]:  # runner -> (GPU, host) us
        return {name: Timing(gpu, gpu, gpu, 50, host) for name, (gpu, host) in us.items()}

    def graph(**us: float):
        def read(names):
            asked.append(list(names))
            return [us[name] for name in names]

        return read

    def stretch(flops: float, timings: dict[str, Timing], read, opts=options) -> float:
        return lowbit.sustained_s(flops, timings, read, opts, heavy_from)

    # long GPU-bound calls: no graph time needed
    long = short(baseline=(180.0, 20.0), winner=(171.0, 20.0))
    assert stretch(down, long, graph()) == 0.15 and asked == []
    # a heavy pair (an FP8 down projection at M = 256): held at the limit
    heavy = short(baseline=(35.4, 20.0), winner=(33.0, 20.0), bf16=(62.1, 20.0))
    assert stretch(down, heavy, graph(baseline=31.7, winner=30.8, bf16=59.2)) == 0.15
    assert asked.pop() == ["baseline", "winner"]
    # a host-bound pair (a qkv projection at M = 256: its host time over its GPU time)
    host_bound = short(baseline=(14.0, 22.0), winner=(13.9, 19.5))
    assert stretch(qkv, host_bound, graph(baseline=13.7, winner=13.8)) == 0.0
    # the bf16 pair alone held at the limit times the row so too (a host-bound low-bit winner)
    asked.clear()
    bf16_heavy = short(baseline=(2317.0, 30.0), winner=(60.0, 80.0), bf16=(92.6, 25.0),
                       bf16_served=(93.0, 25.0))  # fmt: skip
    read = graph(baseline=2300.0, winner=60.0, bf16=90.0, bf16_served=91.0)
    assert stretch(2.0 * 2048 * 4096 * 4096, bf16_heavy, read) == 0.15
    assert asked == [["baseline", "winner"], ["bf16", "bf16_served"]]
    # light calls: no graph time read, no stretch
    asked.clear()
    light = short(baseline=(90.0, 20.0), winner=(95.0, 20.0))
    assert stretch(down, light, graph()) == 0.0 and asked == []
    # a call that cannot be captured is not heavy
    assert stretch(down, heavy, lambda names: None) == 0.0
    assert stretch(down, long, graph(), TuneOptions(sustained_s=0)) == 0.0


def test_decode_rows_on_a_gpu_are_tuned_for_graph_replay() -> None:
    eager = TuneOptions(launch="eager", budget_s=0.02)
    decode, prefill = (GemmKey(m=m, n=512, k=256, **lowbit_fields("int4-g128")) for m in (16, 64))
    assert lowbit.options_for(decode, eager, "cuda") == dataclasses.replace(eager, launch="graph")
    assert lowbit.options_for(prefill, eager, "cuda") is eager
    assert lowbit.options_for(decode, eager, "cpu") is eager  # no graphs on the CPU
    twin = lowbit.bf16_twin(decode)
    assert lowbit.options_for(twin, eager, "cuda").launch == "graph"


def test_tiny_shapes_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every source allowed (Triton's low-bit kernels through the interpreter on a CPU host):
    each row times torch's op for its format against the winner, and the bf16 key of its shape
    is tuned in the same run and stored beside the low-bit winners."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    problems = lowbit.problems(ms=(2,), shapes=[("tiny proj", 32, 256)])
    result = lowbit.run(problems, tmp_path, TuneOptions(budget_s=0.005))
    saved = json.loads((tmp_path / "gemm_lowbit.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [r["format"] for r in saved["rows"]] == list(lowbit.FORMATS)
    bf16_keys = {r["bf16_key"] for r in saved["rows"]}
    assert len(bf16_keys) == 1  # one shape: its bf16 key tuned once for the three formats
    with Store(tmp_path / "gemm_lowbit.db") as store:
        stored = {w.key for w in store.winners(fingerprint().device_class)}
    assert stored == {r["key"] for r in saved["rows"]} | bf16_keys
    on_gpu = torch.cuda.is_available()
    for r in saved["rows"]:
        assert (r["m"], r["n"], r["k"], r["shape"]) == (2, 32, 256, "tiny proj")
        assert r["baseline_us"] > 0 and r["winner_us"] > 0
        assert r["bf16_us"] > 0 and r["bf16_served_us"] > 0 and r["bf16_tune_s"] > 0
        # where the tuning time went (compiling apart from timing), for both formats
        assert set(r["phases"]) == set(r["bf16_phases"]) == set(PHASES)
        assert sum(r["phases"].values()) <= r["tune_s"] + 0.005  # each rounded to 1 ms
        assert r["bytes"] > 0 and r["winner_pct_copy"] > 0
        assert r["baseline_source"] == "torch_lowbit"
        assert r["failures"] == []
        assert r["timing"] == ("graph" if on_gpu else "eager")
        if on_gpu:  # decode rows: graph times, the bare read beside them
            assert r["graph_read_us"] > 0 and r["graph_bf16_served_us"] > 0
            assert r["vs_bf16_served"] == r["graph_bf16_served_us"] / r["graph_winner_us"]
        else:
            assert r["vs_bf16_served"] == r["bf16_served_us"] / r["winner_us"]
            assert r["vs_bf16_cublas"] == r["bf16_us"] / r["winner_us"]
        assert set(r["targets"]) == {"torch >= 0.98x", "bf16 served >= 0.98x"}
        assert r["missed"] == [n for n, t in r["targets"].items() if not t["met"]]
    served_by = {"torch_lowbit", "triton_w4a16", "triton_fp8"}  # a CPU's low-bit sources
    if on_gpu:
        served_by |= {"cuda_w4a16", "cutlass_w4a16", "dequant_gemm", "cuda_fp8", "cutlass_fp8",
                      "cublaslt_fp8"}  # fmt: skip
    assert {r["source"] for r in saved["rows"]} <= served_by
    int4_row = saved["rows"][0]
    assert int4_row["bytes"] < saved["rows"][1]["bytes"]  # half-byte weights move fewer bytes
    assert saved["device"]["name"] and saved["versions"]["torch"]
    assert saved["targets"]["torch >= 0.98x"]["judged"] == 3
    # the targets are a GPU's: counted wherever the run was, judged on a GPU only
    assert saved["targets_judged"] is on_gpu
    assert saved["targets_note"] == (None if on_gpu else lowbit.NOT_JUDGED)
    # the tuning's own times are summed up under their own name, not as the judged summary
    assert "summary" not in saved and saved["tuning_summary"]["n"] == 3
    assert set(saved["formats"]) == set(lowbit.FORMATS)
    assert all(lowbit.TUNING_TARGET in f["targets"] for f in saved["formats"].values())
    assert (tmp_path / "gemm_lowbit.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a run on a machine without a GPU")
def test_a_run_without_a_gpu_says_in_one_line_that_its_targets_are_not_judged(
    tmp_path: Path,
) -> None:
    """The command on a CPU (two real rows, torch's op only, for speed): the rows' ratios are
    printed and written, but no verdict on the GPU targets, neither per row, per target nor on
    the tuning time; one line says why instead. The JSON keeps its shape, marked not judged."""
    args = ["bench", "gemm", "--suite", "lowbit", "--part", "int4-g128", "--proj", "o",
            "--m", "1", "--source", "torch_lowbit", "--budget", "0.005", "--out", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "low-bit GEMMs: served time ratios (eager times)" in result.output
    assert [line for line in lines if "not judged" in line] == [
        "Targets not judged: they are GPU targets, judged only on a GPU; this run timed CPU code "
        "(torch's CPU ops, CPU matmul as 'bf16 cuBLAS', Triton kernels where TRITON_INTERPRET=1), "
        "and CPU timings are not the product's."
    ]
    for verdict in ("all met", "/2 met", "missed", lowbit.TUNING_TARGET):
        assert verdict not in result.output
    saved = json.loads((tmp_path / "gemm_lowbit.json").read_text())
    assert [r["label"] for r in saved["rows"]] == [
        "Llama-3-8B o M=1 int4-g128", "Qwen2.5-7B o M=1 int4-g128"
    ]  # fmt: skip
    assert saved["targets_judged"] is False and saved["targets_note"] == lowbit.NOT_JUDGED
    assert saved["targets"]["torch >= 0.98x"]["judged"] == 2  # counted as on a GPU
    assert all(r["vs_bf16_served"] > 0 and "torch >= 0.98x" in r["targets"] for r in saved["rows"])
    assert (tmp_path / "gemm_lowbit.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.cpu_host
def test_quick_on_a_cpu_runs_its_small_rows_to_the_reports(tmp_path: Path) -> None:
    """The whole CPU smoke run, every source (Triton's through the interpreter), a short budget:
    each format's rows on the small shape measured, the JSON strict and marked not judged, the
    table's ratios those of the JSON, one line saying the rows are CPU-path rows of a small shape
    and none giving a verdict on the GPU targets."""
    out = tmp_path / "bench"
    args = ["bench", "gemm", "--suite", "lowbit", "--quick", "--budget", "0.01", "--out", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "gemm_lowbit.json").read_text(), parse_constant=_refuse)
    rows = saved["rows"]
    want = lowbit.chosen_problems(lowbit.FORMATS, quick=True, device="cpu")
    assert [r["label"] for r in rows] == [label for label, _ in want]
    assert {r["format"] for r in rows} == set(lowbit.FORMATS)
    for r in rows:
        assert r["baseline_us"] > 0 and r["winner_us"] > 0
        assert r["bf16_us"] > 0 and r["bf16_served_us"] > 0
        assert r["vs_bf16_served"] == r["bf16_served_us"] / r["winner_us"]
        # the last table, the served ratios: its row for this label says what the JSON does
        line = [line for line in result.output.splitlines() if f"│ {r['label']} " in line][-1]
        assert lowbit.shown_ratio(r["vs_torch"]) in line
        assert lowbit.shown_ratio(r["vs_bf16_served"]) in line
    assert saved["targets_judged"] is False and saved["targets_note"] == lowbit.NOT_JUDGED
    assert saved["shapes_note"] == lowbit.shapes_note(rows)
    assert saved["shapes_note"].startswith(lowbit.QUICK_CPU_ROWS)
    assert f"{saved['shapes_note']}." in result.output.splitlines()
    for verdict in ("all met", "missed", lowbit.TUNING_TARGET):
        assert verdict not in result.output
    assert (out / "gemm_lowbit.png").read_bytes()[:4] == b"\x89PNG"


def test_ctrl_c_after_the_rows_keeps_an_earlier_complete_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the bf16 twins are tuned: the earlier complete gemm_lowbit.json and .png
    stay; this run's rows go to gemm_lowbit.interrupted.json, marked interrupted."""
    for ext in ("json", "png"):
        (tmp_path / f"gemm_lowbit.{ext}").write_text(f"complete {ext}")

    def cut(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lowbit, "tune_bf16", cut)
    problems = lowbit.problems(formats=("int4-g128",), ms=(2,), shapes=[("tiny", 32, 256)])
    with pytest.raises(KeyboardInterrupt):
        lowbit.run(problems, tmp_path, TuneOptions(budget_s=0.005, sources=["torch_lowbit"]))
    for ext in ("json", "png"):
        assert (tmp_path / f"gemm_lowbit.{ext}").read_text() == f"complete {ext}"
    partial = json.loads((tmp_path / "gemm_lowbit.interrupted.json").read_text())
    assert partial["interrupted"] is True
    assert [r["label"] for r in partial["rows"]] == [label for label, _ in problems]


def _refuse(constant: str) -> None:
    raise ValueError(f"not JSON: {constant}")


@pytest.mark.gpu
def test_eager_rows_are_judged_on_times_taken_side_by_side_after_tuning(tmp_path: Path) -> None:
    """Rows past decode are timed once the compile pool is closed, torch's op, the winner and
    both bf16 runners in turn, and their ratios come from those times."""
    problems = lowbit.problems(formats=("int4-g128",), ms=(64,), shapes=[("small", 256, 512)])
    row = lowbit.run(problems, tmp_path, TuneOptions(budget_s=0.005))["rows"][0]
    assert row["timing"] == "eager"
    for name in ("baseline", "winner", "bf16", "bf16_served"):
        assert row[f"eager_{name}_us"] > 0 and row[f"eager_{name}_pct_copy"] > 0
    for name in ("baseline", "winner"):  # each round beside the median, with the host's time
        rounds = row[f"eager_{name}_rounds_us"]
        assert len(rounds) == lowbit.SIDE_BY_SIDE_ROUNDS
        # the rounds are kept to 0.01 us, the median unrounded: compared as kept
        assert min(rounds) <= round(row[f"eager_{name}_us"], 2) <= max(rounds)
        assert len(row[f"eager_{name}_host_us"]) == len(rounds)
    assert row["vs_torch"] == row["eager_baseline_us"] / row["eager_winner_us"]
    assert row["vs_bf16_cublas"] == row["eager_bf16_us"] / row["eager_winner_us"]
    assert "graph_read_us" not in row  # the bare read is a decode row's floor
    # light calls: read again at full clock for the power check, no graph times, no stretches
    assert row["eager_check_us"]["baseline"] > 0 and "eager_gpu_us" not in row
    assert row["eager_sustained_s"] == 0.0
    # the plain columns are the tuning's own times: the pair is not timed twice
    winner = Store(tmp_path / "gemm_lowbit.db").winner(fingerprint("cuda").device_class, row["key"])
    assert (row["baseline_us"], row["winner_us"]) == (winner.baseline_us, winner.median_us)


@pytest.mark.gpu
def test_a_heavy_pair_is_judged_at_the_power_limit_from_readings_taken_at_full_clock() -> None:
    """``power_check`` times each runner anew (short, at full clock, as the engine's trials) and
    reads graph times only where those allow a heavy call: a 2048 x 4096 x 4096 bf16 GEMM holds
    the GPU at its power limit and its row is retimed over stretches; a 64-row one is light. A
    runner that fails is left out of the check, its error kept in the row."""
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    options = TuneOptions()
    stretch_of_2048 = options.sustained_s
    for m, stretch in ((2048, stretch_of_2048), (64, 0.0)):
        sets = [(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16),) for _ in range(2)]
        timed = {"baseline": (lambda a: a @ b, sets), "winner": (lambda a: torch.mm(a, b), sets)}
        row: dict = {}
        assert lowbit.power_check(row, 2.0 * m * 4096 * 4096, timed, options) == stretch, row
        assert set(row["eager_check_us"]) == {"baseline", "winner"}
        assert ("eager_gpu_us" in row) == (m == 2048), row

    def broken(a: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a runner that fails when called")

    sets = [(torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16),)]
    row = {}
    timed = {"baseline": (lambda a: a @ b, sets), "winner": (broken, sets)}
    assert lowbit.power_check(row, 2.0 * 2048 * 4096 * 4096, timed, options) == stretch_of_2048
    assert set(row["eager_check_us"]) == {"baseline"}  # the rounds record the winner's error
    assert row["eager_check_winner_error"] == "RuntimeError: a runner that fails when called"


def test_each_plot_panel_says_what_its_ratio_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ratio panel's value is the other's time over the served one's: its axis says so (a
    heading "served / bf16" alone reads as the inverse), and the decode panel names its unit."""
    plt = lowbit.pyplot()
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: None)  # the figure kept to read
    row = {"format": "int4-g128", "shape": "8B o", "m": 1, "vs_torch": 1.0, "vs_bf16_served": 2.0,
           "vs_bf16_cublas": 2.0, "served_pct_copy": 40.0}  # fmt: skip
    lowbit.plot([row, row | {"m": 64}], tmp_path / "p.png", "t", judged=False)
    axes = plt.gcf().axes
    assert [ax.get_title() for ax in axes][:3] == [
        "int4-g128: speedup over torch's op", "int4-g128: speedup over bf16 as the tuner serves it",
        "int4-g128: speedup over bf16 cuBLAS",
    ]  # fmt: skip
    labels = [ax.get_ylabel() for ax in axes]
    assert labels == [lowbit.RATIO_LABEL] * 3 + [lowbit.PCT_LABEL]
    assert ">1" in lowbit.RATIO_LABEL and "%" in lowbit.PCT_LABEL
    close("all")


@pytest.fixture
def kept_figure(monkeypatch: pytest.MonkeyPatch):
    """The figure a plot draws, kept open to read (and closed after)."""
    plt = lowbit.pyplot()
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: None)
    yield plt.gcf
    close("all")


def plotted(*rows: dict) -> list[dict]:
    """Rows judged, as ``plot`` gets them: a shape and each ratio's column."""
    for r in rows:
        lowbit.judge(r)
        r["shape"] = r["label"].rsplit(" M=", 1)[0]
    return list(rows)


def test_the_plot_names_the_versions_and_the_times_it_draws(tmp_path: Path, kept_figure) -> None:
    """A PNG read apart from its JSON and log says which versions made it (the rows are judged
    against torch's op and cuBLAS, whose times move with them) and which times its lines are:
    decode rows' CUDA-graph GPU times, joined at M = 16 to 64 to eager ones."""
    rows = plotted(
        row("int4-g128", 1, 128, graph_baseline_us=40.0, graph_winner_us=20.0,
            graph_bf16_us=80.0, graph_bf16_served_us=80.0, graph_winner_pct_copy=50.0),
        row("int4-g128", 64, 128, eager_baseline_us=90.0, eager_winner_us=30.0,
            eager_bf16_us=40.0, eager_bf16_served_us=40.0, eager_winner_pct_copy=20.0),
    )  # fmt: skip
    versions = {"torch": "2.11.0+cu130", "cuda": "13.0", "cublas": "130100", "triton": "3.6.0",
                "cutlass": "4.2.0.0", "tuner": "0.2.0", "driver": "13000"}  # fmt: skip
    result = {"device": {"name": "NVIDIA H100 80GB HBM3", "versions": versions}, "rows": rows,
              "shapes_note": None, "targets_judged": True}  # fmt: skip
    lowbit.drawing(result, tmp_path / "p.png")
    title = kept_figure()._suptitle.get_text()
    assert title.splitlines() == [
        "Low-bit GEMMs on NVIDIA H100 80GB HBM3",
        "torch 2.11.0+cu130, cuda 13.0, cublas 130100, triton 3.6.0, cutlass 4.2.0.0, "
        "tuner 0.2.0; M <= 16: CUDA-graph GPU times, larger M: eager times",
    ]


def test_a_log_ratio_axis_reads_as_the_table_does(tmp_path: Path, kept_figure) -> None:
    """A ratio panel spanning 1x to 20x is drawn on a log axis: its ticks read "16x" as the
    table's ratios do, not matplotlib's "2^4", and its label says the scale is a log one."""
    rows = plotted(*(
        row("int4-g128", m, 128, eager_baseline_us=us, eager_winner_us=10.0,
            eager_bf16_us=10.0, eager_bf16_served_us=10.0, eager_winner_pct_copy=20.0)
        for m, us in ((64, 10.0), (256, 200.0))
    ))  # fmt: skip
    lowbit.plot(rows, tmp_path / "p.png", "t")
    vs_torch, vs_served = kept_figure().axes[:2]
    assert vs_torch.get_yscale() == "log"
    assert vs_torch.yaxis.get_major_formatter()(16.0, 0) == "16x"
    assert vs_torch.get_ylabel() == f"{lowbit.RATIO_LABEL}; log scale"
    assert vs_served.get_yscale() == "linear" and vs_served.get_ylabel() == lowbit.RATIO_LABEL


def test_a_target_drawn_over_lines_it_does_not_judge_says_which_it_judges(
    tmp_path: Path, kept_figure
) -> None:
    """The 3x INT4 decode target judges bf16 weights of 64 MB and more: drawn over every
    decode M, a smaller weight's line under it is no miss, and the panel says so, with the
    count (rings of misses at one point overlap); a target judging every line says nothing."""
    graph = {"graph_baseline_us": 40.0, "graph_bf16_served_us": 60.0, "graph_winner_pct_copy": 50.0}
    rows = plotted(
        row("int4-g128", 1, 128, graph_winner_us=20.0, graph_bf16_us=50.0, **graph),  # 2.5x: missed
        row("int4-g128", 1, 32, graph_winner_us=20.0, graph_bf16_us=50.0, **graph),  # not judged
    )  # fmt: skip
    assert [r["missed"] for r in rows] == [["int4 decode >= 3x bf16 cuBLAS"], []]
    lowbit.plot(rows, tmp_path / "p.png", "t")
    titles = [ax.get_title() for ax in kept_figure().axes]
    assert titles[2].splitlines() == [
        "int4-g128: speedup over bf16 cuBLAS",
        f"target 3x: {lowbit.INT4_DECODE.where} only (0/1 met)",
    ]
    assert titles[1] == "int4-g128: speedup over bf16 as the tuner serves it"

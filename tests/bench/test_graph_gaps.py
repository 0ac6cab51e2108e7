"""bench/graph_gaps.py on the CPU: its arguments and its arithmetic (the graphs need a GPU)."""

import pytest
import torch

from bench import graph_gaps as bench


def test_rounds_default_to_one_balanced_cycle_over_every_capture_of_every_chain() -> None:
    args = bench.parse_args(["--out", "g.json"])
    assert args.chains == list(bench.CHAINS) and args.captures == 3
    assert args.rounds == 12  # 4 chains x 3 captures: an even count, one round each
    odd = bench.parse_args(["--out", "g.json", "--chains", "fp8-rowwise", "--captures", "3"])
    assert odd.rounds == 6


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--captures", "0"], "--captures: 0"),
        (["--iters", "-1"], "--iters: -1"),
        (["--k", "4008"], "fp8-rowwise takes multiples of 16"),
    ],
)
def test_bad_sizes_are_named(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "g.json", *argv])
    assert named in capsys.readouterr().err


def test_sizes_fp8_cannot_take_are_fine_for_the_other_chains() -> None:
    args = bench.parse_args(["--out", "g.json", "--chains", "bf16", "--k", "4008"])
    assert args.k == 4008


def test_idle_time_is_the_step_less_its_kernels_spread_over_the_gaps() -> None:
    got = bench.idle({"step_us": 50.0, "kernel_us": 40.0}, kernels=40)
    assert got == {"idle_us": 10.0, "idle_per_gap_us": 0.25}
    # no profiled sequence of the step: no count of gaps to spread it over
    assert bench.idle({"step_us": 50.0, "kernel_us": 40.0}, kernels=0)["idle_per_gap_us"] is None


@pytest.mark.gpu
def test_every_capture_of_every_chain_is_timed_and_profiled(tmp_path) -> None:
    args = ["--out", str(tmp_path / "g.json"), "--captures", "2", "--gemms", "1", "--between", "2"]
    result = bench.main([*args, "--iters", "2", "--rounds", "2"])
    assert [(r["chain"], r["capture"]) for r in result["rows"]] == [
        (kind, i) for kind in bench.CHAINS for i in range(2)
    ]
    for row in result["rows"]:
        assert row["step_us"] > 0 and row["kernel_us"] > 0 and len(row["step_us_all"]) == 2
        # 2 elementwise kernels, then the GEMM (cuBLAS may add a reduction kernel)
        assert len(row["profiled"]["timeline"]) >= (2 if row["chain"] == "elementwise" else 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_a_gpu_it_says_so(tmp_path) -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--out", str(tmp_path / "g.json")])

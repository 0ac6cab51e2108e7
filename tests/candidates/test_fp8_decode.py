"""The FP8 decode kernels: split-K with interleaved splits (ragged N and K) against float32 GEMMs
on the dequantized operands; the decode configs, built for every decode shape (run on the GPU
by ``test_lowbit_kernels.test_fp8_every_config_on_the_gpu``)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.candidates.test_lowbit_kernels import fp8_problem
from tuner.candidates.triton_fp8 import TritonFp8
from tuner.candidates.triton_kernels import fp8 as fp8_kernels
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant.tolerance import excess

INTERLEAVED = {"kernel": "tiled", "bm": 16, "bn": 16, "bk": 32, "split_k": 3, "interleave": True}
# (N, K, narrow): Llama and Qwen down, gate_up, Llama o and qkv
DECODE_SHAPES = [(4096, 14336, True), (3584, 18944, True), (28672, 4096, False),
                 (37888, 3584, False), (4096, 4096, True), (6144, 4096, True)]  # fmt: skip

# (m, rowwise, fa, fb, k, config) on n = 40
CASES = [
    # split-K, interleaved: split 0 takes steps 0 and 2, split 1 step 1 ...
    (4, True, "e4m3", "e4m3", 96, {**INTERLEAVED, "split_k": 2}),
    # ... and with K = 80, split 2 takes the half step
    (7, False, "e4m3", "e4m3", 80, INTERLEAVED),
    # swapped (b @ a.T: the weight's 64 rows are the wgmma's m), 8 and 16 rows of x
    (3, True, "e4m3", "e4m3", 96, {**INTERLEAVED, "bn": 64, "bm": 8, "split_k": 2, "swap": True}),
    (16, True, "e5m2", "e4m3", 80, {**INTERLEAVED, "bn": 64, "swap": True}),
    # two dots a step (in precise mode each summed apart), K = 160: the last step is half a step
    (5, True, "e4m3", "e4m3", 160, {**INTERLEAVED, "bn": 64, "bk": 32, "dots": 2, "split_k": 2,
                                    "swap": True}),
]  # fmt: skip


@pytest.mark.parametrize("precise", [False, True], ids=["fast", "precise"])
@pytest.mark.parametrize(("m", "rowwise", "fa", "fb", "k", "config"), CASES)
def test_fp8_decode_kernels_match_the_dequantized_gemm(
    m, rowwise, fa, fb, k, config, precise
) -> None:
    a, b, sa, sb, ref, tol = fp8_problem(m, 40, k, rowwise, fa, fb)
    out = fp8_kernels.fp8_matmul(a, b, sa, sb.T if rowwise else sb, config, precise=precise)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 40)
    assert excess(out, ref, tol) <= 1


def test_fp8_decode_bad_configs_name_the_field() -> None:
    a, b, sa, sb, _, _ = fp8_problem(4, 40, 96, True)
    tiled = {"kernel": "tiled", "bm": 16, "bn": 16, "bk": 32, "split_k": 2, "group_m": 1}
    for kernel in ("gemv", "stream_k"):
        field = re.escape(f"config['kernel']='{kernel}': allowed tiled, persistent_tma")
        with pytest.raises(ValueError, match=field):
            fp8_kernels.fp8_matmul(a, b, sa, sb, {**tiled, "kernel": kernel})
    with pytest.raises(ValueError, match=re.escape("config['dots']=3: allowed 1, 2, 4 dots")):
        fp8_kernels.fp8_matmul(a, b, sa, sb, {**tiled, "dots": 3})
    for name in ("interleave", "swap"):
        with pytest.raises(
            ValueError, match=re.escape(f"config['{name}']='yes': allowed True, False")
        ):
            fp8_kernels.fp8_matmul(a, b, sa, sb, {**tiled, name: "yes"})


@pytest.mark.parametrize(("n", "k", "narrow"), DECODE_SHAPES)
def test_fp8_decode_configs_build_for_every_decode_shape(n: int, k: int, narrow: bool) -> None:
    """Narrow N (the down projections, o, qkv) is led by interleaved split-K filling one wave
    at two programs per SM; the deep-pipeline tiles (6-8 stages) run at most one wave at one
    per SM and fill 3/4 of it, the 32 x 512 one only from M = 2; wide N (gate_up) takes one
    split per tile; the 64-row tiles run swapped, two 128-byte dots a step; no config twice;
    every config builds its launches (``jobs``) for both scalings."""
    sms = 132
    for m in (1, 2, 16):
        configs = fp8_kernels.configs(m, n, k)
        assert configs and all(c["kernel"] == "tiled" for c in configs)
        assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)

        def programs(c: dict) -> int:
            return -(-n // c["bn"]) * c["split_k"]

        if narrow:
            first = configs[0]
            assert first["interleave"] and first["split_k"] > 1
            assert sms < programs(first) <= 2 * sms
        else:
            assert all(c["split_k"] == 1 for c in configs)
        deep = [c for c in configs if c["stages"] >= 6]
        assert all(3 * sms <= 4 * programs(c) <= 4 * sms for c in deep)
        assert any(c["bn"] == 32 and c["bk"] == 512 for c in deep) == (
            narrow and m > 1 and -(-n // 32) <= sms
        )
        for config in configs:
            assert config.get("interleave", False) == (config["split_k"] > 1)
            # 64 weight rows: the wgmma's m, two 128-byte dots a step
            assert config.get("swap", False) == (config["bn"] == 64)
            assert (config["bk"], config.get("dots", 1)) == (
                (128, 2) if config["bn"] == 64 else (config["bk"], 1)
            )
            for rowwise in (True, False):
                assert fp8_kernels.jobs(m, n, k, config, rowwise=rowwise, precise=False)


def _key(spec: str, m: int, n: int = 128, k: int = 256) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), "out_dtype": "bf16"})


def test_a_plan_is_made_once_per_shape_and_config() -> None:
    """Launches are derived once per shape, scaling, accumulation and config: an eager decode
    call is too short to derive them every time. True and 1 are different configs."""
    config = {**INTERLEAVED, "bn": 64, "split_k": 2, "swap": True}
    plan = fp8_kernels.checked_plan(4, 40, 96, True, True, config)
    assert fp8_kernels.checked_plan(4, 40, 96, True, True, dict(config)) is plan
    assert fp8_kernels.checked_plan(4, 40, 96, True, False, config) is not plan
    assert fp8_kernels.checked_plan(4, 40, 96, True, True, {**config, "swap": 1}) is not plan
    assert (plan.splits, plan.direct) == (2, True)
    with pytest.raises(ValueError, match=re.escape("config['bk']=[32]: allowed a number")):
        fp8_kernels.checked_plan(4, 40, 96, True, True, {**config, "bk": [32]})
    with pytest.raises(ValueError, match=re.escape("config['dots']=3: allowed 1, 2, 4 dots")):
        fp8_kernels.checked_plan(4, 40, 96, True, True, {**config, "dots": 3})


@pytest.mark.cpu_host
def test_the_runner_checks_its_operands_and_names_what_is_wrong() -> None:
    key = _key("fp8-rowwise", 4)
    run = TritonFp8().build(key, TritonFp8().candidates(key, "cpu")[0])
    a, b, sa, sb = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    ref = fp8_kernels.fp8_matmul(a, b.T, sa, sb, TritonFp8().candidates(key, "cpu")[0],
                                 precise=True)  # fmt: skip
    assert torch.equal(run(a, b, sa, sb), ref)
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    assert run(a, b, sa, sb, out=out) is out and torch.equal(out, ref)
    with pytest.raises(ValueError, match=r"a.shape=\(2, 256\).*built for \(M, N, K\)=\(4, 128"):
        run(a[:2], b, sa[:2], sb)
    with pytest.raises(ValueError, match=r"out: expected torch.bfloat16 \[4, 128\] .* got "):
        run(a, b, sa, sb, out=out.t().contiguous().t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_tiled_calls_launch_directly_once_a_relaunch_matched_the_jit() -> None:
    """After its first call a decode config's kernel launches without Triton's JIT dispatch (a
    relaunch checked bit for bit first), on every later call and inside a CUDA graph."""
    m, n, k = 4, 4096, 1024
    a, b, sa, sb, ref, tol = fp8_problem(m, n, k, True)
    config = fp8_kernels.configs(m, n, k)[0]
    assert config["split_k"] > 1  # the arrival counts' path
    first = fp8_kernels.fp8_matmul(a, b, sa, sb.T, config, precise=True)
    assert excess(first, ref, tol) <= 1
    plan = fp8_kernels.checked_plan(m, n, k, True, True, config)
    assert plan.checked and plan.main.verified and plan.main.compiled
    for _ in range(3):
        assert torch.equal(fp8_kernels.fp8_matmul(a, b, sa, sb.T, config, precise=True), first)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_kernels.fp8_matmul(a, b, sa, sb.T, config, out=out, precise=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)

"""The low-bit GEMM kernels: W4A16 (decode and prefill tiles, split-K, group sizes, fp16/bf16) and FP8 with
tensorwise / rowwise scales (tiled, split-K, persistent TMA) against float32 GEMMs on the
dequantized operands, with tolerances from the formats (``tuner.quant.tolerance``); planted
wrong results must fall outside them. CPU: Triton's interpreter (whose bf16 arithmetic is wrong,
so the W4A16 kernel dequantizes and sums in fp32 there)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from tuner.candidates.triton_kernels import fp8 as fp8_kernels
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.configs import SMEM_LIMIT
from tuner.quant import fp8, int4
from tuner.quant.tolerance import (
    FP8_TENSOR_CORE_ACCUMULATE,
    FP32_ACCUMULATE,
    excess,
    gemm_tolerance,
    unit_roundoff,
)

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K) projections

TILED = {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 128, "dots": 2, "split_k": 1}
TILED_SPLIT = {**TILED, "split_k": 2}
ONE_DOT_SPLIT = {**TILED, "dots": 1, "split_k": 2}


def int4_problem(m: int, n: int, k: int, g: int, dtype: torch.dtype, device: str = DEVICE):
    w = torch.randn(n, k, dtype=dtype, device=device)
    q, sz = int4.quantize(w, g)
    x = torch.randn(m, k, dtype=dtype, device=device)
    wd = int4.dequantize(q, sz, g)
    ref = x.float() @ wd.T
    tol = gemm_tolerance(x, wd, ref, operand_unit=unit_roundoff(dtype),
                         accumulate_unit=FP32_ACCUMULATE, out_dtype=dtype)  # fmt: skip
    return x, q, sz, ref, tol


W4_CASES = [
    (1, TILED, 32, torch.bfloat16, 256),
    (3, TILED_SPLIT, 64, torch.float16, 512),
    (5, ONE_DOT_SPLIT, 128, torch.bfloat16, 256),
    (37, TILED, 256, torch.float16, 256),
    (16, {**TILED, "dots": 1, "split_k": 3}, 128, torch.bfloat16, 384),
    # K's 5 steps in 3 runs of 1, 2 and 2 steps; each step's dots summed apart
    (3, {**TILED, "split_k": 3}, 64, torch.float16, 1280),
    (16, {**TILED, "split_k": 3, "step_sum": True}, 128, torch.bfloat16, 1280),
    # the last split waits for the others' partials
    (5, {**TILED, "split_k": 3, "step_sum": True, "split_wait": True}, 64, torch.bfloat16, 1280),
    # hybrid: tile 0 whole, tile 1 in 3 splits, summed by the last to arrive / the last split
    (3, {**TILED, "split_k": 3, "whole_tiles": 1}, 64, torch.float16, 1280),
    (
        16,
        {**TILED, "split_k": 2, "whole_tiles": 1, "step_sum": True, "split_wait": True},
        128,
        torch.bfloat16,
        768,
    ),
]


@pytest.mark.parametrize(("m", "config", "g", "dtype", "k"), W4_CASES)
def test_w4a16_matches_the_dequantized_gemm(m, config, g, dtype, k) -> None:
    x, q, sz, ref, tol = int4_problem(m, 40, k, g, dtype)
    out = w4a16.w4a16_matmul(x, int4.pack(q), sz, g, config)
    assert out.dtype == dtype and out.shape == (m, 40)
    assert excess(out, ref, tol) <= 1


# n = 200: three whole 64-row blocks and a ragged one of 8 rows; n = 240: a ragged block of 48
# rows, three 16-row tiles in it; K = 384, three chunks
BLOCK_CASES = [
    (200, {**TILED, "bn": 128, "dots": 1}),  # two blocks a tile, the ragged one in the second
    (200, {**TILED, "bn": 64, "dots": 1, "split_k": 3}),
    (200, {**TILED, "bn": 16, "dots": 1}),  # four tiles a block, one in the ragged block
    (240, {**TILED, "bn": 16, "dots": 1}),  # tiles that start inside the ragged block
    (200, {**TILED, "bn": 64, "dots": 1, "split_k": 2, "whole_tiles": 3}),  # the ragged one split
    (240, {**TILED, "bn": 16, "dots": 1, "split_k": 3, "whole_tiles": 12, "split_wait": True}),
]


@pytest.mark.parametrize(("n", "config"), BLOCK_CASES)
def test_w4a16_reads_every_tile_major_block(n: int, config) -> None:
    x, q, sz, ref, tol = int4_problem(3, n, 384, 128, torch.bfloat16)
    assert excess(w4a16.w4a16_matmul(x, int4.pack(q), sz, 128, config), ref, tol) <= 1


@pytest.mark.parametrize("config", [TILED, ONE_DOT_SPLIT, {**TILED, "step_sum": True},
                                    {**ONE_DOT_SPLIT, "split_wait": True},
                                    {**ONE_DOT_SPLIT, "bn": 16, "whole_tiles": 1}])  # fmt: skip
def test_w4a16_planted_errors_are_caught(config) -> None:
    """Nibbles in the wrong order, the scales of the neighbouring group, one K tile dropped."""
    g = 32
    x, q, sz, ref, tol = int4_problem(4, 32, 256, g, torch.float16)
    swapped = int4.pack(q.reshape(32, -1, 2).flip(-1).reshape(32, 256))
    assert excess(w4a16.w4a16_matmul(x, swapped, sz, g, config), ref, tol) > 1
    shifted = sz.roll(1, dims=0).contiguous()
    assert excess(w4a16.w4a16_matmul(x, int4.pack(q), shifted, g, config), ref, tol) > 1
    short = x.clone()
    short[:, -32:] = 0
    assert excess(w4a16.w4a16_matmul(short, int4.pack(q), sz, g, config), ref, tol) > 1


def test_w4a16_two_dot_128_tile_drops_a_stage_where_a_step_spans_many_groups() -> None:
    """Its scales' buffers overflow shared memory at 3 stages with groups under 128."""

    def stages(group: int) -> int:
        tile = [c for c in w4a16.configs(64, 512, 2048, group)
                if (c["bm"], c["bn"], c["dots"]) == (128, 128, 2)]  # fmt: skip
        assert len(tile) == 1
        return tile[0]["stages"]

    assert [stages(g) for g in (32, 64, 128, 256)] == [2, 2, 3, 3]


def test_w4a16_configs_are_valid_for_llama_shapes() -> None:
    for n, k in LLAMA3_8B:
        for m in (1, 3, 16, 256, 2048):
            for g in (32, 64, 128):
                shortlist = w4a16.configs(m, n, k, g)
                assert shortlist
                for config in shortlist:
                    w4a16.check_config(config, m, n, k)
                    if m <= 16:
                        assert config["bm"] >= m


@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (37888, 3584), (28672, 2048)])
def test_w4a16_decode_shortlist_evens_out_the_wide_projections(n: int, k: int) -> None:
    """Where 64-row tiles outnumber the SMs, the shortlist offers whole waves of tiles and the
    others split (in place of one split), every program resident at 5 per SM, the busiest SM
    given fewer steps."""
    for m in (1, 16):
        shortlist = w4a16.configs(m, n, k, 128, sms=132)
        assert all(c.get("whole_tiles") and c["split_wait"] for c in shortlist)
        tiles, steps = n // 64, k // 256
        for c in shortlist:
            whole, split = c["whole_tiles"], c["split_k"]
            assert whole % 132 == 0 and whole + (tiles - whole) * split <= 5 * 132
            busiest = whole // 132 * steps + -(-(tiles - whole) * split // 132) * -(-steps // split)
            assert busiest < -(-tiles // 132) * steps
    assert not any(c.get("whole_tiles") for c in w4a16.configs(1, 4096, 14336, 128))


@pytest.mark.parametrize("out_bytes", [2, 4])
def test_fp8_persistent_configs_leave_room_for_the_output_tile(out_bytes: int) -> None:
    """The persistent kernel keeps its output tile in shared memory beside the pipeline's
    stages: a float32 output gets fewer stages, never more than fit."""
    for m in (64, 512, 4096):
        for config in fp8_kernels.configs(m, 4096, 4096, out_bytes=out_bytes):
            if config["kernel"] == "persistent_tma":
                bm, bn, bk = config["bm"], config["bn"], config["bk"]
                staged = config["stages"] * (bm + bn) * bk + bm * bn * out_bytes
                assert config["stages"] >= 2 and staged <= SMEM_LIMIT, config
    wide, narrow = (fp8_kernels.configs(4096, 4096, 4096, out_bytes=b)[0] for b in (4, 2))
    assert wide["stages"] < narrow["stages"]


def test_fp8_decode_shortlists_give_every_split_work() -> None:
    """K = 18944 in 128-wide tiles cannot be cut in 16 contiguous splits (the 16th would be
    empty); interleaved splits take every S-th K step, so each needs one step at least."""
    for n, k in [*LLAMA3_8B, (3584, 18944), (37888, 3584), (4608, 3584)]:
        for m in (1, 16):
            for config in (c for c in fp8_kernels.configs(m, n, k) if c["kernel"] == "tiled"):
                split, bk = config["split_k"], config["bk"]
                if config.get("interleave"):
                    assert 1 <= split <= -(-k // bk), (n, k, config)
                else:
                    assert fp8_kernels.split_fits(k, bk, split), (n, k, config)
    assert not fp8_kernels.split_fits(18944, 128, 16) and fp8_kernels.split_fits(18944, 128, 8)


@pytest.mark.cpu_host
def test_w4a16_bad_inputs_name_the_field() -> None:
    x, q, sz, _, _ = int4_problem(2, 16, 256, 32, torch.float16, "cpu")
    w = int4.pack(q)
    cases = [
        ((x.float(), w, sz, 32), "x.dtype"),
        ((x, w[:, :64].contiguous(), sz, 32), "weight.shape"),
        ((x, w.int(), sz, 32), "weight"),
        ((x, w, sz, 48), "group_size=48"),
        ((x, w, sz.bfloat16(), 32), "scales_and_zeros.dtype"),
        ((x, w, sz[:2].contiguous(), 32), "scales_and_zeros.shape"),
        ((x, w, sz, 64), "scales_and_zeros.shape"),
    ]
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            w4a16.w4a16_matmul(*args)
    # our layout packs K in whole chunks of 128: K = 96 is refused
    x96, q96, sz96, _, _ = int4_problem(2, 16, 96, 32, torch.float16, "cpu")
    with pytest.raises(ValueError, match="K=96 must be a multiple of 128"):
        w4a16.w4a16_matmul(x96, int4.pack(q96), sz96, 32)
    for bk in (64, 256):  # one chunk of the layout per dot
        with pytest.raises(ValueError, match=f"config\\['bk'\\]={bk}: must be 128"):
            w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "bk": bk})
    with pytest.raises(ValueError, match="config\\['bn'\\]=96: must divide 64"):
        w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "bn": 96})
    # K = 256 is one step of two dots; a bool is not a split count, even once the config's
    # checks passed for the split count it equals (they are kept per typed config)
    w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "split_k": 1})
    for split in (2, True):
        with pytest.raises(
            ValueError, match=re.escape(f"config['split_k']={split}: allowed 1 .. 1")
        ):
            w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "split_k": split})
    for bad in ({**TILED, "dots": 1, "step_sum": True}, {**TILED, "step_sum": 1}):
        with pytest.raises(ValueError, match="config\\['step_sum'\\]"):
            w4a16.w4a16_matmul(x, w, sz, 32, bad)
    # nothing to wait for: one split
    for bad in ({**TILED, "split_wait": "yes"}, {**TILED, "split_wait": True}):
        with pytest.raises(ValueError, match="config\\['split_wait'\\]"):
            w4a16.w4a16_matmul(x, w, sz, 32, bad)
    # whole tiles: fewer than the problem's (one here), with a split of the others
    for bad in ({**ONE_DOT_SPLIT, "whole_tiles": 1}, {**TILED, "bn": 8, "whole_tiles": 1},
                {**ONE_DOT_SPLIT, "bn": 8, "whole_tiles": True},
                {**ONE_DOT_SPLIT, "bn": 8, "whole_tiles": 0.0}):  # fmt: skip
        with pytest.raises(ValueError, match="config\\['whole_tiles'\\]"):
            w4a16.w4a16_matmul(x, w, sz, 32, bad)
    with pytest.raises(ValueError, match="config\\['dots'\\]"):
        w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "dots": 3})
    with pytest.raises(ValueError, match="config\\['note'\\]=\\[1\\]: allowed a number"):
        w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "note": [1]})  # cannot be hashed
    for kernel in ("cutlass", "stream_k"):
        with pytest.raises(ValueError, match=re.escape(f"config['kernel']='{kernel}': allowed")):
            w4a16.w4a16_matmul(x, w, sz, 32, {**TILED, "kernel": kernel})
    x384, q384, sz384, _, _ = int4_problem(2, 16, 384, 32, torch.float16, "cpu")
    with pytest.raises(ValueError, match="config\\['dots'\\]=2: K=384"):
        w4a16.w4a16_matmul(x384, int4.pack(q384), sz384, 32, TILED)


def fp8_problem(m: int, n: int, k: int, rowwise: bool, fa: str = "e4m3", fb: str = "e4m3"):
    quant = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    a, sa = quant(torch.randn(m, k, device=DEVICE), fa)
    b, sb = quant(torch.randn(n, k, device=DEVICE) * 0.05, fb)
    da, db = fp8.dequantize(a, sa), fp8.dequantize(b, sb)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0,
                         accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE, out_dtype=torch.bfloat16)  # fmt: skip
    return a, b, sa, sb, ref, tol


FP8_CASES = [
    (5, True, "e4m3", "e4m3", {"kernel": "tiled", "bm": 16, "bn": 16, "bk": 32, "split_k": 3}),
    (20, False, "e4m3", "e4m3", {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 32}),
    (20, True, "e5m2", "e4m3", {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 64}),
    (33, True, "e4m3", "e5m2", {"kernel": "persistent_tma", "bm": 16, "bn": 32, "bk": 32}),
]


@pytest.mark.parametrize("precise", [False, True], ids=["fast", "precise"])
@pytest.mark.parametrize(("m", "rowwise", "fa", "fb", "config"), FP8_CASES)
def test_fp8_matches_the_dequantized_gemm(m, rowwise, fa, fb, config, precise) -> None:
    a, b, sa, sb, ref, tol = fp8_problem(m, 40, 96, rowwise, fa, fb)
    out = fp8_kernels.fp8_matmul(a, b, sa, sb.T if rowwise else sb, config, precise=precise)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 40)
    assert excess(out, ref, tol) <= 1


def test_fp8_planted_errors_are_caught() -> None:
    config = FP8_CASES[0][-1]
    a, b, sa, sb, ref, tol = fp8_problem(5, 40, 96, True)
    assert excess(fp8_kernels.fp8_matmul(a, b, sa, sb.flip(0), config), ref, tol) > 1
    short = a.clone()
    short[:, -32:] = 0
    assert excess(fp8_kernels.fp8_matmul(short, b, sa, sb, config), ref, tol) > 1


def test_fp8_bad_inputs_name_the_field() -> None:
    a, b, sa, sb, _, _ = fp8_problem(4, 16, 64, True)
    one = torch.ones((), device=DEVICE)
    cases = [
        ((a.float(), b, sa, sb), "a.dtype"),
        ((a.to(torch.float8_e5m2), b.to(torch.float8_e5m2), sa, sb), "e5m2 x e5m2"),
        ((a, b[:, :32], sa, sb), "b.shape"),
        ((a, b, sa.double(), sb), "scale_a.dtype"),
        ((a, b, sa, one), "scale_b.shape"),
        ((a, b, one, sb), "scale_b.shape"),  # a tensorwise scale_a: scale_b is the odd one
    ]
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            fp8_kernels.fp8_matmul(*args)
    with pytest.raises(ValueError, match="config\\['kernel'\\]"):
        fp8_kernels.fp8_matmul(a, b, sa, sb, {"kernel": "gemv", "bm": 16, "bn": 16, "bk": 32})


# --- GPU: every config of the shortlists, torch's baselines beside ------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "g"),
    # Llama's and Qwen's gate_up N: more tiles than SMs, so the shortlist's hybrid configs too
    [
        (1, 512, 32),
        (1, 520, 128),
        (16, 512, 256),
        (300, 520, 128),
        (64, 512, 64),
        (1, 28672, 128),
        (16, 37888, 128),
        (256, 3584, 128),  # Qwen o's N at M = 256: 64-row tiles over four bands of x
    ],
)
def test_w4a16_every_config_on_the_gpu(m: int, n: int, g: int) -> None:
    k = 2048
    x, q, sz, ref, tol = int4_problem(m, n, k, g, torch.bfloat16)
    packed = int4.pack(q)
    for config in w4a16.configs(m, n, k, g):
        assert excess(w4a16.w4a16_matmul(x, packed, sz, g, config), ref, tol) <= 1, config
    torch_out = torch.ops.aten._weight_int4pack_mm(x, int4.to_torch_int4pack(packed), g, sz)
    assert excess(torch_out, ref, tol) <= 1


# n = 512, K = 4096: 4 tiles of 128 rows, 16 steps each; 5 splits: runs of 3 and 4 steps
# (summed by the last to arrive, or by the last split once the others arrived)
GPU_CONFIGS = [
    {**TILED, "bn": 128, "warps": 8, "stages": 3},
    {**TILED, "bn": 128, "warps": 8, "stages": 3, "split_k": 4},
    {**TILED, "bn": 64, "warps": 4, "stages": 3, "split_k": 5, "step_sum": True},
    {
        **TILED,
        "bn": 64,
        "warps": 4,
        "stages": 3,
        "split_k": 5,
        "step_sum": True,
        "split_wait": True,
    },
    # hybrid, 8 tiles of 64 rows: 5 whole, 3 in 3 splits each
    {**TILED, "bn": 64, "warps": 4, "stages": 3, "split_k": 3, "whole_tiles": 5, "step_sum": True},
    {
        **TILED,
        "bn": 64,
        "warps": 4,
        "stages": 3,
        "split_k": 3,
        "whole_tiles": 5,
        "step_sum": True,
        "split_wait": True,
    },
]


GPU_CASES = [(4, config) for config in GPU_CONFIGS]  # (M, config)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "config"), GPU_CASES)
def test_w4a16_later_calls_launch_directly_with_the_same_bits(m: int, config) -> None:
    x, q, sz, ref, tol = int4_problem(m, 512, 4096, 128, torch.bfloat16)
    packed = int4.pack(q)
    first = w4a16.w4a16_matmul(x, packed, sz, 128, config)
    plan = w4a16.checked_plan(m, 512, 4096, 128, config)  # the one the calls ran
    assert plan.checked and plan.main.verified and plan.main.compiled  # the direct path is on
    again = w4a16.w4a16_matmul(x, packed, sz, 128, config)
    assert excess(first, ref, tol) <= 1 and torch.equal(first, again)
    half = w4a16.w4a16_matmul(x.half(), packed, sz.half(), 128, config)  # same plan, fp16 kernel
    assert half.dtype == torch.float16 and excess(half, ref, tol) <= 1


def replays_alike_when_captured_first(counts, first: torch.Tensor, call) -> None:
    """``call(out)`` captured in a CUDA graph before ``counts`` exist (so its split-K partials
    are summed by a second launch) replays to ``first``'s bits."""
    counts.clear()
    out = torch.empty_like(first)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            call(out)
    assert first.device not in counts
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "config"), GPU_CASES[1:])
def test_w4a16_split_k_sums_alike_in_the_kernel_and_in_a_captured_graph(m: int, config) -> None:
    """The tile's last program sums the partials (counts back at zero after each call); a graph
    captured before the counts exist reduces with a second launch, in the same order."""
    x, q, sz, ref, tol = int4_problem(m, 512, 4096, 128, torch.bfloat16)
    packed = int4.pack(q)
    w4a16._counts.clear()
    first = w4a16.w4a16_matmul(x, packed, sz, 128, config)
    again = w4a16.w4a16_matmul(x, packed, sz, 128, config)
    assert excess(first, ref, tol) <= 1 and torch.equal(first, again)
    assert int(w4a16._counts[x.device].abs().sum()) == 0
    replays_alike_when_captured_first(
        w4a16._counts, first, lambda out: w4a16.w4a16_matmul(x, packed, sz, 128, config, out=out)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "config"),
    [
        (512, {"kernel": "tiled", "bm": 16, "bn": 64, "bk": 256, "split_k": 8, "group_m": 1,
               "warps": 4, "stages": 4}),
    ],
)  # fmt: skip
def test_fp8_split_k_sums_alike_in_the_kernel_and_in_a_captured_graph(n: int, config) -> None:
    """As for W4A16: the tile's last program sums the partials and leaves its count at zero; a
    graph captured before the counts exist reduces with a second launch, to the same bits."""
    a, sa = fp8.quantize_rowwise(torch.randn(16, 4096, device="cuda"), "e4m3")
    b, sb = fp8.quantize_rowwise(torch.randn(n, 4096, device="cuda"), "e4m3")
    fp8_kernels._counts.clear()
    first = fp8_kernels.fp8_matmul(a, b, sa, sb, config, precise=True)
    again = fp8_kernels.fp8_matmul(a, b, sa, sb, config, precise=True)
    ref = (a.float() @ b.float().T) * sa.reshape(-1, 1) * sb.reshape(1, -1)
    assert torch.equal(first, again) and torch.allclose(first.float(), ref, rtol=2e-2, atol=1e-1)
    assert int(fp8_kernels._counts[a.device].abs().sum()) == 0
    replays_alike_when_captured_first(
        fp8_kernels._counts, first,
        lambda out: fp8_kernels.fp8_matmul(a, b, sa, sb, config, out=out, precise=True),
    )  # fmt: skip


def alike_on_two_streams_at_once(first: torch.Tensor, call: Callable, rounds: int = 50) -> None:
    """``call(out)`` launched on two streams in turn, ``rounds`` times each, so that their
    kernels run at once: every result is ``first``, bit for bit (a stream that took the other's
    split-K arrivals for its own would store a tile summed from unwritten partials, or none)."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[torch.full_like(first, float("nan")) for _ in range(rounds)] for _ in streams]
    torch.cuda.synchronize()
    for stream in streams:  # both streams' launches queue behind a wait, then run together
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
    for r in range(rounds):
        for stream, out in zip(streams, outs, strict=True):
            with torch.cuda.stream(stream):
                call(out[r])
    torch.cuda.synchronize()
    wrong = sum(not torch.equal(o, first) for per_stream in outs for o in per_stream)
    assert wrong == 0, f"{wrong} of {2 * rounds} results differ from the one-stream result"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in GPU_CONFIGS if c.get("split_k", 1) > 1])
def test_w4a16_split_k_launches_on_two_streams_at_once_keep_their_own_counts(config) -> None:
    x, q, sz, _, _ = int4_problem(16, 4096, 4096, 128, torch.bfloat16)
    packed = int4.pack(q)
    first = w4a16.w4a16_matmul(x, packed, sz, 128, config)
    alike_on_two_streams_at_once(
        first, lambda out: w4a16.w4a16_matmul(x, packed, sz, 128, config, out=out)
    )


@pytest.mark.gpu
def test_fp8_split_k_launches_on_two_streams_at_once_keep_their_own_counts() -> None:
    config = {"kernel": "tiled", "bm": 16, "bn": 64, "bk": 256, "split_k": 8, "group_m": 1,
              "warps": 4, "stages": 4}  # fmt: skip
    a, sa = fp8.quantize_rowwise(torch.randn(16, 4096, device="cuda"), "e4m3")
    b, sb = fp8.quantize_rowwise(torch.randn(4096, 4096, device="cuda"), "e4m3")
    first = fp8_kernels.fp8_matmul(a, b, sa, sb, config, precise=True)
    alike_on_two_streams_at_once(
        first, lambda out: fp8_kernels.fp8_matmul(a, b, sa, sb, config, out=out, precise=True)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "rowwise"),
    [(1, 512, 2048, True), (16, 512, 2048, False), (200, 512, 2048, True),
     (1024, 512, 2048, True), (1, 1000, 14336, True), (16, 1000, 14336, False)],
)  # fmt: skip
def test_fp8_every_config_on_the_gpu(m: int, n: int, k: int, rowwise: bool) -> None:
    """Each config of the shortlist within the tolerance in both accumulation modes, and bit for
    bit the same on a second call; N = 1000 with Llama's down K: a ragged last tile, the decode
    configs' split-K."""
    a, b, sa, sb, ref, tol = fp8_problem(m, n, k, rowwise)
    sb = sb.T if rowwise else sb
    for config in fp8_kernels.configs(m, n, k):
        for precise in (False, True):
            out = fp8_kernels.fp8_matmul(a, b, sa, sb, config, precise=precise)
            assert excess(out, ref, tol) <= 1, (config, precise)
            again = fp8_kernels.fp8_matmul(a, b, sa, sb, config, precise=precise)
            assert torch.equal(out, again), (config, precise)
    if n % 16 == 0:  # the bound holds torch's op too (_scaled_mm takes N in multiples of 16)
        torch_out = torch._scaled_mm(a, b.T, sa, sb, out_dtype=torch.bfloat16)
        assert excess(torch_out, ref, tol) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512])
def test_fp8_precise_mode_promotes_the_partial_sums(m: int) -> None:
    """Long sums of positive products are where the tensor cores' partial-precision accumulator
    drifts: precise mode (``_scaled_mm`` without fast accumulation) must stay near fp32."""
    n, k = 256, 16384
    one = torch.ones((), device="cuda")
    a = (torch.rand(m, k, device="cuda") * 0.5 + 0.5).to(torch.float8_e4m3fn)
    b = (torch.rand(n, k, device="cuda") * 0.5 + 0.5).to(torch.float8_e4m3fn)
    ref = a.double() @ b.double().T
    errors = {}
    for config in fp8_kernels.configs(m, n, k, out_bytes=4):
        for precise in (False, True):
            out = torch.empty(m, n, dtype=torch.float32, device="cuda")
            fp8_kernels.fp8_matmul(a, b, one, one, config, out=out, precise=precise)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            errors[config["kernel"], config["bk"], precise] = err
    for (kernel, bk, precise), err in errors.items():
        if precise:  # a chunk of PROMOTE_EVERY products still sums in partial precision
            fast = errors[kernel, bk, False]
            assert err < 2e-3 and (err < fast / 4 or fast < 4e-4), (kernel, bk, errors)


def test_w4a16_decode_split_rules_on_the_models_shapes() -> None:
    """Splits whose CTAs are all resident at once (5 per SM on 132 SMs), K steps of two dots:
    the down projections split K (Llama 64 tiles x 56 steps, Qwen 56 x 74); the gate_up ones have
    more tiles than SMs, so one split, and the hybrid deals the tail of tiles past whole waves
    of one tile per SM out in two splits."""
    assert w4a16._resident_splits(64, 56, 5, 132) == 8
    assert w4a16._resident_splits(56, 74, 5, 132) == 11
    assert w4a16._resident_splits(448, 16, 5, 132) == 1
    assert w4a16._resident_splits(4, 3, 5, 132) == 3  # never more splits than steps
    assert w4a16._hybrid(448, 16, 5, 132) == (396, 2)
    assert w4a16._hybrid(592, 14, 5, 132) == (528, 2)
    assert w4a16._hybrid(264, 16, 5, 132) is None  # whole waves only: nothing to even out
    assert w4a16._hybrid(100, 16, 5, 132) is None  # fewer tiles than SMs: split-K's case

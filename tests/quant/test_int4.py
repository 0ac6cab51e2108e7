"""INT4 packing: round trips, the nibble order, torch's dequantization convention (CPU op), the
errors on bad input; on a GPU, the round trip through torch's tile-packed format."""

from __future__ import annotations

import pytest
import torch

from tuner.quant import int4
from tuner.quant.tolerance import FP32_ACCUMULATE, excess, gemm_tolerance, unit_roundoff

HAS_GPU = torch.cuda.is_available()


def test_pack_places_each_k_of_a_chunk_as_documented() -> None:
    """Byte b = 16 c + i of a 128-value chunk: k = 2c + ((i >> 1) & 1) + 8 (i & 1) + 16 (i >> 2)
    low, k + 64 high; the chunk after it starts 64 bytes on; a tail past whole chunks pairs
    (2j, 2j + 1)."""
    k = int4.CHUNK * 2 + 4
    q = (torch.arange(k) % 15 + 1).to(torch.uint8)[None, :]  # no zero nibble
    packed = int4.pack(q)[0]
    for kk in range(k):
        chunk, r = divmod(kk, int4.CHUNK)
        if chunk < 2:
            lane, odd, eighth, word, high = (r >> 1) & 3, r & 1, (r >> 3) & 1, (r >> 4) & 3, r >> 6
            byte, shift = 64 * chunk + 16 * lane + 4 * word + 2 * odd + eighth, 4 * high
        else:
            byte, shift = 128 + r // 2, 4 * (r % 2)
        assert (int(packed[byte]) >> shift) & 15 == int(q[0, kk]), kk


def test_pack_stores_64_row_blocks_chunk_by_chunk() -> None:
    """Block b of r rows (the last one: N % 64) starts at byte 64 b * K / 2 and holds its row i's
    chunk c at 64 (c r + i), then its row i's tail at 64 C r + i * tail (C chunks a row): each
    row's bytes are those of that row packed alone."""
    n, k = 2 * 64 + 9, int4.CHUNK * 3 + 10
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = int4.pack(q).reshape(-1)
    h, body = k // 2, int4.CHUNK // 2 * 3
    for row in range(n):
        alone = int4.pack(q[row : row + 1])[0]
        b, i = divmod(row, 64)
        r = min(64, n - 64 * b)
        start = 64 * b * h
        at = [start + 64 * (j // 64 * r + i) + j % 64 for j in range(body)]
        at += [start + body * r + i * (h - body) + j for j in range(h - body)]
        assert torch.equal(packed[at], alone), row


@pytest.mark.parametrize(("n", "k"), [(24, 256), (24, 4), (24, 384 + 6), (64, 256), (130, 390)])
def test_pack_unpack_round_trip(n: int, k: int) -> None:
    """Whole chunks, a tail only, chunks and a tail; one block of fewer than 64 rows, one whole
    block, whole blocks and a ragged one."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = int4.pack(q)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert torch.equal(int4.unpack(packed), q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_is_within_half_a_step(group_size: int) -> None:
    w = torch.randn(16, 256, dtype=torch.bfloat16)
    q, sz = int4.quantize(w, group_size)
    assert sz.shape == (256 // group_size, 16, 2) and sz.dtype == torch.bfloat16
    step = sz[..., 0].float().repeat_interleave(group_size, dim=0).T
    err = (int4.dequantize(q, sz, group_size) - w.float()).abs()
    # half a step from rounding q, plus bf16 rounding of scale and zero (|q - 8| <= 8 steps)
    assert (err <= step * (0.5 + 9 * unit_roundoff(torch.bfloat16)) + 1e-6).all()


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch has no CPU int4 mm"
)
def test_dequantize_follows_torchs_int4_convention() -> None:
    n, k, g = 32, 256, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    sz = torch.randn(k // g, n, 2, dtype=torch.bfloat16)
    x = torch.randn(4, k, dtype=torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
    w = int4.dequantize(q, sz, g)
    ref = x.float() @ w.T
    tol = gemm_tolerance(x, w, ref, operand_unit=unit_roundoff(torch.bfloat16),
                         accumulate_unit=FP32_ACCUMULATE, out_dtype=torch.bfloat16)  # fmt: skip
    assert excess(out, ref, tol) <= 1
    # the opposite zero convention (no -8 offset) is far outside the bound
    assert (
        excess(out, x.float() @ (w + 8 * sz[..., 0].float().repeat_interleave(g, 0).T).T, tol) > 1
    )


def test_bad_inputs_name_the_field() -> None:
    q = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    sz = torch.ones(128 // 32, 8, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_size=48"):
        int4.quantize(torch.randn(8, 128), 48)
    with pytest.raises(ValueError, match="group_size=256"):
        int4.dequantize(q, torch.ones(1, 8, 2), 256)
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        int4.dequantize(q, sz[:, :4], 32)
    with pytest.raises(ValueError, match="q: values"):
        int4.pack(q + 16)
    with pytest.raises(ValueError, match=r"q\.shape"):
        int4.pack(q[:, :127])
    with pytest.raises(ValueError, match="inner_k_tiles=3"):
        int4.to_torch_int4pack(int4.pack(q), inner_k_tiles=3)


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch has no CPU int4 mm"
)
@pytest.mark.parametrize("chunk", [96, 1024])  # a chunk that does not divide K, and one past it
def test_cpu_packing_decodes_to_our_layout(chunk: int) -> None:
    """The one decode of torch's packed weight (both devices' packings) on the CPU's: every
    nibble back in our layout."""
    q = torch.randint(0, 16, (48, 256), dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
    assert torch.equal(int4.from_torch_int4pack(packed, chunk=chunk), int4.pack(q))
    with pytest.raises(ValueError, match="tpacked: expected"):
        int4.from_torch_int4pack(packed.int())


@pytest.mark.gpu
@pytest.mark.parametrize("inner_k_tiles", [2, 8])
def test_torch_tile_pack_round_trip_and_convention(inner_k_tiles: int) -> None:
    n, k, g = 256, 1024, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    packed = int4.pack(q)
    tpacked = int4.to_torch_int4pack(packed, inner_k_tiles)
    assert int4.torch_int4pack_shape(tpacked) == (n, k)
    assert torch.equal(int4.from_torch_int4pack(tpacked, chunk=384), packed)
    sz = (torch.rand(k // g, n, 2, device="cuda") * 0.1).to(torch.bfloat16)
    x = torch.randn(16, k, dtype=torch.bfloat16, device="cuda")
    out = torch.ops.aten._weight_int4pack_mm(x, tpacked, g, sz)
    w = int4.dequantize(q, sz, g)
    ref = x.float() @ w.T
    tol = gemm_tolerance(x, w, ref, operand_unit=unit_roundoff(torch.bfloat16),
                         accumulate_unit=FP32_ACCUMULATE, out_dtype=torch.bfloat16)  # fmt: skip
    assert excess(out, ref, tol) <= 1


def test_quantize_names_a_weight_that_is_not_a_2d_float_one() -> None:
    """A 1-d or batched weight is named by its shape (not "not enough values to unpack"), and an
    integer or FP8 one by its dtype: the scales come out in the weight's dtype, so an integer
    weight's would be truncated to whole numbers without a word."""
    w = torch.randn(8, 128)
    with pytest.raises(ValueError, match=r"^w\.shape=\(128,\): expected a 2-d \[N, K\] weight$"):
        int4.quantize(w[0], 32)
    with pytest.raises(ValueError, match=r"^w\.shape=\(2, 4, 128\): expected a 2-d"):
        int4.quantize(w.view(2, 4, 128), 32)
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=rf"^w\.dtype={dtype}: expected one of torch\.float16"):
            int4.quantize((w * 8).to(dtype), 32)
    for dtype in int4.WEIGHT_DTYPES:  # the scales keep the weight's dtype
        assert int4.quantize(w.to(dtype), 32)[1].dtype == dtype

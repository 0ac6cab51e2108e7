"""INT4 weight-only GEMM (W4A16): ``out = x @ dequant(w).T`` with bf16 or fp16 activations.

The weight is our packed layout (``tuner.quant.int4``): uint8 [N, K / 2], byte j holding
k = j (high nibble) and k = j + K / 2 (low nibble), with torch's [K / group, N, 2] scales and
zeros. Each program loads [BN, BK] bytes of the weight, 16 per thread along K (the row stride
comes as its own argument, so Triton's divisibility specialisation allows 16-byte loads); the
two nibbles give two [BN, BK] weight tiles, one per half of K, each contiguous along K,
matched by two [BM, BK] activation tiles K / 2 apart. A nibble becomes a float through the
mantissa of 2**23 (integer ops and one exact subtract) rather than an int-to-float convert,
whose unit is a fraction of the FMA rate. BK divides the group size and each half of K holds
whole groups, so a tile never straddles two groups: one (scale, zero) pair per row and tile.

- ``w4a16_gemv`` (decode, M <= 4): CUDA-core dot products of x with (q - 8) per tile, scaled
  once per row and group; tensor cores would idle on padding rows and the problem is a read of
  the weight.
- ``w4a16_tiled``: tensor cores on out.T = W x.T, the dequantized weight as the first operand,
  which Hopper's wgmma takes from registers (no shared-memory round trip for the weight); x's
  tiles are the second operand, so BM (activation rows) may be 16 for decode. Its dequant runs
  in the activation dtype (exact q - 8 through the mantissa of 128 or 1024, then one fused
  multiply-add, rounded once as the fp32 path would), which compiles to packed two-lane ops.
Both split K over a second grid axis: fp32 partials [SPLIT_K, M, N] summed in order by the tiled
family's ``splitk_reduce`` (deterministic); with one split they store ``out`` directly.

Entry point for a candidate source: ``w4a16_matmul(x, weight, scales_and_zeros, group_size,
config)`` and ``configs(m, n, k, group_size)``, the configs worth timing for a shape.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.tiled import splitk_reduce, tile_coords
from tuner.quant.int4 import check_group_size, check_scales_and_zeros

Config = dict[str, Any]
ACT_DTYPES = (torch.bfloat16, torch.float16)
MIN_CAPABILITY = (8, 0)
REDUCE_BLOCK = 1024


# fp32 bits of 2**23: a nibble q ORed into the mantissa makes the float 2**23 + q, and
# subtracting 2**23 + 8 leaves q - 8 exactly
MAGIC: tl.constexpr = tl.constexpr(0x4B000000)
MAGIC_OFFSET: tl.constexpr = tl.constexpr(8388616.0)


@triton.jit
def _nibbles(b):
    """fp32 (q - 8) of the high and low nibbles of a uint8 tile, with no int-to-float convert
    (a slow unit): integer ops put each nibble into the mantissa of 2**23, one exact subtract
    follows."""
    w = b.to(tl.int32)
    hi = ((w >> 4) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_OFFSET
    lo = ((w & 15) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_OFFSET
    return hi, lo


@triton.jit
def _nibbles16(b, dtype: tl.constexpr):
    """(q - 8) of both nibbles in the activation dtype (exact), through the mantissa of 128
    (bf16) or 1024 (fp16): integer ops and one 16-bit subtract."""
    w = b.to(tl.int16)
    if dtype == tl.bfloat16:
        magic, offset = 0x4300, tl.full((), 136.0, dtype)
    else:
        magic, offset = 0x6400, tl.full((), 1032.0, dtype)
    hi = ((w >> 4) | magic).to(tl.int16).to(dtype, bitcast=True) - offset.to(dtype)
    lo = ((w & 15) | magic).to(tl.int16).to(dtype, bitcast=True) - offset.to(dtype)
    return hi, lo


@triton.jit
def _scale_zero(sz_ptr, rn, k, N, GROUP: tl.constexpr):
    """fp32 (scale, zero) [BN] of the group holding k, for the weight rows ``rn``."""
    ptrs = sz_ptr + (k // GROUP) * 2 * N + rn * 2
    mask = rn < N
    s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _weight_bytes(w_ptr, rn, j0, N, half, BK: tl.constexpr):
    """The [BN, BK] packed bytes of rows ``rn`` at byte columns j0 .. j0 + BK (rows past N: 0)."""
    rj = tl.max_contiguous(tl.multiple_of(j0 + tl.arange(0, BK), BK), BK)
    ptrs = w_ptr + rn[:, None].to(tl.int64) * half + rj[None, :]
    return tl.load(ptrs, mask=rn[:, None] < N, other=0)


@triton.jit
def _store(out_ptr, ws_ptr, acc, rm, rn, M, N, ldo, SPLIT_K: tl.constexpr):
    """Store an fp32 [BN, BM] tile (weight rows x activation rows) as out[rm, rn], or as its
    split's partial plane."""
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K == 1:
        ptrs = out_ptr + rm[None, :].to(tl.int64) * ldo + rn[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        plane = tl.program_id(1).to(tl.int64) * M * N
        tl.store(ws_ptr + plane + rm[None, :] * N + rn[:, None], acc, mask=mask)


@triton.jit
def w4a16_gemv(
    x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, M, N, half, ldx, ldo, k_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Per tile and activation row: dot(x, q - 8) and sum(x) reduced along K, then scaled
    once per row and group (scale * dot + zero * sum), so each weight element costs integer
    ops, a subtract and one FMA."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    cols = tl.arange(0, BM)
    j_lo = tl.program_id(1) * k_split
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for j0 in range(j_lo, j_lo + k_split, BK):
        q_hi, q_lo = _nibbles(_weight_bytes(w_ptr, rn, j0, N, half, BK))
        s_hi, z_hi = _scale_zero(sz_ptr, rn, j0, N, GROUP)
        s_lo, z_lo = _scale_zero(sz_ptr, rn, half + j0, N, GROUP)
        for m in tl.static_range(BM):
            row = (m + 0 * rk) < M  # row m exists (a tensor mask, as the interpreter wants)
            x_hi = tl.load(x_ptr + m * ldx + j0 + rk, mask=row, other=0.0).to(tl.float32)
            x_lo = tl.load(x_ptr + m * ldx + half + j0 + rk, mask=row, other=0.0).to(tl.float32)
            d_hi = tl.sum(q_hi * x_hi[None, :], axis=1)
            d_lo = tl.sum(q_lo * x_lo[None, :], axis=1)
            part = s_hi * d_hi + z_hi * tl.sum(x_hi) + s_lo * d_lo + z_lo * tl.sum(x_lo)
            acc += tl.where(cols[None, :] == m, part[:, None], 0.0)
    _store(out_ptr, ws_ptr, acc, cols, rn, M, N, ldo, SPLIT_K)


@triton.jit
def w4a16_tiled(
    x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, M, N, half, ldx, ldo, k_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Tensor cores on out.T = W x.T: the dequantized weight tile is the dot's first operand,
    so it can stay in registers (no trip through shared memory) while x's tiles are the
    second; BM (activation rows) may be as small as 16."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    j_lo = tl.program_id(1) * k_split
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * ldx + rk[None, :]
    mask_m = rm[:, None] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for j0 in range(j_lo, j_lo + k_split, BK):
        x_hi = tl.load(x_ptrs + j0, mask=mask_m, other=0.0)
        x_lo = tl.load(x_ptrs + half + j0, mask=mask_m, other=0.0)
        q_hi, q_lo = _nibbles16(_weight_bytes(w_ptr, rn, j0, N, half, BK), x_hi.dtype)
        s_hi, z_hi = _scale_zero(sz_ptr, rn, j0, N, GROUP)
        s_lo, z_lo = _scale_zero(sz_ptr, rn, half + j0, N, GROUP)
        w_hi = tl.fma(q_hi, s_hi[:, None].to(x_hi.dtype), z_hi[:, None].to(x_hi.dtype))
        w_lo = tl.fma(q_lo, s_lo[:, None].to(x_hi.dtype), z_lo[:, None].to(x_hi.dtype))
        acc = tl.dot(w_hi, tl.trans(x_hi), acc)
        acc = tl.dot(w_lo, tl.trans(x_lo), acc)
    _store(out_ptr, ws_ptr, acc, rm, rn, M, N, ldo, SPLIT_K)


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> tuple[int, int, int]:
    """(M, N, K), or a ValueError naming the field that this kernel cannot take."""
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x.dtype={x.dtype}: allowed {ACT_DTYPES}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected a 2-d [M, K] tensor with unit stride along K, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous uint8 [N, K / 2] tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] * 2 != k:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: K / 2 = {k // 2} columns expected "
                         f"for x.shape={tuple(x.shape)}")  # fmt: skip
    check_scales_and_zeros(scales_and_zeros, n, k, group_size, x.dtype)
    check_group_size(group_size, k, halves=True)
    for name, t in (("weight", weight), ("scales_and_zeros", scales_and_zeros)):
        if t.device != x.device:
            raise ValueError(f"{name}.device={t.device}: must be x's device {x.device}")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < MIN_CAPABILITY:
        cap = torch.cuda.get_device_capability(x.device)
        raise ValueError(f"x.device: compute capability {cap}; INT4 kernels need sm80 or newer")
    return m, n, k


def check_config(config: Config, k: int, group_size: int) -> None:
    kernel, bk, split = config.get("kernel"), config["bk"], config.get("split_k", 1)
    if kernel not in ("gemv", "tiled"):
        raise ValueError(f"config['kernel']={kernel!r}: allowed 'gemv', 'tiled'")
    if bk < 16 or group_size % bk:
        raise ValueError(f"config['bk']={bk}: must be >= 16 and divide group_size={group_size}")
    if split < 1 or (k // 2) % (bk * split):
        raise ValueError(
            f"config['split_k']={split}: K / 2 = {k // 2} must split into whole bk={bk} tiles"
        )


def w4a16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    config: Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight).T`` in x's dtype; ``config`` from ``configs`` (None: the first)."""
    m, n, k = check_inputs(x, weight, scales_and_zeros, group_size)
    config = config or configs(m, n, k, group_size)[0]
    check_config(config, k, group_size)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = config.get("split_k", 1)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    bm, bn, bk = config["bm"], config["bn"], config["bk"]
    common = dict(BM=bm, BN=bn, BK=bk, GROUP=group_size, SPLIT_K=split,
                  num_warps=config.get("warps", 4), num_stages=config.get("stages", 2))  # fmt: skip
    args = (
        x,
        weight,
        scales_and_zeros,
        out,
        ws,
        m,
        n,
        k // 2,
        x.stride(0),
        out.stride(0),
        k // 2 // split,
    )
    if config["kernel"] == "gemv":
        w4a16_gemv[(triton.cdiv(n, bn), split)](*args, **common)
    else:
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
        w4a16_tiled[grid](*args, GROUP_M=config.get("group_m", 8), **common)
    if split > 1:
        total = m * n
        splitk_reduce[(triton.cdiv(total, REDUCE_BLOCK),)](
            ws, out, m, n, total, 0, out.stride(0), 1, SPLIT_K=split, BLOCK=REDUCE_BLOCK
        )
    return out


def _splits(tiles: int, k: int, bk: int, sms: int) -> int:
    """Enough K splits that ``tiles`` output tiles cover the SMs about twice; each split whole
    bk tiles of the K / 2 bytes of a row."""
    split = 1
    while tiles * split < 2 * sms and (k // 2) % (bk * split * 2) == 0 and split < 16:
        split *= 2
    return split


# Prefill tiles (bm activation rows, bn weight rows, warps, stages): bk = 64 keeps x's two
# [bm, bk] tiles per stage within shared memory at bm = 256; a larger bm reuses each
# dequantized weight tile for more rows.
PREFILL_TILES = ((128, 128, 8, 3), (256, 128, 8, 3), (128, 64, 4, 4),
                 (64, 128, 4, 4), (32, 64, 4, 4))  # fmt: skip


def configs(m: int, n: int, k: int, group_size: int, sms: int = 132) -> list[Config]:
    """Configs worth timing for an (M, N, K) problem, the likeliest first."""
    bk = min(128, group_size)
    out: list[Config] = []
    if m <= 4:
        bm = triton.next_power_of_2(m)
        for bn, warps in ((32, 4), (64, 4), (16, 4), (64, 8)):
            split = _splits(triton.cdiv(n, bn), k, bk, sms)
            out.append({"kernel": "gemv", "bm": bm, "bn": bn, "bk": bk, "split_k": split,
                        "warps": warps})  # fmt: skip
    if m <= 16:
        for bn, warps, stages in ((64, 4, 3), (128, 8, 3), (64, 4, 4)):
            split = _splits(triton.cdiv(n, bn), k, bk, sms)
            out.append({"kernel": "tiled", "bm": 16, "bn": bn, "bk": bk, "split_k": split,
                        "group_m": 1, "warps": warps, "stages": stages})  # fmt: skip
        return out
    pb = min(64, group_size)
    for bm, bn, warps, stages in PREFILL_TILES:
        if bm <= 2 * max(m, 16):
            split = _splits(triton.cdiv(m, bm) * triton.cdiv(n, bn), k, pb, sms // 2)
            out.append({"kernel": "tiled", "bm": bm, "bn": bn, "bk": pb, "split_k": split,
                        "group_m": 8, "warps": warps, "stages": stages})  # fmt: skip
    out.sort(key=lambda c: -c["bm"] * c["bn"] if m > 256 else c["bm"])
    return out

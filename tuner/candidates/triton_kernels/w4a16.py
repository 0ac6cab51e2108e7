"""INT4 weight-only GEMM (W4A16): ``out = x @ dequant(w).T`` with bf16 or fp16 activations.

The weight is our packed layout (``tuner.quant.int4``): uint8 [N, K / 2], byte j holding
k = j (high nibble) and k = j + K / 2 (low nibble), with torch's [K / group, N, 2] scales and
zeros. Each program loads [BN, BK] bytes of the weight (K-contiguous rows: wide loads); the two
nibbles give two [BN, BK] weight tiles, one per half of K, each contiguous along K, so no
interleave is undone in registers; the activations come as two [BM, BK] tiles, K / 2 apart.
Dequantization ``(q - 8) * scale + zero`` runs in fp32 with one (scale, zero) pair per row of a
tile: BK divides the group size and each half of K holds whole groups, so a tile never straddles
two groups and each pair is one [BN, 2] load.

- ``w4a16_gemv`` (decode, M <= 16): multiply-adds on the CUDA cores into a [BM, BN, BK] fp32
  accumulator reduced once at the end; tensor cores would idle on padding rows and the problem is
  a read of the weight.
- ``w4a16_tiled``: tensor-core tiles (the dequantized tile rounded to the activation dtype), for
  prefill, and with BM = 16 for decode rows that the GEMV's registers cannot hold.
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


@triton.jit
def _scale_zero(sz_ptr, rn, k, N, mask_n, GROUP: tl.constexpr):
    pair = tl.arange(0, 2)
    sz = tl.load(sz_ptr + (k // GROUP) * 2 * N + rn[:, None] * 2 + pair[None, :],
                 mask=mask_n, other=0.0).to(tl.float32)  # fmt: skip
    return tl.split(sz)


@triton.jit
def _dequant_tiles(w_ptr, sz_ptr, rn, j0, N, K, BK: tl.constexpr, GROUP: tl.constexpr):
    """fp32 [BN, BK] tiles of the weight's rows ``rn`` at k = j0 .. j0 + BK (high nibbles) and
    k = K / 2 + j0 .. (low nibbles); rows past N read as zero."""
    half = K // 2
    mask_n = rn[:, None] < N
    rj = j0 + tl.arange(0, BK)
    b = tl.load(w_ptr + rn[:, None].to(tl.int64) * half + rj[None, :], mask=mask_n, other=0)
    s_hi, z_hi = _scale_zero(sz_ptr, rn, j0, N, mask_n, GROUP)
    s_lo, z_lo = _scale_zero(sz_ptr, rn, half + j0, N, mask_n, GROUP)
    w_hi = ((b >> 4).to(tl.float32) - 8.0) * s_hi[:, None] + z_hi[:, None]
    w_lo = ((b & 15).to(tl.float32) - 8.0) * s_lo[:, None] + z_lo[:, None]
    return w_hi, w_lo


@triton.jit
def _store(out_ptr, ws_ptr, acc, rm, rn, M, N, ldo, SPLIT_K: tl.constexpr):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        ptrs = out_ptr + rm[:, None].to(tl.int64) * ldo + rn[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        plane = tl.program_id(1).to(tl.int64) * M * N
        tl.store(ws_ptr + plane + rm[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def w4a16_gemv(
    x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, M, N, K, ldx, ldo, k_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    j_lo = tl.program_id(1) * k_split
    x_ptrs = x_ptr + rm[:, None] * ldx + rk[None, :]
    mask_m = rm[:, None] < M
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for j0 in range(j_lo, j_lo + k_split, BK):
        x_hi = tl.load(x_ptrs + j0, mask=mask_m, other=0.0).to(tl.float32)
        x_lo = tl.load(x_ptrs + K // 2 + j0, mask=mask_m, other=0.0).to(tl.float32)
        w_hi, w_lo = _dequant_tiles(w_ptr, sz_ptr, rn, j0, N, K, BK, GROUP)
        acc += x_hi[:, None, :] * w_hi[None, :, :] + x_lo[:, None, :] * w_lo[None, :, :]
    _store(out_ptr, ws_ptr, tl.sum(acc, axis=2), rm, rn, M, N, ldo, SPLIT_K)


@triton.jit
def w4a16_tiled(
    x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, M, N, K, ldx, ldo, k_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    j_lo = tl.program_id(1) * k_split
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * ldx + rk[None, :]
    mask_m = rm[:, None] < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j0 in range(j_lo, j_lo + k_split, BK):
        x_hi = tl.load(x_ptrs + j0, mask=mask_m, other=0.0)
        x_lo = tl.load(x_ptrs + K // 2 + j0, mask=mask_m, other=0.0)
        w_hi, w_lo = _dequant_tiles(w_ptr, sz_ptr, rn, j0, N, K, BK, GROUP)
        acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc)
        acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc)
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
        k,
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


def _splits(n: int, k: int, bn: int, bk: int, sms: int) -> int:
    """Enough K splits that the grid covers the SMs about twice; each split whole bk tiles of
    the K / 2 bytes of a row."""
    split = 1
    while triton.cdiv(n, bn) * split < 2 * sms and (k // 2) % (bk * split * 2) == 0 and split < 16:
        split *= 2
    return split


def configs(m: int, n: int, k: int, group_size: int, sms: int = 132) -> list[Config]:
    """Configs worth timing for an (M, N, K) problem, the likeliest first."""
    bk = min(128, group_size)
    out: list[Config] = []
    if m <= 4:
        for bn, warps in ((32, 4), (64, 4), (16, 2)):
            b = min(bk, 64) if bn >= 64 else bk
            out.append({"kernel": "gemv", "bm": max(1, triton.next_power_of_2(m)), "bn": bn,
                        "bk": b, "split_k": _splits(n, k, bn, b, sms), "warps": warps})  # fmt: skip
    if m <= 16:
        for bn in (64, 32):
            out.append({"kernel": "tiled", "bm": 16, "bn": bn, "bk": bk,
                        "split_k": _splits(n, k, bn, bk, sms), "group_m": 1, "warps": 4,
                        "stages": 4})  # fmt: skip
        return out
    tiles = ((64, 64, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4))
    for bm, bn, warps, stages in tiles:
        if bm <= 2 * max(m, 16):
            out.append({"kernel": "tiled", "bm": bm, "bn": bn, "bk": min(64, group_size),
                        "split_k": 1, "group_m": 8, "warps": warps, "stages": stages})  # fmt: skip
    if m <= 256:
        out.sort(key=lambda c: c["bm"])
    else:
        out.sort(key=lambda c: -c["bm"] * c["bn"])
    return out

"""Triton GEMM kernels written in this project: a tiled kernel with grouped tile ordering.

Params: {"bm", "bn", "bk", "group_m", "warps", "stages"}. Any strides (so every layout in the
key), any M/N/K (masked edges), batched through the grid's second axis. On the CPU the kernels run
through Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests them.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from tuner.candidates.base import Params, Runner, Source, interpreting
from tuner.keys import DTYPES, GemmKey

SMEM_BYTES = 227 * 1024  # Hopper's per-block limit; configs above it are pruned


@triton.jit
def _tiled_gemm(
    a_ptr, b_ptr, c_ptr, M, N, K,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M row-tiles share each B column-tile while it is in L2
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + batch * s_ab + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    c_ptrs = c_ptr + batch * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def precision(key: GemmKey) -> str:
    """tl.dot input precision: exact fp32 unless the key allows TF32 (bf16/fp16 ignore it)."""
    return "tf32" if key.compute == "tf32" else "ieee"


def as_batched(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch stride, row stride, col stride) of a 2-D or 3-D tensor."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def output_for(key: GemmKey, a: torch.Tensor) -> torch.Tensor:
    shape = (key.m, key.n) if a.dim() == 2 else (key.batch, key.m, key.n)
    return torch.empty(shape, dtype=DTYPES[key.out_dtype], device=a.device)


def smem_bytes(key: GemmKey, bm: int, bn: int, bk: int, stages: int) -> int:
    item = torch.finfo(DTYPES[key.dtype]).bits // 8
    return (bm * bk + bk * bn) * item * max(stages, 1)


class TritonGemm(Source):
    name = "triton_gemm"
    op = "gemm"

    def unavailable(self, device: str) -> str | None:
        if device == "cpu" and not interpreting():
            return "no GPU (set TRITON_INTERPRET=1 to run Triton kernels on the CPU, slowly)"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        if interpreting() and key.dtype == "bf16":
            return "Triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); bf16 runs on the GPU only"
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        if device == "cpu":  # interpreter: one small config keeps CI fast
            return [{"bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1}]
        space = itertools.product((64, 128, 256), (64, 128, 256), (32, 64), (4, 8), (3, 4))
        out = []
        for bm, bn, bk, warps, stages in space:
            if bm > 2 * triton.next_power_of_2(key.m) and bm > 64:
                continue  # a 256-row tile for M=16 wastes the tensor cores
            if bn > 2 * triton.next_power_of_2(key.n) and bn > 64:
                continue
            if smem_bytes(key, bm, bn, bk, stages) > SMEM_BYTES:
                continue
            if bm * bn >= 256 * 128 and warps < 8:
                continue
            out.append(
                {"bm": bm, "bn": bn, "bk": bk, "group_m": 8, "warps": warps, "stages": stages}
            )
        return out

    def build(self, key: GemmKey, params: Params) -> Runner:
        bm, bn, bk = int(params["bm"]), int(params["bn"]), int(params["bk"])
        group_m, warps, stages = int(params["group_m"]), int(params["warps"]), int(params["stages"])
        prec = precision(key)
        grid = (triton.cdiv(key.m, bm) * triton.cdiv(key.n, bn), key.batch)

        def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            c = output_for(key, a) if out is None else out
            _tiled_gemm[grid](
                a, b, c, key.m, key.n, key.k, *as_batched(a), *as_batched(b), *as_batched(c),
                BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PRECISION=prec,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            return c

        return run

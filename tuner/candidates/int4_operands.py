"""The operands of an INT4 weight-only GEMM runner: the shape it is built for, what it may write."""

from __future__ import annotations

import torch

from tuner.core.keys import GemmKey


def check_shape(
    mnk: tuple[int, int, int], key: GemmKey, x: torch.Tensor, weight: torch.Tensor
) -> None:
    """ValueError unless the operands' (M, N, K) ``mnk`` are ``key``'s, which the runner is built
    for."""
    shape = (key.m, key.n, key.k)
    if mnk != shape:
        raise ValueError(f"x.shape={tuple(x.shape)}, weight N={weight.shape[0]}: this runner is "
                         f"built for (M, N, K)={shape}")  # fmt: skip


def check_out(out: torch.Tensor, m: int, n: int, x: torch.Tensor) -> None:
    """ValueError unless a kernel can write ``out`` in place: [M, N] of x's dtype on x's
    device, unit stride along N, rows at least N apart."""
    if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected a [{m}, {n}] {x.dtype} tensor on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    if out.stride(1) != 1 or out.stride(0) < n:
        raise ValueError(f"out.stride()={out.stride()}: expected unit stride along N and rows at "
                         f"least N={n} apart")  # fmt: skip

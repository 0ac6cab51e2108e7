"""The operands of an FP8 GEMM runner on our kernels: the shape and scaling it is built for."""

from __future__ import annotations

import torch

from tuner.core.keys import GemmKey


def check_shape(
    found: tuple[int, int, int, bool],
    key: GemmKey,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
) -> None:
    """ValueError unless the operands' (M, N, K, rowwise) ``found`` are ``key``'s, which the
    runner is built for."""
    shape = (key.m, key.n, key.k)
    if found != (*shape, key.scale == "row"):
        raise ValueError(f"a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)} with "
                         f"{scale_a.numel()} / {scale_b.numel()} scales: this runner is "
                         f"built for (M, N, K)={shape}, {key.scale} scales")  # fmt: skip

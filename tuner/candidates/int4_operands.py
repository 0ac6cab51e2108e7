"""The operands of an INT4 weight-only GEMM runner: checked once per *guard*, not per call.

A runner built for one (M, N, K) checks its operands (devices, dtypes, shapes, strides, what it
may write) before it launches; a decode or small prefill GEMM is short enough that doing so on
every eager call would be a good part of the call. The guard holds everything a check looks at,
so operands with the same guard pass or fail alike, and a known guard skips the check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_GUARDS = 64  # guards a runner remembers; past that it forgets them all and checks again
ALIGN = 16  # bytes: the pointer alignment a guard tells apart (the kernels copy 16-byte pieces)

Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


def guard(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor,
          out: torch.Tensor | None) -> tuple:  # fmt: skip
    """Devices, dtypes, shapes, strides and pointer alignments of the operands, as a key."""
    sz = scales_and_zeros
    return (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() % ALIGN, weight.device,
            weight.dtype, weight.shape, weight.stride(), weight.data_ptr() % ALIGN, sz.device,
            sz.dtype, sz.shape, sz.stride(), sz.data_ptr() % ALIGN,
            None if out is None else (out.device, out.dtype, out.shape, out.stride(),
                                      out.data_ptr() % ALIGN))  # fmt: skip


def check_out(out: torch.Tensor, m: int, n: int, x: torch.Tensor) -> None:
    """ValueError unless a kernel can write ``out`` in place: [M, N] of x's dtype on x's
    device, unit stride along N, rows at least N apart."""
    if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected a [{m}, {n}] {x.dtype} tensor on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    if out.stride(1) != 1 or out.stride(0) < n:
        raise ValueError(f"out.stride()={out.stride()}: expected unit stride along N and rows at "
                         f"least N={n} apart")  # fmt: skip


class CheckedOnce:
    """``check(x, weight, scales_and_zeros, out)`` (raising ValueError), run only for a guard
    not seen passing before."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.passed: set[tuple] = set()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor,
                 out: torch.Tensor | None) -> None:  # fmt: skip
        key = guard(x, weight, scales_and_zeros, out)
        if key in self.passed:
            return
        self.check(x, weight, scales_and_zeros, out)
        if len(self.passed) >= MAX_GUARDS:
            self.passed.clear()
        self.passed.add(key)

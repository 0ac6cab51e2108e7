"""A runner's operands checked once per *guard*, not per call.

A runner built for one (M, N, K) checks its operands (devices, dtypes, shapes, strides, what it
may write) before it launches; a decode or small prefill GEMM is short enough that doing so on
every eager call would be a good part of the call. The guard holds everything a check looks at,
so operands with the same guard pass or fail alike, and a known guard skips the check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_GUARDS = 64  # guards a runner remembers; past that it forgets them all and checks again
ALIGN = 16  # bytes: the pointer alignment a guard tells apart (the kernels load 16-byte pieces)

Check = Callable[..., None]


def guard(*operands: torch.Tensor | None) -> tuple:
    """Devices, dtypes, shapes, strides and pointer alignments of the operands, as a key."""
    return tuple(
        [  # a list, not a generator: this runs on every eager call
            None if t is None else (t.device, t.dtype, t.shape, t.stride(), t.data_ptr() % ALIGN)
            for t in operands
        ]
    )


class CheckedOnce:
    """``check(*operands)`` (raising ValueError), run only for a guard not seen passing before."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.passed: set[tuple] = set()

    def __call__(self, *operands: torch.Tensor | None) -> None:
        key = guard(*operands)
        if key in self.passed:
            return
        self.check(*operands)
        if len(self.passed) >= MAX_GUARDS:
            self.passed.clear()
        self.passed.add(key)

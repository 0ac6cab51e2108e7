"""A runner's operands (an INT4 runner's here): checked once per guard, and the guard tells
apart every property a check reads."""

from __future__ import annotations

import pytest
import torch

from tuner.candidates import operand_guard
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant import int4

KEY = GemmKey(m=2, n=32, k=256, **lowbit_fields("int4-g32"))


def test_the_guard_holds_every_property_a_check_reads() -> None:
    """A runner skips the checks for operands whose guard passed them before, which is safe
    only if the guard holds every property the checks read: operands that differ in any one of
    them (dtype, shape, strides, alignment, the out given or not, out's alignment) have another
    guard."""
    m, n, k = 4, 64, 256
    x = torch.randn(m, k, dtype=torch.bfloat16)
    weight = int4.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8))
    sz = torch.randn(k // 128, n, 2, dtype=torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    guard = operand_guard.guard(x, weight, sz, out)
    assert operand_guard.guard(x.clone(), weight.clone(), sz.clone(), out.clone()) == guard
    odd = torch.empty(sz.numel() + 1, dtype=sz.dtype)[1:].view(sz.shape)  # 2-byte aligned
    rows = torch.empty(m, k + 8, dtype=x.dtype)[:, :k]
    others = [
        (x.half(), weight, sz, out), (x[:2], weight, sz, out), (rows, weight, sz, out),
        (x, weight[:32], sz, out), (x, weight, sz.float(), out), (x, weight, odd, out),
        (x, weight, sz, out.half()), (x, weight, sz, out.t().contiguous().t()),
        (x, weight, sz, None), (x, weight, sz, torch.empty(out.numel() + 1, dtype=out.dtype)[1:].view(out.shape)),
    ]  # fmt: skip
    assert all(operand_guard.guard(*ops) != guard for ops in others)


def test_operands_are_checked_once_per_guard() -> None:
    x, packed, sz = samples.make_inputs(KEY, "cpu", torch.Generator().manual_seed(0))
    seen = []
    checked = operand_guard.CheckedOnce(lambda *operands: seen.append(operands))
    checked(x, packed, sz, None)
    checked(x.clone(), packed, sz, None)  # other memory, same guard: not checked again
    assert len(seen) == 1
    checked(x.t().contiguous().t(), packed, sz, None)  # other strides: a new guard
    checked(x, packed, sz, torch.empty(2, 32, dtype=x.dtype))  # an out: a new guard
    assert len(seen) == 3

    def refuse(*operands):
        raise ValueError("x: refused")

    strict = operand_guard.CheckedOnce(refuse)
    for _ in range(2):  # a guard that failed is not remembered: it fails every time
        with pytest.raises(ValueError, match="refused"):
            strict(x, packed, sz, None)
